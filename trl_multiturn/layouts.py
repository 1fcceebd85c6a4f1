"""Forward layouts of a micro-batch, as pure functions: how rows are laid out for the model and read back.

TRL lays a row out as ``[left-padded prompt | right-padded completion]``, ``(b, P + C)``. The training forward may
lay the same tokens out three other ways, each giving the log-probs of every real completion token up to float
error (the causal mask hides padding, rotary positions see only relative positions):

- compact (:func:`compact_rows`): each row's real tokens moved to the front, ``(b, W)`` with ``W`` the longest row;
- packed (:func:`pack_rows`): compact rows placed several to a row, position ids restarting at 0 per sequence;
- shared prompt (:func:`shared_prompt_row`): one row without padding, each distinct prompt once, followed by the
  completions of the rows that share it (the members of a GRPO group), attended segment by segment
  (``trl_multiturn.shared_attention``).

A causal LM's fused head scores token ``t + 1`` at column ``t``: every layout hands back the columns that score the
completion tokens, so the caller gets ``(b, C)`` aligned with TRL's ``completion_ids``. Choosing a layout and
checking it once on the model is ``trl_multiturn.scoring``'s job.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

import torch


def prompt_completion_contiguous(attention_mask: torch.Tensor, completion_width: int) -> bool:
    """True when every row's mask is ``[0* 1*]`` over the prompt columns and ``[1* 0*]`` over the completion's."""
    prompt = attention_mask[:, : attention_mask.size(1) - completion_width]  # (b, P)
    completion = attention_mask[:, attention_mask.size(1) - completion_width :]  # (b, C)
    return bool((prompt.diff(dim=1) >= 0).all() and (completion.diff(dim=1) <= 0).all())


def prompt_keys(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[tuple[int, ...]]:
    """Each row's real prompt tokens as a tuple (rows with equal tuples share their prompt)."""
    return [tuple(row[m.bool()].tolist()) for row, m in zip(prompt_ids, prompt_mask)]


def shares_prompts(keys: list) -> bool:
    """Whether a micro-batch with these prompts goes through the shared-prompt forward: a prompt repeats, and every
    prompt has at least two tokens (its last token starts each suffix)."""
    return len(set(keys)) < len(keys) and min(len(k) for k in keys) >= 2


class CompactRows(NamedTuple):
    """Rows with their real tokens moved to the front (:func:`compact_rows`)."""

    ids: torch.Tensor  # (b, W) real tokens first, then 0
    mask: torch.Tensor  # (b, W) 1 on real tokens
    index: torch.Tensor  # (b, C) compact column of each completion column
    valid: torch.Tensor  # (b, C) whether that completion column is a real token
    is_completion: torch.Tensor  # (b, W) which compact columns are real completion tokens

    @property
    def labels(self) -> torch.Tensor:
        """(b, W) the ids on real completion tokens, -100 elsewhere: only those are scored."""
        return self.ids.masked_fill(~self.is_completion, -100)


def compact_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_width: int) -> CompactRows:
    """Move each row's real tokens to the front, in their order; ``W`` is the longest row (see :class:`CompactRows`).

    ``input_ids``, ``attention_mask``: (b, P + C) in TRL's layout; ``completion_width``: C."""
    mask = attention_mask.to(torch.long)  # (b, L)
    lengths = mask.sum(1)  # (b,)
    width = max(int(lengths.max()), 1)
    order = torch.argsort(1 - mask, dim=1, stable=True)  # (b, L) real tokens first, in their order
    ids = input_ids.gather(1, order)[:, :width]  # (b, W)
    new_mask = mask.gather(1, order)[:, :width]  # (b, W)
    ids = ids.masked_fill(new_mask == 0, 0) if ids.numel() else ids  # (b, W)
    position = mask.cumsum(1) - 1  # (b, L) compact column of every real token
    index = position[:, mask.size(1) - completion_width :].clamp(min=0, max=width - 1)  # (b, C)
    valid = mask[:, mask.size(1) - completion_width :].bool()  # (b, C)
    completion = torch.zeros_like(mask)  # (b, L)
    completion[:, mask.size(1) - completion_width :] = 1
    is_completion = (completion.gather(1, order)[:, :width] * new_mask).bool()  # (b, W)
    return CompactRows(ids, new_mask, index, valid, is_completion)


def read_completion_columns(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(b, W - 1) fused-head outputs of compact rows (column t scores token t + 1) -> (b, C) at the completion
    columns ``index`` (:attr:`CompactRows.index`); columns that are not real tokens hold junk for the caller to mask."""
    return values.gather(1, (index - 1).clamp(min=0))  # (b, C)


class PackedRows(NamedTuple):
    """Compact rows packed several to a row (:func:`pack_rows`)."""

    ids: torch.Tensor  # (R, S) sequences back to back, 0 after the last
    positions: torch.Tensor  # (R, S) position ids restarting at 0 for every sequence (and for the tail)
    labels: torch.Tensor  # (R, S) the compact rows' labels, -100 on the tail
    rows: torch.Tensor  # (b,) packed row of each compact row
    cols: torch.Tensor  # (b, W - 1) packed output column of each compact output column


def pack_rows(ids: torch.Tensor, labels: torch.Tensor, lengths: list[int], bins: list[list[int]]) -> PackedRows:
    """Place compact rows (``ids``, ``labels``: (b, W); ``lengths``: real tokens per row) into packed rows, the rows
    of ``bins[r]`` back to back in row ``r`` (e.g. ``trl_multiturn.batching.first_fit_decreasing``). Forwarded with
    these position ids and no attention mask, transformers isolates the sequences (block-diagonal attention)."""
    width = ids.size(1)
    capacity = max(sum(lengths[i] for i in members) for members in bins)  # S
    packed = ids.new_full((len(bins), capacity), 0)  # (R, S)
    positions = torch.zeros_like(packed)  # (R, S)
    packed_labels = torch.full_like(packed, -100)  # (R, S)
    place = [(0, 0)] * len(lengths)  # compact row -> (packed row, offset)
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
    rows = torch.tensor([r for r, _ in place], device=ids.device)  # (b,)
    offsets = torch.tensor([o for _, o in place], device=ids.device).unsqueeze(1)  # (b, 1)
    cols = (offsets + torch.arange(width - 1, device=ids.device)).clamp(max=capacity - 2)  # (b, W - 1)
    return PackedRows(packed, positions, packed_labels, rows, cols)


def read_packed(values: torch.Tensor, packed: PackedRows) -> torch.Tensor:
    """(R, S - 1) fused-head outputs of packed rows -> (b, W - 1) laid out as the compact rows' outputs (beyond a
    row's length the values are junk for the caller to mask)."""
    return values[packed.rows.unsqueeze(1), packed.cols]  # (b, W - 1)


class SharedPromptRow(NamedTuple):
    """A micro-batch as one row with each distinct prompt once (:func:`shared_prompt_row`)."""

    ids: torch.Tensor  # (1, L)
    positions: torch.Tensor  # (1, L) a suffix continues its prompt's positions
    labels: torch.Tensor  # (1, L) completion tokens; -100 on prompts and on each suffix's first token
    segments: list[tuple[int, int, int, int]]  # (query start, query end, prefix start, prefix end), covering the row
    cols: torch.Tensor  # (b, C) output column scoring each completion column


def shared_prompt_row(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_width: int,
                      keys: list[tuple] | None = None) -> SharedPromptRow:
    """The rows (b, P + C) in TRL's layout as one row without padding: for each distinct prompt (``keys``, default
    :func:`prompt_keys`), the prompt less its last token, then the suffixes ``[last prompt token, completion]`` of
    the rows that share it. A prompt segment attends to itself causally, a suffix to its prompt and to itself
    causally; every real token then sees what it sees in its own row, at the same position."""
    device = input_ids.device
    prompt_width = input_ids.size(1) - completion_width  # P
    completion_len = attention_mask[:, prompt_width:].sum(1).tolist()  # (b,)
    keys = keys if keys is not None else prompt_keys(input_ids[:, :prompt_width], attention_mask[:, :prompt_width])
    members: dict[tuple, list[int]] = defaultdict(list)
    for i, key in enumerate(keys):
        members[key].append(i)
    pieces, positions, labels, segments, start = [], [], [], [], [0] * len(keys)
    offset = 0
    for key, rows in members.items():
        prefix = torch.tensor(key[:-1], dtype=input_ids.dtype, device=device)  # (n,)
        n = len(prefix)
        pieces.append(prefix)
        positions.append(torch.arange(n, device=device))
        labels.append(torch.full((n,), -100, dtype=input_ids.dtype, device=device))
        segments.append((offset, offset + n, offset, offset))
        prefix_span, offset = (offset, offset + n), offset + n
        for i in rows:
            m = completion_len[i] + 1
            suffix = input_ids[i, prompt_width - 1 : prompt_width + m - 1]  # (m,)
            pieces.append(suffix)
            positions.append(n + torch.arange(m, device=device))
            labels.append(torch.cat([suffix.new_full((1,), -100), suffix[1:]]))  # the prompt token is context
            segments.append((offset, offset + m, *prefix_span))
            start[i], offset = offset, offset + m
    row = torch.cat(pieces).unsqueeze(0)  # (1, L)
    # output column t scores row token t + 1: completion token j of row i is scored at column start[i] + j
    cols = torch.tensor(start, device=device).unsqueeze(1) + torch.arange(completion_width, device=device)  # (b, C)
    cols = cols.clamp(max=row.size(1) - 2)  # beyond a completion: masked by the caller
    return SharedPromptRow(row, torch.cat(positions).unsqueeze(0), torch.cat(labels).unsqueeze(0), segments, cols)
