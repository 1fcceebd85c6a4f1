"""The per-turn layout (``turn_layout="per_turn"``): one training row per turn instead of one per trajectory.

A trajectory ``tau = (u_1, a_1, ..., u_K, a_K)`` of the per-turn layout was sampled turn by turn, turn k from its own
rendered context ``c_k`` (the conversation through the chat template, or through a context function; ``c_k`` need
not be a prefix of ``c_{k+1}``: thinking templates drop earlier ``<think>`` blocks, context functions drop or cut old
observations). Its rows are ``(c_k, a_k)``, k = 1..K: the context as the prompt (never trained) and the ids sampled in
turn k, exactly as sampled, as the completion. The policy is then trained on exactly what it was conditioned on.

Everything the loss reads per token (advantages under turn-level credit, the sampler's log-probs, importance
ratios, the loss mask) is cut from the trajectory's single-sequence row at the columns of ``a_k``; everything per
trajectory (its advantage, reward) is repeated on each of its rows; and each row carries ``sequence_tokens``, N_g of
its trajectory (its loss tokens over all its rows), so that :func:`trl_multiturn.loss.aggregate_loss` weighs a
trajectory the same whether it is one row or K rows (docs/math.md).

A trajectory without turn contexts (a failed reset, or the single-sequence layout) keeps its one row as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .trajectory import Trajectory

#: the batch key that ties a scored row to its :class:`TurnRows` until the rollout is expanded
TRAJECTORY_ID = "trajectory_id"


@dataclass(frozen=True)
class TurnRows:
    """Where the turns of one trajectory lie.

    Attributes:
        contexts: one id list per row, the context its first turn was generated from (``Trajectory.turn_contexts``).
        columns: one list per row, the completion columns (in the trajectory's single-sequence row) the row trains
            on, in order: the tokens sampled in its turn, or, for turns merged into one row (:func:`turn_rows_of`),
            everything from its first sampled token to its last, observations included with loss mask 0.
    """

    contexts: list[list[int]]
    columns: list[list[int]]


def turn_rows_of(traj: Trajectory, merge: bool = True) -> TurnRows | None:
    """The :class:`TurnRows` of a per-turn trajectory; None when it has no turn contexts (one row stays one row).

    With ``merge`` (the default), consecutive turns whose contexts nest share one row: when ``c_{k+1}`` is exactly
    ``c_k`` followed by the trajectory's own tokens from the start of ``a_k`` (``a_k`` and the observation after it),
    turn k+1 is the continuation of turn k's row, whose completion then spans both turns (the observation between them
    with loss mask 0). The log-probs are the same (a causal model conditions each token on the same ids) and the
    shared prefix is computed once; a template that keeps the prefix property gives back the single sequence, a
    thinking template splits where it drops a ``<think>`` block, a context function where it rewrites an
    observation. A turn that sampled no token contributes no row."""
    if not traj.turn_contexts:
        return None
    starts: list[int | None] = [None] * traj.num_turns  # first completion column of each action
    ends = [0] * traj.num_turns  # one past its last sampled column
    for c, (k, m) in enumerate(zip(traj.turn_ids, traj.action_mask)):
        if m:
            starts[k] = c if starts[k] is None else starts[k]
            ends[k] = c + 1
    contexts: list[list[int]] = []
    columns: list[list[int]] = []
    first = None  # (context, start column) of the row being extended
    for k, ctx in enumerate(traj.turn_contexts):
        if starts[k] is None:
            continue
        nests = (merge and first is not None
                 and list(ctx) == first[0] + traj.completion_ids[first[1] : starts[k]])
        if nests:
            columns[-1] = list(range(first[1], ends[k]))  # the row now runs to the end of turn k
        else:
            first = (list(ctx), starts[k])
            contexts.append(list(ctx))
            columns.append(list(range(starts[k], ends[k])))
    return TurnRows(contexts=contexts, columns=columns) if contexts else None


def _row_plan(batch: dict, rows_of: Sequence[TurnRows | None]) -> list[tuple[int, list[int], list[int], list[int]]]:
    """``(source row b, prompt ids, context ids moved into the completion, completion columns)`` of every output row,
    trajectories in order. A context that starts with the trajectory's prompt keeps that prompt as the row's prompt
    and the rest of the context becomes the head of its completion (loss mask 0): every row of a GRPO group then has
    the group's prompt, which the shared-prompt forward computes once for all of them."""
    prompt_ids, prompt_mask, completion_mask = batch["prompt_ids"], batch["prompt_mask"], batch["completion_mask"]
    plan = []
    for b, turns in enumerate(rows_of):
        prompt = prompt_ids[b][prompt_mask[b].bool()].tolist()
        if turns is None:  # the single-sequence row unchanged: its prompt without padding, every real column
            plan.append((b, prompt, [], torch.nonzero(completion_mask[b], as_tuple=False).flatten().tolist()))
            continue
        for ctx, cols in zip(turns.contexts, turns.columns):
            if len(ctx) > len(prompt) and ctx[: len(prompt)] == prompt:
                plan.append((b, prompt, ctx[len(prompt) :], cols))
            else:
                plan.append((b, ctx, [], cols))
    return plan


def expand_turn_rows(batch: dict, rows_of: Sequence[TurnRows | None], pad_token_id: int) -> tuple[dict, list[int]]:
    """The scored rollout with one row per turn.

    Args:
        batch: TRL's scored rollout, B rows (``prompt_ids`` (B, P) left-padded, ``completion_ids`` (B, C)
            right-padded, ``completion_mask``, ``tool_mask`` (B, C), per-trajectory tensors (B,) or (B, 1),
            per-token tensors (B, C)); the :data:`TRAJECTORY_ID` key, if present, is dropped.
        rows_of: B entries, the :class:`TurnRows` of row b (None: keep row b whole).
        pad_token_id: padding of the new prompts and completions.

    Returns:
        ``(rows, owner)``: the dict with R >= B rows in the same layout (prompts = the trajectory's prompt, or the
        context when it does not start with it, left-padded; completions = the rest of the context, then the row's
        columns of the trajectory, right-padded; per-token tensors cut at the same columns, 0 on the moved context
        and on padding, so the moved context carries no loss; per-trajectory tensors repeated), plus
        ``sequence_tokens`` (R,) N_g of each row's trajectory, ``context_tokens`` (R,) the context tokens moved into
        each row's completion; and ``owner``, R source rows b, non-decreasing.
    """
    n, width = batch["completion_ids"].shape  # B, C
    if len(rows_of) != n:
        raise ValueError(f"internal: {len(rows_of)} turn plans for a rollout of {n} rows")
    plan = _row_plan(batch, rows_of)
    owner = [b for b, _, _, _ in plan]
    source = torch.tensor(owner, dtype=torch.long)  # (R,)
    p_w = max(len(prompt) for _, prompt, _, _ in plan)
    c_w = max(1, max(len(head) + len(cols) for _, _, head, cols in plan))
    cols = torch.zeros((len(plan), c_w), dtype=torch.long)  # (R, C') source column of each new column
    valid = torch.zeros((len(plan), c_w), dtype=torch.bool)  # (R, C') a column taken from the trajectory
    head_ids = torch.full((len(plan), c_w), pad_token_id, dtype=torch.long)  # (R, C') context ids moved to the head
    is_head = torch.zeros((len(plan), c_w), dtype=torch.bool)  # (R, C')
    prompts = torch.full((len(plan), p_w), pad_token_id, dtype=torch.long)  # (R, P')
    prompt_mask = torch.zeros((len(plan), p_w), dtype=torch.long)  # (R, P')
    for r, (_, prompt, head, c) in enumerate(plan):
        h = len(head)
        if h:
            head_ids[r, :h] = torch.tensor(head, dtype=torch.long)
            is_head[r, :h] = True
        cols[r, h : h + len(c)] = torch.tensor(c, dtype=torch.long)
        valid[r, h : h + len(c)] = True
        if prompt:
            prompts[r, p_w - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            prompt_mask[r, p_w - len(prompt) :] = 1
    loss_tokens = (batch["completion_mask"] * batch["tool_mask"]).sum(dim=1)  # (B,) N_g

    out: dict = {}
    for key, value in batch.items():
        if key == TRAJECTORY_ID:
            continue
        if key in ("prompt_ids", "prompt_mask"):
            continue
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.size(0) != n:
            out[key] = value  # scalars, counts and anything not per row
            continue
        rows = value[source.to(value.device)]  # (R, ...)
        if value.dim() >= 2 and value.size(1) == width:  # per token (R, C) -> the turn's columns
            gathered = torch.gather(rows, 1, cols.to(value.device).view(len(plan), c_w, *([1] * (value.dim() - 2)))
                                    .expand(len(plan), c_w, *value.shape[2:]))  # (R, C', ...)
            fill = pad_token_id if key == "completion_ids" else 0
            mask = valid.to(value.device).view(len(plan), c_w, *([1] * (value.dim() - 2)))
            rows = torch.where(mask, gathered, torch.full_like(gathered, fill))  # (R, C', ...)
            if key == "completion_ids":  # the context moved into the completion: attended, never trained
                rows = torch.where(is_head.to(value.device), head_ids.to(value.device), rows)
            elif key == "completion_mask":
                rows = torch.where(is_head.to(value.device), torch.ones_like(rows), rows)
        out[key] = rows
    device = batch["prompt_ids"].device
    out["prompt_ids"], out["prompt_mask"] = prompts.to(device), prompt_mask.to(device)
    out["sequence_tokens"] = loss_tokens[source.to(loss_tokens.device)].to(torch.float32)  # (R,)
    out["context_tokens"] = is_head.sum(dim=1).to(device=device, dtype=torch.float32)  # (R,) moved context per row
    return out, owner


def trajectory_mini_batches(owner: Sequence[int], num_trajectories: int, num_mini_batches: int) -> list[list[int]]:
    """The rows of each mini-batch: ``num_mini_batches`` equal consecutive slices of the trajectories (whole groups,
    as the shuffle left them), each with all of its rows.

    Args:
        owner: R source trajectories of the rows, non-decreasing (:func:`expand_turn_rows`).
        num_trajectories: B.
        num_mini_batches: divides B.
    """
    if num_mini_batches < 1 or num_trajectories % num_mini_batches != 0:
        raise ValueError(f"internal: {num_trajectories} trajectories do not split into {num_mini_batches} mini-batches")
    per_mini = num_trajectories // num_mini_batches
    minis: list[list[int]] = [[] for _ in range(num_mini_batches)]
    for r, b in enumerate(owner):
        minis[b // per_mini].append(r)
    return minis


class TurnRowRegistry:
    """Keeps the :class:`TurnRows` of the per-turn trajectories of the current rollout until it is expanded: the
    scored rollout carries a :data:`TRAJECTORY_ID` (B,) column through TRL's scoring, dynamic sampling's merge and
    the group shuffle, and :meth:`expand` reads it back."""

    def __init__(self, merge: bool = True) -> None:
        self._rows: dict[int, TurnRows | None] = {}
        self._next = 0
        self.merge = merge

    def register(self, output: dict, trajs: Sequence[Trajectory]) -> None:
        """Give each trajectory an id and add the (B,) id column to ``output``, TRL's scored rollout."""
        ids = list(range(self._next, self._next + len(trajs)))
        self._next += len(trajs)
        self._rows.update((i, turn_rows_of(t, self.merge)) for i, t in zip(ids, trajs))
        output[TRAJECTORY_ID] = torch.tensor(ids, dtype=torch.long, device=output["completion_ids"].device)  # (B,)

    def expand(self, batch: dict, pad_token_id: int) -> tuple[dict, list[int]]:
        """:func:`expand_turn_rows` of a rollout whose rows were registered; the registry is emptied."""
        rows_of = [self._rows[int(i)] for i in batch[TRAJECTORY_ID].tolist()]
        self._rows.clear()
        return expand_turn_rows(batch, rows_of, pad_token_id)
