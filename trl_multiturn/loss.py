"""The clipped policy loss of multi-turn GRPO and its aggregation, as pure tensor functions.

Per token (only where ``mask`` is 1, i.e. on tokens the policy sampled):

    rho   = exp(clamp(logp - logp_old, -20, 20))
    l_t   = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))           VeRL compute_policy_loss, dual-clip off

with TRL's options: ``delta`` replaces the first ``rho`` by ``min(rho, delta)`` (two-sided clipping), and
``importance_sampling_level="sequence"`` (GSPO) uses one ``log rho`` per trajectory, the mean over its tokens.

then one scalar from the (B, T) matrix ``l`` by :func:`aggregate_loss` (VeRL's four ``loss_agg_mode`` values, TRL's
``loss_type`` names as aliases). The project default is "seq-mean-token-mean": each trajectory's tokens are
averaged over its own N_g sampled tokens, then trajectories are averaged.

:func:`grpo_loss` is the whole objective the trainer backpropagates, in one call: the vLLM importance-sampling
weight on the advantages, :func:`policy_loss`, and ``beta`` times the aggregated KL to the reference model
(:func:`kl_penalty`, optionally bias-corrected by the ratio).

Split invariance: a mini-batch is cut into micro-batches (gradient accumulation) and ranks (DDP). Pass the WHOLE
mini-batch's counts (:func:`loss_normalizers`, summed over micro-batches and ranks) as ``global_num_sequences`` /
``global_num_tokens``; each shard then returns its contribution, and the SUM of the contributions equals the loss
of the whole mini-batch for every mode. (VeRL multiplies by ``dp_size`` inside ``agg_loss`` to undo DDP's gradient
averaging; here the caller does that, so these functions know nothing of ranks.)

Departures from VeRL, numerically immaterial: per-sequence and masked means divide by ``max(count, 1)`` instead of
``count + 1e-8``; masked positions are replaced (``torch.where``) before any arithmetic, so that a NaN or inf on a
mask-0 token cannot reach the loss or the gradient.
"""

from __future__ import annotations

from typing import Any

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
#: TRL 1.16 ``loss_type`` -> mode. TRL's "dapo" normalizes by the tokens of the whole accumulation window, as
#: "token-mean" here; TRL's "bnpo", "grpo" and "dr_grpo" use each micro-batch's own counts, where this package always uses the
#: mini-batch's (split-invariant); "dr_grpo" divides by max_completion_length (the caller's ``norm_constant``).
AGGREGATION_ALIASES = {
    "grpo": "seq-mean-token-mean", "dr_grpo": "seq-mean-token-sum-norm", "bnpo": "token-mean", "dapo": "token-mean",
}
VALID_AGGREGATIONS = AGGREGATIONS + tuple(AGGREGATION_ALIASES)
KL_ESTIMATORS = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}


def canonical_aggregation(mode: str) -> str:
    """VeRL name of an aggregation mode (TRL aliases resolved), or ValueError listing the valid names."""
    if mode in AGGREGATIONS:
        return mode
    if mode in AGGREGATION_ALIASES:
        return AGGREGATION_ALIASES[mode]
    raise ValueError(
        f"loss aggregation {mode!r} is not valid; choose one of {VALID_AGGREGATIONS} "
        f"(TRL aliases: {AGGREGATION_ALIASES})."
    )


def _check_count(name: str, value: Any) -> None:
    if value is not None and float(value) < 0:
        raise ValueError(f"{name}={value!r} must be >= 0 (a count summed over the whole mini-batch).")


def loss_mask(inputs: dict) -> torch.Tensor:
    """(B, C) 1 on the tokens a batch in TRL's layout trains on: ``completion_mask`` times ``tool_mask`` (0 on
    observations, and on whole trajectories that carry no loss) when there is one."""
    mask = inputs["completion_mask"]
    return mask * inputs["tool_mask"] if "tool_mask" in inputs else mask


def loss_normalizers(mask: torch.Tensor, sequence_tokens: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """This shard's ``(num_sequences, num_tokens)``: the trajectories that carry loss, and mask-1 tokens.

    With one row per trajectory a trajectory is a row with at least one mask-1 token (VeRL). With ``sequence_tokens``
    (the per-turn layout, several rows per trajectory) each row counts as the share of its trajectory it holds,
    ``N_b / N_g(b)``, so the rows of a whole trajectory count 1 together however it was split.

    Sum both over every micro-batch and rank of a mini-batch (e.g. ``accelerator.reduce(..., "sum")``) and pass the
    sums as ``global_num_sequences`` / ``global_num_tokens``.

    Args:
        mask: (B, T) 1 on tokens that carry loss.
        sequence_tokens: (B,) N_g of the trajectory each row belongs to (its mask-1 tokens over all its rows), or
            None: every row is a whole trajectory.

    Returns:
        two 0-dim tensors on ``mask``'s device (int64 counts; float64 sequences with ``sequence_tokens``).
    """
    m = mask.bool()  # (B, T)
    num_tokens = m.sum()  # ()
    if sequence_tokens is None:
        num_sequences = m.any(dim=-1).sum()  # () rows without a loss token are not counted (VeRL)
    else:
        num_sequences = sequence_shares(m, sequence_tokens).double().sum()  # () whole trajectories, in shares
    return num_sequences, num_tokens


def sequence_shares(mask: torch.Tensor, sequence_tokens: torch.Tensor) -> torch.Tensor:
    """(B,) the share of its trajectory each row holds, ``N_b / N_g(b)`` (0 for a row without a loss token).

    Args:
        mask: (B, T) 1 on tokens that carry loss.
        sequence_tokens: (B,) N_g of each row's trajectory; must be >= the row's own mask-1 tokens.
    """
    tokens_per_row = mask.bool().sum(dim=-1).to(torch.float64)  # (B,) N_b
    whole = sequence_tokens.to(device=mask.device, dtype=torch.float64)  # (B,) N_g(b)
    if bool((whole < tokens_per_row).any()):
        raise ValueError("sequence_tokens must count at least the row's own loss tokens (N_g(b) >= N_b): a row's "
                         "trajectory cannot carry fewer loss tokens than the row itself.")
    return tokens_per_row / whole.clamp(min=1)  # (B,)


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_num_sequences: int | float | torch.Tensor | None = None,
    global_num_tokens: int | float | torch.Tensor | None = None,
    norm_constant: int | float | None = None,
    sequence_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """One scalar from a per-token loss matrix; VeRL's ``agg_loss`` semantics.

    With ``S`` the rows that have a mask-1 token, ``N_b`` the mask-1 tokens of row b and ``N = sum_b N_b``:

    - "token-mean" (TRL "bnpo"):            ``sum_{b,t} l_bt / N``
    - "seq-mean-token-sum":                 ``1/|S| sum_{b in S} sum_t l_bt``
    - "seq-mean-token-mean" (TRL "grpo"):   ``1/|S| sum_{b in S} (1/N_b) sum_t l_bt``            project default
    - "seq-mean-token-sum-norm" (TRL "dr_grpo"): ``1/|S| sum_{b in S} sum_t l_bt / norm_constant``; VeRL's
      ``agg_loss`` divides the token sum by the horizon only (no ``1/|S|``), and its actor then by the number of
      micro-batches, a scale of micro-batch size times this one (docs/math.md, section 3)

    Args:
        loss_mat: (B, T) per-token loss; values where ``mask`` is 0 are ignored (even NaN / inf).
        mask: (B, T) 1 on tokens that carry loss.
        mode: one of ``VALID_AGGREGATIONS``.
        global_num_sequences: |S| of the whole mini-batch (all micro-batches and ranks); replaces this shard's |S|.
        global_num_tokens: N of the whole mini-batch; replaces this shard's N ("token-mean").
        norm_constant: divisor of "seq-mean-token-sum-norm"; default ``T = mask.shape[-1]``. Pass a constant (e.g.
            ``max_completion_length``) when micro-batches are padded to different widths.
        sequence_tokens: (B,) the per-turn layout (several rows per trajectory): N_g of the trajectory each row
            belongs to. "seq-mean-token-mean" then divides a row's token sum by its trajectory's N_g, not by the
            row's own N_b, and |S| counts trajectories (each row its share N_b / N_g, :func:`loss_normalizers`), so a
            trajectory weighs the same whether it is one row or K rows. None: every row is a whole trajectory.

    Returns:
        () the loss; with global counts, this shard's share so that the sum over shards is the mini-batch loss.
        When the count it divides by is 0, a zero that keeps the graph.
    """
    mode = canonical_aggregation(mode)
    if loss_mat.shape != mask.shape or loss_mat.dim() != 2:
        raise ValueError(
            f"loss_mat {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} must both be (B, T) with the same shape."
        )
    _check_count("global_num_sequences", global_num_sequences)
    _check_count("global_num_tokens", global_num_tokens)
    if norm_constant is not None and not float(norm_constant) > 0:
        raise ValueError(f"norm_constant={norm_constant!r} must be > 0 (e.g. max_completion_length).")

    m = mask.bool()  # (B, T)
    losses = torch.where(m, loss_mat, torch.zeros_like(loss_mat))  # (B, T) mask-0 entries can never leak
    zero = losses.sum() * 0.0  # () a zero attached to the graph
    tokens_per_row = m.sum(dim=-1)  # (B,) N_b

    if mode == "token-mean":
        denom = m.sum() if global_num_tokens is None else global_num_tokens  # () N
        if float(denom) == 0:
            return zero
        return losses.sum() / denom  # ()

    row_sums = losses.sum(dim=-1)  # (B,) sum_t l_bt
    per_row = tokens_per_row if sequence_tokens is None else sequence_tokens.to(tokens_per_row.device)  # (B,) N_g(b)
    if mode == "seq-mean-token-mean":
        row_losses = row_sums / per_row.clamp(min=1).to(row_sums.dtype)  # (B,) this row's part of its token-mean
    else:
        row_losses = row_sums  # (B,) token-sum per row; 0 for empty rows
    if global_num_sequences is None:
        denom = loss_normalizers(m, sequence_tokens)[0].to(row_losses.dtype)  # () |S|, in whole trajectories
    else:
        denom = global_num_sequences  # () |S|
    if float(denom) == 0:
        return zero
    loss = row_losses.sum() / denom  # () seq-mean (empty rows add 0 and are not counted)
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (mask.shape[-1] if norm_constant is None else norm_constant)  # ()
    return loss


def _masked_mean(values: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """() mean of ``values`` over ``m`` (0 when ``m`` is empty); VeRL's ``masked_mean``."""
    return torch.where(m, values, torch.zeros_like(values)).sum() / m.sum().clamp(min=1)


def log_importance_weights(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, level: str = "token"
) -> torch.Tensor:
    """``log rho`` per token, (B, T): "token" ``clamp(logp - logp_old, -20, 20)`` (VeRL's clamp); "sequence" (GSPO,
    TRL's ``importance_sampling_level="sequence"``) each row's mean of those over its mask-1 tokens, on every column.

    Args:
        logprobs: (B, T) current log-probs (carries the gradient). old_logprobs: (B, T). mask: (B, T) 1 = loss token.
        level: "token" or "sequence".
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level={level!r} is not valid; use 'token' or 'sequence'.")
    m = mask.bool()  # (B, T)
    logp = torch.where(m, logprobs, torch.zeros_like(logprobs))  # (B, T) mask-0 values replaced, grad 0 there
    logp_old = torch.where(m, old_logprobs, torch.zeros_like(old_logprobs))  # (B, T)
    log_ratio = torch.clamp(logp - logp_old, min=-20.0, max=20.0)  # (B, T) log rho, clamped as VeRL
    if level == "token":
        return log_ratio  # (B, T)
    seq = log_ratio.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)  # (B, 1) mean over the row's tokens
    return seq.expand_as(log_ratio)  # (B, T)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    aggregation: str = "seq-mean-token-mean",
    global_num_sequences: int | float | torch.Tensor | None = None,
    global_num_tokens: int | float | torch.Tensor | None = None,
    norm_constant: int | float | None = None,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    sequence_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO/GRPO policy loss (VeRL ``compute_policy_loss``, dual-clip off) aggregated by :func:`aggregate_loss`.

    Args:
        logprobs: (B, T) log-probs of the sampled tokens under the current policy (carries the gradient).
        old_logprobs: (B, T) log-probs under the behaviour policy that sampled them (TRL's ``old_per_token_logps``).
        advantages: (B,) one per trajectory, or (B, T) one per token (``trl_multiturn.advantages.turn_advantages``).
        mask: (B, T) 1 on tokens the policy sampled; every other position has no effect on loss or gradient.
        epsilon_low, epsilon_high: the clip range ``[1 - epsilon_low, 1 + epsilon_high]`` (TRL ``epsilon``,
            ``epsilon_high``; VeRL ``clip_ratio_low``, ``clip_ratio_high``).
        aggregation, global_num_sequences, global_num_tokens, norm_constant, sequence_tokens: passed to
            :func:`aggregate_loss`.
        delta: two-sided clipping (TRL ``delta``): the unclipped term uses ``min(rho, delta)``, so a negative
            advantage cannot weigh more than ``delta`` per token. None: off.
        importance_sampling_level: "token" (PPO/GRPO) or "sequence" (GSPO: one ratio per trajectory, the exp of the
            mean token log-ratio); see :func:`log_importance_weights`.

    Returns:
        ``(loss, stats)``. ``loss`` () is what to backpropagate. ``stats`` holds detached 0-dim tensors:
        ``pg_loss`` (= loss; a shard's share when global counts are given), ``pg_clipfrac`` (fraction of mask tokens
        where the clipped term is the larger loss), ``ppo_kl`` (mean of ``logp_old - logp``), ``ratio_mean``,
        ``ratio_min``, ``ratio_max`` (over mask tokens; min/max are NaN when there is none: combine shards with
        ``torch.fmin`` / ``torch.fmax``), and ``num_tokens`` (mask tokens, to token-weight the means across shards).
    """
    if not (logprobs.shape == old_logprobs.shape == mask.shape) or logprobs.dim() != 2:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and mask "
            f"{tuple(mask.shape)} must all be (B, T) with the same shape."
        )
    if advantages.shape not in (logprobs.shape, logprobs.shape[:1]):
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)}; expected (B,) = {tuple(logprobs.shape[:1])} "
            f"or (B, T) = {tuple(logprobs.shape)}."
        )
    if not (epsilon_low >= 0 and epsilon_high >= 0):
        raise ValueError(f"epsilon_low={epsilon_low!r} and epsilon_high={epsilon_high!r} must both be >= 0.")

    m = mask.bool()  # (B, T)
    adv = advantages[:, None].expand_as(logprobs) if advantages.dim() == 1 else advantages  # (B, T)
    adv = torch.where(m, adv, torch.zeros_like(adv))  # (B, T)

    log_ratio = log_importance_weights(logprobs, old_logprobs, mask, importance_sampling_level)  # (B, T) log rho
    ratio = torch.exp(log_ratio)  # (B, T) rho
    capped = ratio if delta is None else torch.clamp(ratio, max=delta)  # (B, T) min(rho, delta): two-sided clip
    loss_unclipped = -adv * capped  # (B, T) -A rho
    loss_clipped = -adv * torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)  # (B, T) -A clip(rho)
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)  # (B, T) pessimistic bound
    loss = aggregate_loss(
        loss_mat,
        mask,
        aggregation,
        global_num_sequences=global_num_sequences,
        global_num_tokens=global_num_tokens,
        norm_constant=norm_constant,
        sequence_tokens=sequence_tokens,
    )  # ()

    with torch.no_grad():
        ratio_d = ratio.detach()  # (B, T)
        inf = torch.full_like(ratio_d, float("inf"))  # (B, T)
        nan = ratio_d.new_tensor(float("nan"))  # () min/max of no token
        any_token = bool(m.any())
        stats = {
            "pg_loss": loss.detach(),  # ()
            "pg_clipfrac": _masked_mean((loss_clipped > loss_unclipped).to(ratio_d.dtype), m),  # ()
            "ppo_kl": _masked_mean(-log_ratio.detach(), m),  # () mean of logp_old - logp
            "ratio_mean": _masked_mean(ratio_d, m),  # ()
            "ratio_min": torch.where(m, ratio_d, inf).min() if any_token else nan,  # ()
            "ratio_max": torch.where(m, ratio_d, -inf).max() if any_token else nan,  # ()
            "num_tokens": m.sum(),  # () int64
        }
    return loss, stats


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled tokens; VeRL's ``kl_penalty`` estimators.

    With ``d = logp - logp_ref``: "kl"/"k1" ``d``; "abs" ``|d|``; "mse"/"k2" ``d^2 / 2``; "low_var_kl"/"k3"
    ``exp(-d) + d - 1`` with ``-d`` clamped to [-20, 20] and the result to [-10, 10] (Schulman's k3; TRL's
    ``per_token_kl`` without the clamps). Aggregate it like the policy loss:
    ``beta * aggregate_loss(kl_penalty(...), mask, mode)``.

    Args:
        logprobs: (B, T) current policy log-probs.
        ref_logprobs: (B, T) reference policy log-probs.
        kind: one of "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3".

    Returns:
        (B, T) per-token KL estimate (unmasked: aggregate it with the action mask).
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"kl_penalty kind {kind!r} is not valid; choose one of {tuple(KL_ESTIMATORS)}.")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} must have the same shape."
        )
    estimator = KL_ESTIMATORS[kind]
    diff = logprobs - ref_logprobs  # (B, T) d
    if estimator == "k1":
        return diff  # (B, T)
    if estimator == "abs":
        return diff.abs()  # (B, T)
    if estimator == "k2":
        return 0.5 * diff.square()  # (B, T)
    neg = torch.clamp(-diff, min=-20.0, max=20.0)  # (B, T) logp_ref - logp
    return torch.clamp(torch.exp(neg) - neg - 1.0, min=-10.0, max=10.0)  # (B, T) k3


def grpo_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
    ref_logprobs: torch.Tensor | None = None, importance_sampling_ratio: torch.Tensor | None = None, beta: float = 0.0,
    use_bias_correction_kl: bool = False, epsilon_low: float = 0.2, epsilon_high: float = 0.2,
    aggregation: str = "seq-mean-token-mean", global_num_sequences: int | float | torch.Tensor | None = None,
    global_num_tokens: int | float | torch.Tensor | None = None, norm_constant: int | float | None = None,
    delta: float | None = None, importance_sampling_level: str = "token", sequence_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The whole GRPO objective of one micro-batch, as ``MultiTurnGRPOTrainer.compute_loss`` trains it:

        L = policy_loss(logp, logp_old, w A, mask) + beta * aggregate(k3(logp, logp_ref) [* rho], mask)

    Args:
        logprobs, old_logprobs, advantages, mask: as :func:`policy_loss`.
        epsilon_low, epsilon_high, delta, importance_sampling_level: as :func:`policy_loss`.
        aggregation, global_num_sequences, global_num_tokens, norm_constant, sequence_tokens: as :func:`policy_loss`,
            for the KL too.
        ref_logprobs: (B, T) reference-model log-probs; read only when ``beta != 0``.
        importance_sampling_ratio: (B, T) or (B, 1) TRL's vLLM correction ``w >= 0`` (truncated or masked
            importance ratio between learner and sampler), or None. ``max(-w A rho, -w A clip(rho)) =
            w max(-A rho, -A clip(rho))``: weighting a token's loss by ``w`` is scaling its advantage by ``w``.
        beta: weight of the KL to the reference model (Schulman's k3, :func:`kl_penalty`), aggregated as the loss.
        use_bias_correction_kl: TRL's default: the KL of pi estimated on samples of pi_old, each token's k3
            weighted by its importance ratio ``rho`` (:func:`log_importance_weights`).

    Returns:
        ``(loss, stats)``: the loss () to backpropagate and :func:`policy_loss`'s stats (``pg_loss`` is the policy
        term alone), plus ``kl`` (() detached, the aggregated KL before ``beta``) when ``beta != 0``.
    """
    if importance_sampling_ratio is not None:
        adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # (B, 1) or (B, T)
        advantages = (adv * importance_sampling_ratio).expand_as(logprobs)  # (B, T) w A
    counts = dict(global_num_sequences=global_num_sequences, global_num_tokens=global_num_tokens,
                  norm_constant=norm_constant, sequence_tokens=sequence_tokens)
    loss, stats = policy_loss(
        logprobs, old_logprobs, advantages, mask, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
        aggregation=aggregation, delta=delta, importance_sampling_level=importance_sampling_level, **counts,
    )  # () policy term
    if beta != 0.0:
        kl = kl_penalty(logprobs, ref_logprobs, kind="low_var_kl")  # (B, T) k3
        if use_bias_correction_kl:
            log_rho = log_importance_weights(logprobs, old_logprobs, mask, importance_sampling_level)  # (B, T)
            kl = kl * torch.exp(log_rho)  # (B, T) k3 of pi on samples of pi_old
        kl_loss = aggregate_loss(kl, mask, aggregation, **counts)  # ()
        loss = loss + beta * kl_loss  # ()
        stats["kl"] = kl_loss.detach()  # ()
    return loss, stats


def sampler_learner_gap(
    sampling_logprobs: torch.Tensor, learner_logprobs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """How far the generator's log-probs are from the learner's on the tokens it sampled, as sums to pool over shards.

    With ``q`` the sampler (the generation backend) and ``p`` the learner at the same parameters (pi_old), on each
    mask-1 token with a finite sampling log-prob, ``d = log p - log q``:

        abs  = |d|                        mean: ``rollout/sampler_logp_diff``
        kl   = exp(d) - 1 - d  (>= 0)     mean: ``rollout/sampler_kl``, the k3 estimate of KL(q || p) on q's samples

    Both are 0 when the sampler and the learner agree; a gap means the loss's ratio is taken against a policy that
    did not sample the data (kernels, precision, a stale engine, or logit processing in the sampler).

    Args:
        sampling_logprobs: (B, T) the sampler's log-prob of each sampled token; NaN where unknown (ignored).
        learner_logprobs: (B, T) the learner's, e.g. ``old_per_token_logps``. mask: (B, T) 1 on loss tokens.

    Returns:
        ``(sum abs, sum kl, count)``: three 0-dim tensors; divide the pooled sums by the pooled count.
    """
    if not (sampling_logprobs.shape == learner_logprobs.shape == mask.shape):
        raise ValueError(
            f"sampling_logprobs {tuple(sampling_logprobs.shape)}, learner_logprobs {tuple(learner_logprobs.shape)} "
            f"and mask {tuple(mask.shape)} must have the same (B, T) shape."
        )
    q = sampling_logprobs.detach().float()  # (B, T)
    p = learner_logprobs.detach().float()  # (B, T)
    m = mask.bool() & torch.isfinite(q) & torch.isfinite(p)  # (B, T) tokens with both log-probs
    d = torch.where(m, p - q, torch.zeros_like(p)).clamp(-20.0, 20.0)  # (B, T) log p - log q, 0 off the mask
    kl = torch.exp(d) - 1.0 - d  # (B, T) k3, 0 where d = 0
    return d.abs().sum(), kl.sum(), m.sum()  # (), (), ()
