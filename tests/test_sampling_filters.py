"""Top-k and top-p (nucleus) filtering of the sampling distribution (``SamplingParams.top_k`` / ``top_p``).

The filter is checked by hand on a small distribution, then through ``TransformersGenerator`` on both of its paths
(K/V reuse and the reference loop) with a logits processor that pins the next-token distribution: every sampled
token lies inside the filtered set, every token of that set is sampled, and the log-prob reported for a token is
the one under the unfiltered ``log_softmax(logits / temperature)`` (the policy's own log-prob, as documented).
"""

from __future__ import annotations

import pytest
import torch

from trl_multiturn.generation import SamplingParams, TransformersGenerator, _filter_logits

PROBS = [0.5, 0.3, 0.15, 0.05]


def kept(logits: torch.Tensor) -> list[int]:
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


@pytest.mark.parametrize(
    "top_k,top_p,expected",
    [
        (0, 1.0, [0, 1, 2, 3]),  # the defaults filter nothing
        (2, 1.0, [0, 1]),
        (3, 1.0, [0, 1, 2]),
        (10, 1.0, [0, 1, 2, 3]),  # k above the vocabulary keeps everything
        (0, 0.4, [0]),  # 0.5 alone crosses 0.4: the token that crosses top_p is kept
        (0, 0.75, [0, 1]),  # 0.5 + 0.3 = 0.8 crosses 0.75
        (0, 0.85, [0, 1, 2]),  # 0.8 + 0.15 = 0.95 crosses 0.85
        (2, 0.85, [0, 1]),  # both: top-k first
    ],
)
def test_filter_by_hand(top_k, top_p, expected):
    logits = torch.tensor([PROBS]).log()  # (1, 4)
    assert kept(_filter_logits(logits, top_k, top_p)) == expected
    # the same in a shuffled vocabulary: the mask goes back to each token's own position
    order = torch.tensor([2, 0, 3, 1])
    shuffled = _filter_logits(logits[:, order], top_k, top_p)
    assert sorted(order[kept(shuffled)].tolist()) == expected
    # kept logits are unchanged
    out = _filter_logits(logits, top_k, top_p)
    assert torch.equal(out[0, expected], logits[0, expected])


def test_ties_at_the_kth_value_are_kept():
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    assert kept(_filter_logits(logits, 2, 1.0)) == [0, 1, 2]


def pinned_distribution(vocab_size: int, token_ids: list[int], probs: list[float]):
    """A logits processor that replaces the model's logits with a fixed distribution over ``token_ids``."""
    fixed = torch.full((vocab_size,), float("-inf"))
    fixed[token_ids] = torch.tensor(probs).log()

    def processor(rows, logits):
        return fixed.to(logits.dtype).expand(logits.size(0), -1).clone()

    return processor


@pytest.mark.parametrize("kv_reuse", [True, False], ids=["kv_reuse", "reference"])
@pytest.mark.parametrize(
    "top_k,top_p,allowed", [(0, 1.0, 5), (2, 1.0, 2), (0, 0.7, 2), (0, 0.9, 3), (3, 0.7, 2)]
)
def test_generator_samples_only_inside_the_filter(smollm2_tokenizer, tiny_model_factory, kv_reuse, top_k, top_p,
                                                  allowed):
    tok = smollm2_tokenizer
    words = [tok(w, add_special_tokens=False)["input_ids"][0] for w in (" sun", " rain", " wind", " snow", " fog")]
    probs = [0.4, 0.3, 0.2, 0.06, 0.04]
    # at temperature 0.8 the distribution is p^1.25 renormalized: [0.441, 0.308, 0.186, 0.041, 0.025]; top-p 0.7 is
    # crossed by the second token, 0.9 by the third; the rarest token is drawn in 480 draws but for odds of 1e-5
    temperature = 0.8
    gen = TransformersGenerator(
        tiny_model_factory(), tok, generator=torch.Generator().manual_seed(0), kv_reuse=kv_reuse,
        logits_processor=pinned_distribution(len(tok), words, probs),
    )
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    outs = gen.generate([[1, 2, 3]] * 16, 30, params)
    sampled = [i for o in outs for i in o.ids]
    assert len(sampled) == 16 * 30 and all(o.finish_reason == "length" for o in outs)
    # the filter applies to the temperature-scaled distribution: p^(1/T), renormalized
    scaled = torch.tensor(probs).log() / temperature
    inside = _filter_logits(scaled.unsqueeze(0), top_k, top_p)
    expected_set = {words[j] for j in kept(inside)}
    assert len(expected_set) == allowed
    assert set(sampled) == expected_set  # nothing outside, and every token inside was drawn
    logp = torch.log_softmax(scaled, dim=-1)
    for o in outs:
        for token, lp in zip(o.ids, o.logprobs):
            assert lp == pytest.approx(float(logp[words.index(token)]), abs=1e-5)
