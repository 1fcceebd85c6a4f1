"""The attention of the shared-prompt row (``trl_multiturn.layouts.shared_prompt_row``), registered with transformers.

The row holds each distinct prompt once and, after it, the suffixes of the rows that share it; a suffix attends to
its prompt and to itself causally, never to another suffix. :func:`install_shared_prompt_attention` wraps the
model's entry of transformers' ``AttentionInterface`` so that a forward called with ``shared_prompt_plan=`` runs
:func:`shared_prompt_attention` (one SDPA call per segment) and every other call runs the original function.
Wrapping the entry, instead of switching the model's implementation for one forward, keeps gradient-checkpointing
replays (which run during the backward pass) on the same function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class SharedAttentionUnused(RuntimeError):
    """The model's layers did not run the shared-prompt attention (their attention does not go through transformers'
    attention interface)."""


@dataclass
class SharedPromptPlan:
    """The segments of a shared-prompt row: ``(query start, query end, prefix start, prefix end)``, in order and
    covering the row; a segment attends to the prefix span and to itself causally. ``calls`` counts the layers that
    ran :func:`shared_prompt_attention` with it."""

    segments: list[tuple[int, int, int, int]]
    calls: int = 0


def shared_prompt_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            shared_prompt_plan: SharedPromptPlan | None = None, **kwargs):
    """Attention of a shared-prompt row, one SDPA call per segment: query ``(1, H, L, D)``, key/value
    ``(1, H_kv, L, D)``; returns ``((1, L, H, D), None)`` as transformers' attention functions do."""
    if shared_prompt_plan is None:
        raise RuntimeError("the shared-prompt attention needs the shared_prompt_plan of its forward")
    shared_prompt_plan.calls += 1
    repeat = query.size(1) // key.size(1)
    outputs = []
    for q_start, q_end, p_start, p_end in shared_prompt_plan.segments:
        q = query[:, :, q_start:q_end]  # (1, H, lq, D)
        k = torch.cat([key[:, :, p_start:p_end], key[:, :, q_start:q_end]], dim=2)  # (1, H_kv, lk, D)
        v = torch.cat([value[:, :, p_start:p_end], value[:, :, q_start:q_end]], dim=2)  # (1, H_kv, lk, D)
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)  # (1, H, lk, D)
        if p_end == p_start:
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling)
        else:  # causal, aligned to the end: query i sees the prefix and suffix keys up to its own position
            lq, lk = q.size(2), k.size(2)
            mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)  # (lq, lk)
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling)
        outputs.append(o)  # (1, H, lq, D)
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None  # (1, L, H, D)


def install_shared_prompt_attention(implementation: str | None) -> None:
    """Wrap transformers' ``AttentionInterface`` entry for ``implementation`` so that a forward called with
    ``shared_prompt_plan=`` runs :func:`shared_prompt_attention`. Idempotent. Raises :class:`SharedAttentionUnused`
    for "eager" (each model's own function, not an entry that can be wrapped)."""
    from transformers import AttentionInterface

    original = AttentionInterface._global_mapping.get(implementation or "eager")
    if original is None:
        raise SharedAttentionUnused
    if getattr(original, "_shared_prompt_wrapper", False):
        return

    def attention(module, query, key, value, attention_mask, *args, shared_prompt_plan=None, **kwargs):
        if shared_prompt_plan is not None:
            return shared_prompt_attention(module, query, key, value, attention_mask, *args,
                                           shared_prompt_plan=shared_prompt_plan, **kwargs)
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    attention._shared_prompt_wrapper = True
    AttentionInterface.register(implementation, attention)
