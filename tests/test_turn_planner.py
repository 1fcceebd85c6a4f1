"""The micro-batch planner of the per-turn layout (issue 19, item 5): a trajectory's rows planned together.

Under a template that drops earlier ``<think>`` blocks every turn is a row whose context repeats the earlier turns;
the prefix-tree forward computes what rows share once, but only when they share a micro-batch. Dealing rows one by
one by length scatters a trajectory's rows over the micro-batches; the planner keeps them together when that
computes fewer tokens, and the mini-batch's loss is unchanged (the same rows, the same normalizers)."""

import random

import pytest
import torch

from trl_multiturn.batching import balanced_micro_batches, chunk_normalizers, chunk_tokens
from trl_multiturn.layouts import MIN_SHARED_RUN, prefix_tree_row
from trl_multiturn.trajectory import Trajectory
from trl_multiturn.turn_rows import expand_turn_rows, trajectory_mini_batches, turn_rows_of

from test_turn_rows import PAD, _scored


def _thinking_trajectory(rng: random.Random, prompt: list[int], turns: int) -> Trajectory:
    """Each turn samples ``<think>`` tokens then visible tokens; the next turn's context keeps the visible tokens and
    the observation only (a thinking template), so turn k's context is not a prefix of turn k + 1's row."""
    t = Trajectory(prompt_ids=list(prompt))
    visible = list(prompt)
    for k in range(turns):
        t.turn_contexts.append(list(visible))
        think = [rng.randrange(1, 400) for _ in range(rng.randint(3, 8))]
        said = [rng.randrange(1, 400) for _ in range(rng.randint(12, 24))]
        t.add_action(think + said)
        visible += said
        if k < turns - 1:
            observation = [rng.randrange(1, 400) for _ in range(rng.randint(10, 20))]
            t.add_observation(observation)
            visible += observation
    return t


def _per_turn_rollout(groups: int = 2, group_size: int = 4, seed: int = 0):
    rng = random.Random(seed)
    trajs = []
    for _ in range(groups):
        prompt = [rng.randrange(1, 400) for _ in range(rng.randint(20, 30))]
        trajs += [_thinking_trajectory(rng, prompt, rng.randint(2, 4)) for _ in range(group_size)]
    batch = _scored(trajs)
    rows, owner = expand_turn_rows(batch, [turn_rows_of(t) for t in trajs], PAD)
    rows["row_owner"] = torch.tensor(owner)  # (R,) carried into each micro-batch by the planner's row slicing
    return trajs, rows, owner


def _tokens(chunks, min_shared=MIN_SHARED_RUN):
    return sum(chunk_tokens(c, True, False, True, min_shared)[0] for c in chunks)


def _owners(chunk) -> list[int]:
    return chunk["row_owner"].tolist()


def test_the_rollout_splits_into_rows_that_repeat_earlier_turns():
    trajs, rows, owner = _per_turn_rollout()
    assert len(owner) == sum(t.num_turns for t in trajs) > len(trajs)  # every turn its own row


@pytest.mark.parametrize("min_shared", [MIN_SHARED_RUN, None])
def test_fixed_micro_batches_hold_whole_trajectories_and_compute_fewer_tokens(min_shared):
    trajs, rows, owner = _per_turn_rollout()
    minis = trajectory_mini_batches(owner, len(trajs), 1)
    dealt = balanced_micro_batches(rows, 4, 4, share_prefix=True, mini_batches=minis)
    planned = balanced_micro_batches(rows, 4, 4, share_prefix=True, mini_batches=minis, owner=owner,
                                     min_shared=min_shared)
    assert len(planned) == 4
    count = {b: owner.count(b) for b in set(owner)}
    for chunk in planned:  # micro_batch_size = 2 trajectories each, every one with all of its rows
        present = set(_owners(chunk))
        assert len(present) == 2 and all(_owners(chunk).count(b) == count[b] for b in present)
    assert any(len({owner for owner in _owners(c)}) > 2 for c in dealt)  # dealing rows scatters trajectories
    assert sorted(sum((_owners(c) for c in planned), [])) == sorted(owner)  # a partition of the same rows
    assert _tokens(planned, min_shared) < _tokens(dealt, min_shared)
    # the same mini-batch normalizers, so the accumulated loss is the mini-batch's (tests/test_turn_rows.py)
    torch.testing.assert_close(chunk_normalizers(planned).sum(0), chunk_normalizers(dealt).sum(0))


def test_the_prefix_tree_cost_counts_what_a_trajectorys_rows_share():
    trajs, rows, owner = _per_turn_rollout(groups=1, group_size=2)
    minis = trajectory_mini_batches(owner, len(trajs), 1)
    (chunk,) = balanced_micro_batches(rows, 1, 1, share_prefix=True, mini_batches=minis, owner=owner,
                                      min_shared=MIN_SHARED_RUN)
    ids = torch.cat([chunk["prompt_ids"], chunk["completion_ids"]], 1)
    mask = torch.cat([chunk["prompt_mask"], chunk["completion_mask"]], 1)
    width = chunk["completion_ids"].size(1)
    tree = prefix_tree_row(ids, mask, width).ids.size(1)
    prompts_only = prefix_tree_row(ids, mask, width, min_shared=None).ids.size(1)
    assert chunk_tokens(chunk, True, False, True, MIN_SHARED_RUN)[0] == tree < prompts_only
    assert chunk_tokens(chunk, True, False, True)[0] == prompts_only


def test_token_budget_micro_batches_of_whole_trajectories_fit_the_budget():
    trajs, rows, owner = _per_turn_rollout(groups=3)
    minis = trajectory_mini_batches(owner, len(trajs), 1)
    budget = 600
    dealt = balanced_micro_batches(rows, 12, 12, budget, share_prefix=True, mini_batches=minis)
    planned = balanced_micro_batches(rows, 12, 12, budget, share_prefix=True, mini_batches=minis, owner=owner,
                                     min_shared=MIN_SHARED_RUN)
    real = [c for c in planned if not c.get("empty_micro_batch")]
    assert not any(c.get("over_token_budget") for c in planned)
    count = {b: owner.count(b) for b in set(owner)}
    for chunk in real:
        present = set(_owners(chunk))
        assert all(_owners(chunk).count(b) == count[b] for b in present)  # whole trajectories
        assert len(present) == 1 or chunk_tokens(chunk, True, False, True, MIN_SHARED_RUN)[0] <= budget
    used = [c for c in dealt if not c.get("empty_micro_batch")]
    assert len(real) <= len(used) and _tokens(real) < _tokens(used)
    torch.testing.assert_close(chunk_normalizers(planned).sum(0), chunk_normalizers(dealt).sum(0))


def test_single_row_trajectories_keep_the_rows_plan():
    """Where no trajectory has several rows (the template kept the prefix property, rows merged), the plan is the
    one the rows get without ``owner``."""
    rng = random.Random(1)
    trajs = []
    for _ in range(2):
        prompt = [rng.randrange(1, 400) for _ in range(20)]
        for _ in range(4):
            t = Trajectory(prompt_ids=list(prompt))
            t.turn_contexts.append(t.input_ids)
            t.add_action([rng.randrange(1, 400) for _ in range(rng.randint(5, 30))])
            trajs.append(t)
    rows, owner = expand_turn_rows(_scored(trajs), [turn_rows_of(t) for t in trajs], PAD)
    assert len(owner) == len(trajs)
    minis = trajectory_mini_batches(owner, len(trajs), 1)
    a = balanced_micro_batches(rows, 4, 4, share_prefix=True, mini_batches=minis)
    b = balanced_micro_batches(rows, 4, 4, share_prefix=True, mini_batches=minis, owner=owner,
                               min_shared=MIN_SHARED_RUN)
    for x, y in zip(a, b):
        assert torch.equal(x["completion_ids"], y["completion_ids"])
