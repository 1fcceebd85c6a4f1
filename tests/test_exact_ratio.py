"""On a fresh rollout the importance ratio is exactly 1 on the first mini-batch, in every forward layout.

With several optimizer steps per rollout the old log-probs are a separate, frozen pass. If that pass lays the rows
out differently from the training pass (another micro-batch partition, compact width, packing bins or shared-prompt
segments), float error makes ``pi / pi_old`` differ from 1 before any update, and tokens near the clip boundary can
be clipped for nothing. The trainer computes the old log-probs of each micro-batch with the very forward the
training pass runs on it, so in fp32 without dropout the difference is exactly 0: these tests run the real entry
point (``trainer.train()``) on a tiny random model and read the log-probs handed to the loss.
"""

import math

import pytest
import torch
from datasets import Dataset

import trl_multiturn.loss as loss_module  # grpo_loss looks policy_loss up here
from scripted import logged
from test_trainer import make_args, vowel_reward
from trl_multiturn import MultiTurnGRPOTrainer
from trl_multiturn.environment import Step


class UnevenEnv:
    """Feedback of 0 to 3 extra words and an end decided by the sampled text: trajectories of one group differ in
    length, so micro-batches differ in width, packing and shared-prompt segments."""

    required_columns = ("q",)

    def reset(self, example):
        return f"Question: {example['q']}"

    def step(self, action):
        n = sum(map(ord, action.text))
        return Step(observation="Invalid." + " Again" * (n % 4), done=n % 3 == 0)


def uneven_prompts(n=8):
    return Dataset.from_dict({"q": ["question " + "word " * (3 * i) for i in range(n)]})


#: name -> config overrides; each is one way the training forward lays out a micro-batch
LAYOUTS = {
    "plain": dict(compact_padding=False),
    "plain-unbalanced": dict(compact_padding=False, balance_micro_batches=False),
    "compact": dict(pack_sequences=False, share_prompt_prefix=False),
    "packed": dict(pack_sequences=True, share_prompt_prefix=False),
    "shared-prompt": dict(pack_sequences=False, share_prompt_prefix=True),
    "token-budget": dict(share_prompt_prefix=False, max_tokens_per_micro_batch=160, micro_batch_size=None),
    "token-budget-shared": dict(share_prompt_prefix=True, max_tokens_per_micro_batch=160, micro_batch_size=None),
    # one mini-batch per rollout, two epochs (pi_old frozen for the second)
    "epochs": dict(mini_batch_size=8, micro_batch_size=4, ppo_epochs=2),
}


def spy_policy_loss(monkeypatch, trainer):
    """Records, for every micro-batch of the first optimizer step, max |log pi - log pi_old| over its loss tokens."""
    gaps = []
    real = loss_module.policy_loss

    def recording(logps, old, advantages, mask, **kw):
        if trainer.state.global_step == 0:
            live = mask.bool()
            gaps.append(float((logps.detach() - old)[live].abs().max()) if live.any() else 0.0)
        return real(logps, old, advantages, mask, **kw)

    monkeypatch.setattr(loss_module, "policy_loss", recording)
    return gaps


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fresh_rollout_ratio_is_exactly_one_on_the_first_mini_batch(tmp_path, smollm2_tokenizer, tiny_model_factory,
                                                                     monkeypatch, layout):
    # a rollout of 2 prompts x 4 = 8 trajectories, 2 mini-batches of 4: the old log-probs are a separate pass
    overrides = {"mini_batch_size": 4, "micro_batch_size": 2, **LAYOUTS[layout]}
    args = make_args(tmp_path, max_steps=1, bf16=False, **overrides)
    trainer = MultiTurnGRPOTrainer(
        model=tiny_model_factory(), args=args, train_dataset=uneven_prompts(), environment_factory=UnevenEnv,
        reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer,
    )
    steps, epochs = trainer.args.steps_per_generation, trainer.args.num_iterations
    assert trainer.args.gradient_accumulation_steps % (steps * epochs) != 0  # pi_old is a separate, frozen pass
    assert next(trainer.model.parameters()).dtype == torch.float32
    gaps = spy_policy_loss(monkeypatch, trainer)
    trainer.train()
    assert len(gaps) == trainer.args.gradient_accumulation_steps
    assert max(gaps) == 0.0, f"{layout}: max |log pi - log pi_old| = {max(gaps):.3e} per micro-batch {gaps}"
    assert logged(trainer, "loss/pg_clipfrac") == [0.0]
    assert logged(trainer, "loss/ratio_min") == [1.0] and logged(trainer, "loss/ratio_max") == [1.0]
    assert logged(trainer, "loss/ppo_kl") == [0.0]
    assert all(math.isfinite(x) for x in logged(trainer, "loss"))


def test_evaluation_scores_pi_old_with_its_own_forward(tmp_path, smollm2_tokenizer, tiny_model_factory, monkeypatch):
    # the same plan (pi_old frozen in training); in evaluation nothing is updated, so pi_old is the loss's forward
    args = make_args(tmp_path, max_steps=1, bf16=False, mini_batch_size=4, micro_batch_size=2, compact_padding=False,
                     per_device_eval_batch_size=4, num_generations_eval=4)
    trainer = MultiTurnGRPOTrainer(
        model=tiny_model_factory(), args=args, train_dataset=uneven_prompts(), eval_dataset=uneven_prompts(4),
        environment_factory=UnevenEnv, reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer,
    )
    gaps = []
    real = loss_module.policy_loss

    def recording(logps, old, advantages, mask, **kw):
        live = mask.bool()
        gaps.append(float((logps.detach() - old)[live].abs().max()) if live.any() else 0.0)
        return real(logps, old, advantages, mask, **kw)

    monkeypatch.setattr(loss_module, "policy_loss", recording)
    metrics = trainer.evaluate()
    assert gaps and max(gaps) == 0.0
    assert math.isfinite(metrics["eval_loss"])
