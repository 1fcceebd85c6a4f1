"""Forward layouts of a micro-batch, as pure functions: how rows are laid out for the model and read back.

TRL lays a row out as ``[left-padded prompt | right-padded completion]``, ``(b, P + C)``. The training forward may
lay the same tokens out three other ways, each giving the log-probs of every real completion token up to float
error (the causal mask hides padding, rotary positions see only relative positions):

- compact (:func:`compact_rows`): each row's real tokens moved to the front, ``(b, W)`` with ``W`` the longest row;
- packed (:func:`pack_rows`): compact rows placed several to a row, position ids restarting at 0 per sequence;
- prefix tree (:func:`prefix_tree_row`): one row without padding in which every prefix that rows share is laid out
  once: each distinct prompt (shared by the members of a GRPO group) and, past it, every run of at least
  :data:`MIN_SHARED_RUN` tokens that several rows continue alike (the earlier turns that the per-turn rows of a
  trajectory repeat when a template rewrites their context), attended segment by segment
  (``trl_multiturn.shared_attention``); :func:`shared_prompt_row` is the same row sharing prompts only.

A causal LM's fused head scores token ``t + 1`` at column ``t``: every layout hands back the columns that score the
completion tokens, so the caller gets ``(b, C)`` aligned with TRL's ``completion_ids``. Choosing a layout and
checking it once on the model is ``trl_multiturn.scoring``'s job.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .shared_attention import Segment


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


def scored_labels(labels: torch.Tensor, positions: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """``labels`` (R, S) with -100 everywhere but at the label columns of the completion columns that are
    ``scored``: the loss's tokens. The fused LM head then projects those positions only (TRL's
    ``add_fused_lm_head``), and the others come back as 0.

    ``positions`` (b, C): the label column of each completion column (:attr:`CompactRows.index` for compact rows,
    ``PrefixTreeRow.cols + 1`` for the prefix-tree row); ``scored`` (b, C) bool. Row i of ``positions`` indexes row i
    of ``labels``, or its only row when R == 1 (the prefix-tree row, where rows that share a column keep it when one
    of them is scored)."""
    rows, cols = scored.nonzero(as_tuple=True)
    keep = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)  # (R, S)
    keep[rows if labels.size(0) > 1 else torch.zeros_like(rows), positions[rows, cols]] = True
    return labels.masked_fill(~keep, -100)


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


#: The shortest run of tokens past the prompts that the prefix-tree row lays out once for the rows that continue it
#: alike before they branch. Such a run is one more segment: one more attention call per layer, whose keys every
#: descendant concatenates again. A shorter run is laid out in each branch instead: a few tokens recomputed once
#: per branch cost less than a call per layer, and the completions of a GRPO group that open alike (a ``<think>``
#: tag, a tool-call header) keep the layout that shares only their prompt.
MIN_SHARED_RUN = 16


class PrefixTreeRow(NamedTuple):
    """A micro-batch as one row in which every prefix its rows share is laid out once (:func:`prefix_tree_row`)."""

    ids: torch.Tensor  # (1, L)
    positions: torch.Tensor  # (1, L) each token at its position in its rows (its depth in the tree)
    labels: torch.Tensor  # (1, L) a token where the column before it scores it, -100 elsewhere (see prefix_tree_row)
    segments: list[Segment]  # in row order, covering it: each attends to its ancestors' spans and itself causally
    cols: torch.Tensor  # (b, C) output column scoring each completion column; rows sharing a prefix share columns
    shares_past_prompts: bool  # some tokens past a prompt are laid out once for several rows


#: the name of the row when it shared prompts only; :func:`shared_prompt_row` still builds that layout
SharedPromptRow = PrefixTreeRow


@dataclass(eq=False)
class _Node:
    """A node of the prefix tree of one prompt's rows: the tokens at depths ``[start, end)`` of every row through it,
    read from row ``rep``. The prompt is the root; an inner node is a run that several rows continue alike before
    they branch, a leaf the rest of one row (or of identical rows, or of rows that are prefixes of its ``rep``)."""

    rep: int
    start: int
    end: int
    leaf: bool
    parent: _Node | None
    rows: list[int]  # rows whose last token lies in this node (their path of segments ends here)
    first: int  # smallest row index under the node: siblings are laid out in this order
    children: list = field(default_factory=list)
    offset: int = 0  # the node's first column in the row
    low: int = 0  # the depths it lays out: [low, high)
    high: int = 0


class _PrefixTree:
    """Builds the prefix tree of the rows that share one prompt (``rows``: indices into ``seqs``, their token lists)."""

    def __init__(self, seqs: list[list[int]], real: list[torch.Tensor], rows: list[int], prompt_len: int,
                 min_shared: int | None):
        self.seqs, self.min_shared = seqs, min_shared
        self.local = {i: k for k, i in enumerate(rows)}
        if min_shared is not None:
            width = max(len(seqs[i]) for i in rows)
            # each row's tokens, then a padding value of its own (negative, so never a token and never another row's
            # padding): the first column where two rows differ is where one branches off or ends
            table = -1 - torch.arange(len(rows), dtype=torch.long).unsqueeze(1).expand(len(rows), width).clone()
            for k, i in enumerate(rows):
                table[k, : len(seqs[i])] = real[i]
            self.table = table  # (g, W)
        n = prompt_len
        self.root = _Node(rows[0], 0, n, leaf=False, parent=None, rows=[], first=rows[0])
        for i in rows:  # no completion token: a one-token segment of its own, as the shared-prompt row always had
            if len(seqs[i]) == n:
                self.root.children.append(_Node(i, n, n, leaf=True, parent=self.root, rows=[i], first=i))
        rest = [i for i in rows if len(seqs[i]) > n]
        if rest and min_shared is None:  # prompts only: each row its own leaf
            self.root.children += [_Node(i, n, len(seqs[i]), True, self.root, [i], i) for i in rest]
        elif rest:
            self._grow(rest, n)

    def _agreement(self, rows: list[int], ref: int, start: int) -> list[int]:
        """For each row, the first depth >= ``start`` where it differs from row ``ref`` (its length if it does not)."""
        index = torch.tensor([self.local[i] for i in rows])
        same = self.table[index, start:] == self.table[self.local[ref], start:]  # (|rows|, W - start)
        agree = same.to(torch.int32).cumprod(1).sum(1) + start  # (|rows|,)
        return [min(int(a), len(self.seqs[i])) for a, i in zip(agree.tolist(), rows)]

    def _grow(self, rows: list[int], depth: int) -> None:
        """The subtree of the root's ``rows``, which all go on past the prompt (``depth``)."""
        seqs, min_shared = self.seqs, self.min_shared
        # (parent, rows through the new node, depth where its tokens start, depth from which they may differ,
        #  rows that end before that depth and read the node's first tokens)
        work = [(self.root, rows, depth, depth, [])]
        while work:
            parent, rows, start, split_from, readers = work.pop()
            ref = max(rows, key=lambda i: (len(seqs[i]), -i))  # the longest row (the first of equal ones)
            agree = self._agreement(rows, ref, split_from)
            diverge = [a for a, i in zip(agree, rows) if a < len(seqs[i])]
            first = min(rows + readers)
            if not diverge:  # every row is a prefix of the longest: one leaf that they all read
                parent.children.append(_Node(ref, start, len(seqs[ref]), True, parent, rows + readers, first))
                continue
            split = min(diverge)  # the first depth where two rows that both go on differ
            ending = [i for i in rows if len(seqs[i]) <= split]
            branches: dict[int, list[int]] = defaultdict(list)
            for i in rows:
                if len(seqs[i]) > split:
                    branches[seqs[i][split]].append(i)
            if split - start >= min_shared:  # worth a segment of its own
                node = _Node(ref, start, split, False, parent, ending + readers, first)
                parent.children.append(node)
                work += [(node, branch, split, split, []) for branch in branches.values()]
            else:  # too short: its tokens start each branch instead; rows ending in it read the first branch
                work += [(parent, branch, start, split, ending + readers if k == 0 else [])
                         for k, branch in enumerate(branches.values())]


def prefix_tree_row(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_width: int,
                    keys: list[tuple] | None = None, min_shared: int | None = MIN_SHARED_RUN) -> PrefixTreeRow:
    """The rows (b, P + C) in TRL's layout as one row without padding, every prefix they share laid out once.

    The rows that share a key (``keys``, default :func:`prompt_keys`; rows with the same key must have the same
    prompt) form a prefix tree of their real tokens: the prompt is its root; past the prompt, a run of tokens that
    several rows continue alike and then branch is an inner node when it is at least ``min_shared`` tokens long
    (:data:`MIN_SHARED_RUN`; shorter runs are laid out again at the start of each branch); the rest of each row is a
    leaf, shared by identical rows and by rows that are a prefix of it. ``min_shared=None`` shares the prompts only:
    each row its own leaf (the shared-prompt row).

    Each node is one segment, laid out in depth-first order (a node, then its subtrees, siblings in the order of
    their first row). A node that has children stops one token short, as the prompt segment always did: its last
    column would have to predict a different next token for each child, so each child lays that token out again as
    its own first token and predicts its next one there. So the root is the prompt less its last token, an inner node
    runs from its parent's last token to its own last but one, a leaf from its parent's last token to its row's end.
    A segment attends to the spans of its ancestors and to itself causally, with position ids continuing from the
    depth, so every token sees what it sees in its own row, at the same position.

    Labels: the fused head scores column t's label from column t - 1. A token of a completion is labelled, so that
    the column before it scores it, except at the start of a segment, whose previous column in the row belongs to
    another segment; a first child directly follows its parent, whose last column is where its first token is
    scored, so that one is labelled too. ``cols[i, j]``: the output column scoring completion column j of row i,
    possibly in a segment shared with other rows (the same log-prob; gradients through it add up over the rows).
    Columns past a row's completion point at junk for the caller to mask."""
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must "
                         "both be (rows, prompt + completion columns)")
    b, width = input_ids.shape
    if b == 0 or not 0 <= completion_width < width:
        raise ValueError(f"the prefix-tree row needs rows and a completion width in [0, {width}), got {b} rows and "
                         f"completion_width={completion_width}")
    if min_shared is not None and min_shared < 1:
        raise ValueError(f"min_shared must be a positive number of tokens or None, got {min_shared}")
    if not prompt_completion_contiguous(attention_mask, completion_width):
        raise ValueError("the prefix-tree row needs TRL's layout: each row's mask [0* 1*] over the prompt columns and "
                         "[1* 0*] over the completion's (no holes)")
    device, prompt_width = input_ids.device, width - completion_width
    mask = attention_mask.detach().to("cpu").bool()
    ids = input_ids.detach().to("cpu", torch.long)
    real = [ids[i][mask[i]] for i in range(b)]  # (len_i,) each row's real tokens
    seqs = [r.tolist() for r in real]
    prompt_len = mask[:, :prompt_width].sum(1).tolist()
    if keys is None:
        keys = [tuple(s[:n]) for s, n in zip(seqs, prompt_len)]
    elif len(keys) != b:
        raise ValueError(f"{len(keys)} keys for {b} rows")
    members: dict[tuple, list[int]] = defaultdict(list)
    for i, key in enumerate(keys):
        members[key].append(i)
    trees = []
    for rows in members.values():
        n, prompt = prompt_len[rows[0]], seqs[rows[0]][: prompt_len[rows[0]]]
        if n < 2:
            raise ValueError(f"row {rows[0]}: the prefix-tree row needs prompts of at least two tokens (the prompt "
                             f"less its last token is laid out once, its last token starts each branch); got {n}")
        for i in rows:
            if prompt_len[i] != n or seqs[i][:n] != prompt:
                raise ValueError(f"rows {rows[0]} and {i} have the same key but different prompt tokens")
        trees.append((_PrefixTree(seqs, real, rows, n, min_shared).root, n))

    pieces: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    labels: list[torch.Tensor] = []
    segments: list[Segment] = []
    length = 0
    for root, n in trees:
        work = [(root, [], False)]  # (node, its ancestors' spans in the row, whether it directly follows its parent)
        while work:
            node, spans, after_parent = work.pop()
            low = 0 if node.parent is None else node.start - 1
            high = node.end if node.leaf else node.end - 1
            node.offset, node.low, node.high = length, low, high
            piece = real[node.rep][low:high]  # (high - low,)
            depth = torch.arange(low, high)  # (high - low,)
            pieces.append(piece)
            positions.append(depth)
            label = piece.masked_fill(depth < n, -100)  # prompt tokens are context
            if not after_parent:
                label[0] = -100
            labels.append(label)
            length += high - low
            segments.append(Segment(node.offset, length, spans))
            inner = spans + [(node.offset, length)]
            children = sorted(node.children, key=lambda c: c.first)
            work += [(child, inner, k == 0) for k, child in reversed(list(enumerate(children)))]

    index = []
    for root, n in trees:
        stack, ends = [root], {}
        while stack:  # the node in which each row's path ends
            node = stack.pop()
            ends.update((i, node) for i in node.rows)
            stack += node.children
        for i, node in sorted(ends.items()):
            path = []
            while node is not None:
                path.append(node)
                node = node.parent
            c = len(seqs[i]) - n  # completion column j is the token at depth n + j, scored at depth n + j - 1
            col: list[int] = []
            for node in reversed(path):
                lo, hi = max(node.low, n - 1), min(node.high, n - 1 + c)
                col += range(node.offset + lo - node.low, node.offset + hi - node.low)
            if len(col) != c:
                raise AssertionError(f"internal: row {i} has {len(col)} scoring columns for {c} completion tokens")
            base = col[-1] + 1 if c else path[0].offset  # past the completion: junk, as in the other layouts
            col += range(base, base + completion_width - c)
            index.append((i, col))
    cols = torch.tensor([col for _, col in sorted(index)], dtype=torch.long).reshape(b, completion_width)
    cols = cols.clamp(max=length - 2).to(device)
    prompt_only = sum(n - 1 for _, n in trees) + sum(len(s) - n + 1 for s, n in zip(seqs, prompt_len))
    as_row = lambda values: torch.cat(values).to(device=device, dtype=input_ids.dtype).unsqueeze(0)  # noqa: E731
    return PrefixTreeRow(as_row(pieces), as_row(positions), as_row(labels), segments, cols, length < prompt_only)


def shared_prompt_row(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_width: int,
                      keys: list[tuple] | None = None) -> PrefixTreeRow:
    """The rows (b, P + C) in TRL's layout as one row without padding, sharing prompts only: for each distinct
    prompt (``keys``, default :func:`prompt_keys`), the prompt less its last token, then the suffixes ``[last prompt
    token, completion]`` of the rows that share it. A prompt segment attends to itself causally, a suffix to its
    prompt and to itself causally; every real token then sees what it sees in its own row, at the same position.
    :func:`prefix_tree_row` with ``min_shared=None``."""
    return prefix_tree_row(input_ids, attention_mask, completion_width, keys, min_shared=None)
