"""What a rollout and an optimizer step log: the ``rollout/``, ``env/``, ``perf/`` and ``loss/`` metrics.

Every function writes into ``metrics``, one mode of TRL's ``_metrics`` (a dict of lists: the trainer's logging
averages each list over the logging window), and gathers or reduces over processes with the ``accelerator`` it is
given, so every rank must call it at the same point. The names and formulas are documented in docs/metrics.md.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, defaultdict

import torch

from .dynamic_sampling import DROP_REASONS
from .trajectory import Trajectory

logger = logging.getLogger(__name__)

#: what each trajectory contributes to the rollout metrics (:func:`_rollout_row`), one column each
_ROLLOUT_COLUMNS = ("turns", "truncated", "failed", "errors", "action_tokens", "observation_tokens", "tool", "answer",
                    "invalid", "observations_truncated", "observations_sanitized", "observation_problems", "skipped",
                    "length")
#: (metric, column, reduction over the rollout); "share": the column's sum over all actions taken
_ROLLOUT_METRICS = (
    ("rollout/turns_mean", "turns", "mean"), ("rollout/turns_max", "turns", "max"),
    ("rollout/truncated_frac", "truncated", "mean"), ("rollout/assistant_tokens_mean", "action_tokens", "mean"),
    ("rollout/observation_tokens_mean", "observation_tokens", "mean"), ("rollout/actions_tool_frac", "tool", "share"),
    ("rollout/actions_answer_frac", "answer", "share"), ("rollout/invalid_action_rate", "invalid", "share"),
    ("env/errors", "errors", "sum"), ("env/failed_frac", "failed", "mean"),
    ("env/observations_truncated", "observations_truncated", "sum"),
    ("env/observations_sanitized", "observations_sanitized", "sum"),
    ("env/observation_problems", "observation_problems", "sum"), ("rollout/skipped_prompts", "skipped", "sum"),
)


def _rollout_row(t: Trajectory) -> list[float]:
    """One trajectory's entries of :data:`_ROLLOUT_COLUMNS`."""
    actions = Counter(t.info.get("actions", []))
    return [t.num_turns, float(t.truncated), float(bool(t.info.get("failed")) and not t.info.get("skipped")),
            len(t.info.get("env_errors", [])), t.num_action_tokens, t.num_observation_tokens, actions["tool"],
            actions["answer"], actions["invalid"], float(t.info.get("observation_truncated", 0)),
            float(t.info.get("observation_sanitized", 0)), float(len(t.info.get("observation_problems", []))),
            float(t.info.get("skipped") is not None), float(len(t.completion_ids))]


def log_rollout(metrics: dict, trajs: list[Trajectory], accelerator, group_size: int) -> dict:
    """``rollout/*`` and ``env/*`` of a rollout over all processes (rewards as set by the advantages: NaN where
    dropped); rewrites TRL's termination metrics (:func:`fix_termination_metrics`). Returns this process's count of
    each ``stop_reason``."""
    rows = torch.tensor([_rollout_row(t) for t in trajs], dtype=torch.float32, device=accelerator.device)
    col = dict(zip(_ROLLOUT_COLUMNS, accelerator.gather(rows).T))  # column -> (B_global,)
    fix_termination_metrics(metrics, col["truncated"], col["length"])
    total_actions = (col["tool"] + col["answer"] + col["invalid"]).sum().clamp(min=1)  # ()
    for name, column, how in _ROLLOUT_METRICS:
        x = col[column]  # (B_global,)
        value = {"mean": x.mean, "max": x.max, "sum": x.sum, "share": lambda: x.sum() / total_actions}[how]()
        metrics[name].append(value.item())
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32, device=accelerator.device)
    rewards = accelerator.gather(rewards)  # (B_global,)
    finite = rewards[torch.isfinite(rewards)]
    metrics["rollout/reward_mean"].append(finite.mean().item() if finite.numel() else float("nan"))
    metrics["rollout/reward_std"].append(finite.std().item() if finite.numel() > 1 else 0.0)
    if rewards.numel() % group_size == 0 and group_size > 1:
        zero = torch.tensor([bool(torch.isfinite(row).sum() < 2 or row[torch.isfinite(row)].std() == 0)
                             for row in rewards.view(-1, group_size)])  # fewer than 2 kept members: no baseline
        metrics["rollout/zero_std_group_frac"].append(zero.float().mean().item())
    return dict(Counter(t.info.get("stop_reason") for t in trajs))


def fix_termination_metrics(metrics: dict, truncated: torch.Tensor, lengths: torch.Tensor) -> None:
    """TRL counts a completion as clipped when its last token is not EOS; a multi-turn trajectory ends at the
    protocol's stop string (``</answer>``) or at ``done`` without one. Rewrite TRL's just-logged
    ``completions/clipped_ratio`` and ``completions/*_terminated_length`` with the trajectory's own truncation flag
    (``Trajectory.truncated``). ``truncated``, ``lengths``: (B_global,)."""
    if not metrics.get("completions/clipped_ratio"):
        return
    truncated = truncated.bool()
    metrics["completions/clipped_ratio"][-1] = truncated.float().mean().item()
    finished = lengths[~truncated] if bool((~truncated).any()) else torch.zeros(1, device=lengths.device)
    for key, value in (("mean", finished.mean()), ("min", finished.min()), ("max", finished.max())):
        if metrics.get(f"completions/{key}_terminated_length"):
            metrics[f"completions/{key}_terminated_length"][-1] = value.item()


def log_advantages(metrics: dict, dropped: torch.Tensor, rewards: torch.Tensor, loss_tokens: int,
                   greedy_group_size: int | None) -> None:
    """After the advantages of a gathered rollout: the dropped share, whether the update is skipped, and with
    ``greedy_baseline`` (``greedy_group_size`` = G) :func:`log_greedy_baseline`."""
    metrics["rollout/dropped_frac"].append(float(dropped.float().mean()))
    metrics["rollout/skipped_update"].append(float(loss_tokens == 0))
    if greedy_group_size is not None:
        log_greedy_baseline(metrics, rewards, greedy_group_size)


def log_greedy_baseline(metrics: dict, rewards: torch.Tensor, group_size: int) -> None:
    """``greedy_baseline``: the mean reward of the groups' greedy members and of their sampled ones (the gathered
    rollout's (B,) rewards, NaN where dropped), and the share of groups whose greedy decode earned less than its
    samples' mean (the groups that push the policy towards what its samples do)."""
    grouped = rewards.detach().float().cpu().view(-1, group_size)  # (B/G, G), member 0 greedy
    greedy, sampled = grouped[:, 0], grouped[:, 1:].nanmean(dim=1)  # (B/G,), (B/G,)
    metrics["rollout/greedy_reward"].append(float(greedy.nanmean()))
    metrics["rollout/sampled_reward"].append(float(grouped[:, 1:].nanmean()))
    both = torch.isfinite(greedy) & torch.isfinite(sampled)  # (B/G,)
    metrics["rollout/greedy_below_samples_frac"].append(float((greedy[both] < sampled[both]).float().mean())
                                                       if bool(both.any()) else float("nan"))


def log_rollout_speed(metrics: dict, stats: dict) -> None:
    """``perf/`` metrics of this process's last rollout (``MultiTurnRollout.last_stats``)."""
    if not stats:
        return
    metrics["perf/rollout_s"].append(stats["wall_s"])
    metrics["perf/rollout_env_wait_s"].append(stats["env_time_s"])
    prefill = stats["prefill_tokens"] / max(stats["generated_tokens"], 1)
    metrics["perf/prefill_tokens_per_generated_token"].append(prefill)
    cached = stats["cached_tokens"] / max(stats["cached_tokens"] + stats["prefill_tokens"], 1)
    metrics["perf/cached_token_frac"].append(cached)


def warn_dropped(trajs: list[Trajectory], dropped: torch.Tensor, local_rows: torch.Tensor, names: list[str],
                 start: int, environment: str) -> None:
    """Warn about the trajectories dropped from the loss (``dropped``: (B_global,) bool), with the reason of each of
    this process's (rows ``start ...`` of the rollout; ``local_rows``: their (B_local, F) rewards)."""
    n_drop = int(dropped.sum())
    if not n_drop:
        return
    reasons = []
    for i, t in enumerate(trajs):
        if bool(dropped[start + i]):
            why = "; ".join(t.info.get("env_errors", [])) or t.info.get("skipped") or ", ".join(
                f"{n}={v}" for n, v in zip(names, local_rows[i].tolist()) if not math.isfinite(v))
            reasons.append(f"example {i} {t.info.get('example', '')}: {why}")
    logger.warning(
        "%d of %d trajectories from %s dropped from the loss and from their group's baseline%s: %s%s",
        n_drop, len(dropped), environment,
        " (all of them: this step's optimizer update is skipped)" if n_drop == len(dropped) else "",
        " | ".join(reasons[:8]), " | ..." if len(reasons) > 8 else "",
    )


def rewrite_trained_advantages(logged, advantages: torch.Tensor, loss_mask: torch.Tensor, accelerator) -> None:
    """Rewrite the ``advantages`` column of TRL's completions table (``logged``, just written by TRL with TRL's
    advantages) with the ones trained on: per trajectory, its advantage, or the mean over its loss tokens for
    per-token advantages; 0 for a trajectory without a loss token. advantages: (B,) or (B, C)."""
    m = loss_mask.float()  # (B, C)
    tokens = m.sum(1)  # (B,)
    per_row = (advantages * m).sum(1) / tokens.clamp(min=1) if advantages.dim() == 2 else advantages.float()  # (B,)
    per_row = torch.where(tokens > 0, per_row, torch.zeros_like(per_row))  # (B,)
    trained = accelerator.gather(per_row).tolist()  # (B_global,)
    if len(logged) < len(trained):
        return
    for _ in trained:
        logged.pop()
    logged.extend(trained)


def log_micro_batches(metrics: dict, chunks: list[dict], accum: int, max_tokens: int | None, warned: bool) -> bool:
    """``perf/micro_batches``: micro-batches that carry loss per optimizer step. Warns (unless ``warned``) when the
    token budget needed more micro-batches than the plan has slots; returns whether a warning was given so far."""
    real = sum(not c.get("empty_micro_batch", False) for c in chunks)
    metrics["perf/micro_batches"].append(real / max(len(chunks) // accum, 1))
    if warned or not any(c.get("over_token_budget") for c in chunks):
        return warned
    logger.warning(
        "max_tokens_per_micro_batch=%d: a mini-batch needed more micro-batches than its %d accumulation slots; it was "
        "cut into that many balanced micro-batches, over the budget. Lower micro_batch_size (more slots; empty ones "
        "cost ~nothing) or raise max_tokens_per_micro_batch.", max_tokens, accum,
    )
    return True


def log_padding(metrics: dict, counts: list[tuple[int, int]], chunks: list[dict], accelerator) -> None:
    """``perf/useful_token_frac`` = real tokens / tokens processed and ``perf/completion_token_frac`` = completion
    tokens / tokens processed, over the rollout's micro-batches ``chunks`` of every process (``counts``:
    ``(processed, real)`` per micro-batch, ``trl_multiturn.batching.chunk_tokens``). Per-turn rows
    (``trl_multiturn.turn_rows``) carry ``context_tokens``: the context moved into their completions is not counted."""
    completion = sum(float(c["completion_mask"].sum()) - (float(c["context_tokens"].sum()) if "context_tokens" in c
                                                          else 0.0) for c in chunks)
    local = [sum(r for _, r in counts), completion, sum(p for p, _ in counts)]
    totals = accelerator.reduce(torch.tensor(local, dtype=torch.float64, device=accelerator.device), reduction="sum")
    processed = totals[2].clamp(min=1)
    metrics["perf/useful_token_frac"].append(float(totals[0] / processed))
    metrics["perf/completion_token_frac"].append(float(totals[1] / processed))


def log_dynamic_sampling(metrics: dict, counts: list[float], accelerator, column: str | None = None,
                         kept_by: dict | None = None) -> None:
    """``rollout/dynamic_sampling/*`` from this process's ``counts`` (prompts sampled, groups kept, surplus, filler,
    rounds, then the groups dropped for each of ``DROP_REASONS``) and, with ``dynamic_sampling_balance=column``, the
    groups kept for each value (``kept_by``: value -> groups, the same values in the same order on every process),
    summed over processes (rounds: averaged)."""
    kept_by = kept_by or {}
    local = list(counts) + list(kept_by.values())
    totals = accelerator.reduce(torch.tensor(local, dtype=torch.float64, device=accelerator.device), reduction="sum")
    names = ["prompts_sampled", "groups_kept", "groups_surplus", "groups_filler", "rounds"] + [
        f"groups_dropped_{why}" for why in DROP_REASONS] + [f"kept_{column}_{value}" for value in kept_by]
    for name, value in zip(names, totals.tolist()):
        value = value / accelerator.num_processes if name == "rounds" else value  # rounds: the same on every rank
        metrics[f"rollout/dynamic_sampling/{name}"].append(value)


class StepStats:
    """The ``loss/*`` and sampler-gap sums of one optimizer step's micro-batches, logged once its last one is in."""

    def __init__(self):
        self.sums: dict[str, float] = defaultdict(float)

    def add(self, stats: dict, gap: tuple | None = None) -> None:
        """One micro-batch: ``stats`` of ``trl_multiturn.loss.grpo_loss``; ``gap``: ``sampler_learner_gap``'s sums."""
        acc, ntok = self.sums, float(stats["num_tokens"])
        if "kl" in stats:
            acc["loss/kl"] += float(stats["kl"])
        if gap is not None:
            for key, value in zip(("gap_abs_sum", "gap_kl_sum", "gap_tokens"), gap):
                acc[key] += float(value)
        acc["loss/pg_loss"] += float(stats["pg_loss"])
        acc["tokens"] += ntok
        for key in ("pg_clipfrac", "ppo_kl", "ratio_mean"):
            acc[key] += float(stats[key]) * ntok  # token-weighted: the step's mean is over all its loss tokens
        if ntok > 0:
            acc["ratio_min"] = min(acc.get("ratio_min", math.inf), float(stats["ratio_min"]))
            acc["ratio_max"] = max(acc.get("ratio_max", -math.inf), float(stats["ratio_max"]))

    def log(self, metrics: dict, accelerator, beta: float) -> None:
        """Reduce the sums over processes, write the step's metrics and start the next step."""
        acc, device = self.sums, accelerator.device
        keys = ("loss/pg_loss", "tokens", "pg_clipfrac", "ppo_kl", "ratio_mean", "loss/kl", "gap_abs_sum",
                "gap_kl_sum", "gap_tokens")
        sums = accelerator.reduce(torch.tensor([acc.get(k, 0.0) for k in keys], dtype=torch.float64, device=device),
                                  reduction="sum")
        extrema = torch.tensor([-acc.get("ratio_min", math.inf), acc.get("ratio_max", -math.inf)], device=device)
        extrema = accelerator.reduce(extrema, reduction="max") if accelerator.num_processes > 1 else extrema
        tokens = max(float(sums[1]), 1.0)
        metrics["loss/pg_loss"].append(float(sums[0]))
        metrics["loss/pg_clipfrac"].append(float(sums[2]) / tokens)
        metrics["loss/ppo_kl"].append(float(sums[3]) / tokens)
        metrics["loss/ratio_mean"].append(float(sums[4]) / tokens)
        metrics["loss/ratio_min"].append(float(-extrema[0]) if math.isfinite(float(extrema[0])) else 1.0)
        metrics["loss/ratio_max"].append(float(extrema[1]) if math.isfinite(float(extrema[1])) else 1.0)
        if beta != 0.0:
            metrics["loss/kl"].append(float(sums[5]))
        if float(sums[8]) > 0:  # sampler vs learner (pi_old) on the sampled tokens of this mini-batch
            metrics["rollout/sampler_logp_diff"].append(float(sums[6]) / float(sums[8]))
            metrics["rollout/sampler_kl"].append(float(sums[7]) / float(sums[8]))
        self.sums = defaultdict(float)
