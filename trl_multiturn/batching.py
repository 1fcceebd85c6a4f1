"""The batch plan: one rollout of B prompts x G samples -> mini-batches (optimizer steps) -> micro-batches.

In the terms of the theory (and of VeRL's PPO trainer):

    rollout      B = train_batch_size prompts x G = num_generations samples = B*G trajectories, one frozen old policy
    mini-batch   mini_batch_size trajectories (global, all devices) = ONE optimizer step; B*G / mini per epoch
    micro-batch  micro_batch_size trajectories per device per forward/backward; mini / (micro * world) of them
                 are accumulated into one step
    ppo_epochs   passes over the rollout before the next one

:class:`BatchPlan` checks that these fit together and maps them onto the knobs TRL's ``GRPOConfig`` understands
(``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``steps_per_generation``, ``num_iterations``).

Departures: VeRL counts ``ppo_mini_batch_size`` in prompts and multiplies it by ``n``; here every size after
``train_batch_size`` is counted in trajectories. A mini-batch that is not a multiple of G (so that prompt groups
are split across optimizer steps) is allowed with a warning: the update is still valid, but the "pg_loss is 0 on a
fresh rollout" identity (docs/math.md) then holds only for the rollout as a whole, not per step.

The planner cuts one scored rollout (TRL's dict of ``(B, ...)`` tensors) into those micro-batches:
:func:`shuffle_groups` permutes whole GRPO groups, :func:`balanced_micro_batches` deals each mini-batch into its
accumulation slots balanced by tokens (or cut to a token budget, VeRL's ``use_dynamic_bsz``), trimmed to their own
padding, and :func:`attach_normalizers` gives every micro-batch the loss normalizers of its whole mini-batch over all
ranks, so that the accumulated micro-batch losses equal the mini-batch loss (``trl_multiturn.loss``).
:func:`chunk_tokens` is the cost model: the tokens the training forward of a micro-batch computes in its layout.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from dataclasses import dataclass

import torch

from .layouts import prefix_tree_row, prompt_completion_contiguous, prompt_keys, shares_prompts
from .loss import loss_normalizers


def _nearest(value: int, candidates: list[int]) -> int | None:
    """The candidate closest to ``value`` (the smaller one on a tie), or None when there is none."""
    return min(candidates, key=lambda c: (abs(c - value), c)) if candidates else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class BatchPlan:
    """How one rollout is cut into optimizer steps and accumulation steps. All sizes are positive ints.

    Args:
        train_batch_size: B, prompts per rollout.
        num_generations: G, samples per prompt (the group size), >= 2.
        mini_batch_size: trajectories per optimizer step, across all devices; divides B*G.
        micro_batch_size: trajectories per device per forward/backward; ``micro * world_size`` divides
            ``mini_batch_size``.
        ppo_epochs: passes over each rollout (TRL ``num_iterations``).
        world_size: data-parallel processes.

    Example: ``BatchPlan(256, 5, 128, 32)`` -> 1280 trajectories, 10 optimizer steps of 4 accumulation steps.

    Raises:
        ValueError: any combination that cannot be realised, naming the knobs, their values and a valid choice.
    """

    train_batch_size: int
    num_generations: int
    mini_batch_size: int
    micro_batch_size: int
    ppo_epochs: int = 1
    world_size: int = 1

    def __post_init__(self) -> None:
        for name in ("train_batch_size", "num_generations", "mini_batch_size", "micro_batch_size", "ppo_epochs",
                     "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BatchPlan: {name}={value!r} must be a positive int.")
        B, G, mini, micro, world = (self.train_batch_size, self.num_generations, self.mini_batch_size,
                                    self.micro_batch_size, self.world_size)
        rollout = B * G
        per_pass = micro * world  # trajectories in one forward/backward across all devices
        if G < 2:
            raise ValueError(
                f"BatchPlan: num_generations={G}; GRPO needs at least 2 samples per prompt for a group baseline "
                "(with 1, the advantage is the raw reward). Set num_generations >= 2, e.g. 5 or 8."
            )
        if mini > rollout:
            raise ValueError(
                f"BatchPlan: mini_batch_size={mini} is larger than one rollout of train_batch_size={B} x "
                f"num_generations={G} = {rollout} trajectories. Use mini_batch_size <= {rollout} that divides it "
                f"(e.g. {rollout}), or raise train_batch_size to {mini // math.gcd(mini, G)} or a multiple of it."
            )
        if rollout % mini != 0:
            valid = [d for d in _divisors(rollout) if d % per_pass == 0]
            hint = (f"valid mini_batch_size values for micro_batch_size={micro} x world_size={world}: {valid}, "
                    f"nearest {_nearest(mini, valid)}") if valid else "change train_batch_size or num_generations"
            raise ValueError(
                f"BatchPlan: train_batch_size={B} x num_generations={G} = {rollout} trajectories per rollout is not "
                f"divisible by mini_batch_size={mini}; {hint}."
            )
        if per_pass > mini:
            ok_micro = [m for m in range(1, micro) if mini % (m * world) == 0]
            raise ValueError(
                f"BatchPlan: micro_batch_size={micro} x world_size={world} = {per_pass} trajectories per "
                f"forward/backward exceeds mini_batch_size={mini}. Lower micro_batch_size to "
                f"{max(ok_micro) if ok_micro else 'a divisor of mini_batch_size / world_size'} or raise "
                f"mini_batch_size to a multiple of {per_pass} that divides {rollout}."
            )
        if mini % per_pass != 0:
            ok_micro = [m for m in range(1, mini // world + 1) if mini % (m * world) == 0]
            if ok_micro:
                hint = f"Valid micro_batch_size values: {ok_micro} (nearest {_nearest(micro, ok_micro)})."
            else:
                ok_mini = [d for d in _divisors(rollout) if d % world == 0]
                hint = (f"No micro_batch_size works: mini_batch_size must be a multiple of world_size={world}; "
                        + (f"valid mini_batch_size values: {ok_mini}." if ok_mini else
                           f"no divisor of the rollout ({rollout} trajectories) is. Change train_batch_size, "
                           "num_generations or the number of processes."))
            raise ValueError(
                f"BatchPlan: mini_batch_size={mini} is not divisible by micro_batch_size={micro} x "
                f"world_size={world} = {per_pass}, so it cannot be split into whole accumulation steps. {hint}"
            )
        if mini % G != 0:
            step = math.lcm(G, per_pass)
            valid = [d for d in _divisors(rollout) if d % step == 0]
            warnings.warn(
                f"BatchPlan: mini_batch_size={mini} is not a multiple of num_generations={G}, so prompt groups are "
                f"split across optimizer steps: each step's on-policy pg_loss is then not 0 (the update is still "
                f"valid). For whole groups per step use mini_batch_size in {valid}.",
                UserWarning,
                stacklevel=3,
            )

    # ----- derived sizes -----
    @property
    def trajectories_per_rollout(self) -> int:
        """B * G: trajectories sampled from one frozen old policy."""
        return self.train_batch_size * self.num_generations

    @property
    def mini_batches_per_rollout(self) -> int:
        """B * G / mini_batch_size: optimizer steps per pass over the rollout."""
        return self.trajectories_per_rollout // self.mini_batch_size

    @property
    def optimizer_steps_per_rollout(self) -> int:
        """mini_batches_per_rollout * ppo_epochs: optimizer steps between two rollouts."""
        return self.mini_batches_per_rollout * self.ppo_epochs

    @property
    def gradient_accumulation_steps(self) -> int:
        """mini_batch_size / (micro_batch_size * world_size): forward/backward passes per optimizer step."""
        return self.mini_batch_size // (self.micro_batch_size * self.world_size)

    @property
    def micro_batches_per_rollout(self) -> int:
        """B * G / (micro_batch_size * world_size): forward/backward passes per device per pass over the rollout."""
        return self.trajectories_per_rollout // (self.micro_batch_size * self.world_size)

    @property
    def whole_groups_per_mini_batch(self) -> bool:
        """True when every mini-batch can hold whole prompt groups (mini_batch_size is a multiple of G)."""
        return self.mini_batch_size % self.num_generations == 0

    def trl_kwargs(self) -> dict[str, int]:
        """The ``GRPOConfig`` values that realise this plan (run with ``world_size`` processes).

        TRL derives ``generation_batch_size = per_device_train_batch_size * world_size * steps_per_generation``,
        which is B * G here, and generates again every ``steps_per_generation * num_iterations`` micro-steps.
        """
        return {
            "per_device_train_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "steps_per_generation": self.micro_batches_per_rollout,
            "num_iterations": self.ppo_epochs,
            "num_generations": self.num_generations,
        }

    def describe(self) -> str:
        """The pipeline drawn as the theory draws it: rollout -> mini-batches -> micro-batches, with the counts."""
        B, G = self.train_batch_size, self.num_generations
        mini, micro, world = self.mini_batch_size, self.micro_batch_size, self.world_size
        ga, steps, epochs = self.gradient_accumulation_steps, self.mini_batches_per_rollout, self.ppo_epochs
        lines = [
            f"rollout: {B} prompts x {G} samples = {self.trajectories_per_rollout} trajectories "
            f"(one frozen old policy), {epochs} PPO epoch(s)",
            f"  -> {steps} mini-batches of {mini} trajectories = {steps} optimizer step(s) per epoch, "
            f"{self.optimizer_steps_per_rollout} per rollout",
            f"       -> each mini-batch: {ga} accumulation step(s) x {world} device(s) x micro-batch of {micro} "
            f"trajectories",
            "TRL GRPOConfig: " + ", ".join(f"{k}={v}" for k, v in self.trl_kwargs().items()),
        ]
        if not self.whole_groups_per_mini_batch:
            lines.append(f"note: mini_batch_size={mini} is not a multiple of num_generations={G}; groups are split "
                         "across optimizer steps")
        return "\n".join(lines)


def balanced_partition(lengths: list[int], num_parts: int) -> list[list[int]]:
    """Split rows into ``num_parts`` micro-batches of similar lengths and balanced padded size (VeRL's dynamic batch
    size with a fixed micro-batch count).

    Rows are sorted by length (longest first) and the sorted list is cut into consecutive parts so that each part's
    padded cost (rows x its longest row) is as even as the cut points allow. Rows of similar length share a
    micro-batch, so each part padded only to its own longest row wastes little; the long rows get small parts and
    the short rows large ones, which keeps the memory of a forward/backward even. Every part gets at least one row.
    Returns row indices per part, each sorted.

    Example: lengths [10, 9, 2, 1] into 2 parts -> [[0, 1], [2, 3]] (padded sizes 2 x 10 and 2 x 2).
    """
    if num_parts < 1:
        raise ValueError(f"balanced_partition needs num_parts >= 1; got {num_parts}.")
    n = len(lengths)
    if n < num_parts:
        raise ValueError(
            f"Cannot split {n} rows into {num_parts} non-empty micro-batches; lower "
            "gradient_accumulation_steps or raise the mini-batch size."
        )
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    sorted_len = [lengths[i] for i in order]

    def parts_needed(budget: int) -> int:
        """Greedy count of consecutive parts whose padded cost stays within ``budget``."""
        parts, rows, head = 1, 0, None
        for length in sorted_len:
            head = length if head is None else head
            if (rows + 1) * head > budget and rows > 0:
                parts, rows, head = parts + 1, 0, length
            rows += 1
        return parts

    # The smallest budget that needs at most num_parts parts (binary search on the padded cost).
    low, high = max(sorted_len), max(sorted_len) * n
    while low < high:
        mid = (low + high) // 2
        if parts_needed(mid) <= num_parts:
            high = mid
        else:
            low = mid + 1
    cuts: list[list[int]] = [[]]
    head = None
    for position, length in enumerate(sorted_len):
        head = length if head is None else head
        remaining_rows = n - position
        remaining_parts = num_parts - len(cuts)
        if cuts[-1] and ((len(cuts[-1]) + 1) * head > low or remaining_rows <= remaining_parts):
            cuts.append([])
            head = length
        cuts[-1].append(order[position])
    while len(cuts) < num_parts:  # fewer cuts were needed: split the largest parts so every part has a row
        largest = max(range(len(cuts)), key=lambda k: len(cuts[k]))
        half = len(cuts[largest]) // 2
        cuts.insert(largest + 1, cuts[largest][half:])
        cuts[largest] = cuts[largest][:half]
    return [sorted(p) for p in cuts]


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins whose lengths sum to at most ``capacity`` (first-fit decreasing;
    an item longer than ``capacity`` gets a bin of its own). Bins are in creation order, members longest first."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def _tokens_processed(chunk: dict, compact: bool, pack: bool = False, share: bool = False) -> int:
    """Tokens one training forward of ``chunk`` computes, padding included."""
    return chunk_tokens(chunk, compact, pack, share)[0]


def chunk_tokens(chunk: dict, compact: bool, pack: bool = False, share: bool = False,
                 min_shared: int | None = None) -> tuple[int, int]:
    """``(processed, real)``: tokens the training forward of ``chunk`` computes, padding included, and how many of
    them are real tokens. With ``share``, a prompt repeated in the chunk is computed once (see
    ``trl_multiturn.layouts.shared_prompt_row``); with ``min_shared`` too, every run of at least that many tokens
    that rows continue alike past their prompt (the prefix tree, ``trl_multiturn.layouts.prefix_tree_row``)."""
    prompt_len, completion_len = chunk["prompt_mask"].sum(1), chunk["completion_mask"].sum(1)  # (B,)
    real = int(prompt_len.sum() + completion_len.sum())
    if not compact:
        return chunk["prompt_ids"].numel() + chunk["completion_ids"].numel(), real
    lengths = (prompt_len + completion_len).tolist()
    if not lengths:
        return 0, 0
    if share and not chunk.get("empty_micro_batch"):
        keys = prompt_keys(chunk["prompt_ids"], chunk["prompt_mask"])
        if shares_prompts(keys):
            cost = _shared_cost(keys, prompt_len.tolist(), completion_len.tolist(), range(len(keys)))
            if min_shared is not None:
                cost = _tree_tokens(chunk, range(len(keys)), min_shared, keys) or cost
            return cost, cost  # one row, no padding
    rows = len(first_fit_decreasing(lengths, max(lengths))) if pack else len(lengths)
    return int(max(lengths)) * rows, real


def _shared_cost(keys: list, prompt_len: list[int], completion_len: list[int], part) -> int:
    """Tokens the training forward of rows ``part`` computes. When a prompt repeats in it (shared-prompt forward,
    one row without padding): each distinct prompt once, less its last token, plus each row's ``[last prompt token,
    completion]``; otherwise rows x longest row."""
    part = list(part)
    if not shares_prompts([keys[i] for i in part]):
        return len(part) * max(prompt_len[i] + completion_len[i] for i in part)
    distinct = {keys[i]: prompt_len[i] - 1 for i in part}
    return sum(distinct.values()) + sum(completion_len[i] + 1 for i in part)


def _tree_tokens(batch: dict, index, min_shared: int | None, keys: list | None = None) -> int | None:
    """Length of the prefix-tree row (:func:`~trl_multiturn.layouts.prefix_tree_row`) of rows ``index`` of ``batch``
    (prompts only with ``min_shared=None``); None when those rows cannot be laid out so (a mask with holes, a prompt
    shorter than two tokens)."""
    idx = torch.tensor(list(index), dtype=torch.long, device=batch["prompt_ids"].device)
    prompt_mask, completion_mask = batch["prompt_mask"][idx], batch["completion_mask"][idx]
    p_w = max(int(prompt_mask.sum(1).max()), 1)
    c_w = max(int(completion_mask.sum(1).max()), 1)
    prompt_ids, prompt_mask = batch["prompt_ids"][idx][:, -p_w:], prompt_mask[:, -p_w:]
    mask = torch.cat([prompt_mask, completion_mask[:, :c_w]], dim=1)  # (b, p_w + c_w)
    if int(prompt_mask.sum(1).min()) < 2 or not prompt_completion_contiguous(mask, c_w):
        return None
    ids = torch.cat([prompt_ids, batch["completion_ids"][idx][:, :c_w]], dim=1)
    keys = keys if keys is not None else prompt_keys(prompt_ids, prompt_mask)
    return int(prefix_tree_row(ids, mask, c_w, keys, min_shared).ids.size(1))


@dataclass(frozen=True)
class _Unit:
    """The rows of one trajectory in the per-turn layout, planned as one: ``prompts`` maps each prompt key of its rows
    to the tokens the prefix-tree row lays out for it once (the prompt less its last token), ``rest`` the rest of its
    prefix-tree row (the tokens of its own, its earlier turns laid out once)."""

    rows: tuple[int, ...]
    prompts: dict
    rest: int


def _units_cost(units: list[_Unit], part) -> int:
    """Tokens of the prefix-tree row of the units ``part``: each distinct prompt once, plus each unit's own tokens (an
    upper bound: runs that different trajectories continue alike past a prompt are shared too)."""
    prompts: dict = {}
    for u in part:
        prompts.update(units[u].prompts)
    return sum(prompts.values()) + sum(units[u].rest for u in part)


def _trajectory_units(batch: dict, rows: list[int], owner: list[int], min_shared: int | None) -> list[_Unit] | None:
    """The rows of a mini-batch grouped by trajectory (rows of one trajectory are consecutive), with their prefix-tree
    cost; None when some trajectory's rows cannot be laid out as a prefix tree."""
    by_owner: dict[int, list[int]] = defaultdict(list)
    for r in rows:
        by_owner[owner[r]].append(r)
    units = []
    for members in by_owner.values():
        idx = torch.tensor(members, dtype=torch.long, device=batch["prompt_ids"].device)
        keys = prompt_keys(batch["prompt_ids"][idx], batch["prompt_mask"][idx])
        length = _tree_tokens(batch, members, min_shared, keys)
        if length is None:
            return None
        prompts = {key: len(key) - 1 for key in keys}
        units.append(_Unit(tuple(members), prompts, length - sum(prompts.values())))
    return units


def _per_turn_parts(batch: dict, rows: list[int], owner: list[int], accum: int, max_tokens: int | None,
                    min_shared: int | None, row_parts: list[list[int]],
                    row_over_budget: bool) -> tuple[list[list[int]], bool]:
    """Micro-batches of whole trajectories for the per-turn layout with the prefix-tree forward, when they compute
    fewer tokens than ``row_parts`` (the rows dealt one by one, over the budget when ``row_over_budget``). Returns
    the plan (positions into ``rows``) and whether it is over the budget.

    A trajectory's rows repeat its earlier turns in their contexts; laid out in one prefix tree they are computed
    once, but only when the rows share a micro-batch, which dealing rows by length rarely gives. Without a budget:
    ``accum`` consecutive slices of equal numbers of trajectories (``micro_batch_size`` trajectories each, in the
    shuffled order, so the members of a group stay together and share their prompt). With ``max_tokens``: the fewest
    micro-batches of whole trajectories within the budget, cut like :func:`_shared_budget_parts` (a trajectory over
    the budget alone). Kept: the plan within the budget, then the one with fewer micro-batches (budget), then the
    one with fewer tokens."""
    units = _trajectory_units(batch, rows, owner, min_shared)
    if units is None or len(units) == len(rows):  # no trajectory has several rows: nothing to keep together
        return row_parts, row_over_budget
    if max_tokens:
        grouped = _budget_cut(len(units), lambda part: _units_cost(units, part),
                              lambda u: units[u].rest - 1, _unit_orders(units), max_tokens, accum)
    elif len(units) % accum == 0:
        size = len(units) // accum
        grouped = [list(range(k * size, (k + 1) * size)) for k in range(accum)]
    else:
        grouped = None
    if grouped is None:
        return row_parts, row_over_budget
    position = {r: i for i, r in enumerate(rows)}
    parts = [sorted(position[r] for u in part for r in units[u].rows) for part in grouped]

    def cost(plan, over):
        return (over, len(plan) if max_tokens else 0,
                sum(_tree_tokens(batch, [rows[i] for i in part], min_shared) or math.inf for part in plan if part))

    return (parts, False) if cost(parts, False) <= cost(row_parts, row_over_budget) else (row_parts, row_over_budget)


def _unit_orders(units: list[_Unit]) -> list[list[int]]:
    """Orders to cut trajectories in: as shuffled (a group's members together), and by cost, longest first."""
    n = len(units)
    return [list(range(n)), sorted(range(n), key=lambda u: (-units[u].rest, u))]


def _rows(value, index: list[int]):
    if isinstance(value, torch.Tensor):
        return value[torch.tensor(index, dtype=torch.long, device=value.device)]
    return [value[i] for i in index]


def _take_rows(batch: dict, index: list[int], n: int, prompt_width: int, completion_width: int) -> dict:
    """The rows ``index`` of ``batch``, prompts cut to their last ``prompt_width`` columns (left padding) and the
    completion-wide (B, C) tensors to their first ``completion_width`` columns (right padding)."""
    width = batch["completion_ids"].size(1)
    chunk = {}
    for key, value in batch.items():
        if value is None or isinstance(value, torch.Tensor) and value.ndim == 0:
            chunk[key] = value
            continue
        if not isinstance(value, (torch.Tensor, list)) or len(value) != n:
            chunk[key] = value
            continue
        v = _rows(value, index)
        if isinstance(v, torch.Tensor) and key in ("prompt_ids", "prompt_mask"):
            v = v[:, v.size(1) - prompt_width :]
        elif isinstance(v, torch.Tensor) and v.ndim == 2 and v.size(1) == width:
            v = v[:, :completion_width]
        chunk[key] = v
    return chunk


def _empty_micro_batch(batch: dict, row: int, n: int) -> dict:
    """A micro-batch that carries no loss: one row cut to two real tokens (its last prompt token and first
    completion token, or its last two prompt tokens), the loss mask (``tool_mask``) all 0. Its forward/backward keeps
    the accumulation count and the DDP/DeepSpeed hooks as planned at ~no cost; a row without a loss token counts in
    no normalizer, so the mini-batch loss is unchanged."""
    has_completion = int(batch["completion_mask"][row].sum()) > 0
    chunk = _take_rows(batch, [row], n, 1 if has_completion else 2, 1)
    chunk["tool_mask"] = torch.zeros_like(chunk["tool_mask"])
    chunk["empty_micro_batch"] = True
    return chunk


def _token_budget_parts(lengths: list[int], budget: int, slots: int) -> list[list[int]] | None:
    """Rows sorted by length (longest first) and cut into the fewest consecutive micro-batches whose padded size
    (rows x longest row) fits ``budget`` (a row longer than the budget goes alone), and among those the one with the
    fewest tokens processed; similar lengths share a micro-batch, so little is padding. None when that takes more
    than ``slots`` micro-batches. Returns row indices per part, each sorted."""
    n = len(lengths)
    return _shared_budget_parts([(i,) for i in range(n)], [1] * n, [x - 1 for x in lengths], budget, slots)


def _shared_budget_parts(keys: list, prompt_len: list[int], completion_len: list[int], budget: int,
                         slots: int) -> list[list[int]] | None:
    """:func:`_token_budget_parts` where a micro-batch that repeats a prompt costs what the shared-prompt forward
    computes (:func:`_shared_cost`: each distinct prompt once, no padding). Rows are laid out in three orders (by
    length; by completion length; a prompt's rows together, longest completion first), each cut into the fewest
    consecutive parts within the budget with the fewest tokens among those (dynamic programming), and the best plan
    kept. None when it needs more than ``slots`` parts."""
    n = len(keys)
    by_prompt: dict[tuple, list[int]] = defaultdict(list)
    for i in range(n):
        by_prompt[keys[i]].append(i)
    groups = sorted(by_prompt.values(), key=lambda rows: (-max(prompt_len[i] + completion_len[i] for i in rows), rows[0]))
    orders = [sorted(range(n), key=lambda i: (-(prompt_len[i] + completion_len[i]), i))]
    if len(groups) < n:
        orders += [
            sorted(range(n), key=lambda i: (-completion_len[i], i)),
            [i for rows in groups for i in sorted(rows, key=lambda i: (-completion_len[i], i))],
        ]
    return _budget_cut(n, lambda part: _shared_cost(keys, prompt_len, completion_len, part),
                       lambda i: completion_len[i], orders, budget, slots)


def _budget_cut(n: int, cost, floor, orders: list[list[int]], budget: int, slots: int) -> list[list[int]] | None:
    """The best of cutting each order of the items ``0..n-1`` into consecutive parts within ``budget``
    (:func:`_cheapest_cut`, :func:`_greedy_cut`): the fewest parts, then the fewest tokens (``cost(part)``; ``floor(i)
    + 1`` is a lower bound of what item i adds to a part). None when it needs more than ``slots`` parts."""
    plans = []
    for order in orders:
        for parts in (_cheapest_cut(order, cost, floor, budget), _greedy_cut(order, cost, budget)):
            plans.append((len(parts), sum(cost(p) for p in parts), parts))
    count, _, parts = min(plans, key=lambda plan: plan[:2])
    return [sorted(p) for p in parts] if count <= slots else None


def _greedy_cut(order, cost, budget) -> list[list[int]]:
    """Consecutive parts of ``order``, each as long as the budget allows (fewest parts for a length-sorted order)."""
    parts: list[list[int]] = []
    for i in order:
        if parts and cost(parts[-1] + [i]) <= budget:
            parts[-1].append(i)
        else:
            parts.append([i])
    return parts


#: the most rows a micro-batch gets from the cheapest-cut search (bounds its O(n * rows^2) cost; the greedy cut,
#: also a candidate, has no bound)
_MAX_SEARCH_ROWS = 64


def _cheapest_cut(order, cost, floor, budget) -> list[list[int]]:
    """Consecutive parts of ``order`` within ``budget`` (a row alone may exceed it): the fewest parts, and among them
    the fewest tokens processed, ``best[j] = min_i best[i] + (1, cost(order[i:j]))``. A part stops growing once its
    completion tokens (a lower bound of its cost) exceed the budget."""
    n = len(order)
    best = [(0, 0)] + [(math.inf, math.inf)] * n
    start = [0] * (n + 1)
    for i in range(n):
        least = 0
        for j in range(i, min(n, i + _MAX_SEARCH_ROWS)):
            least += floor(order[j]) + 1
            if j > i and least > budget:
                break
            tokens = cost(order[i : j + 1])
            if j > i and tokens > budget:
                continue
            candidate = (best[i][0] + 1, best[i][1] + tokens)
            if candidate < best[j + 1]:
                best[j + 1], start[j + 1] = candidate, i
    parts, j = [], n
    while j > 0:
        parts.append(list(order[start[j] : j]))
        j = start[j]
    return parts[::-1]


def balanced_micro_batches(batch: dict, steps: int, accum: int, max_tokens: int | None = None,
                            share_prefix: bool = False, mini_batches: list[list[int]] | None = None,
                            owner: list[int] | None = None, min_shared: int | None = None,
                            skip_rows_without_loss: bool = True) -> list[dict]:
    """Cut the rollout into ``steps`` micro-batches: consecutive mini-batches of equal size (whole groups kept by the
    shuffle), each dealt into ``accum`` micro-batches of balanced token counts and trimmed to their own padding.

    With ``share_prefix`` and no budget, equal consecutive slices (whole groups) replace the balanced dealing when
    the shared-prompt forward computes fewer tokens for them.

    With ``max_tokens`` (token-budget micro-batches, VeRL's ``use_dynamic_bsz``), each mini-batch is cut into the
    fewest length-sorted micro-batches whose padded size fits the budget (with ``share_prefix``, sized for the
    shared-prompt forward: :func:`_shared_budget_parts`); the remaining of its ``accum`` accumulation slots get an
    empty micro-batch (:func:`_empty_micro_batch`). When the budget would need more than ``accum`` micro-batches the
    mini-batch is cut into ``accum`` balanced ones instead (over budget; the caller warns).

    Trimming is exact: prompts are left-padded and completions right-padded, so dropping all-padding columns changes
    no logit of a real token. Per-token tensors (B, C) are trimmed with the completions.

    ``mini_batches``: the rows of each mini-batch, consecutive and in order (the per-turn layout, where a
    mini-batch holds whole trajectories of varying row counts: :func:`trl_multiturn.turn_rows.trajectory_mini_batches`);
    None: ``steps // accum`` equal consecutive slices. ``owner`` (per-turn layout, with ``share_prefix``): the
    trajectory of each row; micro-batches of whole trajectories replace the rows dealt one by one when the prefix-tree
    forward (``min_shared``, or prompts only with None) computes fewer tokens for them (:func:`_per_turn_parts`).

    ``skip_rows_without_loss``: rows whose loss mask (``completion_mask * tool_mask``) is all 0 (a greedy baseline's
    decode, a trajectory dropped by a failed reward or environment, one cut by a limit under
    ``mask_truncated_completions``, dynamic sampling's filler groups) go into no micro-batch. Such a row counts in no
    normalizer and adds exactly 0 to the loss and its gradient (rows of a forward do not attend to each other), so
    the mini-batch's loss is unchanged and its forward and backward are not computed; a mini-batch left with fewer
    rows than ``accum`` fills its remaining slots with empty micro-batches. False: every row is computed (the
    layout before this option, kept for the equivalence test).
    """
    n = batch["prompt_ids"].size(0)
    if mini_batches is None:
        if n % steps != 0:
            raise ValueError(f"internal: rollout of {n} rows is not divisible into {steps} micro-batches")
        per_mini = n // (steps // accum)
        mini_batches = [list(range(start, start + per_mini)) for start in range(0, n, per_mini)]
    elif len(mini_batches) * accum != steps:
        raise ValueError(f"internal: {len(mini_batches)} mini-batches x {accum} accumulation steps != {steps}")
    prompt_len = batch["prompt_mask"].sum(1)  # (B,)
    completion_len = batch["completion_mask"].sum(1)  # (B,)
    carries_loss = (batch["completion_mask"] * batch["tool_mask"]).sum(1) > 0  # (B,)
    chunks = []
    for all_rows in mini_batches:
        rows = [r for r in all_rows if carries_loss[r]] if skip_rows_without_loss else all_rows
        if not rows:  # nothing in this mini-batch carries loss: keep its accumulation slots, compute ~nothing
            shortest = min(all_rows, key=lambda r: (int(completion_len[r]) == 0,
                                                    int(prompt_len[r] + completion_len[r])))
            chunks.extend(_empty_micro_batch(batch, shortest, n) for _ in range(accum))
            continue
        per_mini, slots = len(rows), min(accum, len(rows))
        index_t = torch.tensor(rows, dtype=torch.long, device=batch["prompt_ids"].device)
        lengths = [int(prompt_len[r] + completion_len[r]) for r in rows]
        if max_tokens and share_prefix:
            keys = prompt_keys(batch["prompt_ids"][index_t], batch["prompt_mask"][index_t])
            p_len, c_len = [int(prompt_len[r]) for r in rows], [int(completion_len[r]) for r in rows]
            parts = _shared_budget_parts(keys, p_len, c_len, max_tokens, accum)
        else:
            parts = _token_budget_parts(lengths, max_tokens, accum) if max_tokens else None
        over_budget = bool(max_tokens) and parts is None
        if parts is None:
            parts = balanced_partition(lengths, slots)
            if share_prefix and not max_tokens:
                # groups are contiguous (shuffled whole): equal consecutive slices keep a group's rows together, and
                # the shared-prompt forward computes their prompt once and no padding; keep the cheaper plan
                keys = prompt_keys(batch["prompt_ids"][index_t], batch["prompt_mask"][index_t])
                p_len, c_len = [int(prompt_len[r]) for r in rows], [int(completion_len[r]) for r in rows]
                size = per_mini // slots
                slices = ([list(range(k * size, (k + 1) * size)) for k in range(slots)]
                          if per_mini % slots == 0 else None)
                cost = lambda plan: sum(_shared_cost(keys, p_len, c_len, part) for part in plan if part)  # noqa: E731
                if slices is not None and cost(slices) < cost(parts):
                    parts = slices
        if owner is not None and share_prefix:
            parts, over_budget = _per_turn_parts(batch, rows, owner, accum, max_tokens, min_shared, parts, over_budget)
        for part in parts:
            index = [rows[i] for i in part]
            p_w = int(prompt_len[index].max())
            c_w = max(int(completion_len[index].max()), 1)
            chunk = _take_rows(batch, index, n, p_w, c_w)
            chunk["over_token_budget"] = over_budget
            chunks.append(chunk)
        shortest = rows[min(range(len(rows)), key=lambda i: (int(completion_len[rows[i]]) == 0, lengths[i]))]
        chunks.extend(_empty_micro_batch(batch, shortest, n) for _ in range(accum - len(parts)))
    return chunks


def shuffle_groups(batch: dict, group_size: int) -> dict:
    """Permute whole GRPO groups (members stay together and in order) across the local rollout."""
    n = next(len(v) for v in batch.values() if isinstance(v, (list, torch.Tensor)) and getattr(v, "ndim", 1) > 0)
    if n % group_size != 0:
        perm = torch.randperm(n)  # groups are split across ranks: fall back to a plain shuffle
    else:
        order = torch.randperm(n // group_size)
        perm = (order.unsqueeze(1) * group_size + torch.arange(group_size)).reshape(-1)
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.ndim > 0 and value.size(0) == n:
            out[key] = value[perm.to(value.device)]
        elif isinstance(value, list) and len(value) == n:
            out[key] = [value[i] for i in perm.tolist()]
        else:
            out[key] = value
    return out


def chunk_normalizers(chunks: list[dict], device=None) -> torch.Tensor:
    """(chunks, 2) float64: each micro-batch's ``(sequences, tokens)`` that carry loss (:func:`loss_normalizers` of
    ``completion_mask * tool_mask``; in the per-turn layout, rows count as their share of a trajectory through
    ``sequence_tokens``), to be summed over ranks and handed to :func:`attach_normalizers`."""
    local = torch.zeros(len(chunks), 2, dtype=torch.float64, device=device)  # (chunks, 2)
    for j, chunk in enumerate(chunks):
        mask = chunk["completion_mask"] * chunk["tool_mask"]  # (b, C)
        local[j, 0], local[j, 1] = loss_normalizers(mask, chunk.get("sequence_tokens"))
    return local


def attach_normalizers(chunks: list[dict], totals: torch.Tensor, accum: int) -> None:
    """Give each micro-batch the ``(sequences, tokens)`` of its whole mini-batch, ``mb_num_sequences`` and
    ``mb_num_tokens``: the sums of ``totals`` (chunks, 2) (:func:`chunk_normalizers` summed over ranks) over the
    ``accum`` consecutive micro-batches of its mini-batch."""
    for j, chunk in enumerate(chunks):
        mb = j // accum
        group = totals[mb * accum : (mb + 1) * accum].sum(dim=0)  # (2,)
        chunk["mb_num_sequences"] = group[0].float()
        chunk["mb_num_tokens"] = group[1].float()
