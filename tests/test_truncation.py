"""`mask_truncated_completions` through the trainer's real entry point: what "truncated" means, in one place.

A trajectory is truncated when a token limit cut it (``Trajectory.truncated``, ``stop_reason="max_tokens"``); one that
used up ``max_turns`` is complete. With ``mask_truncated_completions=True`` (the search recipe's setting) exactly the
truncated trajectories carry no loss; the others keep every sampled token.
"""

import pytest
from datasets import Dataset

from scripted import Recorder, logged

from trl_multiturn import MultiTurnGRPOConfig, MultiTurnGRPOTrainer
from trl_multiturn.environment import Step


class LongOrShortEnv:
    """Feedback to every action; for "long" questions the feedback cannot fit in the token budget."""

    required_columns = ("q",)

    def reset(self, example):
        self.long = example["q"].startswith("long")
        return f"Question: {example['q']}"

    def step(self, action):
        return Step(observation=("word " * 120) if self.long else "Invalid.")


def length_reward(completions, **kwargs):
    return [len(c) / 100 for c in completions]


@pytest.mark.parametrize("mask", [True, False])
def test_mask_truncated_completions_drops_exactly_the_token_limited(tmp_path, smollm2_tokenizer, tiny_model_factory,
                                                                    mask):
    args = MultiTurnGRPOConfig(
        output_dir=str(tmp_path / "out"), num_generations=2, prompts_per_rollout=2, mini_batch_size=4,
        micro_batch_size=4, max_completion_length=64, max_tokens_per_turn=6, max_turns=2, max_steps=1,
        logging_steps=1, learning_rate=1e-3, report_to="none", save_strategy="no", seed=0,
        mask_truncated_completions=mask,
    )
    data = Dataset.from_dict({"q": ["long question a", "short question b"]})
    trainer = MultiTurnGRPOTrainer(
        model=tiny_model_factory(), args=args, train_dataset=data, environment_factory=LongOrShortEnv,
        reward_funcs=[length_reward], processing_class=smollm2_tokenizer,
    )
    rec = Recorder(trainer)
    trainer.train()
    (trajs,), (batch,) = rec.rollouts, rec.batches
    kinds = {(t.info["stop_reason"], t.truncated) for t in trajs}
    # both endings occur: the long feedback does not fit (token limit), the short one runs out of turns
    assert ("max_tokens", True) in kinds and ("max_turns", False) in kinds, kinds
    loss_tokens = (batch["tool_mask"] * batch["completion_mask"]).sum(dim=1).tolist()
    for t, n in zip(trajs, loss_tokens):
        expected = 0 if (mask and t.truncated) else t.num_action_tokens
        assert n == expected, (t.info["stop_reason"], t.truncated, n, t.num_action_tokens)
    assert logged(trainer, "rollout/truncated_frac")[0] == pytest.approx(sum(t.truncated for t in trajs) / len(trajs))
