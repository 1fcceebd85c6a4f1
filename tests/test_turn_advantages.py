"""turn_advantages: hand-computed examples per mode, uneven turns, equal groups, one-turn trajectories, the reduction
to plain GRPO when per-turn rewards are zero, and errors."""

import math

import pytest
import torch

from trl_multiturn.advantages import VALID_TURN_ADVANTAGES, group_advantages, turn_advantages
from trl_multiturn.trajectory import Trajectory, completion_tensors

EPS = 1e-6


def layout(rows: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """turn_ids (B, T) from per-row lists of turn ids (-1 = prompt / observation / padding); action mask = turn >= 0.
    Observations are written as -1 here only for brevity; the mask is what keeps them out of the loss."""
    tids = torch.full((len(rows), width), -1, dtype=torch.long)
    for b, row in enumerate(rows):
        tids[b, : len(row)] = torch.tensor(row)
    return tids, (tids >= 0).long()


# One group of G = 3 with uneven turn counts K = (2, 1, 3); prompt token first, an observation (-1) after each turn.
TIDS, MASK = layout([[-1, 0, 0, -1, 1], [-1, 0], [-1, 0, -1, 1, -1, 2, 2]], width=8)
REWARDS = [1.0, 0.0, 0.0]
TURN_REWARDS = [[1.0, 0.0], [0.0], [0.0, 1.0, 0.0]]
# Any column whose values are a permutation of (1, 0, 0): mean 1/3, deviations (2/3, -1/3, -1/3),
# unbiased var ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3 -> std sqrt(1/3).  So A = +a for the 1 and -c for a 0:
S = math.sqrt(1 / 3) + EPS
A, C = (2 / 3) / S, (1 / 3) / S


def expand(per_turn_rows: list[list[float]]) -> torch.Tensor:
    """(B, T) expected advantages: per_turn_rows[b][k] on every action token of turn k, 0 elsewhere."""
    out = torch.zeros(TIDS.shape)
    for b, row in enumerate(per_turn_rows):
        for k, value in enumerate(row):
            out[b][TIDS[b] == k] = value
    return out * MASK


def test_trajectory_mode_broadcasts_outcome_advantage():
    adv = turn_advantages("trajectory", REWARDS, None, TIDS, MASK, group_size=3)
    # outcome column (1, 0, 0) -> (+a, -c, -c) on every action token
    torch.testing.assert_close(adv, expand([[A, A], [-C], [-C, -C, -C]]), rtol=1e-6, atol=1e-7)
    assert (adv[MASK == 0] == 0).all()


def test_mt_grpo_hand_computed_uneven_turns():
    w = 0.5
    adv = turn_advantages("mt-grpo", REWARDS, TURN_REWARDS, TIDS, MASK, group_size=3, turn_weight=w)
    # outcome A^O = (a, -c, -c).  Turn columns, missing turns count 0:
    #   k=0: (1, 0, 0) -> (a, -c, -c);  k=1: (0, 0, 1) -> (-c, -c, a);  k=2: (0, 0, 0) -> exactly 0
    # credit of turn j = sum_{k >= j} A^T_k:
    #   b0: j0 = a - c, j1 = -c;   b1: j0 = -c - c;   b2: j0 = -c + a, j1 = a, j2 = 0
    expected = expand([
        [A + w * (A - C), A + w * (-C)],
        [-C + w * (-2 * C)],
        [-C + w * (A - C), -C + w * A, -C],
    ])
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=1e-6)


def test_mt_grpo_two_turn_case_is_the_paper():
    # Zeng et al.: turn 1 (search) tokens get A^O + lambda A^T, turn 2 (answer) tokens get A^O.
    tids, mask = layout([[0, 0, 1], [0, 1, 1], [0, 1], [0, 0, 1]], width=3)
    outcome = [1.0, 0.0, 1.0, 0.0]
    search_hit = [1.0, 1.0, 0.0, 0.0]
    lam = 0.7
    adv = turn_advantages("mt-grpo", outcome, [[h, 0.0] for h in search_hit], tids, mask, 4, turn_weight=lam)
    a_o = group_advantages(outcome, 4)  # (+, -, +, -)
    a_t = group_advantages(search_hit, 4)  # (+, +, -, -)
    expected = torch.where(tids == 0, (a_o + lam * a_t)[:, None], a_o[:, None].expand(4, 3)) * mask
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=1e-7)


def test_discounted_hand_computed_uneven_turns():
    turn_rewards = [[0.5, 0.0], [0.0], [0.0, 0.5, 0.0]]
    adv = turn_advantages("discounted", [1.0, 0.0, 1.0], turn_rewards, TIDS, MASK, 3, gamma=0.5, turn_weight=1.0)
    # R_k = r_k + gamma R_{k+1}, outcome added at the last turn; after its end a trajectory keeps its last return
    #   b0 (K=2): R1 = 0 + 1 = 1;  R0 = 0.5 + 0.5 * 1 = 1.0;        padded R2 = 1    -> (1, 1, 1)
    #   b1 (K=1): R0 = 0 + 0 = 0;                                   padded           -> (0, 0, 0)
    #   b2 (K=3): R2 = 0 + 1 = 1;  R1 = 0.5 + 0.5 * 1 = 1;  R0 = 0 + 0.5 * 1 = 0.5  -> (0.5, 1, 1)
    # column 0 = (1, 0, 0.5): mean 0.5, deviations (0.5, -0.5, 0), unbiased var 0.5 / 2 = 0.25 -> std 0.5
    # columns 1, 2 = (1, 0, 1): deviations (1/3, -2/3, 1/3), std sqrt(1/3) -> (+c, -a, +c)
    d0 = 0.5 / (0.5 + EPS)
    expected = expand([[d0, C], [-d0], [0.0, C, C]])
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=1e-6)


def test_discounted_carries_the_last_return_not_the_first():
    # b0 stops after 2 turns, b1 takes 3. gamma = 0.5, w = 1, outcomes (1, 0), turn rewards (1, 0) and (0, 0, 0):
    #   b0: R1 = 0 + 1 = 1, R0 = 1 + 0.5 * 1 = 1.5, padded R2 = R1 = 1 (not R0 = 1.5)  -> (1.5, 1, 1)
    #   b1: all 0                                                                       -> (0, 0, 0)
    # scale "none" (no std, which would hide the size of R): a column (x, 0) becomes (x/2, -x/2)
    tids, mask = layout([[0, 1], [0, 1, 2]], width=3)
    adv = turn_advantages("discounted", [1.0, 0.0], [[1.0, 0.0], [0.0, 0.0, 0.0]], tids, mask, 2, gamma=0.5,
                          scale="none")
    expected = torch.tensor([[0.75, 0.5, 0.0], [-0.75, -0.5, -0.5]])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-7)


def test_discounted_turn_weight_scales_turn_rewards_only():
    tids, mask = layout([[0, 1], [0, 1]], width=2)
    # w = 2: b0 R = (2 * 1 + 0 + 0, 0 + 0) = (2, 0)? no: R1 = 2 * 0 + 0 = 0, R0 = 2 * 1 + 1 * R1 = 2
    #        b1 R1 = 0 + 1 = 1, R0 = 0 + 1 = 1.   column 0 = (2, 1), column 1 = (0, 1)
    # G = 2: deviations (+-0.5), unbiased std sqrt(0.5)
    adv = turn_advantages("discounted", [0.0, 1.0], [[1.0, 0.0], [0.0, 0.0]], tids, mask, 2, turn_weight=2.0)
    u = 0.5 / (math.sqrt(0.5) + EPS)
    torch.testing.assert_close(adv, torch.tensor([[u, -u], [-u, u]]), rtol=1e-6, atol=1e-7)


def test_group_with_equal_rewards_is_exactly_zero_in_every_mode():
    # equal outcomes and the same per-turn rewards at every turn index: every normalized column is constant -> 0
    tids, mask = layout([[0, 1, 2], [0, 1, 2], [0, 0, 1, 2]], width=4)
    same = [[0.1, 0.2, 0.1]] * 3
    for mode in VALID_TURN_ADVANTAGES:
        for gamma in (1.0, 0.9):
            adv = turn_advantages(mode, [0.3, 0.3, 0.3], same, tids, mask, 3, gamma=gamma, turn_weight=2.0)
            assert torch.equal(adv, torch.zeros(3, 4)), (mode, gamma)
    # equal outcomes, uneven turn counts, no per-turn reward: still exactly 0 (gamma = 1)
    tids, mask = layout([[0, 1], [0], [0, 1, 2]], width=3)
    for mode in VALID_TURN_ADVANTAGES:
        adv = turn_advantages(mode, [0.3, 0.3, 0.3], [[0.0, 0.0], [0.0], [0.0, 0.0, 0.0]], tids, mask, 3)
        assert torch.equal(adv, torch.zeros(3, 3)), mode


def test_uneven_turn_counts_with_per_turn_rewards_favour_the_trajectory_that_earned_more():
    # every turn earns 0.1; b2 took 3 turns so it collected more. mt-grpo counts a missing turn as 0:
    #   k=0: (0.1, 0.1, 0.1) -> 0;  k=1: (0.1, 0, 0.1) -> (+c', -a', +c');  k=2: (0, 0, 0.1) -> (-c', -c', +a')
    # with the same 1/3, 2/3 pattern scaled by 0.1: std = 0.1 sqrt(1/3), a' = (0.2/3) / std', c' = (0.1/3) / std'
    tids, mask = layout([[0, 1], [0], [0, 1, 2]], width=3)
    adv = turn_advantages("mt-grpo", [0.3, 0.3, 0.3], [[0.1, 0.1], [0.1], [0.1, 0.1, 0.1]], tids, mask, 3)
    sd = 0.1 * math.sqrt(1 / 3) + EPS
    a, c = (0.2 / 3) / sd, (0.1 / 3) / sd
    # credit of turn j = sum_{k >= j} A^T_k (outcome advantage 0: equal outcomes)
    #   b0: j0 = 0 + c' - c' = 0, j1 = c' - c' = 0;   b1: j0 = 0 - a' - c';   b2: j0 = c' + a', j1 = c' + a', j2 = a'
    expected = torch.tensor([[0.0, 0.0, 0.0], [-a - c, 0.0, 0.0], [c + a, c + a, a]])
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-5)


def test_one_turn_trajectories():
    tids, mask = layout([[0, 0], [0, 0]], width=2)
    # K = 1: mt-grpo = A^O + w A^T_0; discounted = N[w r_0 + outcome]
    outcome, turn = [1.0, 0.0], [[0.0], [1.0]]
    u = 0.5 / (math.sqrt(0.5) + EPS)  # G = 2, difference 1: (+u, -u)
    mt = turn_advantages("mt-grpo", outcome, turn, tids, mask, 2, turn_weight=0.5)
    torch.testing.assert_close(mt, torch.tensor([[u - 0.5 * u] * 2, [-u + 0.5 * u] * 2]), rtol=1e-6, atol=1e-7)
    disc = turn_advantages("discounted", outcome, turn, tids, mask, 2, turn_weight=1.0)  # returns (1, 1): equal
    assert torch.equal(disc, torch.zeros(2, 2))


@pytest.mark.parametrize("seed", range(6))
def test_zero_turn_rewards_reduce_to_plain_grpo(seed):
    gen = torch.Generator().manual_seed(seed)
    group_size, groups, width = 4, 3, 12
    batch = group_size * groups
    rewards = torch.rand(batch, generator=gen)
    num_turns = torch.randint(1, 5, (batch,), generator=gen).tolist()
    rows = []
    for k in num_turns:  # each turn: 2 action tokens then one observation token
        rows.append(sum(([t, t, -1] for t in range(k)), [])[:width])
    tids, mask = layout(rows, width)
    zeros = [[0.0] * k for k in num_turns]
    plain = turn_advantages("trajectory", rewards, zeros, tids, mask, group_size)
    torch.testing.assert_close(plain, group_advantages(rewards, group_size)[:, None] * mask, rtol=0, atol=0)
    for scale in ("group", "batch", "none"):
        plain = turn_advantages("trajectory", rewards, zeros, tids, mask, group_size, scale=scale)
        mt = turn_advantages("mt-grpo", rewards, zeros, tids, mask, group_size, scale=scale, turn_weight=3.0)
        disc = turn_advantages("discounted", rewards, zeros, tids, mask, group_size, scale=scale, gamma=1.0)
        assert torch.equal(mt, plain) and torch.equal(disc, plain), scale
    # a discount below 1 does change things when turn counts differ (it can fail)
    disc = turn_advantages("discounted", rewards, zeros, tids, mask, group_size, gamma=0.5)
    assert not torch.allclose(disc, plain)


def test_works_on_completion_tensors():
    trajs = []
    for reward, hits in [(1.0, [1.0, 0.0]), (0.0, [0.0])]:
        t = Trajectory(prompt_ids=[1, 2])
        for k, hit in enumerate(hits):
            t.add_action([10 + k, 11 + k], [-0.5, -0.5])
            t.turn_rewards[-1] = hit
            t.add_observation([99])
        t.reward = reward
        trajs.append(t)
    turn_ids, action_mask = completion_tensors([t.turn_ids for t in trajs], [t.action_mask for t in trajs], width=7)
    adv = turn_advantages(
        "mt-grpo", [t.reward for t in trajs], [t.turn_rewards for t in trajs], turn_ids, action_mask, 2
    )
    assert adv.shape == turn_ids.shape == (2, 7)
    assert (adv[action_mask == 0] == 0).all()  # observations and padding get nothing
    u = 0.5 / (math.sqrt(0.5) + EPS)
    # outcome (1, 0) -> (u, -u); turn 0 hits (1, 0) -> (u, -u); turn 1 (0, missing=0) -> 0
    assert adv[0][turn_ids[0] == 0][:2].tolist() == pytest.approx([2 * u, 2 * u], rel=1e-6)
    assert adv[0][(turn_ids[0] == 1) & (action_mask[0] == 1)].tolist() == pytest.approx([u, u], rel=1e-6)
    assert adv[1][action_mask[1] == 1].tolist() == pytest.approx([-2 * u, -2 * u], rel=1e-6)


def test_bad_inputs_raise_clear_errors():
    tids, mask = layout([[0, 1], [0, 0]], width=2)
    ok = [[0.0, 0.0], [0.0]]
    with pytest.raises(ValueError, match=r"'gae'.*\('trajectory', 'mt-grpo', 'discounted'\).*turn_advantage"):
        turn_advantages("gae", [1.0, 0.0], ok, tids, mask, 2)
    with pytest.raises(ValueError, match="needs turn_rewards"):
        turn_advantages("mt-grpo", [1.0, 0.0], None, tids, mask, 2)
    with pytest.raises(ValueError, match="needs turn_rewards with one list per trajectory"):
        turn_advantages("discounted", [1.0, 0.0], [[0.0]], tids, mask, 2)
    with pytest.raises(ValueError, match="sampled token 1 of trajectory 1 has turn id 1, but that trajectory has 1"):
        turn_advantages("mt-grpo", [1.0, 0.0], [[0.0, 0.0], [0.0]], layout([[0, 1], [0, 1]], 2)[0], mask, 2)
    with pytest.raises(ValueError, match=r"turn_rewards\[0\]\[1\] is nan"):
        turn_advantages("mt-grpo", [1.0, 0.0], [[0.0, float("nan")], [0.0]], tids, mask, 2)
    with pytest.raises(ValueError, match="gamma=1.5.*turn_advantage_gamma"):
        turn_advantages("discounted", [1.0, 0.0], ok, tids, mask, 2, gamma=1.5)
    with pytest.raises(ValueError, match="turn_weight=-1.*turn_advantage_weight"):
        turn_advantages("mt-grpo", [1.0, 0.0], ok, tids, mask, 2, turn_weight=-1.0)
    with pytest.raises(ValueError, match="same shape"):
        turn_advantages("trajectory", [1.0, 0.0], None, tids, mask[:, :1], 2)
    with pytest.raises(ValueError, match="2 rewards but turn_ids has 3 rows"):
        turn_advantages("trajectory", [1.0, 0.0], None, torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2), 2)
    with pytest.raises(ValueError, match="not a multiple of group_size=2"):
        turn_advantages("trajectory", [1.0, 0.0, 1.0], None, torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2), 2)
    with pytest.raises(ValueError, match=r"rewards\[0\] is nan"):
        turn_advantages("trajectory", [float("nan"), 0.0], None, tids, mask, 2)


# ---------------------------------------------------------------------------------------------------------------
# dropped trajectories: every column is normalized over the kept members only
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["trajectory", "mt-grpo", "discounted"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_dropped_members_leave_the_baseline(mode, scale):
    # one group of G = 4 whose member 1 was dropped (its reward is NaN and its turn rewards are junk): the three kept
    # members get exactly what a group of those three alone gets, the dropped one gets 0
    tids, mask = layout([[0, 1, 1], [0, 0, 1], [0, 1], [0, 1, 2]], width=4)
    rewards = [1.0, float("nan"), 0.0, 0.5]
    turn = [[0.5, 0.0], [9.0, 9.0], [0.0, 1.0], [0.0, 0.0, 0.25]]
    keep = torch.tensor([True, False, True, True])
    adv = turn_advantages(mode, rewards, turn, tids, mask, 4, scale=scale, gamma=0.5, turn_weight=0.7, keep=keep)
    alone = turn_advantages(mode, [1.0, 0.0, 0.5], [turn[0], turn[2], turn[3]], tids[keep], mask[keep], 3,
                            scale=scale, gamma=0.5, turn_weight=0.7)
    assert torch.equal(adv[keep], alone)
    assert torch.equal(adv[1], torch.zeros(4))
    # filling the dropped member with the group mean (and 0 turn rewards) and keeping it in the baseline shrinks
    # the std and moves the turn columns' means: it differs (except the outcome alone without a std)
    filled = turn_advantages(mode, [1.0, 0.5, 0.0, 0.5], [turn[0], [0.0, 0.0], turn[2], turn[3]], tids, mask, 4,
                             scale=scale, gamma=0.5, turn_weight=0.7)
    assert torch.allclose(filled[keep], alone) == (mode == "trajectory" and scale == "none")


def test_a_group_left_with_one_member_has_no_signal():
    tids, mask = layout([[0], [0], [0, 1], [0, 1]], width=2)
    keep = torch.tensor([True, False, True, True])  # group 0 keeps 1 member, group 1 keeps both
    for mode in VALID_TURN_ADVANTAGES:
        adv = turn_advantages(mode, [1.0, 0.0, 1.0, 0.0], [[0.2], [0.0], [0.0, 0.1], [0.3, 0.0]], tids, mask, 2,
                              keep=keep)
        assert torch.equal(adv[:2], torch.zeros(2, 2)), mode
        assert bool((adv[2:][mask[2:].bool()] != 0).any()), mode
    with pytest.raises(ValueError, match="keep has 3 entries but there are 4 rewards"):
        turn_advantages("mt-grpo", [1.0, 0.0, 1.0, 0.0], [[0.0]] * 4, tids, mask, 2, keep=[True] * 3)


@pytest.mark.parametrize("mode", ["mt-grpo", "discounted"])
def test_trainer_drops_failed_trajectories_from_turn_baselines(tmp_path, smollm2_tokenizer, tiny_model_factory, mode):
    from scripted import Recorder
    from test_trainer import FeedbackEnv, dataset, make_args, vowel_reward

    from trl_multiturn import MultiTurnGRPOTrainer
    from trl_multiturn.environment import Step

    class TurnRewardSometimesFailing(FeedbackEnv):
        created = 0

        def reset(self, example):
            TurnRewardSometimesFailing.created += 1
            self.fail, self.turn = TurnRewardSometimesFailing.created % 3 == 0, 0
            return super().reset(example)

        def step(self, action):
            if self.fail:
                raise RuntimeError("tool backend down")
            self.turn += 1
            return Step(observation="Invalid.", reward=float(len(action.text) % 3 == self.turn % 3))

    args = make_args(tmp_path, max_steps=1, turn_advantage=mode, turn_advantage_gamma=0.5, turn_advantage_weight=0.7)
    trainer = MultiTurnGRPOTrainer(
        model=tiny_model_factory(), args=args, train_dataset=dataset(), environment_factory=TurnRewardSometimesFailing,
        reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer,
    )
    rec = Recorder(trainer)
    trainer.train()
    (trajs,), (batch,) = rec.rollouts, rec.batches
    adv = batch["advantages"]  # (B, C) in rollout order
    failed = [bool(t.info.get("failed")) for t in trajs]
    assert any(failed) and not all(failed)
    checked = 0
    for g in range(0, len(trajs), 4):
        kept = [i for i in range(g, g + 4) if not failed[i]]
        for i in range(g, g + 4):
            if failed[i]:
                assert torch.equal(adv[i], torch.zeros_like(adv[i]))
        if len(kept) < 2:
            continue
        # the kept members alone, as a group of len(kept): no dropped member in the mean or the std
        turn_ids = torch.full((len(kept), adv.size(1)), -1, dtype=torch.long)
        action_mask = torch.zeros((len(kept), adv.size(1)), dtype=torch.long)
        for row, i in enumerate(kept):
            turn_ids[row, : len(trajs[i].turn_ids)] = torch.tensor(trajs[i].turn_ids)
            action_mask[row, : len(trajs[i].action_mask)] = torch.tensor(trajs[i].action_mask)
        outcome = [trajs[i].reward - sum(trajs[i].turn_rewards) for i in kept]
        alone = turn_advantages(mode, outcome, [trajs[i].turn_rewards for i in kept], turn_ids, action_mask,
                                len(kept), gamma=0.5, turn_weight=0.7)
        torch.testing.assert_close(adv[kept], alone, rtol=1e-5, atol=1e-6)
        checked += len(kept) < 4
    assert checked  # at least one group lost a member and kept a baseline
