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
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass


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

