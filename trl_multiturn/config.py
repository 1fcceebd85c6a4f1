"""``MultiTurnGRPOConfig``: TRL's ``GRPOConfig`` plus only the fields multi-turn training adds.

Batch knobs in the terms of the theory (VeRL's): ``prompts_per_rollout`` (B), ``num_generations`` (G),
``mini_batch_size`` (trajectories per optimizer step, global), ``micro_batch_size`` (trajectories per device per
forward/backward) and ``ppo_epochs``. When they are given, ``__post_init__`` turns them into TRL's own fields
(``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``steps_per_generation``, ``num_iterations``)
through :class:`~trl_multiturn.batching.BatchPlan`, which checks every combination and names the knob to change.
(``TrainingArguments`` already owns a ``train_batch_size`` property, hence ``prompts_per_rollout``.)

Departure from TRL: the policy loss is aggregated by ``loss_aggregation`` (VeRL's modes, default the per-trajectory
N_g normalization "seq-mean-token-mean") with mini-batch-global normalizers; TRL's ``loss_type`` is not used by
this trainer. ``bf16`` defaults to False unless the machine supports it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from trl import GRPOConfig

from .batching import BatchPlan


def _bf16_supported() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


@dataclass
class MultiTurnGRPOConfig(GRPOConfig):
    r"""
    Configuration for [`MultiTurnGRPOTrainer`]: every field of TRL's `GRPOConfig`, plus the ones below.

    > Parameters that control the multi-turn rollout

    max_turns (`int`, defaults to `4`): maximum number of policy actions per trajectory.
    max_tokens_per_turn (`int` or `None`): cap on tokens sampled in one turn (default: no cap beyond the budget).
    max_observation_tokens (`int`, defaults to `512`): observations are cut to this many tokens with a marker.
    env_timeout (`float`, defaults to `30.0`): seconds an environment call may take before it counts as failed.
    raise_on_env_error (`bool`, defaults to `False`): raise instead of recording a failed environment call.
    on_long_prompt (`str`, defaults to `"error"`): a prompt that does not fit the model's context raises ("error")
        or is dropped from the rollout and counted ("skip").

    > Overridden default of GRPOConfig

    disable_dropout (`bool`, defaults to `True`; TRL: `False`): dropout off, so the ratio is exactly 1 on a fresh rollout.

    > Parameters that control the loss and the advantages

    loss_aggregation (`str`, defaults to `"seq-mean-token-mean"`): VeRL's `loss_agg_mode`.
    turn_advantage (`str`, defaults to `"trajectory"`): "trajectory", "mt-grpo" or "discounted".
    turn_advantage_gamma (`float`, defaults to `1.0`): discount for "discounted".
    turn_advantage_weight (`float`, defaults to `1.0`): weight of the turn-level term for "mt-grpo".
    advantage_eps (`float`, defaults to `1e-6`): epsilon in `(r - mean) / (std + eps)` (VeRL's value).

    > Parameters that control the batch plan (VeRL's knobs; all or none of the first three)

    prompts_per_rollout, mini_batch_size, micro_batch_size, ppo_epochs.
    """

    # > Overridden defaults of GRPOConfig
    disable_dropout: bool = field(
        default=True,
        metadata={
            "help": "Turn dropout off in the policy (TRL's default: False). On by default here so that on a fresh "
            "rollout the ratio is exactly 1 when pi_old is recomputed in a separate pass (several optimizer steps "
            "per rollout) and the one-time packing check compares like with like; LoRA dropout of an SFT adapter "
            "included."
        },
    )

    # > Parameters that control the multi-turn rollout
    max_turns: int = field(default=4, metadata={"help": "Maximum number of policy actions (turns) per trajectory."})
    max_tokens_per_turn: int | None = field(
        default=None,
        metadata={"help": "Cap on the tokens the policy may sample in one turn. None: only the overall budget."},
    )
    max_observation_tokens: int | None = field(
        default=512,
        metadata={"help": "Observations longer than this many tokens are truncated with a visible marker."},
    )
    env_timeout: float | None = field(
        default=30.0,
        metadata={"help": "Seconds an environment reset/step may take; past it the trajectory ends as failed."},
    )
    raise_on_env_error: bool = field(
        default=False,
        metadata={"help": "Raise on a failed environment call instead of recording it and dropping the trajectory."},
    )
    on_long_prompt: str = field(
        default="error",
        metadata={
            "help": "A prompt at least as long as the model's context: 'error' raises naming the example; 'skip' drops "
            "that trajectory from the loss and counts it in rollout/skipped_prompts."
        },
    )

    # > Parameters that control the loss and advantages
    loss_aggregation: str = field(
        default="seq-mean-token-mean",
        metadata={
            "help": "How per-token losses become the mini-batch loss (VeRL's loss_agg_mode): 'seq-mean-token-mean' "
            "(per-trajectory N_g normalization, default), 'token-mean', 'seq-mean-token-sum', "
            "'seq-mean-token-sum-norm'. TRL aliases: 'grpo', 'bnpo', 'dr_grpo'."
        },
    )
    turn_advantage: str = field(
        default="trajectory",
        metadata={"help": "Credit assignment: 'trajectory' (plain GRPO), 'mt-grpo' or 'discounted'."},
    )
    turn_advantage_gamma: float = field(
        default=1.0, metadata={"help": "Discount gamma of the per-turn return for turn_advantage='discounted'."}
    )
    turn_advantage_weight: float = field(
        default=1.0, metadata={"help": "Weight of the turn-level advantage term for 'mt-grpo' and 'discounted'."}
    )
    advantage_eps: float = field(
        default=1e-6, metadata={"help": "Epsilon in (r - mean_G) / (std_G + eps), as VeRL."}
    )

    balance_micro_batches: bool = field(
        default=True,
        metadata={
            "help": "Within each mini-batch, sort trajectories by length and cut them into the gradient-accumulation "
            "micro-batches with balanced padded sizes, each padded only to its own longest row (like VeRL's "
            "use_dynamic_bsz with a fixed micro-batch count). The loss is unchanged (mini-batch-global "
            "normalizers); less padding is computed."
        },
    )

    max_tokens_per_micro_batch: int | None = field(
        default=None,
        metadata={
            "help": "Token-budget micro-batches (VeRL's use_dynamic_bsz with ppo_max_token_len_per_gpu): cut each "
            "mini-batch into the fewest micro-batches whose size fits this budget (tokens per device per forward; "
            "a trajectory longer than the budget goes alone), and among those the fewest tokens. The size of a "
            "micro-batch is trajectories x longest prompt + completion, or, where share_prompt_prefix applies, its "
            "tokens without padding with each distinct prompt counted once. The "
            "accumulation slots of an optimizer step stay fixed (mini_batch_size / micro_batch_size per device; "
            "micro_batch_size defaults to 1 here, so there is a slot per trajectory) and the unused ones run an "
            "empty 2-token micro-batch. Short rollouts then take few, full forwards; the loss is unchanged "
            "(mini-batch-global normalizers). Needs balance_micro_batches. None: fixed micro_batch_size."
        },
    )

    compact_padding: bool = field(
        default=True,
        metadata={
            "help": "Lay out each training forward's rows as their real tokens, contiguous and right-padded (as wide "
            "as the longest sequence) instead of TRL's left-padded prompt + right-padded completion (as wide as the "
            "longest prompt plus the longest completion). Same log-probs up to float error for rotary position "
            "encodings; fewer padding tokens computed. Also used for the frozen old log-probs."
        },
    )

    pack_sequences: bool = field(
        default=True,
        metadata={
            "help": "With compact_padding: pack several short sequences into one row of the training forward "
            "(first-fit decreasing into rows as wide as the micro-batch's longest sequence), each with its own "
            "position ids, so attention stays within a sequence. Checked once per run on the first micro-batch "
            "against the unpacked forward; turned off with a warning on models whose attention ignores it."
        },
    )

    share_prompt_prefix: bool = field(
        default=True,
        metadata={
            "help": "With compact_padding: a training forward whose trajectories repeat a prompt (the members of a "
            "GRPO group) runs as one row without padding, each distinct prompt once followed by the completions "
            "that continue it; attention is computed segment by segment (a completion sees its prompt and itself) "
            "through transformers' AttentionInterface (sdpa, flash or flex attention, not 'eager'). Same log-probs "
            "and gradients up to float error, also under gradient checkpointing; a prompt's compute is divided by "
            "the trajectories sharing it. With max_tokens_per_micro_batch, a micro-batch's size is counted this way "
            "and the members of a group are kept together. Checked once per run against the plain forward; turned "
            "off with a warning where the model's attention has more than a causal mask."
        },
    )

    # > Parameters that control the batch plan
    prompts_per_rollout: int | None = field(
        default=None,
        metadata={"help": "B: prompts per rollout (VeRL data.train_batch_size). B*G trajectories share one old policy."},
    )
    mini_batch_size: int | None = field(
        default=None,
        metadata={"help": "Trajectories per optimizer step, over all devices (VeRL ppo_mini_batch_size * n)."},
    )
    micro_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Trajectories per device per forward/backward (VeRL ppo_micro_batch_size_per_gpu). With "
            "max_tokens_per_micro_batch it only sets the accumulation slots (mini_batch_size / micro_batch_size per "
            "device, the most micro-batches of an optimizer step); default 1 there."
        },
    )
    ppo_epochs: int | None = field(
        default=None, metadata={"help": "Passes over each rollout (VeRL ppo_epochs; TRL num_iterations)."}
    )

    def __post_init__(self):
        if self.bf16 is None:  # TRL defaults to bf16=True; only where the hardware supports it
            self.bf16 = _bf16_supported()

        from .advantages import VALID_TURN_ADVANTAGES
        from .loss import VALID_AGGREGATIONS

        if self.loss_aggregation not in VALID_AGGREGATIONS:
            raise ValueError(
                f"loss_aggregation={self.loss_aggregation!r} is not supported; choose one of {list(VALID_AGGREGATIONS)} "
                "(default 'seq-mean-token-mean')."
            )
        checks = (  # (field, valid?, what a valid value looks like)
            ("ppo_epochs", self.ppo_epochs is None or self.ppo_epochs >= 1, "an int >= 1, e.g. 1"),
            ("max_tokens_per_turn", self.max_tokens_per_turn is None or self.max_tokens_per_turn >= 1,
             "None (no cap) or an int >= 1"),
            ("max_observation_tokens", self.max_observation_tokens is None or self.max_observation_tokens >= 1,
             "None (no cap) or an int >= 1, e.g. 512"),
            ("env_timeout", self.env_timeout is None or self.env_timeout > 0, "None (no limit) or seconds > 0, e.g. 30.0"),
            ("turn_advantage_gamma", 0.0 <= self.turn_advantage_gamma <= 1.0, "a discount in [0, 1], e.g. 1.0"),
            ("turn_advantage_weight", math.isfinite(self.turn_advantage_weight), "a finite number, e.g. 1.0"),
            ("advantage_eps", self.advantage_eps >= 0 and math.isfinite(self.advantage_eps), "a number >= 0, e.g. 1e-6"),
            ("scale_rewards", self.scale_rewards in ("group", "batch", "none", True, False), "'group', 'batch' or 'none'"),
            ("on_long_prompt", self.on_long_prompt in ("error", "skip"), "'error' or 'skip'"),
        )
        for name, valid, alternative in checks:
            if not valid:
                raise ValueError(f"{name}={getattr(self, name)!r} is not valid; use {alternative}.")
        if self.turn_advantage not in VALID_TURN_ADVANTAGES:
            raise ValueError(
                f"turn_advantage={self.turn_advantage!r} is not supported; choose one of {list(VALID_TURN_ADVANTAGES)}."
            )
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1; got {self.max_turns}. Use max_turns=1 for single-turn tasks.")
        if self.max_completion_length is None or self.max_completion_length < 1:
            raise ValueError(
                f"max_completion_length must be a positive token budget; got {self.max_completion_length}."
            )
        if self.max_tokens_per_micro_batch is not None:
            budget = self.max_tokens_per_micro_batch
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
                raise ValueError(
                    f"max_tokens_per_micro_batch={budget!r} must be a positive int (tokens per device per forward), "
                    "e.g. 16384, or None for fixed-size micro-batches."
                )
            if not self.balance_micro_batches:
                raise ValueError(
                    "max_tokens_per_micro_batch needs balance_micro_batches=True (it is how micro-batches are cut); "
                    "got balance_micro_batches=False."
                )
            if self.micro_batch_size is None and self.mini_batch_size is not None:
                self.micro_batch_size = 1  # one accumulation slot per trajectory: the budget decides
        knobs = {
            "prompts_per_rollout": self.prompts_per_rollout,
            "mini_batch_size": self.mini_batch_size,
            "micro_batch_size": self.micro_batch_size,
        }
        given = [k for k, v in knobs.items() if v is not None]
        self.batch_plan = None
        if given:
            missing = [k for k, v in knobs.items() if v is None]
            if missing:
                raise ValueError(
                    f"The batch plan needs prompts_per_rollout, mini_batch_size and micro_batch_size together; got "
                    f"{', '.join(f'{k}={knobs[k]}' for k in given)} but not {', '.join(missing)}. Set the missing "
                    "ones, or none of them to use TRL's per_device_train_batch_size / gradient_accumulation_steps."
                )
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
            self.batch_plan = BatchPlan(
                train_batch_size=self.prompts_per_rollout,
                num_generations=self.num_generations,
                mini_batch_size=self.mini_batch_size,
                micro_batch_size=self.micro_batch_size,
                ppo_epochs=self.ppo_epochs or 1,
                world_size=world_size,
            )
            for key, value in self.batch_plan.trl_kwargs().items():
                setattr(self, key, value)
            self.generation_batch_size = None  # derived from steps_per_generation by GRPOConfig
        elif self.ppo_epochs is not None:
            self.num_iterations = self.ppo_epochs
        super().__post_init__()
        if self.batch_plan is not None and self.world_size != self.batch_plan.world_size:
            raise ValueError(
                f"The batch plan was computed for WORLD_SIZE={self.batch_plan.world_size} but the run has "
                f"world_size={self.world_size}. Launch with accelerate/torchrun so WORLD_SIZE is set; on a machine "
                "without GPUs also pass --use_cpu true (or set ACCELERATE_USE_CPU=true), without which accelerate "
                "leaves every process on its own."
            )
