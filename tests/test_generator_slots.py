"""The running batch keeps its K/V in place while rows join and leave (``_RunningKV``): a leaving row is copied out
to its session and the batch's last row moves into its slot; a joining row is prefilled straight into a free slot;
the buffers are rebuilt only when a joiner does not fit. None of this may change what is sampled.

What is proven here, on CPU with a tiny random Llama (real K/V):

* on scripted schedules of joins and leaves (rows finishing at different steps, rows rejoining with new context
  after different delays, more rows than ``max_batch_size``, observations long enough that a joiner is longer than
  the batch's columns, every row leaving), greedy ids equal the reference path's (``kv_reuse=False``, a full prefill
  per turn) and log-probs agree to 1e-5;
* the in-place path gives the same ids and log-probs as rebuilding the buffers at every join (what the generator
  did before: a restack of every row per event), greedy and sampled with the same seeds;
* sampled trajectories do not depend on the slots they decoded in (each row alone gives the same ids);
* a leave copies only the leaving row (plus the one row moved into its slot); a join into a free slot copies only
  the joiner's cached K/V; a joiner longer than the batch's columns rebuilds the buffers;
* columns under attention 0 (free slots, the left padding of every row) do not reach the live rows' results.
"""

from __future__ import annotations

import random

import pytest
import torch

from trl_multiturn.generation import SamplingParams, TransformersGenerator
from trl_multiturn.generation.kv_buffer import _RunningKV

from test_generation_speed import eos_after_some, one_thread  # noqa: F401 (one_thread: an autouse fixture)

GREEDY = SamplingParams(greedy=True)


@pytest.fixture
def tiny(tiny_model_factory):
    return tiny_model_factory(hidden_size=32, num_layers=2, seed=3).eval()


def rand_ids(rng, low, high):
    return [rng.randrange(300, 20000) for _ in range(rng.randrange(low, high))]


def drive(gen, n, turns, params, seed, delays, prompt=(4, 40), obs=(1, 30), budget=(2, 12)):
    """Multi-turn schedule through ``submit`` / ``step``: trajectory i starts at step ``i % 3``; after each turn its
    context grows by the sampled ids and an observation, and it is resubmitted ``delays[...]`` steps later (0: at
    the next step). Returns, per trajectory, its turns as ``(context, budget, ids, logprobs, finish_reason)``."""
    rng = random.Random(seed)
    sessions = [gen.new_session() for _ in range(n)]
    ctx = [rand_ids(rng, *prompt) for _ in range(n)]
    budgets = [[rng.randrange(*budget) for _ in range(turns)] for _ in range(n)]
    observations = [[rand_ids(rng, *obs) for _ in range(turns)] for _ in range(n)]
    due = {i: i % 3 for i in range(n)}
    turn = [0] * n
    record: dict[int, list] = {i: [] for i in range(n)}
    t = 0
    while due or gen.has_work:
        for i in sorted(k for k, v in due.items() if v <= t):
            del due[i]
            gen.submit(i, ctx[i], budgets[i][turn[i]], params, session=sessions[i])
        if gen.has_work:
            for i, out in gen.step():
                record[i].append((ctx[i], budgets[i][turn[i]], out.ids, out.logprobs, out.finish_reason))
                turn[i] += 1
                if turn[i] < turns:
                    ctx[i] = ctx[i] + out.ids + observations[i][turn[i]]
                    due[i] = t + delays[(i + turn[i]) % len(delays)]
        t += 1
        assert t < 10_000
    assert all(len(r) == turns for r in record.values())
    return record


def assert_same(a, b, atol=1e-5):
    assert a.keys() == b.keys()
    for i in a:
        for (ctx_a, bud_a, ids_a, lp_a, fin_a), (ctx_b, bud_b, ids_b, lp_b, fin_b) in zip(a[i], b[i]):
            assert (ctx_a, bud_a, ids_a, fin_a) == (ctx_b, bud_b, ids_b, fin_b), i
            torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), atol=atol, rtol=0)


SCHEDULES = {
    # name: (rows, turns, max_batch_size, delays, drive kwargs)
    "rows_finish_at_different_steps": (8, 4, None, [0, 1, 2, 5], {}),
    "more_rows_than_max_batch_size": (8, 3, 3, [1, 0, 3], {}),
    "long_observations_outgrow_the_columns": (6, 4, None, [0, 2], {"obs": (60, 200)}),
    "rejoin_at_once": (5, 5, None, [0], {"budget": (1, 6)}),
    "one_row_at_a_time": (4, 3, 1, [0, 4], {}),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_greedy_join_leave_schedules_match_the_reference_path(smollm2_tokenizer, tiny, name):
    tok = smollm2_tokenizer
    n, turns, mbs, delays, kw = SCHEDULES[name]
    gen = TransformersGenerator(tiny, tok, max_batch_size=mbs, logits_processor=eos_after_some(tok))
    record = drive(gen, n, turns, GREEDY, seed=len(name), delays=delays, **kw)
    assert gen._batch is None  # every row left: the buffers are freed
    reference = TransformersGenerator(tiny, tok, kv_reuse=False, logits_processor=eos_after_some(tok))
    for i, turns_i in record.items():
        for ctx, budget, ids, logprobs, finish in turns_i:
            (ref,) = reference.generate([ctx], [budget], GREEDY)
            assert ref.ids == ids and ref.finish_reason == finish, (name, i)
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref.logprobs), atol=1e-5, rtol=0)
    if mbs == 1:  # each row decodes alone: a fresh batch per turn, nothing to join
        assert gen.stats["kv_rebuilds"] == 0
        return
    # the schedule did exercise both ways in: joiners written into free slots, and at least one rebuild
    assert gen.stats["kv_rebuilds"] >= 1
    assert gen.stats["prefill_calls"] > gen.stats["kv_rebuilds"] + 1
    if name == "long_observations_outgrow_the_columns":
        assert gen.stats["kv_rebuilds"] >= 2


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.9),
                                    SamplingParams(temperature=0.7, top_k=50, top_p=0.9)], ids=["greedy", "t0.9", "topk"])
@pytest.mark.parametrize("mbs", [None, 3])
def test_in_place_joins_equal_rebuilding_at_every_join(smollm2_tokenizer, tiny, monkeypatch, params, mbs):
    """Same seeds, same schedule: the slots path against one that rebuilds every row's buffers at every join (as
    the generator did before slots, when each event restacked the batch)."""
    tok = smollm2_tokenizer

    def run():
        gen = TransformersGenerator(tiny, tok, generator=torch.Generator().manual_seed(11), max_batch_size=mbs,
                                    logits_processor=eos_after_some(tok))
        return drive(gen, 8, 4, params, seed=7, delays=[0, 1, 3]), gen.stats

    in_place, stats = run()
    monkeypatch.setattr(_RunningKV, "fits", lambda self, rows, length: False)
    rebuilt, rebuilt_stats = run()
    assert_same(in_place, rebuilt)
    assert rebuilt_stats["kv_rebuilds"] > 3 * stats["kv_rebuilds"]
    assert stats["kv_copied_tokens"] < rebuilt_stats["kv_copied_tokens"]
    assert stats["decode_positions"] == rebuilt_stats["decode_positions"]  # live rows only, no empty slots computed


def test_sampled_rows_do_not_depend_on_their_slots(smollm2_tokenizer, tiny):
    tok = smollm2_tokenizer
    sampling = SamplingParams(temperature=0.9)

    def run(mbs):
        gen = TransformersGenerator(tiny, tok, generator=torch.Generator().manual_seed(5), max_batch_size=mbs)
        return drive(gen, 6, 3, sampling, seed=2, delays=[0, 2, 1])

    assert_same(run(None), run(1))


def _submit_rows(gen, tok, budgets, seed=0, low=10, high=40):
    rng = random.Random(seed)
    contexts = [rand_ids(rng, low, high) for _ in budgets]
    sessions = [gen.new_session() for _ in budgets]
    for i, (ctx, budget) in enumerate(zip(contexts, budgets)):
        gen.submit(i, ctx, budget, GREEDY, session=sessions[i])
    return contexts, sessions


@pytest.mark.parametrize("leaver", [7, 2])
def test_a_leave_copies_only_the_leaving_row(smollm2_tokenizer, tiny, leaver):
    """One row of 8 ends its turn: its K/V go to its session; the batch's last row fills its slot (when it was not
    the last one itself) and nothing else is copied. (Before slots, every kept row was restacked.)"""
    tok = smollm2_tokenizer
    gen = TransformersGenerator(tiny, tok)
    budgets = [12] * 8
    budgets[leaver] = 3
    contexts, sessions = _submit_rows(gen, tok, budgets)
    for _ in range(2):
        assert gen.step() == []
    lengths = [r.length for r in gen._batch.rows]  # rows in submission order so far (no one has left)
    copied = gen.stats["kv_copied_tokens"]
    done = gen.step()  # the leaver samples its third token and leaves
    assert [k for k, _ in done] == [leaver]
    expected = lengths[leaver] + (lengths[7] if leaver != 7 else 0)
    assert gen.stats["kv_copied_tokens"] - copied == expected
    assert len(gen._batch.rows) == 7 and sessions[leaver].num_cached_tokens == lengths[leaver]
    while gen.has_work:
        gen.step()


def test_a_join_into_a_free_slot_copies_only_the_joiners_cache(smollm2_tokenizer, tiny):
    tok = smollm2_tokenizer
    gen = TransformersGenerator(tiny, tok)
    budgets = [20] * 8
    budgets[3] = 2
    contexts, sessions = _submit_rows(gen, tok, budgets, seed=1)
    done = {}
    while 3 not in done:
        done.update(gen.step())
    rebuilds, copied = gen.stats["kv_rebuilds"], gen.stats["kv_copied_tokens"]
    rejoin = contexts[3] + done[3].ids + [1000, 1001, 1002]
    gen.submit(3, rejoin, 4, GREEDY, session=sessions[3])
    gen.step()  # joins (the turn's last sampled token and the observation are prefilled), samples, decodes
    assert gen.stats["kv_copied_tokens"] - copied == len(rejoin) - 4  # its cached tokens, nothing of the others
    assert gen.stats["kv_rebuilds"] == rebuilds
    assert len(gen._batch.rows) == 8
    while gen.has_work:
        done.update(gen.step())
    alone = TransformersGenerator(tiny, tok).generate([rejoin], 4, GREEDY)[0]
    assert done[3].ids == alone.ids


def test_a_joiner_longer_than_the_columns_rebuilds_and_matches(smollm2_tokenizer, tiny):
    tok = smollm2_tokenizer
    gen = TransformersGenerator(tiny, tok)
    contexts, _ = _submit_rows(gen, tok, [30, 30, 30], seed=2)
    gen.step()
    long_context = rand_ids(random.Random(9), 400, 401)
    assert len(long_context) > gen._batch.kv.end  # no room on the left of the rows' end column
    gen.submit("long", long_context, 8, GREEDY)
    done = {}
    while gen.has_work:
        done.update(gen.step())
    assert gen.stats["kv_rebuilds"] >= 1
    for key, ctx, budget in [(0, contexts[0], 30), (1, contexts[1], 30), (2, contexts[2], 30), ("long", long_context, 8)]:
        alone = TransformersGenerator(tiny, tok, kv_reuse=False).generate([ctx], budget, GREEDY)[0]
        assert done[key].ids == alone.ids, key
        torch.testing.assert_close(torch.tensor(done[key].logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)


def test_columns_under_attention_zero_do_not_reach_live_rows(smollm2_tokenizer, tiny):
    """Free slots and every row's left padding keep stale K/V (rows that left, rows that moved); fill all of them
    with large values mid-run and nothing sampled changes."""
    tok = smollm2_tokenizer

    def run(poison):
        gen = TransformersGenerator(tiny, tok, logits_processor=eos_after_some(tok))
        contexts, _ = _submit_rows(gen, tok, [4, 9, 3, 12, 6, 12], seed=3, low=5, high=60)
        done, steps = {}, 0
        while gen.has_work:
            done.update(gen.step())
            steps += 1
            if poison and gen._batch is not None and steps % 2 == 0:
                kv, n = gen._batch.kv, len(gen._batch.rows)
                off = kv.mask[:, : kv.end] == 0  # (C, end): columns under attention 0 (free slots: every column)
                off[n:] = True
                for buf in kv.keys + kv.values:
                    buf[:, :, : kv.end].masked_fill_(off[:, None, :, None], 100.0)
        return {k: (o.ids, o.logprobs) for k, o in done.items()}

    clean, poisoned = run(False), run(True)
    assert clean.keys() == poisoned.keys()
    for k in clean:
        assert clean[k][0] == poisoned[k][0]
        torch.testing.assert_close(torch.tensor(poisoned[k][1]), torch.tensor(clean[k][1]), atol=1e-5, rtol=0)


def test_rows_left_the_batch_then_a_new_batch_starts(smollm2_tokenizer, tiny):
    tok = smollm2_tokenizer
    gen = TransformersGenerator(tiny, tok)
    first = gen.generate([[400, 401, 402], [500, 501]], [3, 5], GREEDY)
    assert gen._batch is None  # all rows left: nothing held
    second = gen.generate([[600, 601, 602, 603]], 4, GREEDY)
    alone = TransformersGenerator(tiny, tok).generate([[600, 601, 602, 603]], 4, GREEDY)
    assert second[0].ids == alone[0].ids and len(first[1].ids) <= 5


def test_a_rebuild_sizes_its_slots_to_the_rows_in_flight(smollm2_tokenizer, tiny):
    """Once most trajectories have finished, a rebuild allocates slots for the rows still in flight (running,
    joining, queued, or parked between turns with their K/V), not for the largest batch seen: the evaluation of the
    offline default rebuilt 32 slots x 976 columns (1,372 MiB) for one running row."""
    tok = smollm2_tokenizer
    gen = TransformersGenerator(tiny, tok)
    budgets = [2] * 6 + [30, 30]
    contexts, sessions = _submit_rows(gen, tok, budgets, seed=4)
    done = {}
    while len(done) < 6:
        done.update(gen.step())
    assert gen._batch.kv.slots == 8 and len(gen._batch.rows) == 2
    for i in range(5):  # five trajectories ended (the rollout drops their sessions); trajectory 5 waits for its
        sessions[i].drop()  # observation, its K/V parked in its session
    long_context = rand_ids(random.Random(8), 400, 401)
    assert len(long_context) > gen._batch.kv.end  # the joiner does not fit: the buffers are rebuilt
    gen.submit("long", long_context, 6, GREEDY)
    gen.step()
    assert gen.stats["kv_rebuilds"] == 1
    assert gen._batch.kv.slots == 4  # 2 running + 1 joining + 1 parked
    sessions[5].drop()
    while gen.has_work:
        done.update(gen.step())
    for key, ctx, budget in [(6, contexts[6], 30), (7, contexts[7], 30), ("long", long_context, 6)]:
        alone = TransformersGenerator(tiny, tok, kv_reuse=False).generate([ctx], budget, GREEDY)[0]
        assert done[key].ids == alone.ids, key
