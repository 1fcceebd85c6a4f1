"""The LM-head tile width of the scorer's fused log-prob forward on CPU (``trl_multiturn.scoring.lm_head_chunk``):
TRL's width is restored after the block, the scorer's forwards run with the narrower width, and the log-probs
(forward and gradient) equal TRL's width's up to float rounding."""

from __future__ import annotations

import torch
from trl.kernels.chunked_logprob import ChunkedLogProbFunction
from trl.trainer import utils as trl_utils

from trl_multiturn import scoring


def test_lm_head_chunk_sets_and_restores_trls_width():
    original = trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE
    with scoring.lm_head_chunk(1024):
        assert trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE == 1024
    assert trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE == original
    try:
        with scoring.lm_head_chunk(1024):
            raise KeyError("boom")
    except KeyError:
        pass
    assert trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE == original  # restored on error too
    with scoring.lm_head_chunk(None):  # off (GPU): TRL's own width
        assert trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE == original
    assert scoring.CPU_LOGPROB_CHUNK < original  # narrower than TRL's on CPU, else it would change nothing


def test_narrow_tiles_give_the_same_log_probs_and_gradients():
    torch.manual_seed(0)
    vocab, n = 3 * scoring.CPU_LOGPROB_CHUNK + 123, 64  # several tiles, the last one partial
    w = torch.randn(vocab, 32) * 0.3
    targets = torch.randint(0, vocab, (n,))
    results = []
    for width in (trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE, scoring.CPU_LOGPROB_CHUNK):
        h = torch.randn(n, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        lp, ent, *_ = ChunkedLogProbFunction.apply(h, w, None, targets, 0.7, width, None, 1.0, ("log_probs", "entropy"))
        (lp.sum() + 0.1 * ent.sum()).backward()
        results.append((lp.detach(), ent.detach(), h.grad))
    exact = torch.log_softmax((torch.randn(n, 32, generator=torch.Generator().manual_seed(1)) @ w.t()) / 0.7, -1)
    torch.testing.assert_close(results[1][0], exact.gather(1, targets[:, None])[:, 0], atol=1e-4, rtol=0)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_the_scorer_forwards_with_the_narrow_width_on_cpu(monkeypatch):
    seen = []

    class Scorer(scoring.LayoutScorer):
        def _score(self, *args, **kwargs):
            seen.append(trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE)
            return "scored"

    scorer = Scorer.__new__(Scorer)
    ids = torch.ones((2, 5), dtype=torch.long)
    assert scorer.score(None, ids, ids, 2) == "scored"
    assert seen == [scoring.CPU_LOGPROB_CHUNK]
