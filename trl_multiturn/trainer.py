"""``MultiTurnGRPOTrainer``: TRL's ``GRPOTrainer`` with multi-turn environments, exact observation masks, group
advantages (trajectory- or turn-level) and the N_g-normalized clipped loss with mini-batch-global normalizers.

How it plugs into TRL 1.16 (thin, through its seams):

* rollouts go through TRL's public ``rollout_func`` seam: our loop returns the exact ``prompt_ids``,
  ``completion_ids``, sampling ``logprobs`` and ``env_mask`` (our action mask) plus per-trajectory fields that reach
  the reward functions as keyword arguments (``env_reward``, ``num_turns``, ``turn_rewards``, ``final_answer``, ...);
* ``_generate_and_score_completions`` is extended (calls ``super()``) to run the environments before TRL's part and
  to replace TRL's advantages with ours (``trl_multiturn.advantages``: VeRL's eps, NaN/inf rewards dropped, turn-level
  modes as (B, T) tensors);
* ``_prepare_inputs`` (train mode) cuts the rollout into micro-batches keeping GRPO groups whole (groups are
  shuffled, not their members) and attaches to each micro-batch the sequence and token counts of its mini-batch
  over all ranks, so accumulated micro-batch losses equal the mini-batch loss for every aggregation mode;
* ``compute_loss`` computes the policy loss with ``trl_multiturn.loss`` (TRL's ``delta``,
  ``importance_sampling_level`` and ``use_bias_correction_kl`` included).

Every ``GRPOConfig`` field is honored or refused at construction (``trl_multiturn.config.GRPO_FIELDS``); the private
TRL members used here are checked by tests/test_trl_seams.py.

Departures from TRL's ``GRPOTrainer``: ``loss_aggregation`` (TRL's ``loss_type`` mapped onto it; unset, the project
default "seq-mean-token-mean" rather than TRL's "dapo") with mini-batch-global normalizers; ``advantage_eps`` (1e-6, VeRL)
replaces TRL's 1e-4; groups stay whole inside mini-batches; trajectories whose environment failed or whose reward is
not finite are dropped from the loss and from their group's baseline.
"""

from __future__ import annotations

import copy
import logging
import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers import TrainerCallback
from trl import GRPOTrainer
from trl.distributed import DistributedBackend
from trl.models.utils import disable_gradient_checkpointing, unwrap_model_for_generation
from trl.trainer.utils import split_tensor_dict

from .advantages import group_advantages, turn_advantages
from .batching import balanced_partition, first_fit_decreasing
from .checkpointing import AtomicCheckpointMixin
from .config import MultiTurnGRPOConfig, check_trl_fields
from .dynamic_sampling import DROP_REASONS, Selection, group_signal, merge_scored_rows, next_refill
from .generation import SamplingParams, TransformersGenerator, VLLMGenerator
from .loss import (
    aggregate_loss, kl_penalty, log_importance_weights, loss_normalizers, policy_loss, sampler_learner_gap,
)
from .protocols import ChatToolProtocol, Protocol, TagProtocol
from .rollout import MultiTurnRollout, RolloutConfig
from .trajectory import Trajectory
from .trl_compat import TRLEnvironmentAdapter, is_trl_environment

logger = logging.getLogger(__name__)

#: metric keys logged once per optimizer step (one mini-batch)
STEP_METRICS = ("loss/pg_loss", "loss/pg_clipfrac", "loss/ppo_kl", "loss/ratio_mean", "loss/ratio_min", "loss/ratio_max")


def _env_reward(completions, env_reward, **kwargs) -> list[float]:
    """Reward function exposing the sum of the environment's per-turn rewards (NaN for a failed trajectory)."""
    return [float(r) for r in env_reward]


_env_reward.__name__ = "env_reward"


class _SkipEmptyUpdate(TrainerCallback):
    """Skips the optimizer update of a step whose rollout has no loss token on any rank: every trajectory dropped
    (environment failures, non-finite rewards, skipped prompts) or masked (``mask_truncated_completions``). Its
    gradient is zero, but Adam would still move the parameters with the moments of
    earlier steps; with the gradients set to None the optimizer leaves parameters, moments and step count alone."""

    def __init__(self, trainer: "MultiTurnGRPOTrainer"):
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.trainer._rollout_all_dropped:
            self.trainer.optimizer.zero_grad(set_to_none=True)


class MultiTurnGRPOTrainer(AtomicCheckpointMixin, GRPOTrainer):
    """Multi-turn GRPO trainer.

    Args:
        model: model id, path or ``PreTrainedModel`` (as ``GRPOTrainer``).
        reward_funcs: TRL reward functions (``f(prompts, completions, completion_ids, **columns) -> list[float]``); they
            also receive the trajectory fields ``env_reward``, ``num_turns``, ``turn_rewards``, ``truncated``,
            ``final_answer``, ``stop_reason``. May be empty when the environment rewards.
        args: :class:`~trl_multiturn.config.MultiTurnGRPOConfig`.
        train_dataset / eval_dataset: rows handed to ``Environment.reset``.
        environment_factory: zero-argument callable returning a fresh environment per trajectory; either this
            package's contract (``reset(example)``/``step(action)``) or a TRL 1.16 environment class (public methods as
            tools, ``reset(**row)``, optional ``get_reward``), which is adapted and defaults to ``ChatToolProtocol``.
        protocol: how actions and observations are written (default: the environment's ``protocol`` attribute, else
            ``TagProtocol()``; ``ChatToolProtocol()`` for TRL-style environments).
        peft_config, processing_class, callbacks, optimizers, reward_processing_classes: as ``GRPOTrainer``.
    """

    def __init__(
        self,
        model,
        reward_funcs: Callable | list[Callable] | None = None,
        args: MultiTurnGRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        environment_factory: Callable[[], Any] | None = None,
        protocol: Protocol | None = None,
    ):
        if args is None:
            args = MultiTurnGRPOConfig("multiturn-grpo")
        if not isinstance(args, MultiTurnGRPOConfig):
            raise TypeError(
                f"args must be a MultiTurnGRPOConfig, got {type(args).__name__}. Build a MultiTurnGRPOConfig with the "
                "keyword arguments you gave GRPOConfig (it takes every GRPOConfig field)."
            )
        check_trl_fields(args)  # again: a field may have been changed after the config was built
        _check_vllm_logprobs(args)
        if environment_factory is None:
            raise ValueError(
                "MultiTurnGRPOTrainer needs environment_factory (a callable returning one environment per "
                "trajectory). For single-turn GRPO use trl.GRPOTrainer."
            )
        probe = environment_factory()
        if is_trl_environment(probe):
            factory = lambda: TRLEnvironmentAdapter(environment_factory())  # noqa: E731
            protocol = protocol or ChatToolProtocol()
        elif callable(getattr(probe, "reset", None)) and callable(getattr(probe, "step", None)):
            factory = environment_factory
            protocol = protocol or getattr(probe, "protocol", None) or TagProtocol()
        else:
            raise TypeError(
                f"environment_factory returned {type(probe).__name__}, which has no reset(). An environment needs "
                "reset(example) and step(action) (see trl_multiturn.environment), or be a TRL-style class."
            )
        if getattr(protocol, "requires_stop_strings", False) and not protocol.stop_strings:
            raise ValueError(
                f"{type(protocol).__name__} has no stop strings, so a turn would never end at an action. Give it at "
                "least one tool tag or an answer tag."
            )
        protocol = copy.copy(protocol)  # configured below and validated against the tokenizer: the caller's stays as is
        if args.max_observation_tokens is not None:
            protocol.max_observation_tokens = args.max_observation_tokens
        required = tuple(getattr(probe, "required_columns", ()) or ())
        for name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
            columns = getattr(dataset, "column_names", None)
            if isinstance(columns, dict):  # DatasetDict
                columns = next(iter(columns.values()), [])
            if columns is not None and required:
                missing = [c for c in required if c not in columns]
                if missing:
                    raise ValueError(
                        f"{name} lacks the column(s) {missing} that {type(probe).__name__} needs; it has {columns}. "
                        "Rename or add them (e.g. dataset.rename_column(old, new))."
                    )
        close = getattr(probe, "close", None)
        if callable(close):
            close()

        user_funcs = [] if reward_funcs is None else (list(reward_funcs) if isinstance(reward_funcs, list) else [reward_funcs])
        if args.reward_weights is not None:
            if len(args.reward_weights) != len(user_funcs):
                raise ValueError(
                    f"reward_weights has {len(args.reward_weights)} entries but {len(user_funcs)} reward_funcs were "
                    "given; give one weight per reward function (the environment reward has weight 1)."
                )
            args = copy.copy(args)  # the caller's config keeps its own reward_weights (and can build another trainer)
            args.reward_weights = list(args.reward_weights) + [1.0]

        self.protocol = protocol
        self._environment_factory = factory
        self._environment_name = type(probe).__name__
        self._rollout_all_dropped = False
        self._pending_trajectories: list[Trajectory] | None = None
        self._step_accumulator: dict[str, float] = defaultdict(float)
        super().__init__(
            model=model,
            reward_funcs=user_funcs + [_env_reward],
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            rollout_func=self._rollout_func,
        )
        _check_sharded_generation(args, DistributedBackend(self.accelerator))
        if self.aux_loss_enabled:  # TRL turns the MoE auxiliary loss on from the model's config
            raise ValueError(
                f"{type(self.model).__name__} declares router_aux_loss_coef={self.router_aux_loss_coef} and returns "
                "router logits, but MultiTurnGRPOTrainer does not add the MoE load-balancing loss. Set "
                "router_aux_loss_coef=0.0 to train without it."
            )
        # TRL decides truncation by "last token is not EOS", which is wrong for tag protocols (a turn ends at
        # </answer>); the rollout knows which trajectories hit a limit, so this trainer applies the mask itself.
        self._mask_truncated = bool(args.mask_truncated_completions)
        self._packing_checked: bool | None = None  # pack_sequences: None until checked on the first micro-batch
        self._sharing_checked: bool | None = None  # share_prompt_prefix: None until checked on the first shared batch
        self._in_packing_check = False
        self._defer_old_logps = False  # set while TRL scores a rollout: see _get_per_token_logps_and_entropies
        self.mask_truncated_completions = False
        tokenizer = self._tokenizer
        if tokenizer.pad_token is None:
            if tokenizer.eos_token is None:
                raise ValueError("The tokenizer has neither a pad token nor an EOS token; set tokenizer.pad_token.")
            logger.warning("The tokenizer has no pad token; using its EOS token %r for padding.", tokenizer.eos_token)
            tokenizer.pad_token = tokenizer.eos_token
        protocol.validate(tokenizer)
        max_context = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        self.rollout = MultiTurnRollout(
            self._environment_factory,
            protocol,
            tokenizer,
            RolloutConfig(
                max_turns=args.max_turns,
                max_completion_length=args.max_completion_length,
                max_tokens_per_turn=args.max_tokens_per_turn,
                max_context_length=max_context,
                env_timeout=args.env_timeout,
                raise_on_env_error=args.raise_on_env_error,
                on_long_prompt=args.on_long_prompt,
            ),
        )
        self.add_callback(_SkipEmptyUpdate(self))
        # One sampling stream per rank: ranks that hold members of the same group (prompts_per_rollout not a multiple
        # of the number of processes) would otherwise sample them identically.
        self._sampling_generator = torch.Generator().manual_seed(args.seed + self.accelerator.process_index)
        self._vllm_generator: VLLMGenerator | None = None

    # ------------------------------------------------------------------ rollout
    def _sampling_params(self) -> SamplingParams:
        a = self.args
        return SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k or 0, min_p=a.min_p or 0.0)

    def _run_rollout(self, inputs: list[dict]) -> list[Trajectory]:
        """Roll out one trajectory per input row with the current policy (eval mode, no gradients).

        With ``use_vllm`` the turns are sampled by TRL's vLLM engine through :class:`VLLMGenerator`, which makes
        ``max_turns`` calls on every rank (the collective-call rule). The engine gets the current weights first:
        TRL syncs them inside ``rollout_func``, which this trainer calls after the rollout.
        """
        if self.use_vllm:
            if self.state.global_step != self._last_loaded_step:
                self.vllm_generation.sync_weights()
                self._last_loaded_step = self.state.global_step
            if self._vllm_generator is None:
                self._vllm_generator = VLLMGenerator.from_trl(self.vllm_generation, self._tokenizer)
            return self.rollout.run(inputs, self._vllm_generator, self._sampling_params())
        with unwrap_model_for_generation(
            self.model_wrapped, self.accelerator, gather_deepspeed3_params=self.args.ds3_gather_for_generation,
            gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
        ) as unwrapped:
            was_training = unwrapped.training
            unwrapped.eval()
            try:
                generator = TransformersGenerator(unwrapped, self._tokenizer, generator=self._sampling_generator)
                trajectories = self.rollout.run(inputs, generator, self._sampling_params())
            finally:
                if was_training:
                    unwrapped.train()
        return trajectories

    def _rollout_func(self, prompts, trainer) -> dict[str, list]:
        """TRL's ``rollout_func`` seam: hand over the trajectories computed for this batch."""
        trajs = self._pending_trajectories
        if trajs is None or len(trajs) != len(prompts):
            raise RuntimeError("internal: trajectories were not prepared for this batch")
        return {
            "prompt_ids": [t.prompt_ids for t in trajs],
            "completion_ids": [t.completion_ids for t in trajs],
            "logprobs": [t.logprobs for t in trajs],
            "env_mask": [t.action_mask for t in trajs],
            "env_reward": [float("nan") if t.info.get("failed") else float(sum(t.turn_rewards)) for t in trajs],
            "num_turns": [t.num_turns for t in trajs],
            "turn_rewards": [list(t.turn_rewards) for t in trajs],
            "truncated": [t.truncated for t in trajs],
            "final_answer": [t.info.get("final_answer") for t in trajs],
            "stop_reason": [t.info.get("stop_reason") for t in trajs],
        }

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._last_rewards_per_func = rewards_per_func  # (B_global, F), gathered over processes
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        trajs = self._run_rollout(inputs)
        inputs = [dict(x) for x in inputs]
        for x, t in zip(inputs, trajs):
            if "prompt" not in x:
                x["prompt"] = self._tokenizer.decode(t.prompt_ids, skip_special_tokens=False)
        self._pending_trajectories = trajs
        # pi_old is scored per micro-batch in _prepare_inputs, with the training pass's own forward; TRL's pass over
        # the rollout (another layout and partition) is skipped, unless vLLM's importance sampling needs it now.
        # In evaluation nothing is updated between scoring and the loss: pi_old is the loss's own forward.
        generate_every = self.args.steps_per_generation * self.num_iterations  # TRL scores pi_old when this holds:
        frozen_old = self.args.gradient_accumulation_steps % generate_every != 0
        self._defer_old_logps = frozen_old and not (self.use_vllm and self.vllm_importance_sampling_correction)
        deferred = self._defer_old_logps
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._pending_trajectories = None
            self._defer_old_logps = False
        if deferred and mode == "eval":
            output.pop("old_per_token_logps", None)
        self._replace_advantages(output, trajs, mode)
        self._log_rollout_metrics(trajs, mode)
        self._log_rollout_speed(mode)
        return output

    def _fix_termination_metrics(self, truncated: torch.Tensor, lengths: torch.Tensor, mode: str) -> None:
        """TRL counts a completion as clipped when its last token is not EOS; a multi-turn trajectory ends at the
        protocol's stop string (``</answer>``) or at ``done`` without one. Rewrite TRL's just-logged
        ``completions/clipped_ratio`` and ``completions/*_terminated_length`` with the trajectory's own truncation
        flag (cut by a token limit: ``Trajectory.truncated``), as ``rollout/truncated_frac``.
        ``truncated`` and ``lengths`` are (B_global,), already gathered by :meth:`_log_rollout_metrics`."""
        m = self._metrics[mode]
        if not m.get("completions/clipped_ratio"):
            return
        truncated = truncated.bool()
        m["completions/clipped_ratio"][-1] = truncated.float().mean().item()
        finished = lengths[~truncated] if bool((~truncated).any()) else torch.zeros(1, device=lengths.device)
        for key, value in (("mean", finished.mean()), ("min", finished.min()), ("max", finished.max())):
            if m.get(f"completions/{key}_terminated_length"):
                m[f"completions/{key}_terminated_length"][-1] = value.item()

    def _log_rollout_speed(self, mode: str) -> None:
        """perf/ metrics of this process's last rollout (``MultiTurnRollout.last_stats``)."""
        s, m = self.rollout.last_stats, self._metrics[mode]
        if not s:
            return
        m["perf/rollout_s"].append(s["wall_s"])
        m["perf/rollout_env_wait_s"].append(s["env_time_s"])
        m["perf/prefill_tokens_per_generated_token"].append(s["prefill_tokens"] / max(s["generated_tokens"], 1))
        m["perf/cached_token_frac"].append(s["cached_tokens"] / max(s["cached_tokens"] + s["prefill_tokens"], 1))

    # ------------------------------------------------------------------ advantages
    def _replace_advantages(self, output: dict, trajs: list[Trajectory], mode: str) -> None:
        device = self.accelerator.device
        args = self.args
        group_size = self.num_generations if mode == "train" else self.num_generations_eval
        rpf = self._last_rewards_per_func  # (B_global, F)
        weights = self.reward_weights.to(rpf.device)
        rewards = (rpf * weights.unsqueeze(0)).nansum(dim=1)  # (B_global,)
        # A reward is dropped when the environment failed (env_reward NaN) or any reward is not finite.
        bad = ~torch.isfinite(rpf[:, -1]) | torch.isinf(rpf).any(dim=1) | torch.isnan(rpf).all(dim=1)  # (B_global,)
        local_failed = torch.tensor([bool(t.info.get("failed")) for t in trajs], device=device)
        failed = self.accelerator.gather(local_failed)  # (B_global,)
        dropped = bad | failed
        n_drop = int(dropped.sum())
        start = self.accelerator.process_index * len(trajs)
        local = slice(start, start + len(trajs))
        local_dropped = dropped[local]
        if n_drop:
            names = list(self.reward_func_names)
            reasons = []
            for i, t in enumerate(trajs):
                if not bool(local_dropped[i]):
                    continue
                row = rpf[start + i].tolist()
                why = "; ".join(t.info.get("env_errors", [])) or t.info.get("skipped") or ", ".join(
                    f"{n}={v}" for n, v in zip(names, row) if not math.isfinite(v)
                )
                reasons.append(f"example {i} {t.info.get('example', '')}: {why}")
            logger.warning(
                "%d of %d trajectories from %s dropped from the loss and from their group's baseline%s: %s%s",
                n_drop, len(dropped), self._environment_name,
                " (all of them: this step's optimizer update is skipped)" if n_drop == len(dropped) else "",
                " | ".join(reasons[:8]), " | ..." if len(reasons) > 8 else "",
            )
        for t, d, r in zip(trajs, local_dropped.tolist(), rewards[local].tolist()):
            t.reward = float("nan") if d else float(r)

        safe = rewards.clone()
        safe[dropped] = float("nan")
        self._last_rewards = safe  # (B_global,) NaN where dropped; read by dynamic sampling
        scale = args.scale_rewards if args.scale_rewards in ("group", "batch", "none") else "group"
        seq_adv = _nan_aware_group_advantages(safe, group_size, scale, args.advantage_eps)  # (B_global,)

        if args.turn_advantage == "trajectory":
            advantages = seq_adv[local].to(device)  # (B_local,)
        else:
            # Outcome = the reward functions only: the environment's per-turn rewards enter as turn rewards.
            outcome = (rpf[:, :-1] * weights[:-1].unsqueeze(0)).nansum(dim=1)  # (B_global,)
            outcome[dropped] = float("nan")
            all_turn_rewards = _gather_list(
                self.accelerator, [[r if math.isfinite(r) else 0.0 for r in t.turn_rewards] for t in trajs]
            )
            all_turn_rewards = [
                [0.0] * len(tr) if d else tr for tr, d in zip(all_turn_rewards, dropped.tolist())
            ]
            width = output["completion_ids"].size(1)
            all_turn_ids = _gather_list(self.accelerator, [t.turn_ids for t in trajs])
            all_masks = _gather_list(self.accelerator, [t.action_mask for t in trajs])
            turn_ids = torch.full((len(all_turn_ids), width), -1, dtype=torch.long)
            action_mask = torch.zeros((len(all_turn_ids), width), dtype=torch.long)
            for i, (tid, m) in enumerate(zip(all_turn_ids, all_masks)):
                turn_ids[i, : len(tid)] = torch.tensor(tid, dtype=torch.long)
                action_mask[i, : len(m)] = torch.tensor(m, dtype=torch.long)
            tok_adv = turn_advantages(
                args.turn_advantage,
                outcome.cpu(),
                all_turn_rewards,
                turn_ids,
                action_mask,
                group_size,
                scale=scale,
                eps=args.advantage_eps,
                gamma=args.turn_advantage_gamma,
                turn_weight=args.turn_advantage_weight,
                keep=~dropped.cpu(),  # every column normalized over the kept members of each group only
            )  # (B_global, T), 0 on dropped rows
            advantages = tok_adv[local].to(device)  # (B_local, T)
        output["advantages"] = advantages
        excluded = local_dropped.clone()
        if self._mask_truncated:  # mask_truncated_completions: trajectories cut by a limit carry no loss
            excluded |= torch.tensor([t.truncated for t in trajs], device=excluded.device)
        if excluded.any():
            keep = (~excluded).long().unsqueeze(1)  # (B_local, 1)
            output["tool_mask"] = output["tool_mask"] * keep
        # the update is skipped when no token of the rollout carries loss on any rank: every trajectory dropped, or
        # masked (mask_truncated_completions), or without a sampled token
        loss_mask = output["completion_mask"] * output["tool_mask"]  # (B_local, C)
        loss_tokens = int(self.accelerator.reduce(loss_mask.sum().to(device), reduction="sum"))
        if mode == "train":
            self._rollout_all_dropped = loss_tokens == 0
        if loss_tokens == 0 and n_drop < len(dropped):
            logger.warning("No trajectory of this rollout carries loss (dropped, or masked by mask_truncated_"
                           "completions, or without a sampled token): this step's optimizer update is skipped.")
        self._log_trained_advantages(advantages, loss_mask)
        self._metrics[mode]["rollout/dropped_frac"].append(float(dropped.float().mean()))
        self._metrics[mode]["rollout/skipped_update"].append(float(loss_tokens == 0))

    def _log_trained_advantages(self, advantages: torch.Tensor, loss_mask: torch.Tensor) -> None:
        """Rewrite the ``advantages`` column of TRL's completions table (just logged by TRL with TRL's advantages)
        with the ones trained on: per trajectory, its advantage, or the mean over its loss tokens for per-token
        advantages; 0 for a trajectory without a loss token (dropped or masked). advantages: (B,) or (B, C)."""
        logged = self._logs["advantages"]
        m = loss_mask.float()  # (B, C)
        tokens = m.sum(1)  # (B,)
        if advantages.dim() == 2:
            per_row = (advantages * m).sum(1) / tokens.clamp(min=1)  # (B,) mean over loss tokens
        else:
            per_row = advantages.float()  # (B,)
        per_row = torch.where(tokens > 0, per_row, torch.zeros_like(per_row))  # (B,)
        trained = self.accelerator.gather(per_row).tolist()  # (B_global,)
        if len(logged) < len(trained):
            return
        for _ in trained:
            logged.pop()
        logged.extend(trained)

    # ------------------------------------------------------------------ metrics
    def _log_rollout_metrics(self, trajs: list[Trajectory], mode: str) -> None:
        rows = [
            [
                t.num_turns,
                float(t.truncated),
                float(bool(t.info.get("failed")) and not t.info.get("skipped")),
                len(t.info.get("env_errors", [])),
                t.num_action_tokens,
                t.num_observation_tokens,
                sum(1 for k in t.info.get("actions", []) if k == "tool"),
                sum(1 for k in t.info.get("actions", []) if k == "answer"),
                sum(1 for k in t.info.get("actions", []) if k == "invalid"),
                float(t.info.get("observation_truncated", 0)),
                float(t.info.get("observation_sanitized", 0)),
                float(len(t.info.get("observation_problems", []))),
                float(t.info.get("skipped") is not None),
                float(len(t.completion_ids)),
            ]
            for t in trajs
        ]
        stats = self.accelerator.gather(torch.tensor(rows, dtype=torch.float32, device=self.accelerator.device))
        (turns, trunc, failed, errors, a_tok, o_tok, tool, answer, invalid, obs_trunc, sanitized, problems, skipped,
         lengths) = stats.T
        self._fix_termination_metrics(trunc, lengths, mode)
        total_actions = (tool + answer + invalid).sum().clamp(min=1)
        m = self._metrics[mode]
        m["rollout/turns_mean"].append(turns.mean().item())
        m["rollout/turns_max"].append(turns.max().item())
        m["rollout/truncated_frac"].append(trunc.mean().item())
        m["rollout/assistant_tokens_mean"].append(a_tok.mean().item())
        m["rollout/observation_tokens_mean"].append(o_tok.mean().item())
        m["rollout/actions_tool_frac"].append((tool.sum() / total_actions).item())
        m["rollout/actions_answer_frac"].append((answer.sum() / total_actions).item())
        m["rollout/invalid_action_rate"].append((invalid.sum() / total_actions).item())
        m["env/errors"].append(errors.sum().item())
        m["env/failed_frac"].append(failed.mean().item())
        m["env/observations_truncated"].append(obs_trunc.sum().item())
        m["env/observations_sanitized"].append(sanitized.sum().item())
        m["env/observation_problems"].append(problems.sum().item())
        m["rollout/skipped_prompts"].append(skipped.sum().item())
        rewards = self.accelerator.gather(
            torch.tensor([t.reward for t in trajs], dtype=torch.float32, device=self.accelerator.device)
        )
        group = self.num_generations if mode == "train" else self.num_generations_eval
        finite = rewards[torch.isfinite(rewards)]
        m["rollout/reward_mean"].append(finite.mean().item() if finite.numel() else float("nan"))
        m["rollout/reward_std"].append(finite.std().item() if finite.numel() > 1 else 0.0)
        if rewards.numel() % group == 0 and group > 1:
            g = rewards.view(-1, group)
            zero = torch.tensor(
                [bool(torch.isfinite(row).sum() < 2 or row[torch.isfinite(row)].std() == 0) for row in g]
            )  # a group with fewer than 2 kept members has no baseline: no signal, like a zero-std group
            m["rollout/zero_std_group_frac"].append(zero.float().mean().item())
        reasons = Counter(t.info.get("stop_reason") for t in trajs)
        self.last_stop_reasons = dict(reasons)

    # ------------------------------------------------------------------ batching
    def _prepare_inputs(self, generation_batch):
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        steps = self.args.steps_per_generation
        generate_every = steps * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            if self.args.dynamic_sampling:
                batch = self._dynamic_sampling_rollout(generation_batch)
            else:
                batch = self._generate_and_score_completions(generation_batch)
            batch = _shuffle_groups(batch, self.num_generations)
            self._check_layouts(batch)
            if self.args.balance_micro_batches:
                chunks = _balanced_micro_batches(
                    batch, steps, self.args.gradient_accumulation_steps, self.args.max_tokens_per_micro_batch,
                    share_prefix=self._sharing_planned(batch),
                )
                self._log_micro_batches(chunks)
            else:
                chunks = split_tensor_dict(batch, steps)
            self._attach_normalizers(chunks)
            if "old_per_token_logps" in batch:  # several optimizer steps or epochs per rollout: pi_old is frozen
                self._score_old_logps(chunks)
            self._log_padding(chunks)
            self._buffered_inputs = chunks
        return self._buffered_inputs[self._step % steps]

    def _dynamic_sampling_rollout(self, inputs: list[dict]) -> dict:
        """``dynamic_sampling``: score rounds of rollouts until every rank holds its share of groups with reward
        variance (at most ``max_dynamic_sampling_rounds`` refill rounds, every rank the same number, each rolling out
        the same number of prompts), then one scored batch of the kept groups; places still empty are filled with
        dropped groups whose loss mask is 0 (see trl_multiturn.dynamic_sampling). Refill prompts are drawn from
        ``train_dataset`` with a generator seeded by (seed, global step, round, rank), so a resumed run draws the
        same ones."""
        G, acc, dataset = self.num_generations, self.accelerator, self.train_dataset
        n = len(inputs)
        if n % G:
            raise ValueError(
                f"dynamic_sampling needs whole groups on every rank, but a rank holds {n} trajectories, not a multiple "
                f"of num_generations={G}. Make prompts_per_rollout a multiple of the number of processes."
            )
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise ValueError(
                f"dynamic_sampling draws refill prompts by index, but train_dataset is a {type(dataset).__name__} "
                "without len()/indexing. Pass a map-style dataset or set dynamic_sampling=False."
            )
        selection, batches, rnd, sampled = Selection(quota=n // G), [], 0, 0
        while True:
            batches.append(self._generate_and_score_completions(inputs))
            start, sampled = acc.process_index * len(inputs), sampled + len(inputs) // G
            selection.add_round(rnd, group_signal(self._last_rewards[start : start + len(inputs)].cpu(), G))
            table = acc.gather(torch.tensor([[sampled, len(selection.kept), selection.missing]], device=acc.device))
            prompts = next_refill(table, rnd, self.args.max_dynamic_sampling_rounds, n // G)  # the same on every rank
            if not prompts:
                break
            rnd += 1
            gen = torch.Generator().manual_seed(hash((self.args.seed, self.state.global_step, rnd, acc.process_index))
                                                & (2**62 - 1))
            index = torch.randint(len(dataset), (prompts,), generator=gen).tolist()
            inputs = [dataset[i] for i in index for _ in range(G)]
        kept, filler = selection.rows(G)
        batch = merge_scored_rows([(batches[r], rows, True) for r, rows in kept]
                                  + [(batches[r], rows, False) for r, rows in filler], self._tokenizer.pad_token_id)
        loss_tokens = acc.reduce((batch["completion_mask"] * batch["tool_mask"]).sum(), reduction="sum")
        batch["num_items_in_batch"] = acc.reduce(batch["completion_mask"].sum(), reduction="sum")
        self._rollout_all_dropped = int(loss_tokens) == 0
        counts = [sampled, len(selection.kept), selection.surplus, sum(len(rows) for _, rows in filler) // G, rnd] + [
            selection.dropped[why] for why in DROP_REASONS]
        totals = acc.reduce(torch.tensor(counts, dtype=torch.float64, device=acc.device), reduction="sum")
        names = ["prompts_sampled", "groups_kept", "groups_surplus", "groups_filler", "rounds"] + [
            f"groups_dropped_{why}" for why in DROP_REASONS]
        m = self._metrics["train"]
        for name, value in zip(names, totals.tolist()):
            m[f"rollout/dynamic_sampling/{name}"].append(value / acc.num_processes if name == "rounds" else value)
        return batch

    def _score_old_logps(self, chunks: list[dict]) -> None:
        """Each micro-batch's ``old_per_token_logps`` (B, C) from the call :meth:`compute_loss` makes on it: the same
        rows, layout (plain, compact, packed, shared prompt) and one-time checks, before any update. On a fresh
        rollout ``pi / pi_old`` is then exactly 1 without dropout (the float error of another layout or partition
        would otherwise reach the ratio and the clip), and the cost is one no-gradient forward, as TRL's."""
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            for chunk in chunks:
                input_ids = torch.cat([chunk["prompt_ids"], chunk["completion_ids"]], dim=1)  # (b, P+C)
                attention_mask = torch.cat([chunk["prompt_mask"], chunk["completion_mask"]], dim=1)  # (b, P+C)
                chunk["old_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(
                    self.model, input_ids, attention_mask, chunk["completion_ids"].size(1)
                )  # (b, C)

    def _log_micro_batches(self, chunks: list[dict]) -> None:
        """perf/micro_batches: forward/backward passes that carry loss per optimizer step (token budget: fewer when
        trajectories are short); warns once when the budget needed more micro-batches than the plan has slots."""
        real = sum(not c.get("empty_micro_batch", False) for c in chunks)
        mini_batches = max(len(chunks) // self.args.gradient_accumulation_steps, 1)
        self._metrics["train"]["perf/micro_batches"].append(real / mini_batches)
        if any(c.get("over_token_budget") for c in chunks) and not getattr(self, "_warned_budget", False):
            self._warned_budget = True
            logger.warning(
                "max_tokens_per_micro_batch=%d: a mini-batch needed more micro-batches than its %d accumulation slots; "
                "it was cut into that many balanced micro-batches, over the budget. Lower micro_batch_size (more "
                "slots; empty ones cost ~nothing) or raise max_tokens_per_micro_batch.",
                self.args.max_tokens_per_micro_batch, self.args.gradient_accumulation_steps,
            )

    def _check_layouts(self, batch: dict) -> None:
        """The one-time checks of ``pack_sequences`` and ``share_prompt_prefix``, on every rank at the same point
        (after the first training rollout) with the same forwards: under ZeRO-3 or FSDP each forward gathers weights
        from every rank, so a check that ran on some ranks only would deadlock. Each rank checks rows of its own
        rollout: the first prompt that repeats (up to 4 of its rows), or its first row twice, which repeats its
        prompt too. The verdict is taken over all ranks (the largest error against its tolerance), so every rank
        trains with the same layout."""
        a = self.args
        pack = a.compact_padding and a.pack_sequences and self._packing_checked is None
        share = a.compact_padding and a.share_prompt_prefix and self._sharing_checked is None
        if share and not _full_attention(self.accelerator.unwrap_model(self.model)):
            self._sharing_checked = share = False  # sliding-window / linear-attention layers: never shared
        if not (pack or share):
            return
        keys = _prompt_keys(batch["prompt_ids"], batch["prompt_mask"])
        repeated = next((k for k, n in Counter(keys).items() if n > 1), None)
        rows = [i for i, k in enumerate(keys) if k == repeated][:4] if repeated is not None else [0, 0]
        index = torch.tensor(rows, device=batch["prompt_ids"].device)
        input_ids = torch.cat([batch["prompt_ids"][index], batch["completion_ids"][index]], dim=1)  # (b, P+C)
        attention_mask = torch.cat([batch["prompt_mask"][index], batch["completion_mask"][index]], dim=1)  # (b, P+C)
        width = batch["completion_ids"].size(1)
        # The rollout's rows are always contiguous (left-padded prompt, right-padded completion), so every rank runs
        # the same forwards; elsewhere a rank has no objection.
        contiguous = _prompt_completion_contiguous(attention_mask, width)
        packing = sharing = None
        if pack:
            ids, mask, _, _, is_completion = _compact_rows(input_ids, attention_mask, width)
            packing = self._packing_error(self.model, ids, mask, ids.masked_fill(~is_completion, -100)) if contiguous \
                else (0.0, 1.0)
        if share:
            sharing = self._sharing_error(self.model, input_ids, attention_mask, width, [keys[i] for i in rows]) \
                if contiguous else (0.0, 1.0)
        self._settle_layouts(packing, sharing)

    def _settle_layouts(self, packing: tuple[float, float] | None, sharing: tuple[float, float] | None) -> None:
        """Sets the verdict of each one-time check given as this rank's (error, tolerance): every rank must call this
        together (it gathers), and every rank gets the same verdict, from the largest error against its tolerance."""
        mine = [x for check in (packing, sharing) for x in (check or (0.0, 1.0))]
        acc = self.accelerator
        table = acc.gather(torch.tensor([mine], dtype=torch.float64, device=acc.device)).view(-1, 2, 2)
        worst = (table[..., 0] / table[..., 1]).max(0).values.tolist()  # (check,), over ranks
        err = table[..., 0].max(0).values.tolist()
        if packing is not None:
            self._packing_checked = worst[0] < 1
            if not self._packing_checked:
                logger.warning(
                    "pack_sequences: packed and unpacked log-probs differ by %.2e (mean) on this model (its attention "
                    "does not isolate sequences by position ids); training without packing.", err[0],
                )
        if sharing is not None:
            self._sharing_checked = worst[1] < 1
            if not self._sharing_checked:
                logger.warning(
                    "share_prompt_prefix: log-probs with each prompt computed once differ from the plain forward by "
                    "%.2e (mean) on this model (its attention has more than a causal mask: sliding window, soft-capping, "
                    "sinks, or it does not run through transformers' AttentionInterface); training without prompt "
                    "sharing.", err[1],
                )

    def _sharing_planned(self, batch: dict) -> bool:
        """Whether the micro-batches can be cut for the shared-prompt forward: sharing is on and its one-time check
        (:meth:`_check_layouts`) passed, so a budget is never planned for a forward that does not happen."""
        return bool(self.args.share_prompt_prefix and self.args.compact_padding and self._sharing_checked)

    def _log_padding(self, chunks: list[dict]) -> None:
        """perf/useful_token_frac = real tokens / tokens processed (padding included) and perf/completion_token_frac
        = completion (action + observation) tokens / tokens processed, over the rollout's micro-batches."""
        compact = self.args.compact_padding
        pack = compact and self.args.pack_sequences and self._packing_checked is not False
        share = compact and self.args.share_prompt_prefix and self._sharing_checked is not False
        counts = [_chunk_tokens(c, compact, pack, share) for c in chunks]  # (processed, real)
        completion = sum(float(c["completion_mask"].sum()) for c in chunks)
        totals = self.accelerator.reduce(
            torch.tensor([sum(r for _, r in counts), completion, sum(p for p, _ in counts)], dtype=torch.float64,
                         device=self.accelerator.device),
            reduction="sum",
        )
        processed = totals[2].clamp(min=1)
        self._metrics["train"]["perf/useful_token_frac"].append(float(totals[0] / processed))
        self._metrics["train"]["perf/completion_token_frac"].append(float(totals[1] / processed))

    def _attach_normalizers(self, chunks: list[dict]) -> None:
        """Give each micro-batch the (sequence, token) counts of its whole mini-batch over all ranks."""
        accum = self.args.gradient_accumulation_steps
        local = torch.zeros(len(chunks), 2, dtype=torch.float64, device=self.accelerator.device)
        for j, chunk in enumerate(chunks):
            mask = chunk["completion_mask"] * chunk["tool_mask"]
            local[j, 0], local[j, 1] = loss_normalizers(mask)
        totals = self.accelerator.reduce(local, reduction="sum")  # (chunks, 2) summed over ranks
        for j, chunk in enumerate(chunks):
            mb = j // accum
            group = totals[mb * accum : (mb + 1) * accum].sum(dim=0)
            chunk["mb_num_sequences"] = group[0].float()
            chunk["mb_num_tokens"] = group[1].float()

    # ------------------------------------------------------------------ forward
    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
        compute_aux_loss=False, **multimodal,
    ):
        """Per-token log-probs of the completion columns, (B, C), from a compacted batch when ``compact_padding``.

        TRL lays a row out as ``[left-padded prompt | right-padded completion]``, so every row is as wide as the
        longest prompt plus the longest completion. Compacted, each row is its real tokens, contiguous and
        right-padded: as wide as the longest sequence. Logits of real tokens are unchanged up to float error (the
        causal mask hides padding either way and rotary position encodings see only relative positions). Rows whose
        mask is not ``[0* 1* | 1* 0*]`` (holes), multimodal inputs and MoE aux losses go through TRL's path.

        Called by TRL for pi_old over the whole rollout while ``_defer_old_logps`` is set, it returns NaN instead
        (loud if ever trained on): :meth:`_score_old_logps` scores pi_old per micro-batch.
        """
        if self._defer_old_logps:
            self._defer_old_logps = False  # TRL's first call in the rollout is pi_old; reference log-probs follow
            placeholder = torch.full((input_ids.size(0), logits_to_keep), float("nan"), device=input_ids.device)
            return placeholder, None, None  # (B, C)
        fallback = (
            not self.args.compact_padding or compute_aux_loss or any(v is not None for v in multimodal.values())
            or not _prompt_completion_contiguous(attention_mask, logits_to_keep)
        )
        if fallback:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal,
            )
        batch_size = batch_size or input_ids.size(0)
        sharing = self.args.share_prompt_prefix and self._sharing_checked is not False and logits_to_keep > 0
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, mask, index, valid, is_completion = _compact_rows(
                input_ids[start : start + batch_size], attention_mask[start : start + batch_size], logits_to_keep
            )  # (b, W) x2, (b, C) compact column of each completion column, (b, C) real-token flag, (b, W)
            labels = ids.masked_fill(~is_completion, -100)  # only real completion tokens are scored
            chunk = (input_ids[start : start + batch_size], attention_mask[start : start + batch_size])
            keys = _prompt_keys(chunk[0][:, : -logits_to_keep], chunk[1][:, : -logits_to_keep]) if sharing else None
            if sharing and self._share_prefix(model, *chunk, logits_to_keep, keys):
                try:
                    lp, ent = self._shared_prefix_forward(model, *chunk, logits_to_keep, compute_entropy, keys)  # (b, C)
                except _SharedAttentionUnused:
                    self._sharing_checked = False
                    logger.warning("share_prompt_prefix: the model's attention does not run through transformers' "
                                   "AttentionInterface (e.g. attn_implementation='eager'; use 'sdpa'); training "
                                   "without prompt sharing.")
                else:
                    logps.append(lp.masked_fill(~valid, 0.0))
                    if compute_entropy:
                        entropies.append(ent.masked_fill(~valid, 0.0))
                    continue
            if self.args.pack_sequences and self._packing_ok(model, ids, mask, labels):
                lp, ent = self._packed_forward(model, ids, mask, labels, compute_entropy)  # (b, W-1)
            else:
                with self.accelerator.autocast():
                    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
                lp, ent = out.log_probs, (out.entropy if compute_entropy else None)  # (b, W-1)
            # the fused head scores token t+1 from position t: column t-1 of its (b, W-1) output is token t
            shift = (index - 1).clamp(min=0)  # (b, C)
            logps.append(lp.gather(1, shift).masked_fill(~valid, 0.0))
            if compute_entropy:
                entropies.append(ent.gather(1, shift).masked_fill(~valid, 0.0))
        entropy = torch.cat(entropies, dim=0) if compute_entropy else None
        return torch.cat(logps, dim=0), entropy, None

    def _packed_forward(self, model, ids, mask, labels, compute_entropy):
        """Forward compacted rows packed several to a row (first-fit decreasing into rows as wide as the longest),
        each sequence with its own position ids from 0, so the model's attention is block-diagonal (transformers
        derives packed-sequence masks from position ids when no attention mask is given). With flash-attention
        kernels (variable-length sequences, no attention across or beyond them) everything goes into one row.
        Returns per-row outputs laid out as the compacted rows': ``(log_probs (b, W-1), entropy or None)``."""
        lengths = mask.sum(1).tolist()
        width = ids.size(1)
        capacity = sum(lengths) if _varlen_attention(model) else width
        bins = first_fit_decreasing(lengths, capacity)
        capacity = max(sum(lengths[i] for i in members) for members in bins)
        packed = ids.new_full((len(bins), capacity), 0)
        positions = torch.zeros_like(packed)
        packed_labels = torch.full_like(packed, -100)
        place = [(0, 0)] * len(lengths)  # row -> (bin, offset)
        for r, members in enumerate(bins):
            offset = 0
            for i in members:
                n = lengths[i]
                packed[r, offset : offset + n] = ids[i, :n]
                packed_labels[r, offset : offset + n] = labels[i, :n]
                positions[r, offset : offset + n] = torch.arange(n)
                place[i] = (r, offset)
                offset += n
            positions[r, offset:] = torch.arange(capacity - offset)  # the tail is a sequence of its own
        with self.accelerator.autocast():
            out = model(input_ids=packed, position_ids=positions, labels=packed_labels, fused_lm_head=True)
        rows = torch.tensor([r for r, _ in place], device=ids.device)
        cols = torch.tensor([o for _, o in place], device=ids.device).unsqueeze(1) + torch.arange(width - 1, device=ids.device)
        cols = cols.clamp(max=capacity - 2)  # (b, W-1): beyond a row's length the values are masked by the caller
        take = lambda t: t[rows.unsqueeze(1), cols]  # noqa: E731
        return take(out.log_probs), (take(out.entropy) if compute_entropy else None)

    def _share_prefix(self, model, input_ids, attention_mask, completion_width, keys: list[tuple]) -> bool:
        """Whether this micro-batch's rows go through :meth:`_shared_prefix_forward`: ``share_prompt_prefix`` is on,
        its one-time check (:meth:`_check_layouts`) passed and a prompt repeats in it (GRPO group members). Before
        the first training rollout a single process checks on this micro-batch; several processes wait for it."""
        if not self.args.share_prompt_prefix or self._sharing_checked is False or not _shares_prompts(keys):
            return False
        if self._sharing_checked is None and self.accelerator.num_processes == 1:
            if not _full_attention(self.accelerator.unwrap_model(model)):
                self._sharing_checked = False  # sliding-window / linear-attention layers: never shared
            else:
                error = self._sharing_error(model, input_ids, attention_mask, completion_width, keys)
                self._settle_layouts(None, error)
        return bool(self._sharing_checked)

    def _sharing_error(self, model, input_ids, attention_mask, completion_width,
                       keys: list[tuple]) -> tuple[float, float]:
        """The one-time check of ``share_prompt_prefix``: these rows scored both ways (no gradient, dropout off).
        Returns (mean absolute log-prob difference, tolerance); infinite where the model's attention does not run
        through transformers' AttentionInterface."""
        ids, mask, index, valid, is_completion = _compact_rows(input_ids, attention_mask, completion_width)
        labels = ids.masked_fill(~is_completion, -100)
        self._in_packing_check = True  # lets profilers tell this one-time pass from training
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                with self.accelerator.autocast():
                    plain = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs
                try:
                    shared, _ = self._shared_prefix_forward(
                        model, input_ids, attention_mask, completion_width, False, keys
                    )
                except _SharedAttentionUnused:
                    shared = None
        finally:
            self._in_packing_check = False
            model.train(was_training)
        plain = plain.gather(1, (index - 1).clamp(min=0))  # (b, C), as the compact path reads it
        half = bool(self.args.bf16 or self.args.fp16) or plain.dtype != torch.float32
        if not valid.any():
            return 0.0, 1.0
        err = float("inf") if shared is None else float((plain - shared)[valid].abs().mean())
        return err, (5e-2 if half else 1e-3)

    def _shared_prefix_forward(self, model, input_ids, attention_mask, completion_width, compute_entropy,
                               keys: list[tuple] | None = None):
        """Log-probs (and entropies) of the completion columns, (b, C), with each distinct prompt computed once.

        The micro-batch becomes one row without padding: for each distinct prompt, the prompt less its last token,
        then the suffixes ``[last prompt token, completion]`` of the rows that share it (the members of a GRPO
        group). Position ids continue each suffix from its prompt, and the attention (:func:`_shared_prompt_attention`,
        which the model's attention entry hands this forward to: :func:`_install_shared_prompt_attention`) lets a
        prompt attend to itself causally and a suffix to its prompt and to itself causally, segment by segment. Every real token sees the tokens it sees in the row-per-sequence
        forward, at the same positions, so log-probs and gradients are the same up to float error; a prompt's
        compute is divided by the rows sharing it and no padding is computed. Gradient checkpointing replays the
        same function. Raises :class:`_SharedAttentionUnused` if the model's layers did not call the attention.
        """
        device = input_ids.device
        prompt_width = input_ids.size(1) - completion_width
        prompt_mask = attention_mask[:, :prompt_width]  # (b, P) left-padded
        completion_len = attention_mask[:, prompt_width:].sum(1).tolist()  # (b,)
        keys = keys if keys is not None else _prompt_keys(input_ids[:, :prompt_width], prompt_mask)
        members: dict[tuple, list[int]] = defaultdict(list)
        for i, key in enumerate(keys):
            members[key].append(i)
        pieces, positions, labels, segments, start = [], [], [], [], [0] * len(keys)
        offset = 0
        for key, rows in members.items():
            prefix = torch.tensor(key[:-1], dtype=input_ids.dtype, device=device)
            n = len(prefix)
            pieces.append(prefix)
            positions.append(torch.arange(n, device=device))
            labels.append(torch.full((n,), -100, dtype=input_ids.dtype, device=device))
            segments.append((offset, offset + n, offset, offset))  # (query start, end, prefix start, end)
            prefix_span, offset = (offset, offset + n), offset + n
            for i in rows:
                m = completion_len[i] + 1
                suffix = input_ids[i, prompt_width - 1 : prompt_width + m - 1]
                pieces.append(suffix)
                positions.append(n + torch.arange(m, device=device))
                labels.append(torch.cat([suffix.new_full((1,), -100), suffix[1:]]))  # the prompt token is context
                segments.append((offset, offset + m, *prefix_span))
                start[i], offset = offset, offset + m
        row = torch.cat(pieces).unsqueeze(0)  # (1, L)
        plan = _SharedPromptPlan(segments)
        base = _unwrap(self.accelerator.unwrap_model(model))
        base = base.get_base_model() if hasattr(base, "get_base_model") else base
        _install_shared_prompt_attention(base.config.get_text_config()._attn_implementation)
        # a 4-D mask is taken as prepared by transformers' mask functions (no (L, L) mask is built); the attention
        # ignores it and uses the plan
        no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
        with self.accelerator.autocast():
            out = model(input_ids=row, attention_mask=no_mask, position_ids=torch.cat(positions).unsqueeze(0),
                        labels=torch.cat(labels).unsqueeze(0), fused_lm_head=True, shared_prompt_plan=plan)
        if plan.calls == 0:
            raise _SharedAttentionUnused
        # output column t scores row token t+1: completion token j of row i is scored at column start[i] + j
        cols = torch.tensor(start, device=device).unsqueeze(1) + torch.arange(completion_width, device=device)
        cols = cols.clamp(max=row.size(1) - 2)  # beyond a completion: masked by the caller
        lp = out.log_probs[0][cols]  # (b, C)
        ent = out.entropy[0][cols] if compute_entropy else None
        return lp, ent

    def _packing_ok(self, model, ids, mask, labels) -> bool:
        """Packing is used on micro-batches of two rows or more once its one-time check (:meth:`_check_layouts`) has
        passed on this model. Before the first training rollout a single process checks on this micro-batch (in
        training); several processes wait for it."""
        if mask.size(0) < 2:
            return False  # nothing to pack; and pi_old and the training pass must agree on every micro-batch
        if self._packing_checked is None and self.accelerator.num_processes == 1 and self.model.training:
            self._settle_layouts(self._packing_error(model, ids, mask, labels), None)
        return bool(self._packing_checked)

    def _packing_error(self, model, ids, mask, labels) -> tuple[float, float]:
        """The one-time check of ``pack_sequences``: compacted rows scored packed and unpacked (no gradient, dropout
        off). Returns (mean absolute log-prob difference, tolerance); a leaking mask changes log-probs by O(1)."""
        self._in_packing_check = True  # lets profilers tell this one-time pass from training
        was_training = model.training
        model.eval()  # both forwards without dropout (LoRA / attention dropout would differ between them)
        try:
            with torch.no_grad():
                with self.accelerator.autocast():
                    plain = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs
                packed, _ = self._packed_forward(model, ids, mask, labels, False)
        finally:
            self._in_packing_check = False
            model.train(was_training)
        scored = labels[:, 1:] != -100
        half = bool(self.args.bf16 or self.args.fp16) or plain.dtype != torch.float32
        if not scored.any():
            return 0.0, 1.0
        return float((plain - packed)[scored].abs().mean()), (5e-2 if half else 1e-3)

    # ------------------------------------------------------------------ loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("MultiTurnGRPOTrainer does not return outputs from compute_loss.")
        mode = "train" if self.model.training else "eval"
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (B, P+C)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # (B, P+C)
        mask = completion_mask * inputs["tool_mask"] if "tool_mask" in inputs else completion_mask  # (B, C)
        logps, _, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.size(1)
        )  # (B, C)
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old  # (B, C)
        global_norm = mode == "train" and "mb_num_sequences" in inputs  # normalizers summed over all ranks
        if global_norm:
            n_seq, n_tok = inputs["mb_num_sequences"], inputs["mb_num_tokens"]
        else:
            n_seq, n_tok = loss_normalizers(mask)
        advantages = inputs["advantages"]  # (B,) or (B, C)
        is_ratio = inputs.get("importance_sampling_ratio")  # (B, C) or (B, 1): TRL's vLLM correction, when on
        if is_ratio is not None:
            # max(-w A rho, -w A clip(rho)) = w max(-A rho, -A clip(rho)) for w >= 0: weighting a token's loss by the
            # truncated (or masked) importance ratio w is scaling its advantage by w.
            adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # (B, 1) or (B, C)
            advantages = (adv * is_ratio).expand_as(logps)  # (B, C)
        agg = self.args.loss_aggregation
        norm_constant = float(self.args.max_completion_length)
        loss, stats = policy_loss(
            logps,
            old,
            advantages,
            mask,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            aggregation=agg,
            global_num_sequences=n_seq,
            global_num_tokens=n_tok,
            norm_constant=norm_constant,
            delta=self.args.delta,
            importance_sampling_level=self.args.importance_sampling_level,
        )
        pg_part = loss.detach()
        if self.beta != 0.0:
            kl = kl_penalty(logps, inputs["ref_per_token_logps"], kind="low_var_kl")  # (B, C)
            if self.args.use_bias_correction_kl:  # TRL's default: the KL of pi, estimated on samples of pi_old
                kl = kl * torch.exp(log_importance_weights(logps, old, mask, self.args.importance_sampling_level))
            kl_loss = aggregate_loss(
                kl, mask, agg, global_num_sequences=n_seq, global_num_tokens=n_tok, norm_constant=norm_constant
            )
            loss = loss + self.beta * kl_loss
            self._step_accumulator["loss/kl"] += float(kl_loss.detach())
        sampling = inputs.get("sampling_per_token_logps")  # (B, C) the generator's log-probs, NaN where unknown
        if sampling is not None:
            gap_abs, gap_kl, gap_tokens = sampler_learner_gap(sampling, old, mask)
            self._step_accumulator["gap_abs_sum"] += float(gap_abs)
            self._step_accumulator["gap_kl_sum"] += float(gap_kl)
            self._step_accumulator["gap_tokens"] += float(gap_tokens)
        self._accumulate_step_stats(pg_part, stats, mode)
        if not global_norm:
            return loss  # evaluation: this process's own normalizers, so its own mean
        # DDP / DeepSpeed average gradients over ranks; the normalizers already span all ranks, so undo the average.
        return loss * self.accelerator.num_processes

    def _accumulate_step_stats(self, pg_part: torch.Tensor, stats: dict, mode: str) -> None:
        acc = self._step_accumulator
        ntok = float(stats["num_tokens"])
        acc["loss/pg_loss"] += float(pg_part)
        acc["tokens"] += ntok
        acc["clip_sum"] += float(stats["pg_clipfrac"]) * ntok
        acc["kl_sum"] += float(stats["ppo_kl"]) * ntok
        acc["ratio_sum"] += float(stats["ratio_mean"]) * ntok
        if ntok > 0:
            acc["ratio_min"] = min(acc.get("ratio_min", math.inf), float(stats["ratio_min"]))
            acc["ratio_max"] = max(acc.get("ratio_max", -math.inf), float(stats["ratio_max"]))
        if mode == "train" and not self.accelerator.sync_gradients:
            return  # more micro-batches of this mini-batch to come
        device = self.accelerator.device
        sums = torch.tensor(
            [acc["loss/pg_loss"], acc["tokens"], acc["clip_sum"], acc["kl_sum"], acc["ratio_sum"],
             acc.get("loss/kl", 0.0), acc.get("gap_abs_sum", 0.0), acc.get("gap_kl_sum", 0.0), acc.get("gap_tokens", 0.0)],
            dtype=torch.float64,
            device=device,
        )
        sums = self.accelerator.reduce(sums, reduction="sum")
        extrema = torch.tensor([-acc.get("ratio_min", math.inf), acc.get("ratio_max", -math.inf)], device=device)
        extrema = self.accelerator.reduce(extrema, reduction="max") if self.accelerator.num_processes > 1 else extrema
        tokens = max(float(sums[1]), 1.0)
        m = self._metrics[mode]
        m["loss/pg_loss"].append(float(sums[0]))
        m["loss/pg_clipfrac"].append(float(sums[2]) / tokens)
        m["loss/ppo_kl"].append(float(sums[3]) / tokens)
        m["loss/ratio_mean"].append(float(sums[4]) / tokens)
        m["loss/ratio_min"].append(float(-extrema[0]) if math.isfinite(float(extrema[0])) else 1.0)
        m["loss/ratio_max"].append(float(extrema[1]) if math.isfinite(float(extrema[1])) else 1.0)
        if self.beta != 0.0:
            m["loss/kl"].append(float(sums[5]))
        if float(sums[8]) > 0:  # sampler vs learner (pi_old) on the sampled tokens of this mini-batch
            m["rollout/sampler_logp_diff"].append(float(sums[6]) / float(sums[8]))
            m["rollout/sampler_kl"].append(float(sums[7]) / float(sums[8]))
        self._step_accumulator = defaultdict(float)


# ---------------------------------------------------------------------- helpers (pure)
def _check_vllm_logprobs(args) -> None:
    """vLLM returns log-probs after top-p / top-k filtering, renormalized over the kept tokens ("processed"), while
    the learner scores the unfiltered softmax: the importance-sampling correction would then be biased on every
    token. Refuse that combination, naming the fields."""
    top_p, top_k = args.top_p, args.top_k or 0
    if args.use_vllm and args.vllm_importance_sampling_correction and (top_p < 1.0 or top_k > 0):
        raise ValueError(
            f"use_vllm=True with top_p={top_p} and top_k={top_k}: vLLM's log-probs are renormalized after the "
            "filtering, the learner's are not, so vllm_importance_sampling_correction would be biased. Set top_p=1.0 "
            "and top_k=0, or vllm_importance_sampling_correction=False."
        )


def _check_sharded_generation(args, backend) -> None:
    """The Transformers generator makes as many forwards on a rank as that rank's own turns and tokens need, so the
    ranks make different numbers of them. A forward over sharded weights all-gathers them from every rank: FSDP (both
    versions), or ZeRO-3 without ``ds3_gather_for_generation``, would deadlock. ZeRO-3 with it gathers the whole
    model once around the rollout and removes the hooks (``unwrap_model_for_generation``), so every forward is local.
    """
    if args.use_vllm:
        return
    if backend.is_fsdp:
        raise ValueError(
            f"FSDP (fsdp_version={backend.fsdp_version}) with use_vllm=False: the Transformers generator makes a "
            "different number of forwards on each rank (turns end at different times), and every FSDP forward "
            "all-gathers the sharded weights from all ranks, so the rollout would deadlock. Set use_vllm=True, or "
            "train with DDP, ZeRO-2, or ZeRO-3 with ds3_gather_for_generation=True."
        )
    if backend.is_zero3 and not args.ds3_gather_for_generation:
        raise ValueError(
            "DeepSpeed ZeRO-3 with ds3_gather_for_generation=False and use_vllm=False: the Transformers generator "
            "makes a different number of forwards on each rank, and every ZeRO-3 forward gathers the sharded "
            "weights from all ranks, so the rollout would deadlock. Set ds3_gather_for_generation=True (the weights "
            "are gathered once around the rollout), or use_vllm=True."
        )


def _gather_list(accelerator, items: list) -> list:
    if accelerator.num_processes == 1:
        return list(items)
    from accelerate.utils import gather_object

    return gather_object(items)


def _nan_aware_group_advantages(rewards: torch.Tensor, group_size: int, scale: str, eps: float) -> torch.Tensor:
    """``group_advantages`` over the finite members of each group; dropped (NaN) rows get advantage 0."""
    return group_advantages(rewards, group_size, scale=scale, eps=eps, keep=torch.isfinite(rewards))


def _prompt_completion_contiguous(attention_mask: torch.Tensor, completion_width: int) -> bool:
    """True when every row's mask is ``[0* 1*]`` over the prompt columns and ``[1* 0*]`` over the completion's."""
    prompt = attention_mask[:, : attention_mask.size(1) - completion_width]  # (B, P)
    completion = attention_mask[:, attention_mask.size(1) - completion_width :]  # (B, C)
    return bool((prompt.diff(dim=1) >= 0).all() and (completion.diff(dim=1) <= 0).all())


def _compact_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_width: int):
    """Move each row's real tokens to the front: returns ``(ids (B, W), mask (B, W), index (B, C), valid (B, C),
    is_completion (B, W))`` where ``W`` is the longest row, ``index[i, j]`` the compact column of completion column
    ``j`` of row ``i``, ``valid`` whether that column is a real token and ``is_completion`` which compact columns are
    real completion tokens."""
    mask = attention_mask.to(torch.long)
    lengths = mask.sum(1)  # (B,)
    width = max(int(lengths.max()), 1)
    order = torch.argsort(1 - mask, dim=1, stable=True)  # real tokens first, in their order
    ids = input_ids.gather(1, order)[:, :width]  # (B, W)
    new_mask = mask.gather(1, order)[:, :width]  # (B, W)
    ids = ids.masked_fill(new_mask == 0, 0) if ids.numel() else ids
    position = mask.cumsum(1) - 1  # (B, L): compact column of every real token
    index = position[:, mask.size(1) - completion_width :].clamp(min=0, max=width - 1)  # (B, C)
    valid = mask[:, mask.size(1) - completion_width :].bool()  # (B, C)
    completion = torch.zeros_like(mask)
    completion[:, mask.size(1) - completion_width :] = 1
    is_completion = (completion.gather(1, order)[:, :width] * new_mask).bool()  # (B, W)
    return ids, new_mask, index, valid, is_completion


class _SharedAttentionUnused(RuntimeError):
    """The model's layers did not run the shared-prompt attention (their attention does not go through transformers'
    attention interface)."""


@dataclass
class _SharedPromptPlan:
    """The segments of a shared-prompt row: ``(query start, query end, prefix start, prefix end)``, in order and
    covering the row; a segment attends to the prefix span and to itself causally."""

    segments: list[tuple[int, int, int, int]]
    calls: int = 0


def _shared_prompt_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                             shared_prompt_plan: _SharedPromptPlan | None = None, **kwargs):
    """Attention of a shared-prompt row (see :meth:`MultiTurnGRPOTrainer._shared_prefix_forward`), one SDPA call per
    segment: query ``(1, H, L, D)``, key/value ``(1, H_kv, L, D)``; returns ``((1, L, H, D), None)`` as transformers'
    attention functions do."""
    if shared_prompt_plan is None:
        raise RuntimeError("the shared-prompt attention needs the shared_prompt_plan of its forward")
    shared_prompt_plan.calls += 1
    repeat = query.size(1) // key.size(1)
    outputs = []
    for q_start, q_end, p_start, p_end in shared_prompt_plan.segments:
        q = query[:, :, q_start:q_end]
        k = torch.cat([key[:, :, p_start:p_end], key[:, :, q_start:q_end]], dim=2)
        v = torch.cat([value[:, :, p_start:p_end], value[:, :, q_start:q_end]], dim=2)
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        if p_end == p_start:
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling)
        else:  # causal, aligned to the end: query i sees the prefix and suffix keys up to its own position
            lq, lk = q.size(2), k.size(2)
            mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling)
        outputs.append(o)
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def _install_shared_prompt_attention(implementation: str | None) -> None:
    """Wrap the model's attention function (transformers' ``AttentionInterface`` entry for ``implementation``) so that
    a forward called with ``shared_prompt_plan=`` runs :func:`_shared_prompt_attention`; every other call goes to the
    original function unchanged. Wrapping the entry (instead of switching the model's implementation for one forward)
    keeps gradient-checkpointing replays, which run during the backward pass, on the same function. Idempotent."""
    from transformers import AttentionInterface

    original = AttentionInterface._global_mapping.get(implementation or "eager")
    if original is None:  # "eager" is each model's own function, not an entry that can be wrapped
        raise _SharedAttentionUnused
    if getattr(original, "_shared_prompt_wrapper", False):
        return

    def attention(module, query, key, value, attention_mask, *args, shared_prompt_plan=None, **kwargs):
        if shared_prompt_plan is not None:
            return _shared_prompt_attention(module, query, key, value, attention_mask, *args,
                                            shared_prompt_plan=shared_prompt_plan, **kwargs)
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    attention._shared_prompt_wrapper = True
    AttentionInterface.register(implementation, attention)


def _full_attention(model) -> bool:
    """Whether every layer of ``model`` has full causal attention (no sliding-window or linear-attention layers)."""
    layer_types = getattr(model.config.get_text_config(), "layer_types", None) or []
    return all(t == "full_attention" for t in layer_types)


def _prompt_keys(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[tuple[int, ...]]:
    """Each row's real prompt tokens as a tuple (rows with equal tuples share their prompt)."""
    return [tuple(row[m.bool()].tolist()) for row, m in zip(prompt_ids, prompt_mask)]


def _unwrap(model):
    while hasattr(model, "module"):  # DDP / DeepSpeed wrappers
        model = model.module
    return model


def _varlen_attention(model) -> bool:
    """Whether the model's attention runs packed sequences as variable-length ones (flash-attention kernels)."""
    while hasattr(model, "module"):  # DDP / DeepSpeed wrappers
        model = model.module
    implementation = str(getattr(getattr(model, "config", None), "_attn_implementation", "") or "")
    return "flash" in implementation


def _tokens_processed(chunk: dict, compact: bool, pack: bool = False, share: bool = False) -> int:
    """Tokens one training forward of ``chunk`` computes, padding included."""
    return _chunk_tokens(chunk, compact, pack, share)[0]


def _chunk_tokens(chunk: dict, compact: bool, pack: bool = False, share: bool = False) -> tuple[int, int]:
    """``(processed, real)``: tokens the training forward of ``chunk`` computes, padding included, and how many of
    them are real tokens. With ``share``, a prompt repeated in the chunk is computed once (see
    :meth:`MultiTurnGRPOTrainer._shared_prefix_forward`)."""
    prompt_len, completion_len = chunk["prompt_mask"].sum(1), chunk["completion_mask"].sum(1)  # (B,)
    real = int(prompt_len.sum() + completion_len.sum())
    if not compact:
        return chunk["prompt_ids"].numel() + chunk["completion_ids"].numel(), real
    lengths = (prompt_len + completion_len).tolist()
    if not lengths:
        return 0, 0
    if share and not chunk.get("empty_micro_batch"):
        keys = _prompt_keys(chunk["prompt_ids"], chunk["prompt_mask"])
        if _shares_prompts(keys):
            cost = _shared_cost(keys, prompt_len.tolist(), completion_len.tolist(), range(len(keys)))
            return cost, cost  # one row, no padding
    rows = len(first_fit_decreasing(lengths, max(lengths))) if pack else len(lengths)
    return int(max(lengths)) * rows, real


def _shares_prompts(keys: list) -> bool:
    """Whether a micro-batch with these prompts goes through the shared-prompt forward."""
    return len(set(keys)) < len(keys) and min(len(k) for k in keys) >= 2


def _shared_cost(keys: list, prompt_len: list[int], completion_len: list[int], part) -> int:
    """Tokens the training forward of rows ``part`` computes. When a prompt repeats in it (shared-prompt forward,
    one row without padding): each distinct prompt once, less its last token, plus each row's ``[last prompt token,
    completion]``; otherwise rows x longest row."""
    part = list(part)
    if not _shares_prompts([keys[i] for i in part]):
        return len(part) * max(prompt_len[i] + completion_len[i] for i in part)
    distinct = {keys[i]: prompt_len[i] - 1 for i in part}
    return sum(distinct.values()) + sum(completion_len[i] + 1 for i in part)


def _rows(value, index: list[int]):
    if isinstance(value, torch.Tensor):
        return value[torch.tensor(index, dtype=torch.long, device=value.device)]
    return [value[i] for i in index]


def _take_rows(batch: dict, index: list[int], n: int, prompt_width: int, completion_width: int) -> dict:
    """The rows ``index`` of ``batch``, prompts cut to their last ``prompt_width`` columns (left padding) and the
    completion-wide (B, C) tensors to their first ``completion_width`` columns (right padding)."""
    width = batch["completion_ids"].size(1)
    chunk = {}
    for key, value in batch.items():
        if value is None or isinstance(value, torch.Tensor) and value.ndim == 0:
            chunk[key] = value
            continue
        if not isinstance(value, (torch.Tensor, list)) or len(value) != n:
            chunk[key] = value
            continue
        v = _rows(value, index)
        if isinstance(v, torch.Tensor) and key in ("prompt_ids", "prompt_mask"):
            v = v[:, v.size(1) - prompt_width :]
        elif isinstance(v, torch.Tensor) and v.ndim == 2 and v.size(1) == width:
            v = v[:, :completion_width]
        chunk[key] = v
    return chunk


def _empty_micro_batch(batch: dict, row: int, n: int) -> dict:
    """A micro-batch that carries no loss: one row cut to two real tokens (its last prompt token and first
    completion token, or its last two prompt tokens), the loss mask (``tool_mask``) all 0. Its forward/backward keeps
    the accumulation count and the DDP/DeepSpeed hooks as planned at ~no cost; a row without a loss token counts in
    no normalizer, so the mini-batch loss is unchanged."""
    has_completion = int(batch["completion_mask"][row].sum()) > 0
    chunk = _take_rows(batch, [row], n, 1 if has_completion else 2, 1)
    chunk["tool_mask"] = torch.zeros_like(chunk["tool_mask"])
    chunk["empty_micro_batch"] = True
    return chunk


def _token_budget_parts(lengths: list[int], budget: int, slots: int) -> list[list[int]] | None:
    """Rows sorted by length (longest first) and cut into the fewest consecutive micro-batches whose padded size
    (rows x longest row) fits ``budget`` (a row longer than the budget goes alone), and among those the one with the
    fewest tokens processed; similar lengths share a micro-batch, so little is padding. None when that takes more
    than ``slots`` micro-batches. Returns row indices per part, each sorted."""
    n = len(lengths)
    return _shared_budget_parts([(i,) for i in range(n)], [1] * n, [x - 1 for x in lengths], budget, slots)


def _shared_budget_parts(keys: list, prompt_len: list[int], completion_len: list[int], budget: int,
                         slots: int) -> list[list[int]] | None:
    """:func:`_token_budget_parts` where a micro-batch that repeats a prompt costs what the shared-prompt forward
    computes (:func:`_shared_cost`: each distinct prompt once, no padding). Rows are laid out in three orders (by
    length; by completion length; a prompt's rows together, longest completion first), each cut into the fewest
    consecutive parts within the budget with the fewest tokens among those (dynamic programming), and the best plan
    kept. None when it needs more than ``slots`` parts."""
    n = len(keys)
    by_prompt: dict[tuple, list[int]] = defaultdict(list)
    for i in range(n):
        by_prompt[keys[i]].append(i)
    groups = sorted(by_prompt.values(), key=lambda rows: (-max(prompt_len[i] + completion_len[i] for i in rows), rows[0]))
    orders = [sorted(range(n), key=lambda i: (-(prompt_len[i] + completion_len[i]), i))]
    if len(groups) < n:
        orders += [
            sorted(range(n), key=lambda i: (-completion_len[i], i)),
            [i for rows in groups for i in sorted(rows, key=lambda i: (-completion_len[i], i))],
        ]
    plans = []
    for order in orders:
        for parts in (_cheapest_cut(order, keys, prompt_len, completion_len, budget),
                      _greedy_cut(order, keys, prompt_len, completion_len, budget)):
            plans.append((len(parts), sum(_shared_cost(keys, prompt_len, completion_len, p) for p in parts), parts))
    count, _, parts = min(plans, key=lambda plan: plan[:2])
    return [sorted(p) for p in parts] if count <= slots else None


def _greedy_cut(order, keys, prompt_len, completion_len, budget) -> list[list[int]]:
    """Consecutive parts of ``order``, each as long as the budget allows (fewest parts for a length-sorted order)."""
    parts: list[list[int]] = []
    for i in order:
        if parts and _shared_cost(keys, prompt_len, completion_len, parts[-1] + [i]) <= budget:
            parts[-1].append(i)
        else:
            parts.append([i])
    return parts


#: the most rows a micro-batch gets from the cheapest-cut search (bounds its O(n * rows^2) cost; the greedy cut,
#: also a candidate, has no bound)
_MAX_SEARCH_ROWS = 64


def _cheapest_cut(order, keys, prompt_len, completion_len, budget) -> list[list[int]]:
    """Consecutive parts of ``order`` within ``budget`` (a row alone may exceed it): the fewest parts, and among them
    the fewest tokens processed, ``best[j] = min_i best[i] + (1, cost(order[i:j]))``. A part stops growing once its
    completion tokens (a lower bound of its cost) exceed the budget."""
    n = len(order)
    best = [(0, 0)] + [(math.inf, math.inf)] * n
    start = [0] * (n + 1)
    for i in range(n):
        floor = 0
        for j in range(i, min(n, i + _MAX_SEARCH_ROWS)):
            floor += completion_len[order[j]] + 1
            if j > i and floor > budget:
                break
            cost = _shared_cost(keys, prompt_len, completion_len, order[i : j + 1])
            if j > i and cost > budget:
                continue
            candidate = (best[i][0] + 1, best[i][1] + cost)
            if candidate < best[j + 1]:
                best[j + 1], start[j + 1] = candidate, i
    parts, j = [], n
    while j > 0:
        parts.append(list(order[start[j] : j]))
        j = start[j]
    return parts[::-1]


def _balanced_micro_batches(batch: dict, steps: int, accum: int, max_tokens: int | None = None,
                            share_prefix: bool = False) -> list[dict]:
    """Cut the rollout into ``steps`` micro-batches: consecutive mini-batches of equal size (whole groups kept by the
    shuffle), each dealt into ``accum`` micro-batches of balanced token counts and trimmed to their own padding.

    With ``share_prefix`` and no budget, equal consecutive slices (whole groups) replace the balanced dealing when
    the shared-prompt forward computes fewer tokens for them.

    With ``max_tokens`` (token-budget micro-batches, VeRL's ``use_dynamic_bsz``), each mini-batch is cut into the
    fewest length-sorted micro-batches whose padded size fits the budget (with ``share_prefix``, sized for the
    shared-prompt forward: :func:`_shared_budget_parts`); the remaining of its ``accum`` accumulation slots get an
    empty micro-batch (:func:`_empty_micro_batch`). When the budget would need more than ``accum`` micro-batches the
    mini-batch is cut into ``accum`` balanced ones instead (over budget; the caller warns).

    Trimming is exact: prompts are left-padded and completions right-padded, so dropping all-padding columns changes
    no logit of a real token. Per-token tensors (B, C) are trimmed with the completions.
    """
    n = batch["prompt_ids"].size(0)
    if n % steps != 0:
        raise ValueError(f"internal: rollout of {n} rows is not divisible into {steps} micro-batches")
    per_mini = n // (steps // accum)
    prompt_len = batch["prompt_mask"].sum(1)  # (B,)
    completion_len = batch["completion_mask"].sum(1)  # (B,)
    chunks = []
    for start in range(0, n, per_mini):
        rows = list(range(start, start + per_mini))
        lengths = [int(prompt_len[r] + completion_len[r]) for r in rows]
        if max_tokens and share_prefix:
            keys = _prompt_keys(batch["prompt_ids"][rows[0] : rows[-1] + 1], batch["prompt_mask"][rows[0] : rows[-1] + 1])
            p_len, c_len = [int(prompt_len[r]) for r in rows], [int(completion_len[r]) for r in rows]
            parts = _shared_budget_parts(keys, p_len, c_len, max_tokens, accum)
        else:
            parts = _token_budget_parts(lengths, max_tokens, accum) if max_tokens else None
        over_budget = bool(max_tokens) and parts is None
        if parts is None:
            parts = balanced_partition(lengths, accum)
            if share_prefix and not max_tokens:
                # groups are contiguous (shuffled whole): equal consecutive slices keep a group's rows together, and
                # the shared-prompt forward computes their prompt once and no padding; keep the cheaper plan
                keys = _prompt_keys(batch["prompt_ids"][start : start + per_mini], batch["prompt_mask"][start : start + per_mini])
                p_len, c_len = [int(prompt_len[r]) for r in rows], [int(completion_len[r]) for r in rows]
                size = per_mini // accum
                slices = [list(range(k * size, (k + 1) * size)) for k in range(accum)] if per_mini % accum == 0 else None
                cost = lambda plan: sum(_shared_cost(keys, p_len, c_len, part) for part in plan if part)  # noqa: E731
                if slices is not None and cost(slices) < cost(parts):
                    parts = slices
        for part in parts:
            index = [rows[i] for i in part]
            p_w = int(prompt_len[index].max())
            c_w = max(int(completion_len[index].max()), 1)
            chunk = _take_rows(batch, index, n, p_w, c_w)
            chunk["over_token_budget"] = over_budget
            chunks.append(chunk)
        shortest = rows[min(range(len(rows)), key=lambda i: (int(completion_len[rows[i]]) == 0, lengths[i]))]
        chunks.extend(_empty_micro_batch(batch, shortest, n) for _ in range(accum - len(parts)))
    return chunks


def _shuffle_groups(batch: dict, group_size: int) -> dict:
    """Permute whole GRPO groups (members stay together and in order) across the local rollout."""
    n = next(len(v) for v in batch.values() if isinstance(v, (list, torch.Tensor)) and getattr(v, "ndim", 1) > 0)
    if n % group_size != 0:
        perm = torch.randperm(n)  # groups are split across ranks: fall back to a plain shuffle
    else:
        order = torch.randperm(n // group_size)
        perm = (order.unsqueeze(1) * group_size + torch.arange(group_size)).reshape(-1)
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.ndim > 0 and value.size(0) == n:
            out[key] = value[perm.to(value.device)]
        elif isinstance(value, list) and len(value) == n:
            out[key] = [value[i] for i in perm.tolist()]
        else:
            out[key] = value
    return out
