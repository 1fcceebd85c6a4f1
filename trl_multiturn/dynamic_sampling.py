"""Dynamic sampling (DAPO's "over-sample and filter"), as pure functions.

A GRPO group whose rewards are all equal has advantage 0 for every member, so it adds nothing to the gradient but
still counts in the loss normalizers and costs a training forward. With ``dynamic_sampling=True`` the trainer drops
such groups and rolls out more prompts until the rollout is filled with groups that carry signal:

    round 0     the rollout as planned: B prompts x G samples
    round k     more prompts, drawn from the training set, until every rank holds its B_local groups with signal,
                at most ``max_dynamic_sampling_rounds`` rounds
    cap hit     the missing places are filled with dropped groups that carry no loss: their loss mask is 0, so they
                count in no normalizer (N_g, M, token counts) and the loss is the loss over the kept trajectories

This module holds the decisions (which groups carry signal and why the others do not, how many prompts the next
round rolls out, which rows fill the rollout) and the concatenation of the rounds' scored batches; the trainer
runs the rounds.

Departures from DAPO: DAPO rolls out a whole batch per round; here a round rolls out as many prompts as the keep
rate seen so far says are needed (at most one rollout's worth). As in DAPO, groups with signal beyond the batch
are discarded (counted as surplus). When the cap is hit DAPO's reference implementation keeps sampling or stops
with an error; here the step trains on what was kept. Each rank fills its own share of groups. A group in which
fewer than 2 members have a finite reward has no baseline and is dropped.

With ``dynamic_sampling_balance`` (a column of the training set, e.g. "hops") each rank keeps the same number of
groups with signal for every value of that column (:func:`stratum_quotas`); refill rounds draw only rows whose value
still misses groups (:func:`refill_rows`), and groups with signal of a value already full are surplus. A surplus group
may then fill an empty place when the cap is hit (loss mask 0, like a dropped group) where too few groups were
dropped. Not in DAPO: it keeps one kind of prompt from outvoting another in the gradient.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass, field

import torch

#: why a group carries no signal. "all_correct"/"all_wrong": every member got the reward 1 / 0 (the exact-match
#: scale of the QA rewards); "all_equal": every member got another common value; "no_baseline": fewer than 2
#: members have a finite reward (the others were dropped: failed environment, non-finite reward, skipped prompt)
DROP_REASONS = ("all_correct", "all_wrong", "all_equal", "no_baseline")


def group_signal(rewards: torch.Tensor, group_size: int) -> list[str | None]:
    """For each group of ``group_size`` consecutive rewards, ``None`` when it carries signal (at least 2 finite
    rewards that are not all equal), else the reason it does not (one of :data:`DROP_REASONS`).

    ``rewards`` is (B,), NaN where a trajectory was dropped; rows ``[g*G, (g+1)*G)`` form group ``g``.
    """
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if r.dim() != 1 or r.numel() % group_size != 0:
        raise ValueError(
            f"rewards of shape {tuple(r.shape)} cannot be cut into groups of num_generations={group_size}: "
            "give one reward per trajectory, every prompt's group_size trajectories stored together."
        )
    reasons: list[str | None] = []
    for row in r.view(-1, group_size):  # (G,)
        finite = row[torch.isfinite(row)]  # (G',)
        if finite.numel() < 2:
            reasons.append("no_baseline")
        elif bool((finite != finite[0]).any()):
            reasons.append(None)
        elif float(finite[0]) == 1.0:
            reasons.append("all_correct")
        elif float(finite[0]) == 0.0:
            reasons.append("all_wrong")
        else:
            reasons.append("all_equal")
    return reasons


def refill_prompts(missing: int, kept: int, sampled: int, quota: int) -> int:
    """Prompts per rank the next round rolls out: the ``missing`` groups (the most any rank lacks) divided by the
    keep rate seen so far (``kept`` of ``sampled`` groups, over all ranks), rounded up, at least ``missing`` and at
    most ``quota`` (one rollout's prompts per rank). With nothing kept yet, ``quota``."""
    if missing <= 0:
        return 0
    if kept <= 0:
        return quota
    return max(missing, min(quota, math.ceil(missing * sampled / kept)))


def next_refill(table: torch.Tensor, rounds_done: int, max_rounds: int, quota: int) -> int:
    """Prompts per rank the next round rolls out, 0 to stop. ``table`` is (world, 3): each rank's groups sampled,
    kept and missing, gathered from every rank, so every rank takes the same decision and runs the same rounds (the
    rollout and the reward gathering are collective) even when only one rank still misses groups; a rank that is
    full rolls out too and counts its new groups with signal as surplus."""
    missing = int(table[:, 2].max())
    if missing == 0 or rounds_done >= max_rounds:
        return 0
    return refill_prompts(missing, int(table[:, 1].sum()), int(table[:, 0].sum()), quota)


def stratum_quotas(values: Sequence[Hashable], groups: int, column: str) -> dict:
    """Groups with signal each value of the balance column keeps per rank and rollout: ``groups`` (one rank's groups
    per rollout) shared equally by the distinct ``values`` (the column's value of every training row), in the order
    they first appear."""
    counts = Counter(values)
    if not counts or groups % len(counts):
        raise ValueError(
            f"dynamic_sampling_balance={column!r} keeps the same number of groups for each value of the column, but "
            f"train_dataset has {len(counts)} values {list(counts)} (rows per value: {dict(counts)}) and a device "
            f"holds {groups} groups per rollout, not a multiple of {len(counts)}. Set prompts_per_rollout to a "
            f"multiple of {len(counts)} x the number of processes, or balance by another column."
        )
    return {value: groups // len(counts) for value in counts}


def refill_rows(key: tuple[int, ...], prompts: int, size: int, row_values: Sequence[Hashable] | None = None,
                missing: Collection[Hashable] = ()) -> list[int]:
    """Rows of the training set (``size`` rows) for the next round's ``prompts`` prompts, drawn uniformly with
    replacement by a generator seeded by ``key`` (seed, global step, round, rank), so a resumed run draws the same
    ones. With ``row_values`` (the balance column's value of every row) only rows whose value is in ``missing`` are
    drawn; with nothing missing (this rank is full, another is not) every row is."""
    pool: Sequence[int] = range(size)
    if row_values is not None and missing:
        pool = [i for i, value in enumerate(row_values) if value in missing]
    gen = torch.Generator().manual_seed(hash(key) & (2**62 - 1))
    return [pool[i] for i in torch.randint(len(pool), (prompts,), generator=gen).tolist()]


@dataclass
class Selection:
    """The groups chosen for one rank's rollout over the rounds: ``(round, group)`` pairs, in order. With ``strata``
    (value of the balance column -> groups to keep, summing to ``quota``) each value keeps at most its own quota."""

    quota: int
    strata: dict | None = None
    kept: list[tuple[int, int]] = field(default_factory=list)  # groups with signal, at most ``quota``
    spare: list[tuple[int, int]] = field(default_factory=list)  # groups without signal, to fill when the cap is hit
    unplaced: list[tuple[int, int]] = field(default_factory=list)  # groups with signal that found no place
    dropped: Counter = field(default_factory=Counter)  # reason -> groups
    kept_by: Counter = field(default_factory=Counter)  # value of the balance column (None without) -> kept groups

    def __post_init__(self):
        if self.strata is not None and sum(self.strata.values()) != self.quota:
            raise ValueError(f"Selection: the strata quotas {self.strata} do not sum to quota={self.quota}.")

    @property
    def missing(self) -> int:
        return self.quota - len(self.kept)

    @property
    def surplus(self) -> int:
        return len(self.unplaced)

    def missing_values(self) -> list[Hashable]:
        """The values of the balance column that still miss groups (none without ``strata``)."""
        return [value for value, quota in (self.strata or {}).items() if self.kept_by[value] < quota]

    def add_round(self, round_index: int, reasons: list[str | None], values: list[Hashable] | None = None) -> None:
        """Record one round's groups (``reasons`` from :func:`group_signal`, for this rank's groups; ``values``: each
        group's value of the balance column, needed with ``strata``)."""
        if self.strata is not None and (values is None or len(values) != len(reasons)):
            raise ValueError(f"Selection with strata needs one value per group; got {values} for {len(reasons)}.")
        for g, why in enumerate(reasons):
            value = None if self.strata is None else values[g]
            if why is not None:
                self.dropped[why] += 1
                self.spare.append((round_index, g))
            elif self.kept_by[value] < (self.quota if self.strata is None else self.strata.get(value, 0)):
                self.kept.append((round_index, g))
                self.kept_by[value] += 1
            else:
                self.unplaced.append((round_index, g))

    def rows(self, group_size: int) -> tuple[list[tuple[int, list[int]]], list[tuple[int, list[int]]]]:
        """``(kept, filler)``: for each round, the rows of its scored batch to take, as ``[(round, rows)]``.
        ``filler`` fills the places the kept groups left empty (cap hit), from the first dropped groups, then (with
        ``strata``, where too few were dropped) from the surplus groups."""
        filler = (self.spare + self.unplaced)[: self.missing]

        def by_round(groups):
            out: dict[int, list[int]] = {}
            for r, g in groups:
                out.setdefault(r, []).extend(range(g * group_size, (g + 1) * group_size))
            return sorted(out.items())

        return by_round(self.kept), by_round(filler)


def _pad_to(t: torch.Tensor, width: int, left: bool, value) -> torch.Tensor:
    extra = width - t.size(1)
    if extra == 0:
        return t
    pad = t.new_full((t.size(0), extra) + tuple(t.shape[2:]), value)
    return torch.cat([pad, t] if left else [t, pad], dim=1)


def merge_scored_rows(parts: list[tuple[dict, list[int], bool]], pad_token_id: int) -> dict:
    """Concatenate rows of several scored batches (the dicts the trainer's scoring returns) into one.

    ``parts``: ``(batch, rows, carries_loss)``; a part with ``carries_loss=False`` keeps its rows with the loss
    mask (``tool_mask``) set to 0, so they count in no normalizer. Prompts are left-padded and completions
    right-padded to the widest part; (B, C) per-token tensors (log-probs, turn-level advantages) are right-padded
    with 0 with the completions; (B,) and other tensors are concatenated; non-tensor entries are taken from the
    first part (``num_items_in_batch`` is left to the caller).
    """
    parts = [(b, rows, loss) for b, rows, loss in parts if rows]
    if not parts:
        raise ValueError("merge_scored_rows: no rows to merge.")
    p_w = max(b["prompt_ids"].size(1) for b, _, _ in parts)
    c_w = max(b["completion_ids"].size(1) for b, _, _ in parts)
    out = {}
    for key, first in parts[0][0].items():
        if not isinstance(first, torch.Tensor) or first.dim() == 0:
            out[key] = first
            continue
        per_sequence = all(b[key].dim() >= 2 and b[key].size(1) == 1 for b, _, _ in parts)  # e.g. (B, 1) ratios
        pieces = []
        for batch, rows, loss in parts:
            v = batch[key][torch.tensor(rows, dtype=torch.long, device=batch[key].device)]  # (b, ...)
            if key in ("prompt_ids", "prompt_mask"):
                v = _pad_to(v, p_w, left=True, value=pad_token_id if key == "prompt_ids" else 0)  # (b, P)
            elif v.dim() >= 2 and v.size(1) == batch["completion_ids"].size(1) and not per_sequence:
                v = _pad_to(v, c_w, left=False, value=pad_token_id if key == "completion_ids" else 0)  # (b, C)
            if key == "tool_mask" and not loss:
                v = torch.zeros_like(v)
            pieces.append(v)
        out[key] = torch.cat(pieces, dim=0)
    if "tool_mask" not in out:  # every row's loss mask is its completion mask; filler rows carry none
        out["tool_mask"] = torch.cat(
            [_pad_to(b["completion_mask"][torch.tensor(rows, dtype=torch.long)], c_w, False, 0) * int(loss)
             for b, rows, loss in parts]
        )
    return out
