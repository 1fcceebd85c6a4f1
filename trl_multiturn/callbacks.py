"""Trainer callbacks of ``MultiTurnGRPOTrainer``."""

from __future__ import annotations

from transformers import TrainerCallback


class SkipEmptyUpdate(TrainerCallback):
    """Skips the optimizer update of a step whose rollout has no loss token on any rank: every trajectory dropped
    (environment failures, non-finite rewards, skipped prompts) or masked (``mask_truncated_completions``). Its
    gradient is zero, but Adam would still move the parameters with the moments of earlier steps; with the gradients
    set to None the optimizer leaves parameters, moments and step count alone. With an expert loss
    (``expert_loss_coef`` > 0) the step still has that loss's gradient and is taken."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.trainer._rollout_all_dropped and getattr(self.trainer, "_expert_loss", None) is None:
            self.trainer.optimizer.zero_grad(set_to_none=True)
