"""group_advantages: hand-computed values, VeRL equality, the degenerate groups, and errors."""

import math
from collections import defaultdict

import pytest
import torch

from trl_multiturn.advantages import VALID_SCALES, group_advantages

EPS = 1e-6


def verl_grpo_reference(scores: torch.Tensor, index: list, epsilon: float = 1e-6, norm_by_std: bool = True):
    """Independent reference following VeRL's documented compute_grpo_outcome_advantage:
    group the scores by prompt index; a group of one gets mean 0 and std 1; otherwise mean and unbiased std;
    A = (s - mean) / (std + epsilon), or s - mean when not normalizing by the std."""
    by_group = defaultdict(list)
    for i, key in enumerate(index):
        by_group[key].append(float(scores[i]))
    stats = {}
    for key, vals in by_group.items():
        n = len(vals)
        if n == 1:
            stats[key] = (0.0, 1.0)
        else:
            mu = sum(vals) / n
            stats[key] = (mu, math.sqrt(sum((v - mu) ** 2 for v in vals) / (n - 1)))
    out = []
    for i, key in enumerate(index):
        mu, sd = stats[key]
        out.append((float(scores[i]) - mu) / (sd + epsilon) if norm_by_std else float(scores[i]) - mu)
    return torch.tensor(out, dtype=torch.float64)


def test_hand_computed_group():
    # r = [1, 0, 0, 0]: mean 0.25; unbiased var = (0.75^2 + 3 * 0.25^2) / 3 = 0.75 / 3 = 0.25 -> std 0.5
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4)
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25]) / (0.5 + EPS)
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=1e-7)


def test_two_groups_scale_group_none_batch():
    r = torch.tensor([1.0, 3.0, 2.0, 2.0, 4.0, 6.0], dtype=torch.float64)  # groups of 3
    # group 0: mean 2, deviations [-1, 1, 0], unbiased var (1 + 1 + 0) / 2 = 1 -> std 1
    # group 1: mean 4, deviations [-2, 0, 2], unbiased var (4 + 0 + 4) / 2 = 4 -> std 2
    dev = torch.tensor([-1.0, 1.0, 0.0, -2.0, 0.0, 2.0], dtype=torch.float64)
    torch.testing.assert_close(group_advantages(r, 3, scale="none"), dev, rtol=0, atol=1e-15)
    group_std = torch.tensor([1.0, 1.0, 1.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    torch.testing.assert_close(group_advantages(r, 3, scale="group"), dev / (group_std + EPS), rtol=1e-12, atol=0)
    # batch: mean of all 6 = 18 / 6 = 3; squared deviations 4 + 0 + 1 + 1 + 1 + 9 = 16; var 16 / 5 = 3.2
    batch_std = math.sqrt(3.2)
    torch.testing.assert_close(group_advantages(r, 3, scale="batch"), dev / (batch_std + EPS), rtol=1e-12, atol=0)


def test_identical_rewards_give_exactly_zero_never_nan():
    # 0.1 is not exactly representable: a float mean can differ from 0.1 by one ulp, which / eps would be ~1e-2
    r = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 1.0, 0.0, 0.5])
    for scale in VALID_SCALES:
        adv = group_advantages(r, 3, scale=scale)
        assert torch.equal(adv[:6], torch.zeros(6)), scale
        assert torch.isfinite(adv).all()
    all_same = group_advantages(torch.full((8,), 0.3), 4, scale="batch")  # batch std 0 as well
    assert torch.equal(all_same, torch.zeros(8))


def test_group_of_one_is_verl_mean0_std1():
    r = torch.tensor([0.5, -2.0, 3.0], dtype=torch.float64)
    # mean 0, std 1: A = (r - 0) / (1 + eps)
    torch.testing.assert_close(group_advantages(r, 1), r / (1 + EPS), rtol=1e-15, atol=0)
    torch.testing.assert_close(group_advantages(r, 1), verl_grpo_reference(r, [0, 1, 2]), rtol=1e-12, atol=0)
    torch.testing.assert_close(group_advantages(r, 1, scale="batch"), r / (1 + EPS), rtol=1e-15, atol=0)
    assert torch.equal(group_advantages(r, 1, scale="none"), r)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("group_size", [2, 3, 8])
def test_matches_verl_reference_on_random_rewards(seed, group_size):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.rand(group_size * 4, generator=gen, dtype=torch.float64) * 4 - 1  # (B,) in [-1, 3)
    rewards[:group_size] = torch.randint(0, 2, (group_size,), generator=gen).double()  # a binary group too
    index = [i // group_size for i in range(rewards.numel())]
    for norm in (True, False):
        ours = group_advantages(rewards, group_size, scale="group" if norm else "none")
        ref = verl_grpo_reference(rewards, index, norm_by_std=norm)
        torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-9)


def test_float32_and_integer_rewards():
    assert group_advantages([1, 0], 2).dtype == torch.float32
    torch.testing.assert_close(group_advantages([1, 0], 2), torch.tensor([0.5, -0.5]) / (math.sqrt(0.5) + EPS))


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match=r"rewards\[1\] is nan"):
        group_advantages([1.0, float("nan")], 2)
    with pytest.raises(ValueError, match=r"rewards\[0\] is inf"):
        group_advantages([float("inf"), 1.0], 2)
    with pytest.raises(ValueError, match=r"5 rewards, which is not a multiple of group_size=2 \(num_generations\)"):
        group_advantages([1.0] * 5, 2)
    with pytest.raises(ValueError, match=r"scale='std'.*\('group', 'batch', 'none'\)"):
        group_advantages([1.0, 0.0], 2, scale="std")
    with pytest.raises(ValueError, match="group_size=0"):
        group_advantages([1.0, 0.0], 0)
    with pytest.raises(ValueError, match=r"1-D.*\(2, 2\)"):
        group_advantages(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="empty"):
        group_advantages([], 2)
    with pytest.raises(ValueError, match="eps=-1"):
        group_advantages([1.0, 0.0], 2, eps=-1)


def test_rollout_advantages_weights_rewards_and_drops_failed_rows():
    from trl_multiturn.advantages import rollout_advantages

    # columns: one reward function, then the environment's reward (NaN = its environment failed)
    table = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, float("nan")], [0.0, 1.0], [2.0, 0.0], [0.0, float("inf")]])
    weights = torch.tensor([0.5, 1.0])
    failed = torch.tensor([False, False, False, False, True, False])
    out = rollout_advantages(table, weights, failed, 2, eps=EPS)
    # r = 0.5 f + env: 0.5, 0, -, 1, - (failed), - (infinite)
    assert out.dropped.tolist() == [False, False, True, False, True, True]
    assert out.rewards[:2].tolist() == [0.5, 0.0] and out.rewards[3] == 1.0
    assert torch.isnan(out.rewards[out.dropped]).all()
    # group 0: (0.5, 0) -> +-0.25 / (std 0.3536 + eps); groups 1 and 2 keep fewer than 2 members: 0
    a = 0.25 / (math.sqrt(0.125) + EPS)
    assert out.advantages.tolist() == pytest.approx([a, -a, 0.0, 0.0, 0.0, 0.0], rel=1e-6)
    # a turn mode: the outcome is the reward functions alone; the same rows are dropped
    turn_ids, mask = torch.zeros(6, 3, dtype=torch.long), torch.ones(6, 3, dtype=torch.long)
    per_token = rollout_advantages(table, weights, failed, 2, mode="mt-grpo", eps=EPS, turn_rewards=[[0.0]] * 6,
                                   turn_ids=turn_ids, action_mask=mask)
    b = 0.25 / (math.sqrt(0.125) + EPS)  # outcome (0.5, 0) in group 0
    assert per_token.advantages.shape == (6, 3)
    assert per_token.advantages[:, 0].tolist() == pytest.approx([b, -b, 0.0, 0.0, 0.0, 0.0], rel=1e-6)
