"""aggregate_loss, policy_loss, kl_penalty: hand-computed values, VeRL equality, split invariance, the two on-policy
facts, mask-0 tokens, and errors."""

import math

import pytest
import torch

from trl_multiturn.advantages import group_advantages
from trl_multiturn.loss import (
    AGGREGATION_ALIASES,
    AGGREGATIONS,
    aggregate_loss,
    kl_penalty,
    loss_normalizers,
    policy_loss,
)

NAN, INF = float("nan"), float("inf")


# ----------------------------------------------------------------------------------------------------------------
# an independent reference written from VeRL's documented formulas (core_algos.agg_loss / compute_policy_loss)
# ----------------------------------------------------------------------------------------------------------------
def ref_masked_mean(x, m):
    return (x * m).sum() / (m.sum() + 1e-8)


def ref_agg_loss(loss_mat, mask, mode, scale_factor=None):
    """token-mean: masked sum / token count; seq-*: per-row token sum (or token mean with + 1e-8), averaged over
    rows that have a token; seq-mean-token-sum-norm additionally divided by the mask width (or a given factor)."""
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    row_tokens = mask.sum(-1)
    row_loss = (loss_mat * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        row_loss = row_loss / (row_tokens + 1e-8)
    valid = (row_tokens > 0).to(loss_mat.dtype)
    loss = (row_loss * valid).sum() / valid.sum()
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (mask.shape[-1] if scale_factor is None else scale_factor)
    return loss


def ref_policy_loss(old_lp, lp, adv, mask, clip_low, clip_high, mode):
    """ratio = exp(clamp(lp - old, -20, 20)); l = max(-A ratio, -A clip(ratio)); clipfrac = mean(clipped > plain);
    ppo_kl = mean(old - lp); dual clip off."""
    neg_kl = torch.clamp(lp - old_lp, -20.0, 20.0)
    ratio = torch.exp(neg_kl)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    pg = torch.maximum(l1, l2)
    return ref_agg_loss(pg, mask, mode), ref_masked_mean((l2 > l1).to(lp.dtype), mask), ref_masked_mean(-neg_kl, mask)


def random_batch(seed, batch=8, width=10, dtype=torch.float64, empty_row=True):
    """Uneven lengths (1..width tokens, one row with none), random log-probs and per-row advantages."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (batch,), generator=gen)
    if empty_row:
        lengths[batch // 2] = 0
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()  # (B, T) right-padded
    old = -torch.rand(batch, width, generator=gen, dtype=dtype) * 3
    new = old + torch.randn(batch, width, generator=gen, dtype=dtype) * 0.3
    adv = torch.randn(batch, generator=gen, dtype=dtype)
    return new, old, adv, mask


# ----------------------------------------------------------------------------------------------------------------
# aggregate_loss
# ----------------------------------------------------------------------------------------------------------------
LOSS = torch.tensor([[1.0, 2.0, 7.0, 7.0], [1.0, 1.0, 1.0, 5.0], [9.0, 9.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])  # N_b = (2, 4, 0); the empty row is not counted


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 1 + 1 + 1 + 5) / 6),  # 11 / 6
        ("seq-mean-token-sum", ((1 + 2) + (1 + 1 + 1 + 5)) / 2),  # (3 + 8) / 2 = 5.5
        ("seq-mean-token-mean", ((1 + 2) / 2 + (1 + 1 + 1 + 5) / 4) / 2),  # (1.5 + 2) / 2 = 1.75
        ("seq-mean-token-sum-norm", ((1 + 2) + (1 + 1 + 1 + 5)) / 2 / 4),  # 5.5 / T = 5.5 / 4 = 1.375
        ("bnpo", 11 / 6),
        ("grpo", 1.75),
        ("dr_grpo", 1.375),
    ],
)
def test_aggregate_hand_computed(mode, expected):
    assert aggregate_loss(LOSS, MASK, mode).item() == pytest.approx(expected, rel=1e-6)


def test_norm_constant_and_global_counts_hand_computed():
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_constant=10).item() == pytest.approx(0.55)
    # as one shard of a mini-batch with 5 sequences and 20 tokens in all: 11 / 20 and (1.5 + 2) / 5
    assert aggregate_loss(LOSS, MASK, "token-mean", global_num_tokens=20).item() == pytest.approx(0.55)
    assert aggregate_loss(LOSS, MASK, "grpo", global_num_sequences=5).item() == pytest.approx(0.7)
    n_seq, n_tok = loss_normalizers(MASK)
    assert (n_seq.item(), n_tok.item()) == (2, 6)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregate_matches_verl_reference(seed, mode):
    new, _, _, mask = random_batch(seed)
    torch.testing.assert_close(aggregate_loss(new, mask, mode), ref_agg_loss(new, mask, mode), rtol=1e-7, atol=0)


def test_all_masked_gives_zero_that_keeps_the_graph():
    x = torch.randn(2, 3, requires_grad=True)
    for mode in AGGREGATIONS:
        loss = aggregate_loss(x, torch.zeros(2, 3), mode)
        assert loss.item() == 0.0 and loss.requires_grad
        loss.backward()
        assert torch.equal(x.grad, torch.zeros(2, 3))
        x.grad = None


def test_aggregate_errors():
    with pytest.raises(ValueError, match=r"'sum'.*token-mean.*seq-mean-token-mean.*grpo.*dr_grpo.*bnpo"):
        aggregate_loss(LOSS, MASK, "sum")
    with pytest.raises(ValueError, match=r"\(3, 4\).*\(3, 3\)"):
        aggregate_loss(LOSS, MASK[:, :3], "token-mean")
    with pytest.raises(ValueError, match="global_num_tokens=-1"):
        aggregate_loss(LOSS, MASK, "token-mean", global_num_tokens=-1)
    with pytest.raises(ValueError, match="norm_constant=0"):
        aggregate_loss(LOSS, MASK, "dr_grpo", norm_constant=0)
    assert set(AGGREGATION_ALIASES.values()) <= set(AGGREGATIONS)


# ----------------------------------------------------------------------------------------------------------------
# policy_loss
# ----------------------------------------------------------------------------------------------------------------
def hand_batch():
    """Row 0 (A = +1): ratios (1.5, 0.5), pad.  Row 1 (A = -1): ratios (1.5, 0.5, 1.0)."""
    ratios = torch.tensor([[1.5, 0.5, 1.0], [1.5, 0.5, 1.0]], dtype=torch.float64)
    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    new = (old + ratios.log()).requires_grad_(True)
    return new, old, torch.tensor([1.0, -1.0], dtype=torch.float64), torch.tensor([[1, 1, 0], [1, 1, 1]])


def test_policy_loss_hand_computed_every_mode():
    new, old, adv, mask = hand_batch()
    # per-token max(-A r, -A clip(r, 0.8, 1.2)):
    #   row 0, A=+1: r=1.5 -> max(-1.5, -1.2) = -1.2 (clipped);  r=0.5 -> max(-0.5, -0.8) = -0.5
    #   row 1, A=-1: r=1.5 -> max(1.5, 1.2) = 1.5;  r=0.5 -> max(0.5, 0.8) = 0.8 (clipped);  r=1 -> 1.0
    # row sums: -1.7 and 3.3; row means: -0.85 and 1.1; 5 tokens, 2 rows, T = 3
    expected = {
        "seq-mean-token-mean": (-0.85 + 1.1) / 2,  # 0.125
        "token-mean": (-1.7 + 3.3) / 5,  # 0.32
        "seq-mean-token-sum": (-1.7 + 3.3) / 2,  # 0.8
        "seq-mean-token-sum-norm": (-1.7 + 3.3) / 2 / 3,  # 0.2667
    }
    for mode, value in expected.items():
        loss, stats = policy_loss(new, old, adv, mask, aggregation=mode)
        assert loss.item() == pytest.approx(value, rel=1e-12), mode
        assert stats["pg_loss"].item() == pytest.approx(value, rel=1e-12)
        assert not stats["pg_loss"].requires_grad
    assert stats["pg_clipfrac"].item() == pytest.approx(2 / 5)
    # ppo_kl = mean(old - new) = -(ln 1.5 + ln 0.5 + ln 1.5 + ln 0.5 + ln 1) / 5 = -2 ln 0.75 / 5
    assert stats["ppo_kl"].item() == pytest.approx(-2 * math.log(0.75) / 5, rel=1e-12)
    assert stats["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 1.5 + 0.5 + 1.0) / 5)
    assert (stats["ratio_min"].item(), stats["ratio_max"].item()) == pytest.approx((0.5, 1.5))
    assert stats["num_tokens"].item() == 5


def test_policy_loss_hand_computed_gradient_and_asymmetric_clip():
    new, old, adv, mask = hand_batch()
    loss, stats = policy_loss(new, old, adv, mask, epsilon_low=0.2, epsilon_high=0.6)
    # clip range (0.8, 1.6): row 0 r=1.5 is no longer clipped -> -1.5; row 1 r=0.5 still clipped -> 0.8
    # seq-mean-token-mean = ((-1.5 - 0.5) / 2 + (1.5 + 0.8 + 1.0) / 3) / 2 = (-1 + 1.1) / 2 = 0.05
    assert loss.item() == pytest.approx(0.05, rel=1e-12)
    assert stats["pg_clipfrac"].item() == pytest.approx(1 / 5)
    loss.backward()
    # d/dlogp of -A r / (N_b * |S|) is -A r / (N_b * 2) on unclipped tokens, 0 on clipped ones and padding
    expected = torch.tensor([[-1.5 / 4, -0.5 / 4, 0.0], [1.5 / 6, 0.0, 1.0 / 6]], dtype=torch.float64)
    torch.testing.assert_close(new.grad, expected, rtol=1e-12, atol=1e-15)


def test_log_ratio_is_clamped_to_20_as_verl():
    # one token with logp - old = 30 and A = -1: ratio = exp(clamp(30, -20, 20)) = exp(20);
    # loss = max(-A r, -A clip(r)) = max(exp(20), 1.2) = exp(20); ppo_kl = -clamp(30) = -20
    lp = torch.tensor([[30.0]], dtype=torch.float64, requires_grad=True)
    loss, stats = policy_loss(lp, torch.zeros(1, 1, dtype=torch.float64), torch.tensor([-1.0], dtype=torch.float64),
                              torch.ones(1, 1))
    assert loss.item() == pytest.approx(math.exp(20), rel=1e-12)
    assert stats["ppo_kl"].item() == -20.0 and stats["ratio_max"].item() == pytest.approx(math.exp(20), rel=1e-12)
    loss.backward()
    assert lp.grad.item() == 0.0  # outside the clamp there is no gradient


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_policy_loss_matches_verl_reference(seed, mode):
    new, old, adv, mask = random_batch(seed)
    adv_tok = adv[:, None].expand_as(new) * mask  # VeRL takes (B, T) advantages, 0 outside the response mask
    ref_loss, ref_clipfrac, ref_kl = ref_policy_loss(old, new, adv_tok, mask, 0.2, 0.28, mode)
    for advantages in (adv, adv_tok):  # (B,) and (B, T) give the same numbers
        loss, stats = policy_loss(new, old, advantages, mask, epsilon_high=0.28, aggregation=mode)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-7, atol=1e-12)
        torch.testing.assert_close(stats["pg_clipfrac"], ref_clipfrac, rtol=1e-7, atol=1e-12)
        torch.testing.assert_close(stats["ppo_kl"], ref_kl, rtol=1e-7, atol=1e-12)


# ----------------------------------------------------------------------------------------------------------------
# the two on-policy facts (property tests over random inputs)
# ----------------------------------------------------------------------------------------------------------------
def on_policy_batch(seed, group_size, groups, width=16):
    gen = torch.Generator().manual_seed(seed)
    batch = group_size * groups
    rewards = torch.rand(batch, generator=gen)
    adv = group_advantages(rewards, group_size)  # (B,) sums to 0 within each group
    lengths = torch.randint(1, width + 1, (batch,), generator=gen)  # unequal, every row has a token
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    logp = (-torch.rand(batch, width, generator=gen) * 4).requires_grad_(True)
    return logp, adv, mask, lengths


@pytest.mark.parametrize("seed", range(20))
def test_on_policy_seq_mean_token_mean_loss_is_zero_but_gradient_is_not(seed):
    logp, adv, mask, _ = on_policy_batch(seed, group_size=[2, 4, 5, 8][seed % 4], groups=1 + seed % 3)
    loss, stats = policy_loss(logp, logp.detach(), adv, mask, aggregation="seq-mean-token-mean")
    # ratio = 1 -> loss = -1/|S| sum_b A_b (1/N_b) sum_t 1 = -1/|S| sum_b A_b = 0 for whole groups
    assert abs(loss.item()) < 1e-6
    assert stats["ratio_min"].item() == stats["ratio_max"].item() == 1.0
    loss.backward()
    # gradient: -A_b / (N_b |S|) on each sampled token -- not zero
    assert logp.grad.abs().max().item() > 1e-3
    expected = -(adv / mask.sum(-1))[:, None] * mask / adv.numel()
    torch.testing.assert_close(logp.grad, expected, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("seed", range(20))
def test_on_policy_token_mean_with_unequal_lengths_is_not_zero(seed):
    logp, adv, mask, lengths = on_policy_batch(seed, group_size=[2, 4, 5, 8][seed % 4], groups=1 + seed % 3)
    if lengths.unique().numel() == 1:
        pytest.skip("equal lengths by chance")
    loss, _ = policy_loss(logp, logp.detach(), adv, mask, aggregation="token-mean")
    # ratio = 1 -> loss = -sum_b A_b N_b / sum_b N_b: a length-weighted sum of advantages, not 0 in general
    expected = -(adv * lengths).sum() / lengths.sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    assert abs(loss.item()) > 1e-4


# ----------------------------------------------------------------------------------------------------------------
# mask-0 tokens have no effect, whatever their value
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_mask_zero_tokens_change_neither_loss_nor_gradient(mode):
    new, old, adv, mask = random_batch(7)
    adv_tok = adv[:, None].expand_as(new).clone()
    off = mask == 0
    results = []
    for junk in (0.0, 1e6, -1e6, NAN, INF):
        lp = new.clone()
        lp[off] = junk
        old_j, adv_j = old.clone(), adv_tok.clone()
        old_j[off], adv_j[off] = -junk, junk
        lp.requires_grad_(True)
        loss, stats = policy_loss(lp, old_j, adv_j, mask, aggregation=mode)
        loss.backward()
        results.append((loss.detach(), lp.grad, stats))
    for loss, grad, stats in results[1:]:
        assert torch.equal(loss, results[0][0])
        assert torch.equal(grad, results[0][1])
        assert torch.equal(grad[off], torch.zeros_like(grad[off]))
        for key in ("pg_clipfrac", "ppo_kl", "ratio_mean", "ratio_min", "ratio_max"):
            assert torch.equal(stats[key], results[0][2][key]), key


# ----------------------------------------------------------------------------------------------------------------
# split invariance: a mini-batch cut into micro-batches and ranks sums to the whole
# ----------------------------------------------------------------------------------------------------------------
def shard_losses(new, old, adv, mask, mode, bounds, trim, norm_constant=None, global_counts=True):
    """Per-shard losses for row ranges ``bounds``; each shard trimmed to its own width when ``trim``."""
    n_seq, n_tok = loss_normalizers(mask)  # in a trainer: summed over micro-batches and all-reduced over ranks
    out = []
    for lo, hi in bounds:
        width = int(mask[lo:hi].sum(-1).max().clamp(min=1)) if trim else mask.shape[1]
        kwargs = dict(global_num_sequences=n_seq, global_num_tokens=n_tok) if global_counts else {}
        loss, _ = policy_loss(new[lo:hi, :width], old[lo:hi, :width], adv[lo:hi], mask[lo:hi, :width],
                              aggregation=mode, norm_constant=norm_constant, **kwargs)
        out.append(loss)
    return out


# micro-batches of 3, 1 and 4 rows (uneven sizes and lengths, one holds the empty row), and 2 ranks x 2 micro
SPLITS = {"micro": [(0, 3), (3, 4), (4, 8)], "ranks_x_micro": [(0, 2), (2, 4), (4, 6), (6, 8)]}


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("mode", AGGREGATIONS + tuple(AGGREGATION_ALIASES))
def test_split_invariance_loss_and_gradient(mode, split):
    new, old, adv, mask = random_batch(3)
    width = mask.shape[1]
    # micro-batches trimmed to their own width: "seq-mean-token-sum-norm" then needs a fixed norm_constant
    norm = width if mode in ("seq-mean-token-sum-norm", "dr_grpo") else None
    full_lp = new.clone().requires_grad_(True)
    full, _ = policy_loss(full_lp, old, adv, mask, aggregation=mode, norm_constant=norm)
    full.backward()
    shard_lp = new.clone().requires_grad_(True)
    parts = shard_losses(shard_lp, old, adv, mask, mode, SPLITS[split], trim=True, norm_constant=norm)
    total = torch.stack(parts).sum()
    total.backward()  # accumulated gradients (DDP would average over ranks: the trainer multiplies by world size)
    torch.testing.assert_close(total, full, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(shard_lp.grad, full_lp.grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_naive_mean_of_micro_batch_means_differs(mode):
    new, old, adv, mask = random_batch(3)
    full, _ = policy_loss(new, old, adv, mask, aggregation=mode)
    naive = torch.stack(shard_losses(new, old, adv, mask, mode, SPLITS["micro"], trim=False, global_counts=False))
    assert abs(naive.mean().item() - full.item()) > 1e-3  # what gradient accumulation of local means computes
    right = torch.stack(shard_losses(new, old, adv, mask, mode, SPLITS["micro"], trim=False)).sum()
    torch.testing.assert_close(right, full, rtol=1e-12, atol=1e-14)


def test_stats_of_an_empty_shard():
    lp = torch.zeros(2, 3, requires_grad=True)
    loss, stats = policy_loss(lp, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3))
    assert loss.item() == 0.0 and loss.requires_grad
    assert stats["num_tokens"].item() == 0 and stats["pg_clipfrac"].item() == 0.0
    assert math.isnan(stats["ratio_min"].item()) and math.isnan(stats["ratio_max"].item())


def test_policy_loss_errors():
    new, old, adv, mask = hand_batch()
    with pytest.raises(ValueError, match=r"logprobs \(2, 3\), old_logprobs \(2, 2\)"):
        policy_loss(new, old[:, :2], adv, mask)
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\); expected \(B,\) = \(2,\) or \(B, T\)"):
        policy_loss(new, old, torch.zeros(3), mask)
    with pytest.raises(ValueError, match="'seq-mean'"):
        policy_loss(new, old, adv, mask, aggregation="seq-mean")
    with pytest.raises(ValueError, match="epsilon_low=-0.1"):
        policy_loss(new, old, adv, mask, epsilon_low=-0.1)


# ----------------------------------------------------------------------------------------------------------------
# kl_penalty
# ----------------------------------------------------------------------------------------------------------------
def test_kl_penalty_hand_computed():
    lp, ref = torch.tensor([[0.5, -30.0, 30.0]]), torch.zeros(1, 3)
    # d = lp - ref = (0.5, -30, 30)
    assert kl_penalty(lp, ref, "kl").tolist() == [[0.5, -30.0, 30.0]]
    assert torch.equal(kl_penalty(lp, ref, "k1"), kl_penalty(lp, ref, "kl"))
    assert kl_penalty(lp, ref, "abs").tolist() == [[0.5, 30.0, 30.0]]
    assert kl_penalty(lp, ref, "mse").tolist() == [[0.125, 450.0, 450.0]]  # d^2 / 2
    # k3 = exp(-d) + d - 1 with -d clamped to [-20, 20], result clamped to [-10, 10]:
    #   d = 0.5: exp(-0.5) - 0.5 = 0.1065306597;  d = -30: exp(20) - 21 -> 10;  d = 30: exp(-20) + 19 -> 10
    k3 = kl_penalty(lp, ref)
    assert k3[0, 0].item() == pytest.approx(math.exp(-0.5) - 0.5, rel=1e-6)
    assert k3[0, 1:].tolist() == [10.0, 10.0]
    assert torch.equal(kl_penalty(lp, ref, "k3"), k3)
    assert torch.equal(kl_penalty(lp, ref, "k2"), kl_penalty(lp, ref, "mse"))
    with pytest.raises(ValueError, match=r"'full'.*low_var_kl"):
        kl_penalty(lp, ref, "full")
    with pytest.raises(ValueError, match="same shape"):
        kl_penalty(lp, ref[:, :2])


def test_grpo_loss_adds_the_weighted_kl_and_scales_advantages_by_the_sampling_weight():
    from trl_multiturn.loss import grpo_loss

    logp = torch.zeros(1, 2)  # rho = 1 everywhere
    ref = torch.full((1, 2), math.log(2.0))  # d = logp - ref = -log 2
    mask = torch.ones(1, 2)
    w = torch.tensor([[0.5, 1.0]])  # TRL's vLLM importance-sampling weight
    loss, stats = grpo_loss(logp, logp, torch.tensor([2.0]), mask, ref_logprobs=ref, importance_sampling_ratio=w,
                            beta=0.1, use_bias_correction_kl=True)
    # policy: -A w rho = (-1, -2), token-mean of the row -> -1.5; k3 = exp(log 2) - log 2 - 1 per token
    k3 = 2.0 - math.log(2.0) - 1.0
    assert float(stats["pg_loss"]) == pytest.approx(-1.5, abs=1e-6)
    assert float(stats["kl"]) == pytest.approx(k3, abs=1e-6)
    assert float(loss) == pytest.approx(-1.5 + 0.1 * k3, abs=1e-6)
    no_kl, stats = grpo_loss(logp, logp, torch.tensor([2.0]), mask)
    assert float(no_kl) == pytest.approx(-2.0, abs=1e-6) and "kl" not in stats
