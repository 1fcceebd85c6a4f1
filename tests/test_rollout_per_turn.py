"""The per-turn layout of the rollout (issue 19, items 1 and 4): each turn generated from its own rendered context.

What is proven here: the generator is given exactly ``Trajectory.turn_contexts[k]`` at turn k (both loops: the
lock-step one with a replaying backend, the streaming one with ``TransformersGenerator``); with ``TagProtocol`` and no
context function each context is the single sequence up to that turn; with a ChatML template (tokenization round
trips) each context is a prefix of the single sequence; a template that drops earlier ``<think>`` blocks drops them
from the context; context functions rewrite old observations in the context but never in the single sequence; a
context function that raises fails its trajectory only; ``turn_rows`` gives each turn's sampled ids and log-probs.
"""

import pytest
import torch

from scripted import CHATML, THINK_DROPPING, ReplayGenerator, ScriptedLM, with_template
from test_generation_speed import LaggyEnv, eos_after_some
from test_rollout import SearchLikeEnv, TRLStyleCalculator

from trl_multiturn.context import OBSERVATION_PLACEHOLDER, keep_last_observations, truncate_observations
from trl_multiturn.environment import Action, Step
from trl_multiturn.generation import SamplingParams, TransformersGenerator
from trl_multiturn.models import tool_chat_template
from trl_multiturn.protocols import TRUNCATION_MARKER, ChatToolProtocol, Protocol, TagProtocol
from trl_multiturn.rollout import MultiTurnRollout, RolloutConfig
from trl_multiturn.trajectory import Trajectory
from trl_multiturn.trl_compat import TRLEnvironmentAdapter


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def run(env_factory, tok, protocol, generator, examples, **cfg):
    """One rollout with the test defaults; returns the trajectories."""
    config = RolloutConfig(**{"max_turns": 4, "max_completion_length": 256, "env_timeout": 5.0, **cfg})
    rollout = MultiTurnRollout(env_factory, protocol, tok, config)
    try:
        return rollout.run(examples, generator, SamplingParams())
    finally:
        rollout.close()


def sequence_context(t: Trajectory, k: int) -> list[int]:
    """The single sequence before turn k's first token: what turn k is generated from in the sequence layout."""
    start = sum(1 for tid in t.turn_ids if tid < k)
    return t.prompt_ids + t.completion_ids[:start]


def backend(kind: str, tok, texts: list[str], finish_reason: str):
    """A scripted policy writing ``texts`` turn by turn, and the list of contexts it was given (filled as it runs).

    ``replay``: ``ReplayGenerator`` (no ``submit``: the lock-step loop). ``streaming``: ``TransformersGenerator`` over
    ``ScriptedLM`` (the streaming loop; ScriptedLM cannot reuse K/V, so every turn is prefilled whole and recorded)."""
    if kind == "replay":
        gen = ReplayGenerator(tok, texts, finish_reason=finish_reason)
        return gen, gen.contexts
    eos = tok.eos_token
    scripts = [ids(tok, text[: -len(eos)] if text.endswith(eos) else text) for text in texts]
    lm = ScriptedLM(scripts, len(tok), tok.eos_token_id)
    return TransformersGenerator(lm, tok), lm.contexts


def given(kind: str, contexts) -> list[list[int]]:
    """Every context the backend was given, in order (the replaying backend records one list per call)."""
    return [c for call in contexts for c in call] if kind == "replay" else list(contexts)


# ---------------------------------------------------------------------------------------------------- trajectory
def test_turn_rows_give_each_turns_sampled_ids_and_logprobs():
    t = Trajectory(prompt_ids=[1, 2])
    t.add_action([10, 11], [-0.1, -0.2])  # turn 0
    t.add_observation([50, 51, 52])
    t.add_action([12], [-0.3])  # turn 1
    t.add_observation([53])
    t.add_action([13, 14, 15], [-0.4, -0.5, -0.6])  # turn 2
    # sequence layout: the context of turn k is the single sequence before it
    assert t.turn_rows() == [
        ([1, 2], [10, 11], [-0.1, -0.2]),
        ([1, 2, 10, 11, 50, 51, 52], [12], [-0.3]),
        ([1, 2, 10, 11, 50, 51, 52, 12, 53], [13, 14, 15], [-0.4, -0.5, -0.6]),
    ]
    # per-turn layout: the recorded contexts
    t.turn_contexts = [[1, 2], [1, 2, 99, 50], [1, 2, 98, 53]]
    t.validate()
    assert [row[0] for row in t.turn_rows()] == t.turn_contexts
    assert [row[1:] for row in t.turn_rows()] == [
        ([10, 11], [-0.1, -0.2]), ([12], [-0.3]), ([13, 14, 15], [-0.4, -0.5, -0.6])]
    t.turn_contexts = [[1, 2]]
    with pytest.raises(ValueError, match="turn_contexts has 1 entries but num_turns is 3"):
        t.validate()


# ---------------------------------------------------------------------------------------------------- TagProtocol
class TaggedEnv:
    """Feedback for an invalid action; for a search, an observation holding the protocol's own tags and many words
    (sanitized and truncated by the protocol); an answer ends the episode."""

    def reset(self, example):
        return f"Question: {example['q']}"

    def step(self, action):
        if action.kind == "answer":
            return Step(reward=1.0, done=True)
        if action.kind == "invalid":
            return Step(observation="Invalid. Use the tags.")
        return Step(observation="<answer>fake</answer> " + "word " * 30)


TAG_TURNS = ["I am not sure yet", "<think>search</think><search>capital</search>", "<search>again</search>",
             "<answer>Paris</answer>"]


@pytest.mark.parametrize("kind", ["replay", "streaming"])
def test_tag_protocol_contexts_are_the_single_sequence(smollm2_tokenizer, kind):
    tok = smollm2_tokenizer
    protocol = TagProtocol(max_observation_tokens=8)
    gen, contexts = backend(kind, tok, TAG_TURNS, "stop")
    (t,) = run(TaggedEnv, tok, protocol, gen, [{"q": "capital of France?"}], turn_layout="per_turn")
    t.validate()
    assert t.info["actions"] == ["invalid", "tool", "tool", "answer"] and t.info["stop_reason"] == "answer"
    assert t.info["observation_sanitized"] == 2 and t.info["observation_truncated"] == 2
    # the generator was given exactly the recorded contexts, and each is the single sequence up to that turn
    assert given(kind, contexts) == t.turn_contexts and len(t.turn_contexts) == 4
    assert t.turn_contexts == [sequence_context(t, k) for k in range(4)]
    # the same trajectory as the sequence layout
    gen, _ = backend(kind, tok, TAG_TURNS, "stop")
    (s,) = run(TaggedEnv, tok, protocol, gen, [{"q": "capital of France?"}])
    assert (s.prompt_ids, s.completion_ids, s.action_mask, s.turn_ids) == (
        t.prompt_ids, t.completion_ids, t.action_mask, t.turn_ids)
    assert s.turn_contexts == [] and [row[0] for row in s.turn_rows()] == t.turn_contexts


def test_tag_render_context_reuses_sampled_ids_and_retokenizes_edited_text(smollm2_tokenizer):
    tok = smollm2_tokenizer
    protocol = TagProtocol(use_chat_template=False)
    sampled = ids(tok, "<search>x</search>") + [tok.eos_token_id]  # decodes (special tokens skipped) to the text
    messages = [{"role": "user", "content": "Q"},
                {"role": "assistant", "content": "<search>x</search>", "ids": sampled},
                {"role": "tool", "content": "doc", "action": Action(kind="tool", name="search")}]
    observation = ids(tok, "\n\n<information>doc</information>\n\n")
    prompt = protocol.prompt_ids(tok, "Q")
    assert protocol.render_context(tok, messages) == prompt + sampled + observation
    messages[1] = {**messages[1], "content": "<search>y</search>"}  # a context function rewrote the turn
    assert protocol.render_context(tok, messages) == prompt + ids(tok, "<search>y</search>") + observation
    with pytest.raises(ValueError, match="got a 'user' message after the first turn"):
        protocol.render_context(tok, messages + [{"role": "user", "content": "more"}])


# ---------------------------------------------------------------------------------------------------- chat templates
THINK_TURNS = [
    '<think>I should look it up.</think>\n<tool_call>\n{"name": "search", "arguments": {"query": "capital of France"}}'
    '\n</tool_call><|im_end|>',
    "<think>The document says Paris.</think>\nParis<|im_end|>",
]


@pytest.mark.parametrize("kind", ["replay", "streaming"])
def test_think_dropping_template_drops_the_earlier_think_block(smollm2_tokenizer, kind):
    tok = with_template(smollm2_tokenizer, THINK_DROPPING)
    gen, contexts = backend(kind, tok, THINK_TURNS, "eos")
    (t,) = run(SearchLikeEnv, tok, ChatToolProtocol(), gen, [{"q": "capital of France?"}], turn_layout="per_turn")
    t.validate()
    assert t.info["actions"] == ["tool", "answer"] and t.info["stop_reason"] == "answer"
    assert given(kind, contexts) == t.turn_contexts  # the generator got exactly the recorded contexts
    first, second = (tok.decode(c) for c in t.turn_contexts)
    assert t.turn_contexts[0] == t.prompt_ids
    assert "I should look it up" not in second  # turn 1's think block is gone from turn 2's context
    assert '<tool_call>\n{"name": "search"' in second and "Doc 1(Title: capital of France) text" in second
    assert second.endswith("<|im_start|>assistant\n")
    # the context is the template's rendering of the conversation as a deployed agent loop holds it
    conversation = [{"role": "user", "content": "Question: capital of France?"},
                    {"role": "assistant", "content": tok.decode(ids(tok, THINK_TURNS[0]), skip_special_tokens=True)},
                    {"role": "tool", "name": "search", "content": "Doc 1(Title: capital of France) text"}]
    rendered = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert t.turn_contexts[1] == list(rendered["input_ids"])
    # the single sequence still holds every sampled id, think blocks included; it is not turn 2's context
    assert "I should look it up" in tok.decode(t.completion_ids)
    assert t.turn_contexts[1] != sequence_context(t, 1)
    rows = t.turn_rows()
    assert [r[0] for r in rows] == t.turn_contexts
    eos = tok.eos_token
    assert [r[1] for r in rows] == [ids(tok, THINK_TURNS[0][: -len(eos)]) + [tok.eos_token_id],
                                    ids(tok, THINK_TURNS[1][: -len(eos)]) + [tok.eos_token_id]]
    if kind == "replay":
        assert [r[2] for r in rows] == [[-0.5] * len(r[1]) for r in rows]  # ReplayGenerator's log-probs
    else:
        assert all(len(r[2]) == len(r[1]) and max(r[2]) <= 0.0 for r in rows)


def test_max_context_length_bounds_the_rendered_context(smollm2_tokenizer):
    """In the per-turn layout ``max_context_length`` bounds the rendered context plus the turn, not the sequence."""
    tok = with_template(smollm2_tokenizer, THINK_DROPPING)
    (t,) = run(SearchLikeEnv, tok, ChatToolProtocol(), ReplayGenerator(tok, THINK_TURNS, finish_reason="eos"),
               [{"q": "capital of France?"}], turn_layout="per_turn")
    turn2 = len(ids(tok, THINK_TURNS[1]))
    limit = len(t.turn_contexts[1]) + turn2 + 1  # room for turn 2 after its rendered context
    assert len(sequence_context(t, 1)) + turn2 > limit  # but not after the single sequence (it keeps the think block)
    (t,) = run(SearchLikeEnv, tok, ChatToolProtocol(), ReplayGenerator(tok, THINK_TURNS, finish_reason="eos"),
               [{"q": "capital of France?"}], turn_layout="per_turn", max_context_length=limit)
    assert t.info["stop_reason"] == "answer" and not t.truncated
    (s,) = run(SearchLikeEnv, tok, ChatToolProtocol(), ReplayGenerator(tok, THINK_TURNS, finish_reason="eos"),
               [{"q": "capital of France?"}], max_context_length=limit)
    assert s.truncated and s.info["stop_reason"] == "max_tokens"


@pytest.mark.parametrize("template", ["trl", "chatml"])
def test_chatml_contexts_are_prefixes_of_the_single_sequence(smollm2_tokenizer, template):
    """With a ChatML template whose rendering tokenizes back to the sampled ids, re-rendering the conversation gives
    the single sequence: each context is a prefix of it and equals the sequence layout's context. The tool schema of
    a TRL-style environment is rendered into every context."""
    tok = with_template(smollm2_tokenizer, tool_chat_template() if template == "trl" else CHATML)
    texts = ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
             '<tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 1}}\n</tool_call><|im_end|>',
             "It is 6.<|im_end|>"]
    factory = lambda: TRLEnvironmentAdapter(TRLStyleCalculator())  # noqa: E731
    example = [{"prompt": [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "2+3+1?"}]}]
    gen = ReplayGenerator(tok, texts, finish_reason="eos")
    (t,) = run(factory, tok, ChatToolProtocol(), gen, example, turn_layout="per_turn")
    t.validate()
    assert t.info["actions"] == ["tool", "tool", "answer"]
    assert given("replay", gen.contexts) == t.turn_contexts
    for k, context in enumerate(t.turn_contexts):
        assert context == t.input_ids[: len(context)] == sequence_context(t, k)
    if template == "trl":
        assert all('"name": "add"' in tok.decode(c) for c in t.turn_contexts)
    (s,) = run(factory, tok, ChatToolProtocol(), ReplayGenerator(tok, texts, finish_reason="eos"), example)
    assert s.completion_ids == t.completion_ids and s.action_mask == t.action_mask


def test_chatml_cut_turn_is_closed_in_the_context_as_in_the_sequence(smollm2_tokenizer):
    """A turn cut by ``max_tokens_per_turn`` has no EOS; the single sequence closes it with a masked EOS and the chat
    template closes the message the same way."""
    tok = with_template(smollm2_tokenizer, tool_chat_template())
    gen = ReplayGenerator(tok, ["Paris is the capital of France, I am sure of it", "Paris<|im_end|>"],
                          finish_reason="eos")
    (t,) = run(SearchLikeEnv, tok, ChatToolProtocol(), gen, [{"q": "capital of France?"}], turn_layout="per_turn",
               max_tokens_per_turn=4)
    assert t.info["actions"] == ["invalid", "answer"]
    assert t.completion_ids[4] == tok.eos_token_id and t.action_mask[4] == 0
    assert t.turn_contexts[1] == sequence_context(t, 1)


# ---------------------------------------------------------------------------------------------------- context functions
SEARCHES = ["<search>first</search>", "<search>second</search>", "<search>third</search>", "<answer>Paris</answer>"]


def test_keep_last_observations_in_the_rollout(smollm2_tokenizer):
    tok = smollm2_tokenizer
    protocol = TagProtocol()
    gen = ReplayGenerator(tok, SEARCHES)
    (t,) = run(SearchLikeEnv, tok, protocol, gen, [{"q": "x"}], turn_layout="per_turn",
               context_fn=keep_last_observations(1))
    t.validate()
    assert given("replay", gen.contexts) == t.turn_contexts and t.info["stop_reason"] == "answer"

    def observation(text):
        return protocol.observation_ids(tok, text, Action(kind="tool", name="search"))[0]

    doc = "Doc 1(Title: {}) text".format
    turn = [ids(tok, text) for text in SEARCHES]
    # turn 4 sees the last observation; the two before it are the placeholder; every sampled id is kept
    assert t.turn_contexts[3] == (t.prompt_ids + turn[0] + observation(OBSERVATION_PLACEHOLDER) + turn[1]
                                  + observation(OBSERVATION_PLACEHOLDER) + turn[2] + observation(doc("third")))
    assert t.turn_contexts[1] == sequence_context(t, 1)  # one observation so far: nothing removed
    # the single sequence keeps every observation
    text = tok.decode(t.completion_ids)
    assert all(doc(q) in text for q in ("first", "second", "third")) and OBSERVATION_PLACEHOLDER not in text


def test_truncate_observations_in_the_rollout(smollm2_tokenizer):
    tok = smollm2_tokenizer
    gen = ReplayGenerator(tok, SEARCHES[:2] + SEARCHES[3:])
    (t,) = run(SearchLikeEnv, tok, TagProtocol(), gen, [{"q": "x"}], turn_layout="per_turn",
               context_fn=truncate_observations(3, tok))
    last = tok.decode(t.turn_contexts[2])
    assert "Doc 1(Title: first) text" not in last and TRUNCATION_MARKER in last  # the older one, cut
    assert "Doc 1(Title: second) text" in last  # the most recent one, whole
    assert TRUNCATION_MARKER not in tok.decode(t.completion_ids)


def test_a_failing_context_function_fails_its_trajectory_only(smollm2_tokenizer):
    tok = smollm2_tokenizer

    def picky(messages):
        if "boom" in messages[0]["content"] and len(messages) > 1:
            raise RuntimeError("cannot summarize this")
        return messages

    trajs = run(SearchLikeEnv, tok, TagProtocol(), ReplayGenerator(tok, SEARCHES[:1] + SEARCHES[3:]),
                [{"q": "boom"}, {"q": "fine"}], turn_layout="per_turn", context_fn=picky)
    bad, good = trajs
    for t in trajs:
        t.validate()
    assert bad.info["failed"] and bad.info["stop_reason"] == "context_error" and bad.num_turns == 1
    assert bad.info["env_errors"] == ["context_fn failed: RuntimeError: cannot summarize this"]
    assert len(bad.turn_contexts) == 1
    assert not good.info.get("failed") and good.info["stop_reason"] == "answer" and len(good.turn_contexts) == 2


# ---------------------------------------------------------------------------------------------------- K/V reuse
def run_tiny(tok, model, kv_reuse):
    """Greedy per-turn rollouts of a tiny random model whose contexts diverge from the previous turn's (older
    observations replaced by the placeholder)."""
    generator = TransformersGenerator(model, tok, generator=torch.Generator().manual_seed(0), kv_reuse=kv_reuse,
                                      logits_processor=eos_after_some(tok))
    rollout = MultiTurnRollout(LaggyEnv, TagProtocol(use_chat_template=False), tok, RolloutConfig(
        max_turns=4, max_completion_length=200, max_tokens_per_turn=7, env_timeout=5.0, turn_layout="per_turn",
        context_fn=keep_last_observations(1)))
    try:
        return rollout.run([{"i": i} for i in range(3)], generator, SamplingParams(greedy=True)), rollout.last_stats
    finally:
        rollout.close()


def test_per_turn_contexts_with_kv_reuse_match_the_reference(smollm2_tokenizer, tiny_model_factory):
    torch.set_num_threads(1)
    tok = smollm2_tokenizer
    model = tiny_model_factory(hidden_size=32, num_layers=2, seed=3).eval()
    ref, ref_stats = run_tiny(tok, model, kv_reuse=False)
    fast, fast_stats = run_tiny(tok, model, kv_reuse=True)
    for a, b in zip(ref, fast):
        b.validate()
        assert a.turn_contexts == b.turn_contexts and a.completion_ids == b.completion_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)
    # the contexts did diverge from the sequence (turn 3 on) and the cached prefix was still reused
    assert any(b.turn_contexts[k] != sequence_context(b, k) for b in fast for k in range(2, b.num_turns))
    assert fast_stats["cached_tokens"] > 0 and fast_stats["prefill_tokens"] < ref_stats["prefill_tokens"]


# ---------------------------------------------------------------------------------------------------- configuration
def test_configuration_errors(smollm2_tokenizer):
    with pytest.raises(ValueError, match=r"context_fn is set with turn_layout='sequence'.*Set turn_layout='per_turn'"):
        RolloutConfig(context_fn=keep_last_observations(1))
    with pytest.raises(ValueError, match=r"turn_layout must be one of \('sequence', 'per_turn'\); got 'turns'"):
        RolloutConfig(turn_layout="turns")
    with pytest.raises(ValueError, match="context_fn must be a callable"):
        RolloutConfig(turn_layout="per_turn", context_fn=3)

    class Plain(Protocol):
        def prompt_ids(self, tokenizer, prompt, tools=None):
            return [1]

        def parse(self, text, finished_by_eos):
            return Action(kind="answer", text=text)

        def observation_ids(self, tokenizer, observation, action):
            return [], {}

    with pytest.raises(ValueError, match=r"Plain does not implement render_context.*turn_layout='sequence'"):
        MultiTurnRollout(SearchLikeEnv, Plain(), smollm2_tokenizer, RolloutConfig(turn_layout="per_turn"))
    MultiTurnRollout(SearchLikeEnv, Plain(), smollm2_tokenizer, RolloutConfig()).close()  # sequence: fine
