"""``MultiTurnGRPOConfig``: TRL's ``GRPOConfig`` plus only the fields multi-turn training adds.

Batch knobs in the terms of the theory (VeRL's): ``prompts_per_rollout`` (B), ``num_generations`` (G),
``mini_batch_size`` (trajectories per optimizer step, global), ``micro_batch_size`` (trajectories per device per
forward/backward) and ``ppo_epochs``. When they are given, ``__post_init__`` turns them into TRL's own fields
(``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``steps_per_generation``, ``num_iterations``)
through :class:`~trl_multiturn.batching.BatchPlan`, which checks every combination and names the knob to change.
(``TrainingArguments`` already owns a ``train_batch_size`` property, hence ``prompts_per_rollout``.)

Departure from TRL: the policy loss is aggregated by ``loss_aggregation`` (VeRL's modes, default the per-trajectory
N_g normalization "seq-mean-token-mean") with mini-batch-global normalizers. TRL's ``loss_type``, when set, is mapped
onto it (:data:`LOSS_TYPE_AGGREGATION`; a ``loss_type`` and a ``loss_aggregation`` that disagree raise); left unset,
the project's default applies, not TRL's "dapo". ``bf16`` defaults to False unless the machine supports it.

Every field of ``GRPOConfig`` is either honored or refused: :data:`GRPO_FIELDS` says how this trainer treats each one
TRL adds, :data:`TRAINER_FIELDS` lists the ``TrainingArguments`` fields that transformers' ``Trainer`` applies, and
:func:`check_trl_fields` raises on a value this trainer would otherwise ignore (``__post_init__`` and the trainer's
constructor both call it).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from trl import GRPOConfig

from .activation_checkpointing import check_policy
from .batching import BatchPlan


def _bf16_supported() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


# ---------------------------------------------------------------------------------------------------------------------
# How MultiTurnGRPOTrainer treats every field of TRL's GRPOConfig (tests/test_config_fields.py walks them all).

HONORED, REFUSED = "honored", "refused"

#: The project's default aggregation (per-trajectory N_g normalization), used when neither field is set.
DEFAULT_AGGREGATION = "seq-mean-token-mean"

#: Each ``GRPOConfig`` field that is not a plain ``TrainingArguments`` field (plus the two ``TrainingArguments``
#: fields this trainer's loss bypasses): ``(HONORED, where / how)`` or ``(REFUSED, what to use instead)``. A refused
#: field raises at construction when it differs from TRL's default; :data:`_CONDITIONS` adds the honored fields that
#: are refused only for some values.
GRPO_FIELDS: dict[str, tuple[str, str]] = {
    # model loading
    "model_init_kwargs": (HONORED, "TRL's constructor loads a model given by name with them."),
    "trust_remote_code": (HONORED, "TRL's constructor (model loading, vLLM engine)."),
    "router_aux_loss_coef": (REFUSED, "the MoE load-balancing loss is not added by this trainer: leave it None or 0.0 "
                                      "on dense models; on a MoE model whose config declares a coefficient, set "
                                      "router_aux_loss_coef=0.0 to train without the auxiliary loss"),
    "disable_dropout": (HONORED, "TRL's constructor; default True here."),
    "cast_lm_head_to_fp32": (HONORED, "TRL's fused LM head, which every training forward of this trainer calls."),
    # generation
    "num_generations": (HONORED, "G, the group size (rollout and advantages)."),
    "num_generations_eval": (HONORED, "G of evaluation rollouts and advantages."),
    "max_completion_length": (HONORED, "the token budget of a whole trajectory (actions and observations)."),
    "ds3_gather_for_generation": (HONORED, "passed to unwrap_model_for_generation around the rollout; False is "
                                           "refused under ZeRO-3 with the Transformers generator"),
    "shuffle_dataset": (HONORED, "TRL's train sampler."),
    "pad_to_multiple_of": (REFUSED, "micro-batches are re-padded to their own width (balance_micro_batches, "
                                    "compact_padding); leave it 'auto' (None off Neuron)"),
    "generation_batch_size": (HONORED, "TRL's rollout size; must give whole optimizer steps (see "
                                       "steps_per_generation)."),
    "steps_per_generation": (HONORED, "micro-batches per device per rollout; a multiple of "
                                      "gradient_accumulation_steps."),
    "temperature": (HONORED, "sampling of every turn; log-probs under logits / temperature (fused LM head)."),
    "top_p": (HONORED, "nucleus filtering of every turn (both generators)."),
    "top_k": (HONORED, "top-k filtering of every turn (both generators)."),
    "min_p": (HONORED, "min-p filtering of every turn (Transformers generator; refused with use_vllm, whose log-probs "
                       "would be those of the filtered distribution)."),
    "generation_kwargs": (HONORED, "extra vLLM sampling parameters (use_vllm=True only)."),
    "chat_template_kwargs": (REFUSED, "the protocol renders prompts and observations itself; render the prompt "
                                      "text in the environment's reset() or configure the protocol"),
    "repetition_penalty": (REFUSED, "a penalized sampling distribution is not the policy the loss scores; leave it "
                                    "1.0"),
    "cache_implementation": (REFUSED, "the Transformers generator manages its own KV cache across turns; leave it "
                                      "None"),
    "use_vllm": (HONORED, "turns are sampled by TRL's vLLM engine (VLLMGenerator)."),
    "vllm_mode": (HONORED, "TRL's vLLM engine: 'colocate' or 'server'."),
    "vllm_model_impl": (HONORED, "TRL's vLLM engine."),
    "vllm_enable_sleep_mode": (REFUSED, "vLLM's KV cache would sleep between the turns of a rollout; leave it False"),
    "vllm_structured_outputs_regex": (REFUSED, "multi-turn actions are parsed by the protocol; leave it None"),
    "vllm_server_base_url": (HONORED, "TRL's vLLM client."),
    "vllm_server_host": (HONORED, "TRL's vLLM client."),
    "vllm_server_port": (HONORED, "TRL's vLLM client."),
    "vllm_server_timeout": (HONORED, "TRL's vLLM client."),
    "vllm_group_port": (HONORED, "TRL's vLLM weight sync."),
    "vllm_gpu_memory_utilization": (HONORED, "TRL's colocated vLLM engine."),
    "vllm_max_model_length": (HONORED, "TRL's colocated vLLM engine."),
    "vllm_tensor_parallel_size": (HONORED, "TRL's colocated vLLM engine; collectives of VLLMGenerator."),
    # loss
    "beta": (HONORED, "KL penalty to the reference model (k3), aggregated like the policy loss."),
    "num_iterations": (HONORED, "passes over each rollout (ppo_epochs)."),
    "epsilon": (HONORED, "eps_low of the clip range."),
    "delta": (HONORED, "two-sided clipping: the unclipped ratio is capped at delta (trl_multiturn.loss.policy_loss)."),
    "epsilon_high": (HONORED, "eps_high of the clip range."),
    "sapo_temperature_neg": (REFUSED, "only used by loss_type='sapo', which this trainer does not support"),
    "sapo_temperature_pos": (REFUSED, "only used by loss_type='sapo', which this trainer does not support"),
    "vespo_k_pos": (REFUSED, "only used by loss_type='vespo', which this trainer does not support"),
    "vespo_lambda_pos": (REFUSED, "only used by loss_type='vespo', which this trainer does not support"),
    "vespo_k_neg": (REFUSED, "only used by loss_type='vespo', which this trainer does not support"),
    "vespo_lambda_neg": (REFUSED, "only used by loss_type='vespo', which this trainer does not support"),
    "importance_sampling_level": (HONORED, "'token' or 'sequence' (GSPO) ratios in trl_multiturn.loss.policy_loss."),
    "reward_weights": (HONORED, "one weight per reward function; the environment reward gets weight 1."),
    "multi_objective_aggregation": (HONORED, "'sum_then_normalize' (weighted sum, then group advantages) only."),
    "scale_rewards": (HONORED, "advantage scale of this trainer's group advantages."),
    "loss_type": (HONORED, "mapped onto loss_aggregation (resolve_loss_aggregation)."),
    "mask_truncated_completions": (HONORED, "trajectories cut by a limit carry no loss (the rollout's truncation "
                                            "flag)."),
    "sync_ref_model": (HONORED, "TRL's reference-model sync callback."),
    "ref_model_mixup_alpha": (HONORED, "TRL's reference-model sync callback."),
    "ref_model_sync_steps": (HONORED, "TRL's reference-model sync callback."),
    "top_entropy_quantile": (REFUSED, "the loss is not masked by token entropy; leave it 1.0"),
    "entropy_coef": (REFUSED, "no entropy bonus is added to the loss; leave it 0.0"),
    "use_adaptive_entropy": (REFUSED, "no entropy bonus is added to the loss; leave it False"),
    "entropy_coef_min": (REFUSED, "only used by the adaptive entropy bonus, which this trainer does not add"),
    "entropy_coef_max": (REFUSED, "only used by the adaptive entropy bonus, which this trainer does not add"),
    "entropy_coef_delta": (REFUSED, "only used by the adaptive entropy bonus, which this trainer does not add"),
    "entropy_target": (REFUSED, "only used by the adaptive entropy bonus, which this trainer does not add"),
    "max_tool_calling_iterations": (REFUSED, "TRL's tool loop is not used; set max_turns"),
    "vllm_importance_sampling_correction": (HONORED, "TRL computes the ratio; compute_loss weights the advantages."),
    "vllm_importance_sampling_mode": (HONORED, "TRL's vLLM importance-sampling ratio."),
    "vllm_importance_sampling_clip_max": (HONORED, "TRL's vLLM importance-sampling ratio."),
    "vllm_importance_sampling_clip_min": (HONORED, "TRL's vLLM importance-sampling ratio."),
    "vllm_importance_sampling_cap": (HONORED, "deprecated alias of vllm_importance_sampling_clip_max (TRL)."),
    "off_policy_mask_threshold": (REFUSED, "off-policy sequence masking is not applied; leave it None"),
    "use_bias_correction_kl": (HONORED, "with beta != 0, the per-token KL is weighted by the importance ratio."),
    # logging
    "log_completions": (HONORED, "TRL's completion table."),
    "log_multimodal": (HONORED, "TRL's completion table."),
    "num_completions_to_print": (HONORED, "TRL's completion table."),
    "log_unique_prompts": (HONORED, "TRL's completion table."),
    "log_completions_hub_repo": (HONORED, "TRL's completion table."),
    # generation backends this trainer does not use
    "use_transformers_continuous_batching": (REFUSED, "the Transformers generator reuses each trajectory's KV cache "
                                                      "across turns; leave it False, or set use_vllm=True"),
    "transformers_continuous_batching_config": (REFUSED, "continuous batching is not used; leave it None"),
    "use_transformers_paged": (REFUSED, "continuous batching is not used; leave it False, or set use_vllm=True"),
    # TrainingArguments fields that transformers' Trainer applies in the compute_loss this trainer replaces
    "label_smoothing_factor": (REFUSED, "the policy loss has no label smoothing; leave it 0.0"),
    "average_tokens_across_devices": (REFUSED, "the loss normalizers always span every device; leave it True"),
}

#: ``TrainingArguments`` fields that transformers' ``Trainer`` (and TRL's constructor) apply as usual.
TRAINER_FIELDS = frozenset("""
    output_dir per_device_train_batch_size num_train_epochs max_steps learning_rate lr_scheduler_type
    lr_scheduler_kwargs warmup_steps optim optim_args weight_decay adam_beta1 adam_beta2 adam_epsilon
    optim_target_modules gradient_accumulation_steps max_grad_norm bf16 fp16 bf16_full_eval fp16_full_eval tf32
    activation_checkpointing activation_checkpointing_kwargs gradient_checkpointing gradient_checkpointing_kwargs
    torch_compile torch_compile_backend torch_compile_mode use_liger_kernel liger_kernel_config use_cache
    neftune_noise_alpha torch_empty_cache_steps auto_find_batch_size logging_strategy logging_steps logging_first_step
    log_on_each_node logging_nan_inf_filter include_num_input_tokens_seen log_level log_level_replica disable_tqdm
    report_to run_name project trackio_space_id trackio_bucket_id trackio_static_space_id eval_strategy eval_steps
    eval_delay per_device_eval_batch_size prediction_loss_only eval_on_start eval_do_concat_batches
    eval_use_gather_object eval_accumulation_steps include_for_metrics batch_eval_metrics save_only_model
    save_strategy save_steps save_on_each_node save_total_limit enable_jit_checkpoint push_to_hub hub_token
    hub_private_repo hub_model_id hub_strategy hub_always_push hub_revision load_best_model_at_end
    metric_for_best_model greater_is_better ignore_data_skip restore_callback_states_from_checkpoint
    full_determinism seed data_seed use_cpu accelerator_config parallelism_config dataloader_drop_last
    dataloader_num_workers dataloader_pin_memory dataloader_persistent_workers dataloader_prefetch_factor
    dataloader_multiprocessing_context dataloader_in_order remove_unused_columns label_names
    train_sampling_strategy length_column_name ddp_find_unused_parameters ddp_bucket_cap_mb ddp_broadcast_buffers
    ddp_static_graph ddp_backend ddp_timeout fsdp fsdp_config deepspeed debug skip_memory_metrics do_train do_eval
    do_predict resume_from_checkpoint local_rank
""".split())

#: Honored fields refused for some values: ``name -> (accepted(value, args), what to use instead)``.
_CONDITIONS = {
    "generation_kwargs": (lambda v, a: not v or a.use_vllm,
                          "only the vLLM generator takes extra sampling parameters; set use_vllm=True or leave it "
                          "None"),
    "multi_objective_aggregation": (lambda v, a: v == "sum_then_normalize",
                                    "advantages are computed from the weighted sum of the rewards; use "
                                    "'sum_then_normalize'"),
    "importance_sampling_level": (lambda v, a: v in ("token", "sequence"), "use 'token' or 'sequence'"),
    "router_aux_loss_coef": (lambda v, a: not v, GRPO_FIELDS["router_aux_loss_coef"][1]),
    "min_p": (lambda v, a: not v or (0.0 < v <= 1.0 and not a.use_vllm),
              "use a value in (0, 1] with the Transformers generator (use_vllm=False), or top_p / top_k"),
    "pad_to_multiple_of": (lambda v, a: v in (None, "auto"), GRPO_FIELDS["pad_to_multiple_of"][1]),
}


def _trl_default(name: str):
    from dataclasses import MISSING, fields

    f = next(f for f in fields(GRPOConfig) if f.name == name)
    return f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]


def resolve_loss_aggregation(loss_type: str | None, loss_aggregation: str | None) -> str:
    """The VeRL aggregation mode from TRL's ``loss_type`` and this config's ``loss_aggregation`` (either may be None).

    ``loss_type`` maps as ``trl_multiturn.loss.AGGREGATION_ALIASES`` ("grpo" -> "seq-mean-token-mean", "dr_grpo" ->
    "seq-mean-token-sum-norm", "dapo" and "bnpo" -> "token-mean"); with neither set, :data:`DEFAULT_AGGREGATION`.
    Raises when both are set and disagree, or for a TRL loss this trainer does not compute."""
    from .loss import AGGREGATION_ALIASES, canonical_aggregation

    aggregation = None if loss_aggregation is None else canonical_aggregation(loss_aggregation)
    if loss_type is None:
        return aggregation or DEFAULT_AGGREGATION
    if loss_type not in AGGREGATION_ALIASES:
        raise ValueError(
            f"loss_type={loss_type!r} is not supported by MultiTurnGRPOTrainer (its clipped loss is GRPO's); use one "
            f"of {sorted(AGGREGATION_ALIASES)}, or leave loss_type unset and choose loss_aggregation."
        )
    mapped = AGGREGATION_ALIASES[loss_type]
    if aggregation is not None and aggregation != mapped:
        raise ValueError(
            f"loss_type={loss_type!r} means loss_aggregation={mapped!r}, but loss_aggregation={loss_aggregation!r} was "
            "also set. Set only one of them (loss_aggregation is the one this trainer reads), or make them agree."
        )
    return mapped


def check_trl_fields(args) -> None:
    """Raise ValueError naming every field of ``args`` that this trainer would ignore (see :data:`GRPO_FIELDS`),
    a ``loss_type`` that disagrees with ``loss_aggregation``, and a rollout that does not hold whole optimizer steps
    (``steps_per_generation`` not a multiple of ``gradient_accumulation_steps``)."""
    problems = []
    for name, (status, alternative) in GRPO_FIELDS.items():
        value = getattr(args, name)
        if name in _CONDITIONS:
            accepted, alternative = _CONDITIONS[name]
            ok = accepted(value, args)
        else:
            ok = status == HONORED or value == _trl_default(name)
        if not ok:
            problems.append(f"{name}={value!r} is not supported by MultiTurnGRPOTrainer: {alternative}.")
    if problems:
        raise ValueError(" ".join(problems))
    resolve_loss_aggregation(args.loss_type, args.loss_aggregation)  # raises on a disagreeing pair
    steps, accum = args.steps_per_generation, args.gradient_accumulation_steps
    if steps is not None and steps % accum != 0:
        good = max(1, round(steps / accum)) * accum
        raise ValueError(
            f"steps_per_generation={steps} (generation_batch_size={args.generation_batch_size}) is not a multiple "
            f"of gradient_accumulation_steps={accum}: a "
            "rollout must hold whole optimizer steps, since each optimizer step's loss is normalized over its own "
            f"mini-batch. Set steps_per_generation to a multiple of {accum} (e.g. {good}, generation_batch_size = "
            f"{good} x per_device_train_batch_size x processes), leave both unset (one optimizer step per rollout), "
            "or give prompts_per_rollout / mini_batch_size / micro_batch_size."
        )


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
    template_check (`str`, defaults to `"warn"`): when the chat template does not keep turn k a prefix of turn k+1,
        warn ("warn"), raise ("error") or skip the check ("off").
    turn_layout (`str`, defaults to `"sequence"`): one training row per trajectory ("sequence") or one per turn, each
        generated from and trained on its own rendered context ("per_turn").
    keep_last_observations (`int` or `None`): per-turn context policy: observations older than the last N are
        replaced by a placeholder. Needs `turn_layout="per_turn"`.
    truncate_observations (`int` or `None`): per-turn context policy: observations but the latest are cut to M
        tokens. Needs `turn_layout="per_turn"`.

    > Overridden default of GRPOConfig

    disable_dropout (`bool`, defaults to `True`; TRL: `False`): dropout off, so the ratio is exactly 1 on a fresh rollout.

    > Parameters that control the loss and the advantages

    loss_aggregation (`str` or `None`): VeRL's `loss_agg_mode`; None: from `loss_type` when set, else
        `"seq-mean-token-mean"`.
    loss_type (`str` or `None`; TRL: `"dapo"`): TRL's name of the aggregation, mapped onto `loss_aggregation`.
    turn_advantage (`str`, defaults to `"trajectory"`): "trajectory", "mt-grpo" or "discounted".
    turn_advantage_gamma (`float`, defaults to `1.0`): discount for "discounted".
    turn_advantage_weight (`float`, defaults to `1.0`): weight of the turn-level term for "mt-grpo".
    turn_reward_gate (`str`, defaults to `"none"`): "finished" zeroes the positive per-turn rewards of trajectories
        that did not answer (out of turns or tokens); negative ones (costs) stay.
    advantage_eps (`float`, defaults to `1e-6`): epsilon in `(r - mean) / (std + eps)` (VeRL's value).
    greedy_baseline (`bool`, defaults to `False`): each group's first rollout is decoded greedily, not trained, and
        is the baseline of the others (ReMax / self-critical).
    expert_loss_coef (`float`, defaults to `0.0`): weight of a teacher-forced NLL on expert trajectories added to the
        GRPO loss (InstructGPT's PPO-ptx); needs the trainer's `expert_dataset`.
    expert_micro_batch_size (`int`, defaults to `2`): expert examples per training micro-batch.

    > Parameters that control dynamic sampling (DAPO)

    dynamic_sampling (`bool`, defaults to `False`): drop groups without reward variance and refill the rollout.
    max_dynamic_sampling_rounds (`int`, defaults to `4`): the most refill rounds per rollout.
    dynamic_sampling_balance (`str` or `None`, defaults to `None`): a train_dataset column whose values keep equal
        numbers of groups.

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
    rollout_max_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Transformers generator: at most this many trajectories decode together; the others wait in a "
            "queue and join as running ones finish or wait on their environment. The K/V cache of a rollout grows "
            "with the rows decoding together, so this bounds its memory (a rollout of B*G trajectories otherwise "
            "decodes them all at once). Sampled tokens do not depend on it (every trajectory samples from its own "
            "seeded generator). None: no limit. Refused with use_vllm (set vLLM's own limits there)."
        },
    )
    rollout_merge_adapter: bool = field(
        default=False,
        metadata={
            "help": "Transformers generator: sample with the LoRA adapter folded into a copy of each adapted weight "
            "(W + dW, one matmul per layer instead of three), the original weights put back after each rollout, bit "
            "for bit. Meant for GPUs, where an unmerged adapter multiplies a decode step's kernel launches (measured on 2 CPU "
            "cores: no gain). Costs one more copy of the adapted weights during the rollout; the sampler's "
            "log-probs move by float rounding (the learner recomputes its own). Skipped (the adapter runs as is) for "
            "quantized bases, DoRA and non-LoRA models. Refused with use_vllm (vLLM gets merged weights already) and "
            "FSDP (sharded weights)."
        },
    )
    activation_checkpointing_policy: str = field(
        default="full",
        metadata={
            "help": "What gradient checkpointing keeps for the backward pass. 'full' (transformers' behaviour): each "
            "decoder layer's input, the layer's whole forward recomputed in the backward. 'save_matmuls': the outputs of "
            "the layer's full-rank matrix multiplications and fused attention are kept and only the cheap ops (norms, "
            "activations, rotary embeddings, adapter products) are recomputed: the same gradients, most of the "
            "recompute saved, more memory per token than 'full' and less than no checkpointing (docs/benchmarks.md). "
            "Needs gradient_checkpointing=True and non-reentrant checkpointing."
        },
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
    template_check: str = field(
        default="warn",
        metadata={
            "help": "At construction, for protocols that render turns through the chat template (ChatToolProtocol): "
            "render a probe conversation and check that each turn's context, as the trainer builds it (one sequence "
            "per trajectory), is what the template renders for the same messages, i.e. that turn k is a token prefix "
            "of turn k+1. Thinking templates that drop earlier <think> blocks break it, and the model is then trained "
            "on contexts it will not see deployed. 'warn' (default) warns naming the first difference; 'error' "
            "raises; 'off' skips the check."
        },
    )

    turn_layout: str = field(
        default="sequence",
        metadata={
            "help": "'sequence' (default): a trajectory is one token sequence, each turn generated from the whole "
            "sequence so far, and trained as one row; exact when the template keeps turn k a prefix of turn k+1 "
            "(Search-R1's inline tags, ChatML). 'per_turn': each turn is generated from the conversation rendered as "
            "the deployed model sees it (the chat template, after keep_last_observations / truncate_observations or "
            "the trainer's context_fn) and trained as its own row, the context as prompt and the sampled ids as "
            "completion; a trajectory keeps its weight in the loss whatever the number of rows (N_g counts its tokens "
            "over all its rows). For thinking templates that drop earlier <think> blocks, and for context management."
        },
    )
    keep_last_observations: int | None = field(
        default=None,
        metadata={
            "help": "Context policy of turn_layout='per_turn': the observations older than the last N are replaced "
            "by a short placeholder in the next turn's context (trl_multiturn.context.keep_last_observations). None: off."
        },
    )
    truncate_observations: int | None = field(
        default=None,
        metadata={
            "help": "Context policy of turn_layout='per_turn': every observation but the latest is cut to this many "
            "tokens, with a visible marker, in the next turn's context (trl_multiturn.context.truncate_observations). "
            "None: off."
        },
    )

    # > Parameters that control the loss and advantages
    loss_aggregation: str | None = field(
        default=None,
        metadata={
            "help": "How per-token losses become the mini-batch loss (VeRL's loss_agg_mode): 'seq-mean-token-mean' "
            "(per-trajectory N_g normalization), 'token-mean', 'seq-mean-token-sum', 'seq-mean-token-sum-norm'. "
            "TRL aliases: 'grpo', 'bnpo', 'dapo', 'dr_grpo'. None (default): from loss_type when that is set, else "
            "'seq-mean-token-mean'. Normalizers always span the whole mini-batch (all micro-batches and devices)."
        },
    )
    loss_type: str | None = field(
        default=None,
        metadata={
            "help": "TRL's name of the loss (TRL's default: 'dapo'), mapped onto loss_aggregation: 'grpo' -> "
            "'seq-mean-token-mean', 'dr_grpo' -> 'seq-mean-token-sum-norm' (divided by max_completion_length), "
            "'dapo' and 'bnpo' -> 'token-mean'. None (default): not set, loss_aggregation decides (project default "
            "'seq-mean-token-mean', not TRL's 'dapo'). Setting both to disagreeing values raises; 'cispo', 'sapo', "
            "'vespo' and 'luspo' are refused."
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
    turn_reward_gate: str = field(
        default="none",
        metadata={
            "help": "'none' or 'finished': with 'finished', the environment's positive per-turn rewards of a "
            "trajectory that did not end by answering (or by the environment's done), i.e. ran out of turns or "
            "tokens, are set to 0 before rewards and advantages are computed; negative ones (costs) are kept. A "
            "shaping reward (e.g. a retrieval hit) then never pays a trajectory that produced no answer, and a cost "
            "(e.g. a redundant search) cannot be shed by never answering."
        },
    )
    advantage_eps: float = field(
        default=1e-6, metadata={"help": "Epsilon in (r - mean_G) / (std_G + eps), as VeRL."}
    )
    greedy_baseline: bool = field(
        default=False,
        metadata={
            "help": "Decode the first of each group's num_generations rollouts greedily and use its reward as the "
            "baseline of the other G - 1 (ReMax, self-critical sequence training): A_i = (r_i - r_greedy) / "
            "(std_G + eps), std over all G rewards under scale_rewards='group'. The greedy rollout is not trained "
            "(loss mask 0; it still counts in dynamic sampling's reward variance). A group whose samples all succeed "
            "where the greedy decode fails then carries signal, so a policy evaluated greedily is paid for its "
            "greedy mistakes. Logged: rollout/greedy_reward, rollout/sampled_reward, "
            "rollout/greedy_below_samples_frac. Needs num_generations >= 2, turn_advantage='trajectory', "
            "turn_layout='sequence' and the Transformers generator (use_vllm=False)."
        },
    )

    expert_loss_coef: float = field(
        default=0.0,
        metadata={
            "help": "Add c * L_expert to the GRPO loss, L_expert the teacher-forced negative log-likelihood of expert "
            "trajectories on their action tokens (observation tokens masked, the warm start's loss), as InstructGPT's "
            "PPO-ptx adds its pretraining loss: it holds behaviour that no group's reward variance pays for. Each "
            "training micro-batch adds the token mean over expert_micro_batch_size examples of the trainer's "
            "expert_dataset (trl_multiturn.sft.sft_dataset), divided by the accumulation steps. Logged: "
            "loss/expert_nll. 0: off (an expert_dataset is then refused). One process or DDP; refused under "
            "DeepSpeed and FSDP."
        },
    )
    expert_micro_batch_size: int = field(
        default=2, metadata={"help": "Expert examples per training micro-batch when expert_loss_coef > 0."}
    )
    balance_micro_batches: bool = field(
        default=True,
        metadata={
            "help": "Within each mini-batch, sort trajectories by length and cut them into the gradient-accumulation "
            "micro-batches with balanced padded sizes, each padded only to its own longest row (like VeRL's "
            "use_dynamic_bsz with a fixed micro-batch count). The loss is unchanged (mini-batch-global "
            "normalizers); less padding is computed. Rows that carry no loss token (a greedy baseline's member, dropped "
            "trajectories, dynamic sampling's filler groups) are left out of the micro-batches: not computed."
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
            "position ids, so attention stays within a sequence. Checked once per run, on every process at the "
            "first training rollout, against the unpacked forward (one verdict for all processes); turned off with "
            "a warning on models whose attention ignores it."
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

    # > Parameters that control dynamic sampling
    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "DAPO's over-sample and filter: drop the groups whose rewards are all equal (they have advantage "
            "0 and carry no gradient) and roll out more prompts, drawn from the training set, until the rollout holds "
            "prompts_per_rollout groups with reward variance (see max_dynamic_sampling_rounds). Needs a map-style "
            "train_dataset and whole groups on every rank."
        },
    )
    max_dynamic_sampling_rounds: int = field(
        default=4,
        metadata={
            "help": "With dynamic_sampling: the most refill rounds per rollout, each rolling out at most one "
            "rollout's prompts, so a rollout samples at most (1 + this) x prompts_per_rollout prompts. When the cap "
            "is hit, the missing places are filled with dropped groups whose loss mask is 0: the loss and its "
            "normalizers are those of the kept trajectories."
        },
    )
    dynamic_sampling_balance: str | None = field(
        default=None,
        metadata={
            "help": "With dynamic_sampling: the name of a train_dataset column (e.g. 'hops'). Each rollout keeps the "
            "same number of groups with reward variance for every value of that column (the groups per device, "
            "prompts_per_rollout / processes, must be a multiple of the number of values); refill rounds draw "
            "prompts only from the rows whose value still misses groups, and groups with signal of a value already "
            "full are surplus. Logged as rollout/dynamic_sampling/kept_<column>_<value>. None: groups are kept "
            "whatever their column values."
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

        if self.loss_aggregation is not None and self.loss_aggregation not in VALID_AGGREGATIONS:
            raise ValueError(
                f"loss_aggregation={self.loss_aggregation!r} is not supported; choose one of {list(VALID_AGGREGATIONS)} "
                "(default 'seq-mean-token-mean')."
            )
        self.loss_aggregation = resolve_loss_aggregation(self.loss_type, self.loss_aggregation)
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
            ("template_check", self.template_check in ("warn", "error", "off"), "'warn', 'error' or 'off'"),
            ("turn_layout", self.turn_layout in ("sequence", "per_turn"), "'sequence' (default) or 'per_turn'"),
            ("turn_reward_gate", self.turn_reward_gate in ("none", "finished"), "'none' (default) or 'finished'"),
            ("keep_last_observations", self.keep_last_observations is None or self.keep_last_observations >= 0,
             "None (off) or an int >= 0, e.g. 2"),
            ("truncate_observations", self.truncate_observations is None or self.truncate_observations >= 1,
             "None (off) or an int >= 1 (tokens), e.g. 64"),
            ("max_dynamic_sampling_rounds", isinstance(self.max_dynamic_sampling_rounds, int)
             and self.max_dynamic_sampling_rounds >= 0, "an int >= 0, e.g. 4 (0: no refill; groups without signal still leave the loss)"),
        )
        for name, valid, alternative in checks:
            if not valid:
                raise ValueError(f"{name}={getattr(self, name)!r} is not valid; use {alternative}.")
        if self.turn_advantage not in VALID_TURN_ADVANTAGES:
            raise ValueError(
                f"turn_advantage={self.turn_advantage!r} is not supported; choose one of {list(VALID_TURN_ADVANTAGES)}."
            )
        self._check_turn_layout()
        self._check_greedy_baseline()
        if not self.expert_loss_coef >= 0.0:  # NaN too
            raise ValueError(f"expert_loss_coef must be >= 0 (0 turns the expert loss off); got {self.expert_loss_coef}.")
        if self.expert_micro_batch_size < 1:
            raise ValueError(f"expert_micro_batch_size must be >= 1; got {self.expert_micro_batch_size}.")
        if self.rollout_max_batch_size is not None:
            if self.rollout_max_batch_size < 1:
                raise ValueError(f"rollout_max_batch_size must be >= 1 or None; got {self.rollout_max_batch_size}.")
            if self.use_vllm:
                raise ValueError(
                    f"rollout_max_batch_size={self.rollout_max_batch_size} limits the Transformers generator only; "
                    "with use_vllm=True leave it None and bound vLLM's batch through its own settings."
                )
        if self.rollout_merge_adapter and (self.use_vllm or self.fsdp):
            raise ValueError(
                f"rollout_merge_adapter=True folds LoRA into the Transformers generator's weights; with "
                f"{'use_vllm=True (vLLM already samples with merged weights)' if self.use_vllm else 'FSDP (its weights are sharded)'} "
                "leave it False."
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
        check_trl_fields(self)
        check_policy(self)  # after TrainingArguments resolved activation_checkpointing / gradient_checkpointing

    def _check_greedy_baseline(self) -> None:
        """Refuse what ``greedy_baseline`` cannot honour, naming the setting to change."""
        if not self.greedy_baseline:
            return
        problems = [
            (self.num_generations is not None and self.num_generations < 2,
             f"num_generations={self.num_generations} leaves no sampled rollout next to the greedy one; use >= 2"),
            (self.turn_advantage != "trajectory",
             f"turn_advantage={self.turn_advantage!r}: the greedy baseline is a trajectory-level one; use 'trajectory'"),
            (self.turn_layout != "sequence", f"turn_layout={self.turn_layout!r}: use 'sequence'"),
            (self.use_vllm, "use_vllm=True samples every row of a batch alike; use the Transformers generator"),
        ]
        found = [text for bad, text in problems if bad]
        if found:
            raise ValueError(
                f"greedy_baseline=True cannot be honoured: {'; '.join(found)} (or set greedy_baseline=False).")

    def _check_turn_layout(self) -> None:
        """Refuse what the per-turn layout cannot honour, and context policies without it."""
        policies = [k for k in ("keep_last_observations", "truncate_observations") if getattr(self, k) is not None]
        if policies and self.turn_layout != "per_turn":
            raise ValueError(
                f"{', '.join(f'{k}={getattr(self, k)}' for k in policies)} changes what each turn sees, which only "
                "the per-turn layout trains exactly; set turn_layout='per_turn' (got turn_layout="
                f"{self.turn_layout!r})."
            )
        if self.turn_layout != "per_turn":
            return
        if self.importance_sampling_level == "sequence":
            raise ValueError(
                "importance_sampling_level='sequence' (GSPO: one ratio per trajectory) is not supported with "
                "turn_layout='per_turn', where a trajectory is several rows; use importance_sampling_level='token' "
                "or turn_layout='sequence'."
            )
        if not self.balance_micro_batches:
            raise ValueError(
                "turn_layout='per_turn' cuts mini-batches by trajectory, which the balanced planner does; set "
                "balance_micro_batches=True (got False)."
            )
