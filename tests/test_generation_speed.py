"""The rollout speed-ups change nothing but speed: K/V kept across turns, rows joining and leaving a running batch,
shared prompt prefixes, environment steps overlapped with generation, and the vLLM backend's calls.

What is proven here, on CPU with a tiny random Llama (real K/V) and stand-ins for vLLM:

* greedy decoding gives the same ids (and log-probs to float tolerance) with the optimizations as with the
  reference loop (``kv_reuse=False``: full prefill, one batch per call), turn after turn and through whole
  multi-turn rollouts whose environments answer at different times;
* sampled log-probs equal a fresh forward over the whole context at every turn;
* after the first turn only the appended tokens are prefilled; a dropped cache falls back to a full prefill;
* a row that joins a running batch, or waits for room in it, samples what it would sample alone;
* stop strings end a turn inside the backend (nothing is generated past them);
* environment steps run while other rows generate, and concurrently with each other;
* ``VLLMGenerator`` passes token-id prompts, per-row budgets, stop strings and ``logprobs`` to the colocate engine
  and to the server client, and every rank makes the same number of calls (the collective-call rule).
"""

from __future__ import annotations

import random
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from trl_multiturn.environment import Step
from trl_multiturn.generation import (
    Collectives,
    GenerationSession,
    SamplingParams,
    TransformersGenerator,
    VLLMGenerator,
)
from trl_multiturn.protocols import TagProtocol
from trl_multiturn.rollout import MultiTurnRollout, RolloutConfig

from scripted import OneShotEnv, ScriptedLM


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest, and steadiest, on one thread (the CI machine is shared)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tiny(tiny_model_factory):
    return tiny_model_factory(hidden_size=32, num_layers=2, seed=3)


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def random_contexts(n, seed=0, low=4, high=30):
    rng = random.Random(seed)
    return [[rng.randrange(300, 20000) for _ in range(rng.randrange(low, high))] for _ in range(n)]


def force_text(tok, text_ids, context_length):
    """A logits processor that makes a row with a ``context_length``-token context write ``text_ids``, then EOS."""

    def processor(rows, logits):
        out = torch.full_like(logits, float("-inf"))  # (A, V)
        for a, row in enumerate(rows):
            p = len(row) - context_length
            out[a, text_ids[p] if p < len(text_ids) else tok.eos_token_id] = 0.0
        return out

    return processor


# ---------------------------------------------------------------------------------------------------- exactness
def test_kv_reuse_greedy_matches_reference_turn_after_turn(smollm2_tokenizer, tiny):
    tok = smollm2_tokenizer
    rng = random.Random(1)
    contexts = random_contexts(5, seed=1)
    reference = TransformersGenerator(tiny, tok, kv_reuse=False)
    fast = TransformersGenerator(tiny, tok)
    assert fast.kv_reuse and not reference.kv_reuse
    sessions = [fast.new_session() for _ in contexts]
    ctx_ref, ctx_fast = [list(c) for c in contexts], [list(c) for c in contexts]
    greedy = SamplingParams(greedy=True)
    new_tokens = [len(c) for c in contexts]  # tokens appended since the previous turn (all of them at turn 0)
    for turn in range(4):
        budgets = [rng.randrange(2, 10) for _ in contexts]
        out_ref = reference.generate(ctx_ref, budgets, greedy)
        out_fast = fast.generate(ctx_fast, budgets, greedy, sessions=sessions)
        for i, (ctx, o) in enumerate(zip(ctx_fast, out_fast)):
            assert o.prefill_tokens + o.cached_tokens == len(ctx)  # every context token computed or reused
            if turn > 0:
                # only new tokens are computed; a row whose new chunk is shorter than the longest one re-feeds a few
                # history tokens so that all rows of the prefill align
                assert new_tokens[i] <= o.prefill_tokens <= max(new_tokens)
        for i, (a, b) in enumerate(zip(out_ref, out_fast)):
            assert a.ids == b.ids, (turn, i)
            torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)
            assert a.finish_reason == b.finish_reason
            observation = [rng.randrange(300, 20000) for _ in range(rng.randrange(1, 12))]
            new_tokens[i] = 1 + len(observation)  # the turn's last sampled token was never fed, then the observation
            ctx_ref[i] = ctx_ref[i] + a.ids + observation
            ctx_fast[i] = ctx_fast[i] + b.ids + observation
    # the reference computed every history again; the fast path computed the new tokens only
    assert fast.stats["prefill_tokens"] < reference.stats["prefill_tokens"] / 2


class LaggyEnv:
    """An environment whose answers take a trajectory-dependent time and length; never ends the episode."""

    def reset(self, example):
        self.i = example["i"]
        self.turn = 0
        preamble = "You are a careful research agent. Search with the search tag, answer with the answer tag. "
        return preamble + f"Question {example['i']}: " + "word " * (3 + 2 * example["i"])

    def step(self, action):
        self.turn += 1
        time.sleep(0.002 * ((self.i * 7 + self.turn * 3) % 11))
        return Step(observation="obs " * (1 + (self.i + self.turn) % 5), reward=0.1 * self.turn)


def eos_after_some(tok):
    """Deterministic early EOS: after any token divisible by 5 the next token is EOS (turns end at varied lengths)."""

    def processor(rows, logits):
        logits = logits.clone()
        for a, row in enumerate(rows):
            if row[-1] % 5 == 0 and row[-1] != tok.eos_token_id:
                logits[a] = float("-inf")
                logits[a, tok.eos_token_id] = 0.0
        return logits

    return processor


def run_rollout(tok, model, kv_reuse, sampling, n=6, seed=0, max_batch_size=None):
    rollout = MultiTurnRollout(
        LaggyEnv,
        TagProtocol(use_chat_template=False),
        tok,
        RolloutConfig(max_turns=4, max_completion_length=200, max_tokens_per_turn=7, env_timeout=5.0),
    )
    generator = TransformersGenerator(
        model, tok, generator=torch.Generator().manual_seed(seed), kv_reuse=kv_reuse,
        logits_processor=eos_after_some(tok), max_batch_size=max_batch_size,
    )
    try:
        trajs = rollout.run([{"i": i} for i in range(n)], generator, sampling)
    finally:
        rollout.close()
    return trajs, rollout.last_stats, generator.stats


def test_rollout_trajectories_unchanged_by_the_optimizations(smollm2_tokenizer, tiny):
    tok = smollm2_tokenizer
    greedy = SamplingParams(greedy=True)
    ref, ref_stats, _ = run_rollout(tok, tiny, kv_reuse=False, sampling=greedy)
    fast, fast_stats, gen_stats = run_rollout(tok, tiny, kv_reuse=True, sampling=greedy)
    capped, _, _ = run_rollout(tok, tiny, kv_reuse=True, sampling=greedy, max_batch_size=2)
    for a, b, c in zip(ref, fast, capped):
        b.validate()
        assert a.completion_ids == b.completion_ids == c.completion_ids
        assert a.action_mask == b.action_mask and a.turn_ids == b.turn_ids and a.turn_rewards == b.turn_rewards
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)
        assert a.info["stop_reason"] == b.info["stop_reason"]
    assert sum(t.num_turns for t in fast) > len(fast)  # multi-turn, with varied turn lengths (early EOS)
    assert len({len(t.completion_ids) for t in fast}) > 1
    assert fast_stats["generated_tokens"] == ref_stats["generated_tokens"]
    assert fast_stats["prefill_tokens"] < ref_stats["prefill_tokens"]
    assert gen_stats["shared_prefix_tokens"] > 0  # the prompts share their preamble


def test_sampled_trajectories_do_not_depend_on_batching(smollm2_tokenizer, tiny):
    """Per-trajectory sampling streams: the same seed gives the same trajectories whatever the batch shape."""
    tok = smollm2_tokenizer
    sampling = SamplingParams(temperature=0.9)
    a, _, _ = run_rollout(tok, tiny, kv_reuse=True, sampling=sampling, seed=5)
    b, _, _ = run_rollout(tok, tiny, kv_reuse=True, sampling=sampling, seed=5, max_batch_size=1)
    assert [t.completion_ids for t in a] == [t.completion_ids for t in b]


def test_sampling_logprobs_equal_a_fresh_forward_every_turn(smollm2_tokenizer, tiny):
    tok = smollm2_tokenizer
    gen = TransformersGenerator(tiny, tok, generator=torch.Generator().manual_seed(0))
    contexts = random_contexts(3, seed=2)
    sessions = [gen.new_session() for _ in contexts]
    for turn in range(3):
        outs = gen.generate(contexts, 6, SamplingParams(temperature=0.7), sessions=sessions)
        if turn:
            assert all(o.prefill_tokens == 3 for o in outs)  # last sampled token + 2 appended ids, no history
        for i, (ctx, out) in enumerate(zip(contexts, outs)):
            full = torch.tensor([ctx + out.ids])
            with torch.no_grad():
                logp = torch.log_softmax(tiny(full).logits[0, :-1].float() / 0.7, -1)
            recomputed = logp.gather(-1, full[0, 1:, None])[:, 0][len(ctx) - 1 :]
            torch.testing.assert_close(recomputed, torch.tensor(out.logprobs), atol=1e-4, rtol=0)
            contexts[i] = ctx + out.ids + [400 + turn, 500 + i]


def test_only_new_tokens_are_prefilled_and_a_dropped_cache_falls_back(smollm2_tokenizer, tiny):
    tok = smollm2_tokenizer
    greedy = SamplingParams(greedy=True)
    gen = TransformersGenerator(tiny, tok)
    session = gen.new_session()
    context = random_contexts(1, seed=4, low=20, high=21)[0]
    (first,) = gen.generate([context], 5, greedy, sessions=[session])
    assert first.prefill_tokens == len(context) and first.cached_tokens == 0
    observation = [1000, 1001, 1002]
    context2 = context + first.ids + observation
    (second,) = gen.generate([context2], 5, greedy, sessions=[session])
    # prefill tokens per generated token after the first turn: the last sampled token + the observation, no history
    assert second.prefill_tokens == 1 + len(observation)
    assert second.cached_tokens == len(context2) - 1 - len(observation)
    # the same turn without the cache: a full prefill, the same ids
    session.drop()
    (again,) = gen.generate([context2], 5, greedy, sessions=[session])
    assert again.prefill_tokens == len(context2) and again.cached_tokens == 0
    assert again.ids == second.ids
    # a context that diverges from the cached ids reuses only the common prefix
    edited = context2[:10] + [7777] + context2[11:]
    (diverged,) = gen.generate([edited], 3, greedy, sessions=[session])
    assert diverged.cached_tokens == 10


def test_a_running_row_holds_its_kv_once(smollm2_tokenizer, tiny):
    """While a row decodes, its earlier K/V live only in the batch's buffers (the session's copy is released when
    the row joins), and the session gets them back, whole, when the turn ends: the cache is never held twice."""
    tok = smollm2_tokenizer
    greedy = SamplingParams(greedy=True)
    gen = TransformersGenerator(tiny, tok)
    session = gen.new_session()
    context = random_contexts(1, seed=5, low=20, high=21)[0]
    (first,) = gen.generate([context], 5, greedy, sessions=[session])
    assert session.kv is not None and len(session.cached_ids) == len(context) + len(first.ids) - 1
    context2 = context + first.ids + [1000, 1001]
    gen.submit("x", context2, 5, greedy, session=session)
    gen.step()  # the row joins: its cached prefix is copied into the batch, then decodes
    assert gen._batch is not None and session.kv is None and session.cached_ids == []
    while gen.has_work:
        gen.step()
    n = len(session.cached_ids)
    assert session.kv is not None and n >= len(context2) and all(k.shape[2] == n for k, _ in session.kv)


def test_rows_join_a_running_batch_and_sample_what_they_would_alone(smollm2_tokenizer, tiny):
    tok = smollm2_tokenizer
    greedy = SamplingParams(greedy=True)
    a_ctx, b_ctx, c_ctx = random_contexts(3, seed=6, low=8, high=25)
    alone = {k: TransformersGenerator(tiny, tok).generate([c], 12, greedy)[0].ids for k, c in zip("abc", (a_ctx, b_ctx, c_ctx))}
    gen = TransformersGenerator(tiny, tok, max_batch_size=2)
    sessions = {k: gen.new_session() for k in "abc"}
    gen.submit("a", a_ctx, 12, greedy, session=sessions["a"])
    done = {}
    for _ in range(3):
        done.update(gen.step())
    gen.submit("b", b_ctx, 12, greedy, session=sessions["b"])  # joins while "a" is decoding
    gen.submit("c", c_ctx, 12, greedy, session=sessions["c"])  # waits: max_batch_size=2
    assert len(gen._batch.rows) == 1 and len(gen._queue) == 2
    while gen.has_work:
        done.update(gen.step())
    assert {k: o.ids for k, o in done.items()} == alone
    assert gen.stats["prefill_calls"] >= 3


def test_stop_strings_end_the_turn_inside_the_backend(smollm2_tokenizer, tiny):
    tok = smollm2_tokenizer
    script = ids(tok, "<think>look</think><search>capital of France</search> and more text after it")
    context = ids(tok, "Q: capital?")
    gen = TransformersGenerator(tiny, tok, logits_processor=force_text(tok, script, len(context)))
    (out,) = gen.generate([context], 64, SamplingParams(stop_strings=("</search>", "</answer>")))
    assert out.finish_reason == "stop" and tok.decode(out.ids).endswith("</search>")
    assert gen.stats["generated_tokens"] == len(out.ids)  # nothing sampled past the stop string
    assert gen.stats["decode_positions"] == len(out.ids) - 1  # and the stop token itself was never fed


def test_kv_reuse_through_a_peft_adapter(smollm2_tokenizer, tiny):
    """A LoRA-wrapped policy (what the trainer generates with under peft_config) keeps K/V across turns too."""
    from peft import LoraConfig, get_peft_model

    tok = smollm2_tokenizer
    model = get_peft_model(tiny, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)).eval()
    fast, reference = TransformersGenerator(model, tok), TransformersGenerator(model, tok, kv_reuse=False)
    assert fast.kv_reuse
    contexts = random_contexts(2, seed=9)
    sessions = [fast.new_session() for _ in contexts]
    for turn in range(2):
        a = reference.generate(contexts, 5, SamplingParams(greedy=True))
        b = fast.generate(contexts, 5, SamplingParams(greedy=True), sessions=sessions)
        assert [o.ids for o in a] == [o.ids for o in b]
        contexts = [c + o.ids + [321, 654] for c, o in zip(contexts, a)]
    assert all(o.cached_tokens > 0 for o in b)


def test_kv_reuse_does_not_depend_on_the_name_of_the_cache_argument(smollm2_tokenizer, tiny, monkeypatch):
    """transformers 5.24 renamed the forward's ``past_key_values`` to ``cache``; K/V reuse works under both (the
    generator tests pass under 5.17 and 5.25), so an earlier 5.x must not silently fall back to full prefills."""
    from trl_multiturn.generation import kv_buffer, transformers_generator

    for name in ("cache", "past_key_values"):
        monkeypatch.setattr(kv_buffer, "_CACHE_KWARG", name)
        monkeypatch.setattr(transformers_generator, "_CACHE_KWARG", name)
        assert kv_buffer._kv_reuse_blocker(tiny) is None
        assert TransformersGenerator(tiny, smollm2_tokenizer).kv_reuse


def test_a_model_that_cannot_keep_kv_warns_and_takes_the_reference_path(smollm2_tokenizer):
    from transformers import MistralConfig, MistralForCausalLM

    tok = smollm2_tokenizer
    config = MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=16,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    with pytest.warns(UserWarning, match=r"K/V reuse across turns is off: the model uses sliding-window attention \(sliding_window=16\)"):
        gen = TransformersGenerator(model, tok)
    assert not gen.kv_reuse
    reference = TransformersGenerator(model, tok, kv_reuse=False)  # asked for: no warning
    contexts = [ids(tok, "Question one"), ids(tok, "A second, longer question")]
    a = gen.generate(contexts, 6, SamplingParams(greedy=True), sessions=[gen.new_session() for _ in contexts])
    b = reference.generate(contexts, 6, SamplingParams(greedy=True))
    assert [o.ids for o in a] == [o.ids for o in b] and all(len(o.ids) == 6 for o in a)
    assert all(o.logprobs == pytest.approx(p.logprobs, abs=1e-6) for o, p in zip(a, b))


def test_reference_path_for_models_without_a_transformers_cache(smollm2_tokenizer):
    tok = smollm2_tokenizer
    lm = ScriptedLM([ids(tok, "short")], len(tok), tok.eos_token_id)
    gen = TransformersGenerator(lm, tok)
    assert not gen.kv_reuse  # ScriptedLM keeps its own cache object: full prefill, one batch per call
    (out,) = gen.generate([ids(tok, "Q")], 64, SamplingParams(), sessions=[GenerationSession()])
    assert out.finish_reason == "eos"


# ---------------------------------------------------------------------------------------------------- independence
class GatedEnv:
    """Environments whose calls wait for each other, so that overlap is an order of events, not a race with a clock.

    The first calls of all four trajectories wait at a barrier (they must all be in flight at once); trajectory 0's
    first call then waits until another trajectory's second call has started, which needs that trajectory's second
    turn to be generated meanwhile. In lock step neither can happen: the wait times out and the trajectory fails.
    ``log`` holds ``(event, trajectory, call, generation steps so far)`` in the order the events happened."""

    log: list = []
    first_calls = threading.Barrier(4)
    second_call_started = threading.Event()
    generation_steps = [0]
    bound_s = 30.0

    def reset(self, example):
        self.i, self.calls = example["i"], 0
        return f"Question {self.i}"

    def step(self, action):
        self.calls += 1
        GatedEnv.log.append(("start", self.i, self.calls, GatedEnv.generation_steps[0]))
        if self.calls == 1:
            GatedEnv.first_calls.wait(timeout=GatedEnv.bound_s)
        if self.calls == 2 and self.i != 0:
            GatedEnv.second_call_started.set()
        if self.calls == 1 and self.i == 0 and not GatedEnv.second_call_started.wait(GatedEnv.bound_s):
            raise TimeoutError("no other trajectory reached its second environment call meanwhile")
        GatedEnv.log.append(("end", self.i, self.calls, GatedEnv.generation_steps[0]))
        return Step(observation="ok")


def test_env_steps_overlap_generation_and_each_other(smollm2_tokenizer, tiny):
    tok = smollm2_tokenizer
    GatedEnv.log, GatedEnv.generation_steps = [], [0]
    GatedEnv.first_calls, GatedEnv.second_call_started = threading.Barrier(4), threading.Event()
    rollout = MultiTurnRollout(
        GatedEnv, TagProtocol(use_chat_template=False), tok,
        RolloutConfig(max_turns=3, max_completion_length=200, max_tokens_per_turn=4, env_timeout=60.0),
    )
    gen = TransformersGenerator(tiny, tok)
    original = gen.step

    def counted_step():
        GatedEnv.generation_steps[0] += 1
        return original()

    gen.step = counted_step
    trajs = rollout.run([{"i": i} for i in range(4)], gen, SamplingParams(greedy=True))
    rollout.close()
    assert [t.info.get("env_errors") for t in trajs] == [None] * 4  # the barrier and the wait were both met
    assert [t.num_turns for t in trajs] == [3, 3, 3, 3]
    log = GatedEnv.log
    slow_start = log.index(next(e for e in log if e[:3] == ("start", 0, 1)))
    slow_end = log.index(next(e for e in log if e[:3] == ("end", 0, 1)))
    # the first calls of all four trajectories were in flight together: all started before any ended
    first_end = next(k for k, e in enumerate(log) if e[0] == "end" and e[2] == 1)
    assert sorted(e[1] for e in log[:first_end] if e[0] == "start" and e[2] == 1) == [0, 1, 2, 3]
    # while trajectory 0 waited for its environment, the others kept generating (their next turns) ...
    assert log[slow_end][3] > log[slow_start][3]
    # ... and a fast trajectory's second environment call started before the slow first call ended (no lock step)
    assert any(e[0] == "start" and e[1] != 0 and e[2] == 2 for e in log[slow_start:slow_end])
    assert rollout.last_stats["env_busy_s"] > rollout.last_stats["env_time_s"]


# ---------------------------------------------------------------------------------------------------- vLLM backend
class FakeSamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


def _fake_completion(tok, text, budget, stops):
    """What vLLM would return for ``text``: cut after the first stop string (kept) or at the budget."""
    cut = [text.index(s) + len(s) for s in stops if s in text]
    if cut:
        text = text[: min(cut)]
    out = ids(tok, text)
    return out[:budget]


class FakeLLM:
    """Stand-in for ``vllm.LLM``: every prompt continues with a fixed text; records what it was asked."""

    def __init__(self, tok, text):
        self.tok, self.text, self.calls = tok, text, []

    def generate(self, prompts, sampling_params, use_tqdm=False):
        self.calls.append((prompts, sampling_params))
        outs = []
        for prompt, sp in zip(prompts, sampling_params):
            assert "prompt_token_ids" in prompt
            token_ids = _fake_completion(self.tok, self.text, sp.max_tokens, getattr(sp, "stop", []))
            logprobs = [{t: SimpleNamespace(logprob=-0.1 * (k + 1), rank=1)} for k, t in enumerate(token_ids)]
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=token_ids, logprobs=logprobs)]))
        return outs


class FakeClient:
    """Stand-in for TRL's ``VLLMClient`` (server mode)."""

    def __init__(self, tok, text):
        self.tok, self.text, self.calls = tok, text, []

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, top_k=0, max_tokens=16, logprobs=0, generation_kwargs=None):
        self.calls.append(dict(prompts=prompts, max_tokens=max_tokens, logprobs=logprobs, **(generation_kwargs or {})))
        stops = (generation_kwargs or {}).get("stop", [])
        completions = [_fake_completion(self.tok, self.text, max_tokens, stops) for _ in prompts]
        return {
            "prompt_ids": prompts,
            "completion_ids": completions,
            "logprobs": [[[-0.2] for _ in c] for c in completions],
            "logprob_token_ids": [[[t] for t in c] for c in completions],
        }


def test_vllm_colocate_passes_token_ids_budgets_stops_and_logprobs(smollm2_tokenizer):
    tok = smollm2_tokenizer
    llm = FakeLLM(tok, "<search>capital of France</search> and then more")
    gen = VLLMGenerator(tok, "colocate", llm=llm, sampling_params_cls=FakeSamplingParams)
    contexts = [ids(tok, "Q one"), ids(tok, "Q two is longer"), ids(tok, "Q three")]
    outs = gen.generate(contexts, [64, 0, 3], SamplingParams(temperature=0.8, stop_strings=("</search>", "</answer>")))
    prompts, sampling = llm.calls[0]
    assert [p["prompt_token_ids"] for p in prompts] == [contexts[0], contexts[2]]  # budget 0: not sent
    assert [sp.max_tokens for sp in sampling] == [64, 3]
    assert sampling[0].stop == ["</search>", "</answer>"] and sampling[0].include_stop_str_in_output
    assert sampling[0].logprobs == 0 and sampling[0].temperature == 0.8
    assert outs[0].finish_reason == "stop" and tok.decode(outs[0].ids).endswith("</search>")
    assert outs[0].logprobs == pytest.approx([-0.1 * (k + 1) for k in range(len(outs[0].ids))])
    assert outs[1].ids == [] and outs[2].finish_reason == "length" and len(outs[2].ids) == 3


def test_vllm_server_mode_through_the_client(smollm2_tokenizer):
    tok = smollm2_tokenizer
    client = FakeClient(tok, "<answer>Paris</answer><|im_end|>")
    gen = VLLMGenerator(tok, "server", client=client)
    outs = gen.generate([ids(tok, "Q"), ids(tok, "Q2")], [64, 2], SamplingParams(greedy=True, stop_strings=("</answer>",)))
    call = client.calls[0]
    assert call["stop"] == ["</answer>"] and call["include_stop_str_in_output"] and call["max_tokens"] == 64
    assert outs[0].finish_reason == "stop" and outs[0].logprobs == [-0.2] * len(outs[0].ids)
    assert len(outs[1].ids) == 2 and outs[1].finish_reason == "length"  # cut to its own budget


def test_vllm_generator_from_trls_vllm_generation(smollm2_tokenizer):
    """``from_trl`` reads the mode, the engine or client, and TRL's generation_kwargs from ``trainer.vllm_generation``."""
    tok = smollm2_tokenizer
    client = FakeClient(tok, "<answer>Paris</answer>")
    accelerator = SimpleNamespace(num_processes=1, process_index=0, is_main_process=True)
    trl_side = SimpleNamespace(mode="server", vllm_client=client, accelerator=accelerator, generation_kwargs={"seed": 7})
    gen = VLLMGenerator.from_trl(trl_side, tok)
    (out,) = gen.generate([ids(tok, "Q")], 16, SamplingParams(stop_strings=("</answer>",)))
    assert client.calls[0]["seed"] == 7 and out.finish_reason == "stop"
    llm = FakeLLM(tok, "x")
    colocate = SimpleNamespace(mode="colocate", llm=llm, accelerator=accelerator, generation_kwargs=None, tensor_parallel_size=1)
    assert VLLMGenerator.from_trl(colocate, tok).llm is llm


class ThreadCollectives(Collectives):
    """Two "ranks" as two threads: all_gather and broadcast meet at a barrier (a rank that skips a call hangs the
    other, which the barrier's timeout turns into a failure)."""

    def __init__(self, shared, rank, world):
        self.shared, self.rank, self.is_main, self.world = shared, rank, rank == 0, world

    def _exchange(self, obj):
        s = self.shared
        s["slots"][self.rank] = obj
        s["barrier"].wait(timeout=10)
        out = list(s["slots"])
        s["barrier"].wait(timeout=10)
        return out

    def all_gather(self, obj):
        return self._exchange(obj)

    def broadcast(self, obj):
        return self._exchange(obj)[0]


def test_vllm_collective_call_rule_in_the_rollout(smollm2_tokenizer):
    """Rank 0 finishes after one turn, rank 1 needs three: both still make max_turns calls (no deadlock)."""
    tok = smollm2_tokenizer
    shared = {"slots": [None, None], "barrier": threading.Barrier(2)}
    client = FakeClient(tok, "<search>x</search>")
    results, errors = {}, []

    def rank_main(rank, searches):
        gen = VLLMGenerator(tok, "server", client=client, collectives=ThreadCollectives(shared, rank, 2))
        rollout = MultiTurnRollout(OneShotEnv, TagProtocol(use_chat_template=False), tok, RolloutConfig(max_turns=4, env_timeout=5.0))
        try:
            trajs = rollout.run([{"searches": s} for s in searches], gen, SamplingParams())
            results[rank] = (gen.calls, [t.num_turns for t in trajs])
        except Exception as exc:  # surfaced below
            errors.append(exc)
        finally:
            rollout.close()

    threads = [threading.Thread(target=rank_main, args=(0, [0])), threading.Thread(target=rank_main, args=(1, [2, 1]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert results[0] == (4, [1]) and results[1] == (4, [3, 2])
    # the engine was called only while some rank had rows, by the main process, with every rank's rows
    assert [len(c["prompts"]) for c in client.calls] == [3, 2, 1]
