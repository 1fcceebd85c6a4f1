"""The attention of the shared-prompt (prefix-tree) row (``trl_multiturn.layouts.prefix_tree_row``), registered with
transformers.

The row holds every prefix that rows of the micro-batch share once: each distinct prompt and, past it, every run of
tokens that several rows continue alike (a prefix tree of the rows); a segment attends to the segments of its
ancestors in the tree and to itself causally, never to a sibling's. :func:`install_shared_prompt_attention` wraps the
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


class Segment(tuple):
    """One segment of a shared-prompt row, as a flat tuple ``(query start, query end, prefix start, prefix end, ...)``:
    the row's columns ``[query start, query end)`` attend to the prefix spans (the segments of their ancestors in the
    prefix tree, in row order, adjacent ones merged) and causally to themselves.

    A segment without ancestors carries one empty span at its own start, so that the segments of a layout that
    shares only prompts are the 4-tuples ``(query start, query end, prompt start, prompt end)`` the shared-prompt row
    always had; any tuple of that flat form (e.g. a hand-written 4-tuple) is read the same way."""

    def __new__(cls, start: int, end: int, spans=()):
        if not 0 <= start < end:
            raise ValueError(f"a segment needs 0 <= start < end, got [{start}, {end})")
        merged: list[list[int]] = []
        for a, b in spans:
            if not 0 <= a <= b <= start:
                raise ValueError(f"prefix span [{a}, {b}) of segment [{start}, {end}) does not lie before it")
            if b == a:
                continue
            if merged and merged[-1][1] == a:  # contiguous with the previous span: one slice of the keys
                merged[-1][1] = b
            else:
                merged.append([a, b])
        flat = [x for span in merged for x in span] or [start, start]
        return super().__new__(cls, (start, end, *flat))

    def __getnewargs__(self):  # copy and pickle rebuild it from its parts
        return self[0], self[1], prefix_spans(self)

    @property
    def query(self) -> tuple[int, int]:
        return self[0], self[1]

    @property
    def spans(self) -> list[tuple[int, int]]:
        """The non-empty prefix spans."""
        return prefix_spans(self)


def prefix_spans(segment: tuple) -> list[tuple[int, int]]:
    """The non-empty prefix spans of a segment in the flat form of :class:`Segment`."""
    if len(segment) < 4 or len(segment) % 2:
        raise ValueError(f"a segment is (query start, query end, prefix start, prefix end, ...), got {segment!r}")
    return [(segment[k], segment[k + 1]) for k in range(2, len(segment), 2) if segment[k + 1] > segment[k]]


@dataclass
class SharedPromptPlan:
    """The segments of a shared-prompt row (:class:`Segment`: a query span and its ancestors' spans), in order and
    covering the row; a segment attends to its prefix spans and to itself causally. ``calls`` counts the layers that
    ran :func:`shared_prompt_attention` with it."""

    segments: list[tuple[int, ...]]
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
    for segment in shared_prompt_plan.segments:
        q_start, q_end = segment[0], segment[1]
        spans = prefix_spans(segment)
        q = query[:, :, q_start:q_end]  # (1, H, lq, D)
        if not spans:
            k, v = key[:, :, q_start:q_end], value[:, :, q_start:q_end]  # (1, H_kv, lq, D)
        elif len(spans) == 1 and spans[0][1] == q_start:  # ancestors right before the segment: a view, no copy
            k, v = key[:, :, spans[0][0]:q_end], value[:, :, spans[0][0]:q_end]  # (1, H_kv, lk, D)
        else:  # the ancestors' keys in row order (= position order along the path), then the segment's own
            k = torch.cat([key[:, :, a:b] for a, b in spans] + [key[:, :, q_start:q_end]], dim=2)  # (1, H_kv, lk, D)
            v = torch.cat([value[:, :, a:b] for a, b in spans] + [value[:, :, q_start:q_end]], dim=2)
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)  # (1, H, lk, D)
        if not spans:
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling)
        else:  # causal, aligned to the end: query i sees every prefix key and the segment's keys up to its own
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
