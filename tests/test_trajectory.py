"""Trajectory building and collation: exact ids, masks, turn ids and old log-probs, right and left padded."""

import math

import pytest
import torch

from trl_multiturn.trajectory import Trajectory, TrajectoryBatch, collate_trajectories

PAD = 0


def two_turn() -> Trajectory:
    """prompt [11, 12] | action [21, 22] | obs [31] | action [41] ; reward 1.0."""
    t = Trajectory(prompt_ids=[11, 12])
    t.add_action([21, 22], [-0.1, -0.2])
    t.add_observation([31])
    t.add_action([41], [-0.4])
    t.reward = 1.0
    return t


def one_turn() -> Trajectory:
    """prompt [13] | action [23] ; reward 0.0."""
    t = Trajectory(prompt_ids=[13])
    t.add_action([23], [-0.3])
    return t


def test_trajectory_builders_keep_one_mask_meaning():
    t = two_turn()
    assert t.input_ids == [11, 12, 21, 22, 31, 41]
    assert t.action_mask == [1, 1, 0, 1]
    assert t.turn_ids == [0, 0, 0, 1]  # the observation after action 0 carries turn 0
    assert t.logprobs == [-0.1, -0.2, 0.0, -0.4]
    assert t.turn_rewards == [0.0, 0.0] and t.num_turns == 2
    assert t.num_action_tokens == 3 and t.num_observation_tokens == 1
    t.validate()


def test_collate_right_padding_every_field():
    batch = collate_trajectories([two_turn(), one_turn()], pad_token_id=PAD)
    assert isinstance(batch, TrajectoryBatch) and batch.padding_side == "right"
    # widths: 2 + 4 = 6 and 1 + 1 = 2 -> L = 6
    assert batch.input_ids.tolist() == [[11, 12, 21, 22, 31, 41], [13, 23, PAD, PAD, PAD, PAD]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]]
    assert batch.action_mask.tolist() == [[0, 0, 1, 1, 0, 1], [0, 1, 0, 0, 0, 0]]
    assert batch.turn_ids.tolist() == [[-1, -1, 0, 0, 0, 1], [-1, 0, -1, -1, -1, -1]]
    expected_lp = torch.tensor([[0, 0, -0.1, -0.2, 0, -0.4], [0, -0.3, 0, 0, 0, 0]])
    torch.testing.assert_close(batch.old_logprobs, expected_lp, rtol=0, atol=0)
    assert batch.prompt_lengths.tolist() == [2, 1]
    assert batch.lengths.tolist() == [6, 2]
    assert batch.rewards.tolist() == [1.0, 0.0]
    assert batch.num_turns.tolist() == [2, 1]
    assert batch.input_ids.dtype == torch.long and batch.old_logprobs.dtype == torch.float32
    assert (batch.batch_size, batch.seq_len, len(batch)) == (2, 6, 2)


def test_collate_left_padding_every_field():
    batch = collate_trajectories([two_turn(), one_turn()], pad_token_id=PAD, padding_side="left")
    assert batch.input_ids.tolist() == [[11, 12, 21, 22, 31, 41], [PAD, PAD, PAD, PAD, 13, 23]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1]]
    assert batch.action_mask.tolist() == [[0, 0, 1, 1, 0, 1], [0, 0, 0, 0, 0, 1]]
    assert batch.turn_ids.tolist() == [[-1, -1, 0, 0, 0, 1], [-1, -1, -1, -1, -1, 0]]
    torch.testing.assert_close(batch.old_logprobs[1], torch.tensor([0, 0, 0, 0, 0, -0.3]), rtol=0, atol=0)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_never_carries_loss_and_observations_are_attended(side):
    batch = collate_trajectories([two_turn(), one_turn()], pad_token_id=PAD, padding_side=side, pad_to_multiple_of=4)
    assert batch.seq_len == 8  # 6 rounded up to a multiple of 4
    pad = batch.attention_mask == 0
    assert not batch.action_mask[pad].any()
    assert (batch.turn_ids[pad] == -1).all() and (batch.old_logprobs[pad] == 0).all()
    assert (batch.action_mask <= batch.attention_mask).all()  # every sampled token is attended
    # the observation token 31 is attended but carries no loss
    obs = batch.input_ids == 31
    assert batch.attention_mask[obs].tolist() == [1] and batch.action_mask[obs].tolist() == [0]
    # the action tokens of each row are exactly what the policy sampled, in order
    assert batch.input_ids[0][batch.action_mask[0].bool()].tolist() == [21, 22, 41]
    assert batch.input_ids[1][batch.action_mask[1].bool()].tolist() == [23]


def test_old_logprobs_zero_where_mask_zero_even_if_trajectory_has_junk():
    t = two_turn()
    t.logprobs[2] = float("nan")  # junk on the observation token (mask 0) must not reach the batch
    batch = collate_trajectories([t], pad_token_id=PAD)
    assert batch.old_logprobs[0, 4].item() == 0.0 and torch.isfinite(batch.old_logprobs).all()


def test_select_and_to_keep_fields():
    batch = collate_trajectories([two_turn(), one_turn(), two_turn()], pad_token_id=PAD)
    sub = batch.select([2, 1])
    assert sub.input_ids.tolist() == [batch.input_ids[2].tolist(), batch.input_ids[1].tolist()]
    assert sub.rewards.tolist() == [1.0, 0.0] and sub.padding_side == "right"
    assert batch.select(slice(0, 1)).num_turns.tolist() == [2]
    moved = batch.to("cpu")
    assert torch.equal(moved.action_mask, batch.action_mask)


def test_collate_errors_name_the_problem():
    with pytest.raises(ValueError, match="no trajectories"):
        collate_trajectories([], pad_token_id=PAD)
    with pytest.raises(ValueError, match="padding_side='middle'"):
        collate_trajectories([one_turn()], pad_token_id=PAD, padding_side="middle")
    with pytest.raises(ValueError, match="pad_to_multiple_of=0"):
        collate_trajectories([one_turn()], pad_token_id=PAD, pad_to_multiple_of=0)
    broken = one_turn()
    broken.action_mask.append(1)  # lengths disagree
    with pytest.raises(ValueError, match=r"trajectory 1: .*action_mask has length 2"):
        collate_trajectories([one_turn(), broken], pad_token_id=PAD)
    nan_lp = one_turn()
    nan_lp.logprobs[0] = math.inf
    with pytest.raises(ValueError, match="trajectory 0: sampled completion token 0 has log-prob inf"):
        collate_trajectories([nan_lp], pad_token_id=PAD)
