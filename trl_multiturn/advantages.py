"""Group-relative advantages: trajectory-level GRPO and turn-level credit assignment, as pure tensor functions.

A group is the ``G = group_size`` rollouts of one prompt, stored contiguously: rows ``[g*G, (g+1)*G)`` of every
input belong to group ``g`` (TRL's and this package's layout). :func:`group_advantages` is GRPO's

    A_i = (r_i - mean_G(r)) / (std_G(r) + eps)      std unbiased (Bessel), as VeRL's ``compute_grpo_outcome_advantage``

and :func:`turn_advantages` turns rewards into one advantage per token (B, T) for the three credit-assignment
modes of ``MultiTurnGRPOConfig.turn_advantage`` (see docs/turn_credit.md for the equations and caveats).

Departures from VeRL / TRL, each on purpose:
- A group whose rewards are all identical gets advantage exactly 0 (VeRL computes ``(r - mean) / (std + eps)``,
  which in float arithmetic can leave a residue of the mean's rounding divided by ``eps``).
- VeRL's group of size 1 (mean 0, std 1, so ``A = r / (1 + eps)``) is kept, and applied under every ``scale``.
- ``scale="batch"`` is TRL's ``scale_rewards="batch"``: the group mean, divided by the std of the whole batch.
- ``eps`` defaults to VeRL's 1e-6 (TRL adds 1e-4).
- ``keep`` (both functions) leaves dropped trajectories (failed environment, non-finite reward) out of every mean
  and std, in every mode; they get 0, and so does a group that keeps fewer than 2 members.

:func:`rollout_advantages` is what the trainer calls on a whole rollout: it weights the reward functions, decides
which trajectories are dropped, and hands the rest to :func:`group_advantages` or :func:`turn_advantages`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

VALID_SCALES = ("group", "batch", "none")
VALID_TURN_ADVANTAGES = ("trajectory", "mt-grpo", "discounted")


# ----------------------------------------------------------------------------------------------------------------
# validation helpers (errors name the value and the knob that fixes it)
# ----------------------------------------------------------------------------------------------------------------
def _check_scale(scale: str) -> None:
    if scale not in VALID_SCALES:
        raise ValueError(
            f"scale={scale!r} is not a valid advantage scale; choose one of {VALID_SCALES} "
            "(GRPOConfig.scale_rewards): 'group' = GRPO, 'batch' = std over the batch, 'none' = Dr. GRPO."
        )


def _check_group_size(group_size: int, num_rewards: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be a positive int (GRPOConfig.num_generations).")
    if num_rewards % group_size != 0:
        raise ValueError(
            f"got {num_rewards} rewards, which is not a multiple of group_size={group_size} "
            "(num_generations): every prompt needs exactly group_size rollouts, stored contiguously."
        )


def _as_rewards(rewards: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """(B,) float tensor of finite rewards, or ValueError."""
    r = torch.as_tensor(rewards)
    if not torch.is_floating_point(r):
        r = r.to(torch.float32)
    if r.dim() != 1:
        raise ValueError(f"rewards must be 1-D with one reward per trajectory, got shape {tuple(r.shape)}.")
    if r.numel() == 0:
        raise ValueError("rewards is empty; pass one reward per trajectory.")
    bad = ~torch.isfinite(r)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"rewards[{i}] is {float(r[i])}; rewards must be finite (check the reward functions and environment)."
        )
    return r


# ----------------------------------------------------------------------------------------------------------------
# group-relative normalization
# ----------------------------------------------------------------------------------------------------------------
def _normalize(values: torch.Tensor, group_size: int, scale: str, eps: float) -> torch.Tensor:
    """Group-relative normalization of validated ``values`` (B,) -> (B,); the math of :func:`group_advantages`."""
    grouped = values.view(-1, group_size)  # (B/G, G)
    if group_size == 1:  # VeRL: a lone rollout has mean 0 and std 1 (under every scale here)
        return values.clone() if scale == "none" else values / (1.0 + eps)  # (B,)
    mean = grouped.mean(dim=1, keepdim=True)  # (B/G, 1)
    std = grouped.std(dim=1, keepdim=True)  # (B/G, 1) unbiased, as torch.std and VeRL
    equal = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)  # (B/G, 1) True where all G rewards are identical
    centered = torch.where(equal, torch.zeros_like(grouped), grouped - mean)  # (B/G, G) exactly 0 for equal groups
    if scale == "group":
        scaled = centered / (std + eps)  # (B/G, G)
    elif scale == "batch":
        batch_std = values.std() if values.numel() > 1 else values.new_tensor(1.0)  # () unbiased, whole batch
        scaled = centered / (batch_std + eps)  # (B/G, G)
    else:  # "none": Dr. GRPO, no division by a std
        scaled = centered  # (B/G, G)
    return scaled.reshape(-1)  # (B,)


def _normalize_kept(values: torch.Tensor, keep: torch.Tensor | None, group_size: int, scale: str, eps: float
                    ) -> torch.Tensor:
    """:func:`_normalize` over the kept members of each group only; (B,) values, (B,) bool keep -> (B,).

    A dropped member is neither normalized nor part of its group's mean and std (nor of the batch std); it gets 0,
    and so does every member of a group that keeps fewer than 2 (no baseline is left). Without drops this is
    :func:`_normalize` exactly, VeRL's lone rollout of ``group_size = 1`` included.
    """
    if keep is None or bool(keep.all()):
        return _normalize(values, group_size, scale, eps)  # (B,)
    out = torch.zeros_like(values)  # (B,)
    if scale == "batch":
        kept = values[keep]  # (n_kept,)
        batch_std = kept.std() if kept.numel() > 1 else values.new_tensor(1.0)  # () over kept members only
    for start in range(0, values.numel(), group_size):
        rows = torch.arange(start, start + group_size, device=values.device)[keep[start : start + group_size]]
        n = rows.numel()
        if n < 2:
            continue  # no baseline left in this group: no learning signal
        normalized = _normalize(values[rows], n, "none" if scale == "batch" else scale, eps)  # (n,)
        out[rows] = normalized / (batch_std + eps) if scale == "batch" else normalized
    return out  # (B,)


def group_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_size: int,
    scale: str = "group",
    eps: float = 1e-6,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """One advantage per trajectory from its group's rewards.

    Args:
        rewards: (B,) trajectory rewards, group ``g`` in rows ``[g*G, (g+1)*G)``.
        group_size: G, rollouts per prompt (``num_generations``).
        scale: "group" ``(r - mean_G) / (std_G + eps)``; "batch" ``(r - mean_G) / (std_B + eps)`` with the std of
            all B rewards; "none" ``r - mean_G`` (Dr. GRPO). std is unbiased (divides by n - 1).
        eps: added to the std before dividing.
        keep: (B,) bool, False for a dropped trajectory: means and stds are over the kept members only, a dropped
            row gets 0 (its reward is not read, it may be NaN), and so does a group with fewer than 2 kept members.

    Returns:
        (B,) advantages (float dtype of ``rewards``, float32 for integer input). A group of identical rewards gets
        exactly 0; a group of size 1 gets ``A = r / (1 + eps)`` (VeRL: mean 0, std 1; ``r`` for "none").

    Raises:
        ValueError: non-finite rewards, a count that is not a multiple of ``group_size``, an unknown ``scale``,
            a negative ``eps``.
    """
    _check_scale(scale)
    keep, rewards, _ = _apply_keep(keep, rewards, None)
    r = _as_rewards(rewards)  # (B,)
    _check_group_size(group_size, r.numel())
    if not (eps >= 0 and math.isfinite(eps)):
        raise ValueError(f"eps={eps!r} must be a finite number >= 0.")
    return _normalize_kept(r, None if keep is None else keep.to(r.device), group_size, scale, eps)  # (B,)


def greedy_baseline_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_size: int,
    scale: str = "group",
    eps: float = 1e-6,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages against the group's greedy member, the baseline of ReMax and self-critical sequence training.

    Member 0 of each group was decoded greedily (``MultiTurnGRPOConfig.greedy_baseline``) and is not trained; the
    other ``G - 1`` were sampled:

        A_i = (r_i - r_greedy) / (std_G + eps)   i = 1 .. G-1,        A_greedy = 0

    The greedy reward is a function of the policy and the prompt, not of the samples, so as a baseline it leaves the
    policy gradient unbiased; unlike the group mean it is not zero-mean over the samples: a group whose samples all
    answer while the greedy decode does not carries signal, and one where the samples and the greedy decode agree
    does not. ``scale``: "group" divides by the unbiased std of all G rewards of the group (greedy included), "batch"
    by the std of the batch's kept rewards, "none" not at all. A group whose kept rewards are all equal gets exactly
    0. A dropped sampled member gets 0 and leaves the std; when the greedy member is dropped, the group falls back to
    GRPO over its kept samples (:func:`group_advantages`' math, at least 2 needed).

    Args:
        rewards: (B,) trajectory rewards, group ``g`` in rows ``[g*G, (g+1)*G)``, its greedy member first.
        group_size: G >= 2 (a greedy member and at least one sample).
        scale, eps, keep: as :func:`group_advantages`.

    Returns:
        (B,) advantages, 0 on every greedy member.
    """
    _check_scale(scale)
    keep, rewards, _ = _apply_keep(keep, rewards, None)
    r = _as_rewards(rewards)  # (B,)
    _check_group_size(group_size, r.numel())
    if group_size < 2:
        raise ValueError(f"group_size={group_size} leaves no sampled member next to the greedy one; use "
                         "num_generations >= 2 with greedy_baseline.")
    if not (eps >= 0 and math.isfinite(eps)):
        raise ValueError(f"eps={eps!r} must be a finite number >= 0.")
    kept = torch.ones_like(r, dtype=torch.bool) if keep is None else keep.to(r.device)  # (B,)
    out = torch.zeros_like(r)  # (B,)
    batch_std = None
    if scale == "batch":
        values = r[kept]  # (n_kept,)
        batch_std = values.std() if values.numel() > 1 else r.new_tensor(1.0)  # () over the kept rewards
    for start in range(0, r.numel(), group_size):
        rows = torch.arange(start, start + group_size, device=r.device)[kept[start : start + group_size]]  # kept
        samples = rows[rows != start]  # kept sampled members
        if samples.numel() == 0 or rows.numel() < 2:
            continue
        values = r[rows]  # (n,)
        if bool((values == values[0]).all()):
            continue  # identical rewards: exactly 0
        if rows[0] == start:  # the greedy member is kept: it is the baseline
            centered = r[samples] - r[start]  # (n - 1,)
            std = values.std()  # () unbiased, greedy included
        else:  # no greedy reward: GRPO over the kept samples
            centered = r[samples] - r[samples].mean()
            std = r[samples].std()
        if scale == "group":
            out[samples] = centered / (std + eps)
        elif scale == "batch":
            out[samples] = centered / (batch_std + eps)
        else:
            out[samples] = centered
    return out  # (B,)


def greedy_rows(count: int, start: int, group_size: int) -> list[bool]:
    """Which of ``count`` rows, the first at global index ``start``, are their group's greedy member (the first)."""
    return [(start + i) % group_size == 0 for i in range(count)]


def _apply_keep(keep, rewards, turn_rewards):
    """``(keep (B,) bool on CPU or None, rewards with dropped rows read as 0, turn_rewards likewise)``."""
    if keep is None:
        return None, rewards, turn_rewards
    keep = torch.as_tensor(keep, dtype=torch.bool).reshape(-1).cpu()  # (B,)
    raw = torch.as_tensor(rewards)
    if keep.numel() != raw.numel():
        raise ValueError(f"keep has {keep.numel()} entries but there are {raw.numel()} rewards; they must match.")
    raw = raw if torch.is_floating_point(raw) else raw.to(torch.float32)
    rewards = torch.where(keep.to(raw.device), raw, torch.zeros_like(raw))  # (B,) dropped rows read as 0
    if turn_rewards is not None:
        turn_rewards = [row if k else [0.0] * len(row) for row, k in zip(turn_rewards, keep.tolist())]
    return keep, rewards, turn_rewards


# ----------------------------------------------------------------------------------------------------------------
# turn-level credit assignment
# ----------------------------------------------------------------------------------------------------------------
def _check_turn_inputs(
    mode: str,
    num_rewards: int,
    turn_rewards: Sequence[Sequence[float]] | None,
    turn_ids: torch.Tensor,
    action_mask: torch.Tensor,
    gamma: float,
    turn_weight: float,
) -> None:
    if mode not in VALID_TURN_ADVANTAGES:
        raise ValueError(
            f"turn advantage mode {mode!r} is not valid; choose one of {VALID_TURN_ADVANTAGES} "
            "(MultiTurnGRPOConfig.turn_advantage)."
        )
    if turn_ids.dim() != 2 or action_mask.shape != turn_ids.shape:
        raise ValueError(
            f"turn_ids {tuple(turn_ids.shape)} and action_mask {tuple(action_mask.shape)} must both be (B, T) "
            "with the same shape."
        )
    if turn_ids.shape[0] != num_rewards:
        raise ValueError(f"got {num_rewards} rewards but turn_ids has {turn_ids.shape[0]} rows; they must match.")
    if mode == "trajectory":
        return
    if turn_rewards is None or len(turn_rewards) != num_rewards:
        n = None if turn_rewards is None else len(turn_rewards)
        raise ValueError(
            f"turn advantage mode {mode!r} needs turn_rewards with one list per trajectory ({num_rewards}), got {n}."
        )
    for b, row in enumerate(turn_rewards):
        for k, x in enumerate(row):
            if not math.isfinite(float(x)):
                raise ValueError(f"turn_rewards[{b}][{k}] is {x}; per-turn rewards must be finite.")
    if not (0.0 <= gamma <= 1.0):
        raise ValueError(f"gamma={gamma!r} must lie in [0, 1] (MultiTurnGRPOConfig.turn_advantage_gamma).")
    if not (math.isfinite(turn_weight) and turn_weight >= 0):
        raise ValueError(
            f"turn_weight={turn_weight!r} must be a finite number >= 0 (MultiTurnGRPOConfig.turn_advantage_weight)."
        )
    num_turns = torch.tensor([len(row) for row in turn_rewards], device=turn_ids.device)  # (B,)
    bad = action_mask.bool() & ((turn_ids < 0) | (turn_ids >= num_turns[:, None]))  # (B, T)
    if bool(bad.any()):
        b, t = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"sampled token {t} of trajectory {b} has turn id {int(turn_ids[b, t])}, but that trajectory has "
            f"{int(num_turns[b])} per-turn rewards; every sampled token needs a turn id in [0, num_turns)."
        )


def _pad_turns(turn_rewards: Sequence[Sequence[float]], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(B, K) per-turn rewards, K = max_b K_b (at least 1), 0.0 after a trajectory's last turn."""
    width = max(1, max(len(row) for row in turn_rewards))
    out = torch.zeros((len(turn_rewards), width), dtype=dtype, device=device)  # (B, K)
    for b, row in enumerate(turn_rewards):
        if len(row):
            out[b, : len(row)] = torch.as_tensor([float(x) for x in row], dtype=dtype, device=device)
    return out


def _discounted_returns(
    outcome: torch.Tensor, turn_rewards: Sequence[Sequence[float]], gamma: float, turn_weight: float, width: int
) -> torch.Tensor:
    """(B, K) per-turn returns ``R_t = sum_{k=t}^{K_b-1} gamma^(k-t) w r_k + gamma^(K_b-1-t) r_outcome``.

    For ``t >= K_b`` (the trajectory has already stopped) ``R_t = R_{K_b-1}`` (``= r_outcome`` when ``K_b = 0``),
    so that every turn index compares the whole group. Computed in Python floats (K is small), then one tensor.
    """
    rows = []
    for ret, row in zip(outcome.tolist(), turn_rewards):  # ret starts as the outcome, counted at the last turn
        returns = []
        for k in reversed(range(len(row))):
            ret = turn_weight * float(row[k]) + (ret if k == len(row) - 1 else gamma * ret)  # R_k
            returns.append(ret)
        returns.reverse()  # [R_0, ..., R_{K_b-1}]
        last = returns[-1] if returns else ret  # R_{K_b-1}, or the outcome when there is no turn
        rows.append(returns + [last] * (width - len(returns)))  # the last return carried past the end
    return torch.tensor(rows, dtype=outcome.dtype, device=outcome.device)  # (B, K)


def turn_advantages(
    mode: str,
    rewards: torch.Tensor | Sequence[float],
    turn_rewards: Sequence[Sequence[float]] | None,
    turn_ids: torch.Tensor,
    action_mask: torch.Tensor,
    group_size: int,
    *,
    scale: str = "group",
    eps: float = 1e-6,
    gamma: float = 1.0,
    turn_weight: float = 1.0,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token advantages (B, T) for the turn-credit ``mode`` (``MultiTurnGRPOConfig.turn_advantage``).

    Notation: ``r_b`` the outcome reward of trajectory b (``rewards``), ``r_{b,k}`` the reward its action k earned
    (``turn_rewards[b][k]``, k = 0..K_b-1), ``N_G[x]`` the group-relative normalization of a column ``x`` with
    ``scale`` and ``eps`` (:func:`group_advantages`), ``k(b, t)`` the turn of token t (``turn_ids``).

    - ``"trajectory"``: ``A_{b,t} = N_G[r]_b``, plain GRPO broadcast onto the action tokens; ``turn_rewards`` is
      ignored (may be None).
    - ``"mt-grpo"`` (Zeng et al., arXiv 2505.11821), generalized to K turns:
      ``A^T_{b,k} = N_G[r_{.,k}]_b`` per turn index k (a trajectory without turn k counts ``r_{b,k} = 0``), and
      ``A_{b,t} = N_G[r]_b + turn_weight * sum_{k >= k(b,t)} A^T_{b,k}``: the reward earned by the observation after
      action k credits the tokens of turns 0..k. With K = 2 and a reward on turn 0 only this is the paper's
      ``A = A^O + lambda A^T`` on the first turn and ``A^O`` on the second.
    - ``"discounted"``: ``R_{b,k} = sum_{j >= k} gamma^(j-k) turn_weight r_{b,j} + gamma^(K_b-1-k) r_b`` (the outcome
      counted at the last turn; a trajectory that stopped before k keeps its last return), and
      ``A_{b,t} = N_G[R_{.,k(b,t)}]_b``: normalized across the group at the same turn index.

    With every per-turn reward 0, "mt-grpo" (any weight) and "discounted" (gamma = 1) equal "trajectory" exactly.

    Args:
        mode: one of ``VALID_TURN_ADVANTAGES``.
        rewards: (B,) outcome rewards. Per-turn rewards are NOT added to it here: pass them in ``turn_rewards``.
        turn_rewards: B lists, list b holding the K_b per-turn rewards of trajectory b (lengths may differ).
        turn_ids: (B, T) turn of each token (0-based), -1 on prompt/padding (``trl_multiturn.trajectory.completion_tensors``).
        action_mask: (B, T) 1 on sampled tokens; the result is 0 wherever it is 0.
        group_size: G, rollouts per prompt, contiguous rows.
        scale, eps: as in :func:`group_advantages`, used for every normalization.
        gamma: discount over turns for "discounted" (``turn_advantage_gamma``), in [0, 1].
        turn_weight: weight of the turn-level signal relative to the outcome (``turn_advantage_weight``), >= 0.
        keep: (B,) bool, False for a dropped trajectory (failed environment, non-finite reward). Every column
            (outcome, turn index, return) is normalized over the kept members of each group only, as the
            trajectory-level baseline is; dropped rows get 0 and their reward and per-turn rewards are not read
            (they may be NaN). A group that keeps fewer than 2 members gets 0. None: every trajectory is kept.

    Returns:
        (B, T) float advantages on ``action_mask``'s device, 0.0 where ``action_mask`` is 0 and on dropped rows.
    """
    keep, rewards, turn_rewards = _apply_keep(keep, rewards, turn_rewards)
    r = _as_rewards(rewards)  # (B,)
    _check_scale(scale)
    _check_group_size(group_size, r.numel())
    if not (eps >= 0 and math.isfinite(eps)):
        raise ValueError(f"eps={eps!r} must be a finite number >= 0.")
    _check_turn_inputs(mode, r.numel(), turn_rewards, turn_ids, action_mask, gamma, turn_weight)

    device = action_mask.device
    r = r.to(device)  # (B,)
    mask = action_mask.bool()  # (B, T)
    if keep is not None:
        keep = keep.to(device)  # (B,)
        mask = mask & keep[:, None]  # (B, T) a dropped trajectory carries no advantage
    outcome_adv = _normalize_kept(r, keep, group_size, scale, eps)  # (B,)
    if mode == "trajectory":
        per_token = outcome_adv[:, None].expand(mask.shape)  # (B, T)
        return torch.where(mask, per_token, torch.zeros_like(per_token))  # (B, T)

    if mode == "mt-grpo":
        padded = _pad_turns(turn_rewards, r.dtype, device)  # (B, K) r_{b,k}, 0 after the last turn
        turn_adv = torch.stack(
            [_normalize_kept(padded[:, k], keep, group_size, scale, eps) for k in range(padded.shape[1])], dim=1
        )  # (B, K) A^T_{b,k}
        credit = turn_adv.flip(1).cumsum(1).flip(1)  # (B, K) sum_{k' >= k} A^T_{b,k'}
        per_turn = outcome_adv[:, None] + turn_weight * credit  # (B, K)
    else:  # "discounted"
        width = max(1, max(len(row) for row in turn_rewards))
        returns = _discounted_returns(r, turn_rewards, gamma, turn_weight, width)  # (B, K) R_{b,k}
        per_turn = torch.stack(
            [_normalize_kept(returns[:, k], keep, group_size, scale, eps) for k in range(width)], dim=1
        )  # (B, K)

    index = turn_ids.clamp(0, per_turn.shape[1] - 1)  # (B, T) safe gather index; masked tokens dropped below
    per_token = per_turn.gather(1, index)  # (B, T) A_{b, k(b,t)}
    return torch.where(mask, per_token, torch.zeros_like(per_token))  # (B, T)


# ----------------------------------------------------------------------------------------------------------------
# a whole rollout
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class RolloutAdvantages:
    """The advantages of a rollout and what decided them (:func:`rollout_advantages`)."""

    advantages: torch.Tensor  # (B,) per trajectory, or (B, T) per token for a turn mode; 0 on dropped rows
    rewards: torch.Tensor  # (B,) weighted sum of the reward functions, NaN where dropped
    dropped: torch.Tensor  # (B,) bool: the environment failed or a reward is not finite


def rollout_advantages(
    rewards_per_func: torch.Tensor,
    weights: torch.Tensor,
    failed: torch.Tensor,
    group_size: int,
    *,
    mode: str = "trajectory",
    scale: str = "group",
    eps: float = 1e-6,
    turn_rewards: Sequence[Sequence[float]] | None = None,
    turn_ids: torch.Tensor | None = None,
    action_mask: torch.Tensor | None = None,
    gamma: float = 1.0,
    turn_weight: float = 1.0,
    greedy_baseline: bool = False,
) -> RolloutAdvantages:
    """Advantages of a whole rollout from its reward table, as ``MultiTurnGRPOTrainer`` trains them.

    ``r_b = sum_f w_f R_bf`` (NaN entries skipped). Trajectory b is dropped (left out of its group's baseline, advantage
    0) when its environment failed, its environment reward (the last column) is not finite, any reward is infinite,
    or every reward is NaN. Then "trajectory" mode: :func:`group_advantages` of ``r``; a turn mode:
    :func:`turn_advantages` with the reward functions alone as the outcome (the environment's per-turn rewards enter
    as ``turn_rewards``, a non-finite one read as 0).

    Args:
        rewards_per_func: (B, F) reward of each reward function, the environment's reward last (NaN: no reward).
        weights: (F,) ``reward_weights``, the environment's last.
        failed: (B,) bool, the environment failed.
        group_size: G, rollouts per prompt, contiguous rows.
        mode: ``turn_advantage``, one of ``VALID_TURN_ADVANTAGES``.
        scale: ``scale_rewards``; a value outside ``VALID_SCALES`` (TRL's bool) means "group".
        eps, gamma, turn_weight: as :func:`turn_advantages`.
        turn_rewards, turn_ids, action_mask: the turn modes' inputs (B lists; (B, T), (B, T)); unread in
            "trajectory" mode.
        greedy_baseline: member 0 of each group is a greedy decode: :func:`greedy_baseline_advantages` ("trajectory"
            mode only).

    Returns:
        :class:`RolloutAdvantages`.
    """
    w = weights.to(rewards_per_func.device)  # (F,)
    rewards = (rewards_per_func * w.unsqueeze(0)).nansum(dim=1)  # (B,)
    bad = (~torch.isfinite(rewards_per_func[:, -1]) | torch.isinf(rewards_per_func).any(dim=1)
           | torch.isnan(rewards_per_func).all(dim=1))  # (B,)
    dropped = bad | failed.to(bad.device)  # (B,)
    rewards[dropped] = float("nan")  # (B,)
    scale = scale if scale in VALID_SCALES else "group"
    if mode == "trajectory":
        advantage_fn = greedy_baseline_advantages if greedy_baseline else group_advantages
        advantages = advantage_fn(rewards, group_size, scale=scale, eps=eps, keep=torch.isfinite(rewards))  # (B,)
        return RolloutAdvantages(advantages, rewards, dropped)
    if greedy_baseline:
        raise ValueError(f"greedy_baseline=True works with turn_advantage='trajectory' only; got {mode!r}.")
    outcome = (rewards_per_func[:, :-1] * w[:-1].unsqueeze(0)).nansum(dim=1)  # (B,) the reward functions only
    outcome[dropped] = float("nan")
    finite = [[0.0] * len(row) if d else [r if math.isfinite(r) else 0.0 for r in row]
              for row, d in zip(turn_rewards, dropped.tolist())]
    advantages = turn_advantages(
        mode, outcome.cpu(), finite, turn_ids, action_mask, group_size, scale=scale, eps=eps, gamma=gamma,
        turn_weight=turn_weight, keep=~dropped.cpu(),  # every column normalized over the kept members only
    )  # (B, T), 0 on dropped rows
    return RolloutAdvantages(advantages, rewards, dropped)
