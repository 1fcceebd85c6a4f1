"""Protocols, the generation loop and the multi-turn rollout, driven by scripted policies.

What is proven here: stop strings end a turn inside the backend; sampled ids are never re-tokenized (the ids on a
trajectory are exactly what the model was fed, turn by turn); every observation / template token has action mask 0
and every sampled token mask 1; limits, faults and bad observations are recorded and never kill the batch.
"""

import asyncio
import threading

import pytest
import torch

from trl_multiturn.environment import Action, Step
from trl_multiturn.generation import SamplingParams, TransformersGenerator
from trl_multiturn.protocols import TRUNCATION_MARKER, ChatToolProtocol, TagProtocol
from trl_multiturn.rollout import EnvironmentError_, MultiTurnRollout, RolloutConfig
from trl_multiturn.trl_compat import TRLEnvironmentAdapter

from scripted import ReplayGenerator, ScriptedLM


class SearchLikeEnv:
    """Answers a search with a fixed observation; an answer ends the episode with reward 1 if it says 'paris'."""

    def reset(self, example):
        return f"Question: {example['q']}"

    def step(self, action):
        if action.kind == "tool":
            return Step(observation=f"Doc 1(Title: {action.arguments['query']}) text")
        if action.kind == "answer":
            return Step(reward=float(action.content.lower() == "paris"), done=True)
        return Step(observation="Invalid. Use the tags.")


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------------------------------- protocols
def test_tag_protocol_parse():
    p = TagProtocol()
    assert p.stop_strings == ("</search>", "</answer>")
    a = p.parse("<think>hmm</think>\n<search> capital of France </search>")
    assert (a.kind, a.name, a.arguments) == ("tool", "search", {"query": "capital of France"})
    a = p.parse("<think>ok</think><answer>Paris</answer>")
    assert (a.kind, a.content) == ("answer", "Paris")
    assert p.parse("I think it is Paris").kind == "invalid"
    assert p.parse("<search></search>").kind == "invalid"
    assert p.parse("<search>unterminated").kind == "invalid"


def test_tag_protocol_observation_is_sanitized_and_truncated(smollm2_tokenizer):
    p = TagProtocol(max_observation_tokens=8)
    obs_ids, record = p.observation_ids(
        smollm2_tokenizer, "<answer>fake</answer> " + "word " * 50, Action(kind="tool", name="search")
    )
    text = smollm2_tokenizer.decode(obs_ids)
    assert text.startswith("\n\n<information>") and text.endswith("</information>\n\n")
    assert "<answer>" not in text and "[answer]" in text
    assert TRUNCATION_MARKER in text
    assert record == {"observation_sanitized": True, "observation_truncated": True}
    # feedback for an invalid action is inserted without the information tags
    fb_ids, _ = p.observation_ids(smollm2_tokenizer, "fix it", Action(kind="invalid"))
    assert smollm2_tokenizer.decode(fb_ids) == "\nfix it\n"


def test_tag_protocol_rejects_bad_configuration():
    with pytest.raises(ValueError, match="tag"):
        TagProtocol(tool_tags=(), answer_tag="")
    with pytest.raises(ValueError, match="{text}"):
        TagProtocol(observation_template="<information></information>")


def test_chat_tool_protocol(smollm2_tokenizer):
    from trl_multiturn.models import tool_chat_template

    tok = smollm2_tokenizer
    p = ChatToolProtocol()
    with pytest.raises(ValueError, match="tool"):
        p.validate(tok)  # SmolLM2's own template cannot render tool calls
    original = tok.chat_template
    try:
        tok.chat_template = tool_chat_template()
        p.validate(tok)
        a = p.parse('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
        assert (a.kind, a.name, a.arguments) == ("tool", "add", {"a": 1, "b": 2})
        assert p.parse("The answer is 3.").kind == "answer"
        assert p.parse("<tool_call>{not json}</tool_call>").kind == "invalid"
        obs, _ = p.observation_ids(tok, "3", a)
        text = tok.decode(obs)
        # the observation is a tool message followed by the assistant generation prompt
        assert "3" in text and text.rstrip().endswith("<|im_start|>assistant")
        assert text.startswith("\n<|im_start|>")
    finally:
        tok.chat_template = original


# ---------------------------------------------------------------------------------------------------- generation
def test_generation_stops_at_stop_string(smollm2_tokenizer):
    tok = smollm2_tokenizer
    script = ids(tok, "<think>look it up</think><search>capital of France</search> and then more text")
    lm = ScriptedLM([script], len(tok), tok.eos_token_id)
    gen = TransformersGenerator(lm, tok)
    (out,) = gen.generate([ids(tok, "Q: capital?")], 64, SamplingParams(stop_strings=("</search>", "</answer>")))
    text = tok.decode(out.ids)
    assert out.finish_reason == "stop"
    assert text.endswith("</search>"), text
    assert "more text" not in text
    assert len(out.logprobs) == len(out.ids)


def test_generation_eos_and_length(smollm2_tokenizer):
    tok = smollm2_tokenizer
    lm = ScriptedLM([ids(tok, "short")], len(tok), tok.eos_token_id)
    gen = TransformersGenerator(lm, tok)
    (out,) = gen.generate([ids(tok, "Q")], 64, SamplingParams())
    assert out.finish_reason == "eos" and out.ids[-1] == tok.eos_token_id
    (out,) = gen.generate([ids(tok, "Q")], 1, SamplingParams())
    assert out.finish_reason == "length" and len(out.ids) == 1


def test_sampling_logprobs_match_a_fresh_forward(smollm2_tokenizer, tiny_model_factory):
    tok = smollm2_tokenizer
    model = tiny_model_factory().eval()
    gen = TransformersGenerator(model, tok, generator=torch.Generator().manual_seed(0))
    contexts = [ids(tok, "a short prompt"), ids(tok, "a much longer prompt with several more tokens in it")]
    outs = gen.generate(contexts, 12, SamplingParams(temperature=0.7))
    for ctx, out in zip(contexts, outs):
        full = torch.tensor([ctx + out.ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(full).logits[0, :-1].float() / 0.7, -1)
        recomputed = logp.gather(-1, full[0, 1:, None])[:, 0][len(ctx) - 1 :]
        torch.testing.assert_close(recomputed, torch.tensor(out.logprobs), atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------------- rollout
def make_rollout(env_factory, tok, protocol=None, **cfg):
    defaults = dict(max_turns=4, max_completion_length=256, env_timeout=2.0)
    defaults.update(cfg)
    return MultiTurnRollout(env_factory, protocol or TagProtocol(), tok, RolloutConfig(**defaults))


def test_rollout_search_then_answer_masks_and_exactness(smollm2_tokenizer):
    tok = smollm2_tokenizer
    turn1 = ids(tok, "<think>I need to search.</think>\n<search>capital of France</search>")
    turn2 = ids(tok, "<think>Found it.</think>\n<answer>Paris</answer>")
    lm = ScriptedLM([turn1, turn2], len(tok), tok.eos_token_id)
    rollout = make_rollout(SearchLikeEnv, tok)
    (t,) = rollout.run([{"q": "capital of France?"}], TransformersGenerator(lm, tok), SamplingParams())
    t.validate()
    assert t.num_turns == 2 and not t.truncated
    assert t.info["stop_reason"] == "answer" and t.info["final_answer"] == "Paris"
    assert t.turn_rewards == [0.0, 1.0]
    # token exactness: each prefill context equals the trajectory's ids up to that turn
    assert lm.contexts[0] == t.prompt_ids
    assert lm.contexts[1] == t.input_ids[: len(lm.contexts[1])]
    # masks: sampled ids (turn1, turn2) are mask 1; the inserted observation is mask 0
    comp, mask = t.completion_ids, t.action_mask
    n1 = len(turn1)
    assert comp[:n1] == turn1 and mask[:n1] == [1] * n1
    obs_len = len(lm.contexts[1]) - len(t.prompt_ids) - n1
    assert mask[n1 : n1 + obs_len] == [0] * obs_len
    obs_text = tok.decode(comp[n1 : n1 + obs_len])
    assert obs_text == "\n\n<information>Doc 1(Title: capital of France) text</information>\n\n"
    assert comp[n1 + obs_len :] == turn2 and set(mask[n1 + obs_len :]) == {1}
    assert t.turn_ids == [0] * (n1 + obs_len) + [1] * len(turn2)
    assert all(lp == 0.0 for lp, m in zip(t.logprobs, mask) if m == 0)


def test_rollout_limits_truncate(smollm2_tokenizer):
    tok = smollm2_tokenizer
    # never answers: stops at max_turns; every action was complete, so it is NOT truncated (only a token limit
    # truncates: Trajectory.truncated), and it carries loss under mask_truncated_completions
    gen = ReplayGenerator(tok, ["<search>again</search>"])
    (t,) = make_rollout(SearchLikeEnv, tok, max_turns=3).run([{"q": "x"}], gen, SamplingParams())
    assert t.num_turns == 3 and not t.truncated and t.info["stop_reason"] == "max_turns"
    # token budget counted over actions AND observations
    (t,) = make_rollout(SearchLikeEnv, tok, max_completion_length=30).run(
        [{"q": "x"}], ReplayGenerator(tok, ["<search>again</search>"]), SamplingParams()
    )
    assert t.truncated and t.info["stop_reason"] == "max_tokens" and len(t.completion_ids) <= 30


class FaultyEnv:
    """Fails in a way chosen by the example. A "hangs" step blocks until ``release`` is set (bounded: 60 s);
    ``hang_ended`` is set when it returns."""

    release = threading.Event()
    hang_ended = threading.Event()

    def reset(self, example):
        self.mode = example["mode"]
        if self.mode == "reset_raises":
            raise RuntimeError("reset exploded")
        return "Question: q"

    def step(self, action):
        if self.mode == "step_raises":
            raise ValueError("step exploded")
        if self.mode == "hangs":
            FaultyEnv.release.wait(60)
            FaultyEnv.hang_ended.set()
        if self.mode == "huge":
            return Step(observation="word " * 5000)
        if self.mode == "not_string":
            return Step(observation={"docs": [1, 2]})
        if self.mode == "bad_return":
            return "not a Step"
        return Step(observation="fine")


def test_rollout_records_environment_faults_and_goes_on(smollm2_tokenizer):
    tok = smollm2_tokenizer
    modes = ["ok", "reset_raises", "step_raises", "hangs", "huge", "not_string", "bad_return"]
    rollout = make_rollout(FaultyEnv, tok, TagProtocol(max_observation_tokens=32), max_turns=2, env_timeout=0.5)
    FaultyEnv.release.clear()
    FaultyEnv.hang_ended.clear()
    try:
        generator = ReplayGenerator(tok, ["<search>q</search>"])
        trajs = rollout.run([{"mode": m} for m in modes], generator, SamplingParams())
        # the rollout returned while the hanging step was still blocked: env_timeout ended the wait, not the step
        assert not FaultyEnv.hang_ended.is_set()
    finally:
        FaultyEnv.release.set()
    by_mode = dict(zip(modes, trajs))
    for t in trajs:
        t.validate()
        assert len(t.completion_ids) >= 1
    assert not by_mode["ok"].info.get("failed")
    for mode in ("reset_raises", "step_raises", "hangs", "bad_return"):
        assert by_mode[mode].info["failed"], mode
        assert by_mode[mode].info["env_errors"], mode
    assert "timed out" in by_mode["hangs"].info["env_errors"][0]
    assert by_mode["huge"].info["observation_truncated"] >= 1
    assert TRUNCATION_MARKER in tok.decode(by_mode["huge"].completion_ids)
    assert "not a string" in by_mode["not_string"].info["observation_problems"][0]
    assert '{"docs": [1, 2]}' in tok.decode(by_mode["not_string"].completion_ids)


def test_rollout_can_raise_on_env_error(smollm2_tokenizer):
    rollout = make_rollout(FaultyEnv, smollm2_tokenizer, raise_on_env_error=True)
    with pytest.raises(EnvironmentError_, match="step exploded"):
        rollout.run([{"mode": "step_raises"}], ReplayGenerator(smollm2_tokenizer, ["<search>q</search>"]), SamplingParams())


class AsyncEnv:
    """Each ``reset`` and each ``step`` waits until all ``batch`` environments have entered the same call: run one
    after the other, the first would wait alone and time out (an environment error on its trajectory)."""

    batch = 8
    entered: dict = {}

    async def _all_together(self, call: str) -> None:
        entered = AsyncEnv.entered.setdefault(call, {"count": 0, "event": asyncio.Event()})
        entered["count"] += 1
        if entered["count"] == AsyncEnv.batch:
            entered["event"].set()
        await asyncio.wait_for(entered["event"].wait(), 20)

    async def reset(self, example):
        await self._all_together("reset")
        return "Question"

    async def step(self, action):
        await self._all_together("step")
        return Step(observation="obs", done=True, reward=0.5)


def test_async_environments_run_concurrently(smollm2_tokenizer):
    AsyncEnv.entered = {}
    rollout = make_rollout(AsyncEnv, smollm2_tokenizer, env_timeout=60)
    trajs = rollout.run([{}] * 8, ReplayGenerator(smollm2_tokenizer, ["<search>q</search>"]), SamplingParams())
    assert [t.info.get("env_errors") for t in trajs] == [None] * 8
    assert [t.turn_rewards for t in trajs] == [[0.5]] * 8
    assert {call: e["count"] for call, e in AsyncEnv.entered.items()} == {"reset": 8, "step": 8}


class ClosingEnv:
    """Records its calls, including ``close``; its reset fails when the example says so."""

    instances: list = []

    def __init__(self):
        self.calls = []
        ClosingEnv.instances.append(self)

    def reset(self, example):
        self.calls.append("reset")
        if example["mode"] == "reset_raises":
            raise RuntimeError("reset exploded")
        return "Question"

    def step(self, action):
        self.calls.append("step")
        return Step(observation="obs")

    def close(self):
        self.calls.append("close")


class AsyncClosingEnv(ClosingEnv):
    async def close(self):
        self.calls.append("async close")


@pytest.mark.parametrize("env_class", [ClosingEnv, AsyncClosingEnv])
def test_every_environment_is_closed_after_the_rollout(smollm2_tokenizer, env_class):
    """``close()`` (sync or async) runs once per environment, after its last call, whether its episode ended by the
    turn limit, an answer or a failed reset."""
    ClosingEnv.instances = []
    rollout = make_rollout(env_class, smollm2_tokenizer, max_turns=2)
    modes = ["ok", "reset_raises", "ok"]
    gen = ReplayGenerator(smollm2_tokenizer, ["<search>q</search>", "<answer>x</answer>"])
    trajs = rollout.run([{"mode": m} for m in modes], gen, SamplingParams())
    rollout.close()
    close = "close" if env_class is ClosingEnv else "async close"
    assert [t.info["stop_reason"] for t in trajs] == ["answer", "reset_error", "answer"]
    assert [e.calls for e in ClosingEnv.instances] == [
        ["reset", "step", "step", close], ["reset", close], ["reset", "step", "step", close]
    ]


class TRLStyleCalculator:
    """A TRL 1.16 environment_factory class: public methods are tools, reset(**row), get_reward()."""

    def reset(self, **kwargs):
        self.calls = 0
        return None

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: first integer
            b: second integer
        """
        self.calls += 1
        return a + b

    def get_reward(self) -> float:
        return float(self.calls)


def test_trl_style_environment_through_chat_tools(smollm2_tokenizer):
    from trl_multiturn.models import tool_chat_template

    tok = smollm2_tokenizer
    original = tok.chat_template
    try:
        tok.chat_template = tool_chat_template()
        env_factory = lambda: TRLEnvironmentAdapter(TRLStyleCalculator())  # noqa: E731
        gen = ReplayGenerator(
            tok,
            ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>', "It is 5.<|im_end|>"],
            finish_reason="eos",
        )
        rollout = make_rollout(env_factory, tok, ChatToolProtocol())
        (t,) = rollout.run([{"prompt": [{"role": "user", "content": "2+3?"}]}], gen, SamplingParams())
        assert t.info["stop_reason"] == "answer" and t.turn_rewards == [0.0, 1.0]
        text = tok.decode(t.completion_ids)
        assert "<tool_response>\n5\n</tool_response>" in text
        # the tool schema was rendered into the prompt
        assert '"name": "add"' in tok.decode(t.prompt_ids)
        obs_ids = [i for i, m in zip(t.completion_ids, t.action_mask) if m == 0]
        assert "5" in tok.decode(obs_ids) and "<|im_start|>assistant" in tok.decode(obs_ids)
    finally:
        tok.chat_template = original


def test_tag_turn_cut_by_max_tokens_per_turn_is_invalid_not_truncation(smollm2_tokenizer):
    tok = smollm2_tokenizer
    # 3 tokens per turn cannot hold "<search>...</search>": each turn is cut, answered as invalid, and the episode
    # ends at max_turns, not truncated (the per-turn cap ends a turn, not the trajectory)
    gen = ReplayGenerator(tok, ["<search>a long query that never closes</search>"])
    (t,) = make_rollout(SearchLikeEnv, tok, max_turns=2, max_tokens_per_turn=3).run([{"q": "x"}], gen, SamplingParams())
    assert t.info["actions"] == ["invalid", "invalid"] and not t.truncated and t.info["stop_reason"] == "max_turns"
    obs = tok.decode([i for i, m in zip(t.completion_ids, t.action_mask) if m == 0])
    assert obs.count("Invalid. Use the tags.") == 2


def test_chat_turn_cut_without_eos_is_invalid_and_closed(smollm2_tokenizer):
    from trl_multiturn.models import tool_chat_template

    tok = smollm2_tokenizer
    original = tok.chat_template
    try:
        tok.chat_template = tool_chat_template()
        # turn 1 is cut at max_tokens_per_turn=4 before EOS: not a final answer, but an invalid action; the
        # environment's feedback follows a closed message (EOS inserted with mask 0), as the chat template renders it
        gen = ReplayGenerator(tok, ["Paris is the capital of France, I am sure of it", "Paris<|im_end|>"],
                              finish_reason="eos")
        rollout = make_rollout(SearchLikeEnv, tok, ChatToolProtocol(), max_tokens_per_turn=4)
        (t,) = rollout.run([{"q": "capital of France?"}], gen, SamplingParams())
        assert t.info["actions"] == ["invalid", "answer"], t.info["actions"]
        assert t.info["stop_reason"] == "answer" and not t.truncated and t.info["final_answer"] == "Paris"
        first = ids(tok, "Paris is the capital of France, I am sure of it")[:4]
        assert t.completion_ids[:4] == first and t.action_mask[:4] == [1] * 4
        assert t.completion_ids[4] == tok.eos_token_id and t.action_mask[4] == 0
        obs = tok.decode([i for i, m in zip(t.completion_ids, t.action_mask) if m == 0])
        assert "Invalid. Use the tags." in obs
    finally:
        tok.chat_template = original


class HitEnv(SearchLikeEnv):
    """SearchLikeEnv whose searches earn 0.5 each (a shaping reward such as a retrieval hit)."""

    def step(self, action):
        step = super().step(action)
        if action.kind == "tool":
            step.reward = 0.5
        return step


@pytest.mark.parametrize("gate", ["none", "finished"])
def test_turn_reward_gate_zeroes_the_turn_rewards_of_trajectories_that_never_answered(smollm2_tokenizer, gate):
    tok = smollm2_tokenizer
    answered_gen = ReplayGenerator(tok, ["<search>a</search>", "<answer>Paris</answer>"])
    (answered,) = make_rollout(HitEnv, tok, turn_reward_gate=gate).run([{"q": "x"}], answered_gen, SamplingParams())
    assert answered.info["stop_reason"] == "answer" and answered.turn_rewards == [0.5, 1.0]  # kept either way
    assert "gated_turn_rewards" not in answered.info
    for cfg in (dict(max_turns=3), dict(max_completion_length=30)):  # out of turns; out of tokens
        gen = ReplayGenerator(tok, ["<search>again</search>"])
        (t,) = make_rollout(HitEnv, tok, turn_reward_gate=gate, **cfg).run([{"q": "x"}], gen, SamplingParams())
        assert t.info["stop_reason"] in ("max_turns", "max_tokens") and t.num_turns >= 2
        earned = [0.5] * (t.num_turns - (t.info["stop_reason"] == "max_tokens"))
        earned += [0.0] * (t.num_turns - len(earned))
        if gate == "none":
            assert t.turn_rewards == earned and "gated_turn_rewards" not in t.info
        else:
            assert t.turn_rewards == [0.0] * t.num_turns and t.info["gated_turn_rewards"] == earned
        t.validate()


class CostEnv(SearchLikeEnv):
    """SearchLikeEnv whose first search earns 0.5 and every later one costs -1.0 (a redundant search's cost)."""

    def step(self, action):
        step = super().step(action)
        if action.kind == "tool":
            self.searched = getattr(self, "searched", 0) + 1
            step.reward = 0.5 if self.searched == 1 else -1.0
        return step


def test_turn_reward_gate_keeps_the_costs_of_trajectories_that_never_answered(smollm2_tokenizer):
    """The gate drops credits only: searching on until the turns run out does not shed the searches' costs."""
    tok = smollm2_tokenizer
    gen = ReplayGenerator(tok, ["<search>again</search>"])
    (t,) = make_rollout(CostEnv, tok, turn_reward_gate="finished", max_turns=3).run([{"q": "x"}], gen,
                                                                                     SamplingParams())
    assert t.info["stop_reason"] == "max_turns" and t.num_turns == 3
    assert t.info["gated_turn_rewards"] == [0.5, -1.0, -1.0]
    assert t.turn_rewards == [0.0, -1.0, -1.0]
    t.validate()


def test_turn_reward_gate_is_validated():
    with pytest.raises(ValueError, match="turn_reward_gate must be one of"):
        RolloutConfig(turn_reward_gate="answered")
