"""Trajectory building: exact ids, masks, turn ids and old log-probs; completion tensors in TRL's layout."""

import math

import pytest
import torch

from trl_multiturn.trajectory import Trajectory, completion_tensors



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


def test_completion_tensors_lay_out_turns_and_mask_as_trl_lays_out_completions():
    trajs = [two_turn(), one_turn()]
    turn_ids, mask = completion_tensors([t.turn_ids for t in trajs], [t.action_mask for t in trajs], width=5)
    # completions right-padded to C = 5: 21 22 31 41 _ and 23 _ _ _ _
    assert turn_ids.tolist() == [[0, 0, 0, 1, -1], [0, -1, -1, -1, -1]]
    assert mask.tolist() == [[1, 1, 0, 1, 0], [1, 0, 0, 0, 0]]
    assert turn_ids.dtype == mask.dtype == torch.long
    # padding never carries loss; the observation token 31 carries the turn of the action before it, and no loss
    assert not mask[turn_ids == -1].any() and mask[0, 2] == 0 and turn_ids[0, 2] == 0


def test_validate_names_the_problem():
    broken = one_turn()
    broken.action_mask.append(1)  # lengths disagree
    with pytest.raises(ValueError, match="action_mask has length 2"):
        broken.validate()
    bad_reward = one_turn()
    bad_reward.reward = math.inf
    with pytest.raises(ValueError, match="reward is inf"):
        bad_reward.validate()
