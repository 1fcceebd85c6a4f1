"""Activation checkpointing as configured, through every rollout, and a policy that recomputes less.

Two things, both about the decoder layers that ``activation_checkpointing`` (``gradient_checkpointing``) wraps:

* **The configuration survives the rollouts.** transformers' ``Trainer.train`` reads ``every_n_layers`` and
  ``offload`` out of ``activation_checkpointing_kwargs`` and passes the rest to ``torch.utils.checkpoint``. A GRPO
  step turns checkpointing off around the rollout and the log-prob passes and back on with the raw dict (TRL's
  ``unwrap_model_for_generation`` / ``disable_gradient_checkpointing``): from the first rollout on, every layer was
  checkpointed again and the two keys reached the layers' forward, which ignores unknown keyword arguments.
  :func:`checkpointing_suspended` turns it off for the whole rollout stage and back on exactly as configured.

* **``activation_checkpointing_policy="save_matmuls"``.** Full checkpointing keeps only each layer's input and
  recomputes the layer's whole forward in the backward pass: with frozen base weights (LoRA) that recompute is
  about a third of a training step's compute. The policy keeps the outputs of the layer's full-rank matrix
  multiplications (the projections) and of fused attention, and recomputes only what is cheap: norms, activation
  functions, rotary embeddings, residual adds, dropout, the low-rank adapter products. Gradients are the same
  (recomputing an op on the same inputs gives the same values); memory per token sits between full checkpointing
  and none (measured in docs/benchmarks.md). It uses torch's selective activation checkpointing
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``), which needs non-reentrant checkpointing.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager

import torch

POLICIES = ("full", "save_matmuls")

#: keys of ``activation_checkpointing_kwargs`` that transformers applies per layer instead of passing to torch
LAYER_KEYS = ("every_n_layers", "offload")

#: a matrix product with an inner or outer dimension at most this is "low rank" (LoRA's A and B products): its output
#: is recomputed, not kept (cheap to redo, and the B product's output is as large as the projection's)
LOW_RANK = 64


def _matmul_ops() -> frozenset:
    aten = torch.ops.aten
    return frozenset(getattr(aten, name).default for name in ("mm", "addmm") if hasattr(aten, name))


def _attention_ops() -> frozenset:
    names = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    return frozenset(getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name))


def _full_rank(op, args) -> bool:
    """Whether a (add)mm call multiplies two matrices of more than :data:`LOW_RANK` rows and columns."""
    a, b = (args[1], args[2]) if len(args) >= 3 else (args[0], args[1])  # addmm(bias, a, b) / mm(a, b)
    return min(a.shape[-1], b.shape[-1]) > LOW_RANK


_MATMUL_OPS, _ATTENTION_OPS = _matmul_ops(), _attention_ops()


def save_matmuls_policy(ctx, op, *args, **kwargs):
    """Selective-checkpointing policy: keep full-rank matmul and fused-attention outputs, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    if op in _ATTENTION_OPS or (op in _MATMUL_OPS and _full_rank(op, args)):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _save_matmuls_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(save_matmuls_policy)


def checkpointing_options(args) -> tuple[dict, dict]:
    """``(torch kwargs, layer kwargs)`` for ``activation_checkpointing_enable`` from the config: the torch
    ``checkpoint`` keywords (``context_fn`` added for "save_matmuls") and ``every_n_layers`` / ``offload``."""
    kwargs = dict(getattr(args, "activation_checkpointing_kwargs", None) or args.gradient_checkpointing_kwargs or {})
    layer = {key: kwargs.pop(key) for key in LAYER_KEYS if key in kwargs}
    policy = getattr(args, "activation_checkpointing_policy", "full")
    if policy == "save_matmuls":
        if kwargs.get("use_reentrant"):  # set by the user, or by TRL for PEFT under DeepSpeed ZeRO-3
            raise ValueError(f"activation_checkpointing_policy={policy!r} needs non-reentrant checkpointing; got "
                             "gradient_checkpointing_kwargs={'use_reentrant': True} (TRL sets it for PEFT under "
                             "DeepSpeed ZeRO-3): set it to False, or leave the policy 'full'.")
        kwargs.setdefault("use_reentrant", False)
        kwargs["context_fn"] = _save_matmuls_context
    return kwargs, layer


def _enable(model, args) -> None:
    kwargs, layer = checkpointing_options(args)
    # enabling registers a new "inputs require grad" hook on the embeddings without removing the last one: remove it,
    # so that hooks do not pile up over a run's toggles
    getattr(model, "disable_input_require_grads", lambda: None)()
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None and all(k in inspect.signature(enable).parameters for k in layer):
        enable(activation_checkpointing_kwargs=kwargs or None, **layer)  # None: transformers' default
    else:  # transformers without per-layer options: the keys go to torch, as its Trainer passes them
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={**kwargs, **layer} or None)


@contextmanager
def checkpointing_suspended(model, args):
    """Activation checkpointing off inside the block (rollouts, no-gradient log-prob passes: TRL's own toggles in
    there find it off and leave it so), then on again with the configured options, ``context_fn`` included."""
    new_names = hasattr(model, "activation_checkpointing_disable")  # transformers >= 5.2x; the old ones warn
    enabled = bool(getattr(model, "is_activation_checkpointing" if new_names else "is_gradient_checkpointing", False))
    if enabled:
        model.activation_checkpointing_disable() if new_names else model.gradient_checkpointing_disable()
    try:
        yield
    finally:
        if enabled:
            _enable(model, args)


def suspends_checkpointing(method):
    """Decorator of a trainer method (``self.model``, ``self.args``) that runs it in :func:`checkpointing_suspended`."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with checkpointing_suspended(self.model, self.args):
            return method(self, *args, **kwargs)

    return wrapper


def check_policy(args) -> None:
    """Refuse a policy that would be ignored or cannot run, naming the fix."""
    policy = getattr(args, "activation_checkpointing_policy", "full")
    if policy not in POLICIES:
        raise ValueError(f"activation_checkpointing_policy={policy!r}: use one of {POLICIES}.")
    if policy == "full":
        return
    if not (getattr(args, "activation_checkpointing", None) or args.gradient_checkpointing):
        raise ValueError(f"activation_checkpointing_policy={policy!r} chooses what gradient checkpointing keeps, but "
                         "gradient_checkpointing is False: set gradient_checkpointing=True, or leave the policy "
                         "'full'.")
    checkpointing_options(args)  # raises for reentrant checkpointing


__all__ = ["POLICIES", "check_policy", "checkpointing_options", "checkpointing_suspended", "save_matmuls_policy",
           "suspends_checkpointing"]
