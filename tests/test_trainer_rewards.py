"""The reward a trajectory gets and the advantages it leads to, through ``trainer.train()`` on a tiny model.

* ``reward_weights``: the reward is ``sum_i w_i f_i`` over the reward functions plus the environment's reward
  (the sum of its per-turn rewards) with weight 1; the advantages are the group-normalized rewards.
* Turn-level advantages with dropped trajectories: a dropped member (its environment failed) gets advantage 0 and is
  left out of every mean and std of its group (its turn rewards are never read); a group left with one member has no
  baseline and gets 0. The expected values are computed group by group on the kept members only.
"""

from __future__ import annotations

import math

import pytest
import torch

from scripted import Recorder
from test_trainer import FeedbackEnv, dataset, make_args, vowel_reward

from trl_multiturn import MultiTurnGRPOTrainer
from trl_multiturn.advantages import group_advantages, turn_advantages
from trl_multiturn.environment import Step


class TurnRewardEnv(FeedbackEnv):
    """Each step earns 0.25 x its turn number (so per-turn rewards differ between turns)."""

    def reset(self, example):
        self.turn = 0
        return super().reset(example)

    def step(self, action):
        self.turn += 1
        return Step(observation="Invalid.", reward=0.25 * self.turn + 0.1 * (len(action.text) % 2))


def recorded(fn, calls):
    """``fn`` that also appends each list of values it returns to ``calls``."""

    def wrapper(completions, **kwargs):
        values = fn(completions, **kwargs)
        calls.append(list(values))
        return values

    wrapper.__name__ = fn.__name__
    return wrapper


def length_reward(completions, **kwargs):
    return [len(c) / 100 for c in completions]


@pytest.mark.parametrize("weights", [[2.0, -0.5], None], ids=["weighted", "default_ones"])
def test_reward_weights_weight_each_function_and_the_environment_counts_once(tmp_path, smollm2_tokenizer,
                                                                             tiny_model_factory, weights):
    vowels, lengths = [], []
    args = make_args(tmp_path, max_steps=1, reward_weights=weights)
    trainer = MultiTurnGRPOTrainer(
        model=tiny_model_factory(), args=args, train_dataset=dataset(), environment_factory=TurnRewardEnv,
        reward_funcs=[recorded(vowel_reward, vowels), recorded(length_reward, lengths)],
        processing_class=smollm2_tokenizer,
    )
    rec = Recorder(trainer)
    trainer.train()
    assert args.reward_weights == weights  # the caller's config is left as it was
    (trajs,), (batch,), (v,), (n,) = rec.rollouts, rec.batches, vowels, lengths
    w1, w2 = weights or (1.0, 1.0)
    expected = [w1 * a + w2 * b + sum(t.turn_rewards) for a, b, t in zip(v, n, trajs)]
    assert all(sum(t.turn_rewards) > 0 for t in trajs)  # the environment's reward is in play
    assert [t.reward for t in trajs] == pytest.approx(expected, rel=1e-6)
    expected_adv = group_advantages(torch.tensor(expected), 4, eps=args.advantage_eps)
    torch.testing.assert_close(batch["advantages"], expected_adv, rtol=1e-5, atol=1e-6)


class FailingRowsEnv(TurnRewardEnv):
    """Rows 1, 5, 6 and 7 of every rollout (B = 8, G = 4: one member of group 0, three of group 1) earn a huge
    reward on their first step, then fail on the second: they are dropped. Rollouts create their environments in
    row order after the trainer's probe, so the creation count gives the row."""

    created = 0
    FAILING_ROWS = (1, 5, 6, 7)

    def __init__(self):
        FailingRowsEnv.created += 1
        self.row = (FailingRowsEnv.created - 2) % 8  # the first one created is the trainer's probe

    def step(self, action):
        if self.row in self.FAILING_ROWS:
            self.turn += 1
            if self.turn >= 2:
                raise RuntimeError("tool backend down")
            return Step(observation="Invalid.", reward=100.0)
        return super().step(action)


@pytest.mark.parametrize("mode", ["mt-grpo", "discounted"])
def test_turn_level_advantages_leave_dropped_trajectories_out_of_the_baseline(tmp_path, smollm2_tokenizer,
                                                                              tiny_model_factory, mode):
    FailingRowsEnv.created = 0
    args = make_args(tmp_path, max_steps=1, turn_advantage=mode, turn_advantage_gamma=0.5, turn_advantage_weight=0.7)
    trainer = MultiTurnGRPOTrainer(
        model=tiny_model_factory(), args=args, train_dataset=dataset(), environment_factory=FailingRowsEnv,
        reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer,
    )
    rec = Recorder(trainer)
    trainer.train()
    (trajs,), (batch,) = rec.rollouts, rec.batches
    dropped = [bool(t.info.get("failed")) for t in trajs]
    assert dropped == [row in FailingRowsEnv.FAILING_ROWS for row in range(8)]
    assert all(t.turn_rewards[0] == 100.0 for t, d in zip(trajs, dropped) if d)  # never read
    adv = batch["advantages"]  # (B, C) in rollout order
    turn_ids = torch.full(adv.shape, -1, dtype=torch.long)
    action_mask = torch.zeros(adv.shape, dtype=torch.long)
    for row, t in enumerate(trajs):
        turn_ids[row, : len(t.turn_ids)] = torch.tensor(t.turn_ids)
        action_mask[row, : len(t.action_mask)] = torch.tensor(t.action_mask)
    # group 0 keeps rows 0, 2, 3: its advantages are those of a group of three; group 1 keeps row 4 alone: zeros
    kept = [0, 2, 3]
    expected = torch.zeros_like(adv)
    expected[kept] = turn_advantages(
        mode, [trajs[r].reward - sum(trajs[r].turn_rewards) for r in kept], [trajs[r].turn_rewards for r in kept],
        turn_ids[kept], action_mask[kept], 3, gamma=0.5, turn_weight=0.7,
    )
    assert all(math.isfinite(trajs[r].reward) for r in kept)
    assert expected[kept].abs().sum() > 0  # a real signal in the kept group
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["trajectory", "mt-grpo"])
def test_turn_reward_gate_finished_leaves_trajectories_that_never_answered_their_outcome_alone(
        tmp_path, smollm2_tokenizer, tiny_model_factory, mode):
    """TurnRewardEnv never ends an episode: every trajectory stops at max_turns or the token budget, so with
    turn_reward_gate='finished' no per-turn reward reaches the reward table, the reward functions or the advantages."""
    seen = []

    def env_seen(completions, env_reward, turn_rewards, **kwargs):
        seen.append((list(env_reward), [list(r) for r in turn_rewards]))
        return [0.0] * len(completions)

    args = make_args(tmp_path, max_steps=1, turn_reward_gate="finished", turn_advantage=mode)
    trainer = MultiTurnGRPOTrainer(
        model=tiny_model_factory(), args=args, train_dataset=dataset(), environment_factory=TurnRewardEnv,
        reward_funcs=[vowel_reward, env_seen], processing_class=smollm2_tokenizer,
    )
    rec = Recorder(trainer)
    trainer.train()
    (trajs,), (batch,) = rec.rollouts, rec.batches
    assert all(t.info["stop_reason"] in ("max_turns", "max_tokens") for t in trajs)
    assert all(sum(t.info["gated_turn_rewards"]) > 0 for t in trajs)  # the environment did pay them
    assert all(t.turn_rewards == [0.0] * t.num_turns for t in trajs)
    ((env_rewards, turn_rewards),) = seen
    assert env_rewards == [0.0] * len(trajs) and all(set(r) == {0.0} for r in turn_rewards)
    vowels = torch.tensor(vowel_reward([smollm2_tokenizer.decode(t.completion_ids, skip_special_tokens=True)
                                        for t in trajs], None))
    assert [t.reward for t in trajs] == pytest.approx(vowels.tolist(), rel=1e-5, abs=1e-6)
    expected = group_advantages(vowels, 4, eps=args.advantage_eps)  # (B,) the outcome alone
    adv = batch["advantages"]
    if adv.dim() == 2:  # per token: every sampled token of trajectory b carries expected[b]
        sampled = [torch.tensor(t.action_mask, dtype=torch.bool) for t in trajs]
        adv = torch.stack([row[: len(m)][m].unique() for row, m in zip(adv, sampled)]).squeeze(-1)  # one per row
    torch.testing.assert_close(adv, expected, rtol=1e-4, atol=1e-5)
