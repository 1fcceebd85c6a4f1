"""Sampling with LoRA folded into the weights: one matmul per adapted linear layer instead of three.

An unmerged LoRA layer computes ``W x + s * B (A x)``: three matmuls, a scaling and an add where the base layer
launches one matmul. On a GPU, where a decode step of a small model is bound by kernel launches, that is most of an
adapted layer's cost (not measured yet); on 2 CPU cores, where the decode step reads the weights whole, it is not:
4% of a decode step, no gain on a rollout (docs/benchmarks.md), so it is off by default.
:func:`merged_lora` folds the adapter in for the duration of a ``with`` block, the way the rollout and the
evaluation use the policy (eval mode, no gradients):

* each adapted ``nn.Linear`` gets a **new** weight tensor ``W + get_delta_weight()`` (PEFT's own delta, so
  ``fan_in_fan_out`` and the scaling are PEFT's), and the adapter branch is switched off (PEFT's
  ``disable_adapter``), so the forward is the base layer's one matmul;
* on exit the original weight tensors are put back (the same objects, bit for bit). PEFT's
  ``merge_adapter()`` / ``unmerge_adapter()`` computes ``W += dW`` then ``W -= dW`` in place instead: in bfloat16
  that rounds the frozen base weights at every rollout (errors of the order of the weight's own precision), which
  the learner would then train against.

The cost is one more copy of the adapted weights while the block runs (for SmolLM2-135M in float32 about 0.4 GB).
The merged forward equals the unmerged one up to float rounding (the order of the additions differs), so the
sampler's log-probs move by about that much; the learner recomputes its own (on-policy, the ratio is still 1).
Not merged, the block runs the adapter as it is: a model that is not a PEFT LoRA model, quantized base layers
(QLoRA: a 4-bit weight cannot hold ``W + dW``), DoRA, LoRA on non-linear layers, or adapters already merged.
"""

from __future__ import annotations

import contextlib

import torch


def _mergeable_layers(model) -> list | None:
    """The LoRA linear layers of ``model`` whose base weights can take ``W + dW``, or None if any adapted layer
    cannot (then nothing is merged: a half-merged model would be a different policy)."""
    try:
        from peft import PeftModel
        from peft.tuners.lora import Linear as LoraLinear
        from peft.tuners.lora import LoraLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        return None
    if not isinstance(model, PeftModel):
        return None
    layers = []
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        base = module.get_base_layer()
        active = [a for a in module.active_adapters if a in module.lora_A]
        if (
            type(module) is not LoraLinear
            or type(base) is not torch.nn.Linear
            or not base.weight.dtype.is_floating_point
            or getattr(module, "merged", False)
            or module.disable_adapters
            or any(module.use_dora.get(a, False) for a in active)
        ):
            return None
        if active:
            layers.append((module, base, active))
    return layers or None


def can_merge_lora(model) -> bool:
    """Whether :func:`merged_lora` folds ``model``'s adapter in (see the module docstring for what it skips)."""
    return _mergeable_layers(model) is not None


@contextlib.contextmanager
def merged_lora(model, enabled: bool = True):
    """Within the block, ``model`` (a PEFT LoRA model) computes with ``W + dW`` in each adapted linear layer and its
    adapter branch off; on exit every original weight tensor is back. Yields whether it merged. A no-op (yields
    False) when ``enabled`` is False or the model cannot be merged."""
    layers = _mergeable_layers(model) if enabled else None
    if layers is None:
        yield False
        return
    originals = []
    try:
        with torch.no_grad():
            for module, base, active in layers:
                weight = base.weight.data  # (out, in)
                delta = sum(module.get_delta_weight(a) for a in active)  # (out, in)
                originals.append((base, weight))
                base.weight.data = weight + delta.to(weight.dtype)  # a new tensor: `weight` is left untouched
        with model.disable_adapter():
            yield True
    finally:
        for base, weight in originals:
            base.weight.data = weight
