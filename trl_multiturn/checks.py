"""What ``MultiTurnGRPOTrainer`` checks and resolves when it is built: its config, the environment factory and its
protocol, the datasets' columns, the reward functions, the model and the tokenizer (and, at the first rollout, what
``dynamic_sampling`` needs).

Each check raises with the offending value and the knob that fixes it, before any training starts.
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any, Callable

from .config import MultiTurnGRPOConfig, check_trl_fields
from .dynamic_sampling import stratum_quotas
from .protocols import ChatToolProtocol, Protocol, TagProtocol
from .templates import TemplateCheck, check_template_prefix
from .trl_compat import TRLEnvironmentAdapter, is_trl_environment

logger = logging.getLogger(__name__)


def check_args(args: MultiTurnGRPOConfig | None) -> MultiTurnGRPOConfig:
    """The trainer's config (a default one for None), checked again: a field may have changed since it was built."""
    if args is None:
        args = MultiTurnGRPOConfig("multiturn-grpo")
    if not isinstance(args, MultiTurnGRPOConfig):
        raise TypeError(
            f"args must be a MultiTurnGRPOConfig, got {type(args).__name__}. Build a MultiTurnGRPOConfig with the "
            "keyword arguments you gave GRPOConfig (it takes every GRPOConfig field)."
        )
    check_trl_fields(args)
    check_vllm_logprobs(args)
    return args


def check_vllm_logprobs(args) -> None:
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


def check_sharded_generation(args, backend) -> None:
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


def resolve_environment(environment_factory: Callable[[], Any] | None, protocol: Protocol | None, args,
                        datasets: dict[str, Any]) -> tuple[Callable[[], Any], Protocol, str]:
    """``(factory, protocol, environment name)``: a TRL-style environment class is wrapped in
    ``TRLEnvironmentAdapter`` (default protocol ``ChatToolProtocol``); this package's own contract defaults to the
    environment's ``protocol`` attribute, else ``TagProtocol``. The protocol is a copy configured with
    ``max_observation_tokens`` (the caller's stays as is). One probe environment is built to check that it has the
    methods it needs and that ``datasets`` (name -> dataset or None) have its ``required_columns``."""
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
    protocol = copy.copy(protocol)  # configured here and validated against the tokenizer: the caller's stays as is
    if args.max_observation_tokens is not None:
        protocol.max_observation_tokens = args.max_observation_tokens
    _check_columns(tuple(getattr(probe, "required_columns", ()) or ()), type(probe).__name__, datasets)
    close = getattr(probe, "close", None)
    if callable(close):
        close()
    return factory, protocol, type(probe).__name__


def _check_columns(required: tuple[str, ...], environment: str, datasets: dict[str, Any]) -> None:
    for name, dataset in datasets.items():
        columns = getattr(dataset, "column_names", None)
        if isinstance(columns, dict):  # DatasetDict
            columns = next(iter(columns.values()), [])
        missing = [c for c in required if c not in columns] if columns is not None else []
        if missing:
            raise ValueError(
                f"{name} lacks the column(s) {missing} that {environment} needs; it has {columns}. Rename or add them "
                "(e.g. dataset.rename_column(old, new))."
            )


def env_reward(completions, env_reward, **kwargs) -> list[float]:
    """Reward function exposing the sum of the environment's per-turn rewards (NaN for a failed trajectory)."""
    return [float(r) for r in env_reward]


def reward_functions(reward_funcs, args) -> tuple[list[Callable], MultiTurnGRPOConfig]:
    """The reward functions TRL gets, the user's then :func:`env_reward`, and the config with one weight more for the
    environment's reward (weight 1); a copy, so the caller's config can build another trainer."""
    funcs = [] if reward_funcs is None else (list(reward_funcs) if isinstance(reward_funcs, list) else [reward_funcs])
    if args.reward_weights is not None:
        if len(args.reward_weights) != len(funcs):
            raise ValueError(
                f"reward_weights has {len(args.reward_weights)} entries but {len(funcs)} reward_funcs were given; "
                "give one weight per reward function (the environment reward has weight 1)."
            )
        args = copy.copy(args)
        args.reward_weights = list(args.reward_weights) + [1.0]
    return funcs + [env_reward], args


def check_protocol(protocol: Protocol, tokenizer, template_check: str = "warn") -> None:
    """The protocol validated against the tokenizer, then the chat template's prefix property
    (:func:`~trl_multiturn.templates.check_template_prefix`; it applies to protocols that render turns through the
    template) as ``template_check`` says: 'warn', 'error' or 'off'. A protocol that refuses the template gets the
    template's first prefix break added to its error, which is often why it refuses (Qwen3's own template)."""
    try:
        protocol.validate(tokenizer)
    except ValueError as exc:
        found = _prefix_break(protocol, tokenizer) if template_check != "off" else None
        if found is None:
            raise
        raise ValueError(f"{exc}\n{found.explain()}") from exc
    if template_check == "off":
        return
    result = check_template_prefix(tokenizer, protocol)
    if result.keeps_prefix:
        return
    message = (
        f"{result.explain()}\nThe single-sequence layout trains turn {result.turn} and later on a context the deployed "
        "model will not see: deployed, it is given the template's rendering. Set turn_layout='per_turn' (each turn "
        "generated from and trained on its own context as the template renders it), or use a chat template that "
        "keeps earlier assistant turns as they were sampled, or set template_check='off' to silence this check."
    )
    if template_check == "error":
        raise ValueError(f"{message} (template_check='error'; 'warn' trains anyway.)")
    warnings.warn(message, stacklevel=3)


def _prefix_break(protocol: Protocol, tokenizer) -> TemplateCheck | None:
    """The template's first prefix break, or None where it keeps the property or cannot render the probe at all."""
    try:
        result = check_template_prefix(tokenizer, protocol)
    except Exception:  # diagnostic only: the protocol's own error is raised either way
        return None
    return None if result.keeps_prefix else result


def check_aux_loss(aux_loss_enabled: bool, model, router_aux_loss_coef: float) -> None:
    """No MoE auxiliary loss: TRL turns it on from the model's config, and this trainer does not add it."""
    if aux_loss_enabled:
        raise ValueError(
            f"{type(model).__name__} declares router_aux_loss_coef={router_aux_loss_coef} and returns router logits, "
            "but MultiTurnGRPOTrainer does not add the MoE load-balancing loss. Set router_aux_loss_coef=0.0 to train "
            "without it."
        )


def ensure_pad_token(tokenizer) -> None:
    """A tokenizer without a pad token pads with its EOS token (with a warning); with neither, an error."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("The tokenizer has neither a pad token nor an EOS token; set tokenizer.pad_token.")
        logger.warning("The tokenizer has no pad token; using its EOS token %r for padding.", tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token


def check_dynamic_sampling(rows: int, group_size: int, dataset) -> None:
    """``dynamic_sampling`` needs whole groups on every rank (``rows`` of them here) and refill prompts drawn by
    index from a map-style ``train_dataset``."""
    if rows % group_size:
        raise ValueError(
            f"dynamic_sampling needs whole groups on every rank, but a rank holds {rows} trajectories, not a multiple "
            f"of num_generations={group_size}. Make prompts_per_rollout a multiple of the number of processes."
        )
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ValueError(
            f"dynamic_sampling draws refill prompts by index, but train_dataset is a {type(dataset).__name__} "
            "without len()/indexing. Pass a map-style dataset or set dynamic_sampling=False."
        )


def dynamic_sampling_balance(args, dataset) -> tuple[list | None, dict | None]:
    """``dynamic_sampling_balance``, checked when the trainer is built: the column's value of every row of
    ``train_dataset`` and the groups each value keeps per rank and rollout (``stratum_quotas``); ``(None, None)``
    when it is not set. Refused without ``dynamic_sampling``, for a column the dataset lacks, and for groups per rank
    that the column's values do not divide."""
    column = args.dynamic_sampling_balance
    if column is None:
        return None, None
    if not args.dynamic_sampling:
        raise ValueError(
            f"dynamic_sampling_balance={column!r} balances the groups that dynamic sampling keeps, but "
            "dynamic_sampling=False. Set dynamic_sampling=True, or dynamic_sampling_balance=None."
        )
    rows = args.per_device_train_batch_size * args.steps_per_generation  # one rank's trajectories per rollout
    check_dynamic_sampling(rows, args.num_generations, dataset)
    columns = getattr(dataset, "column_names", None) or []
    if column not in columns:
        raise ValueError(
            f"dynamic_sampling_balance={column!r} is not a column of train_dataset, which has {columns}. Name one of "
            "its columns (e.g. 'hops'), or add it (dataset.add_column)."
        )
    values = list(dataset[column])
    return values, stratum_quotas(values, rows // args.num_generations, column)
