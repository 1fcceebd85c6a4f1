"""Trainer callbacks of ``MultiTurnGRPOTrainer``."""

from __future__ import annotations

from transformers import TrainerCallback


class SkipEmptyUpdate(TrainerCallback):
    """Skips the optimizer update of a step whose rollout has no loss token on any rank: every trajectory dropped
    (environment failures, non-finite rewards, skipped prompts) or masked (``mask_truncated_completions``). Its
    gradient is zero, but Adam would still move the parameters with the moments of earlier steps; with the gradients
    set to None the optimizer leaves parameters, moments and step count alone. The expert loss's gradient
    (``expert_loss_coef`` > 0) of such a step is dropped with it: it anchors RL updates, and there is none."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.trainer._rollout_all_dropped:
            self.trainer.optimizer.zero_grad(set_to_none=True)
