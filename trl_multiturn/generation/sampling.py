"""Sampling settings and the sampled turn shared by both backends, with the per-token helpers they use: top-k /
top-p / min-p filtering of the logits, the EOS ids of a tokenizer and model, and the check that ends a turn (EOS, a
stop string in the decoded tail, the token budget).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """Sampling settings for one turn (mirrors TRL's ``GRPOConfig`` generation fields)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    greedy: bool = False
    stop_strings: tuple[str, ...] = ()


def sampling_params_from_config(args) -> SamplingParams:
    """The sampling of a TRL ``GRPOConfig`` (``temperature``, ``top_p``, ``top_k``, ``min_p``; ``None`` = off)."""
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k or 0,
                          min_p=args.min_p or 0.0)


@dataclass
class GenerationOutput:
    """One sampled turn.

    Attributes:
        ids: (n,) sampled token ids, up to and including the stop token (EOS or the token completing a stop string).
        logprobs: (n,) log-prob of each sampled id under ``log_softmax(logits / temperature)``.
        finish_reason: "eos", "stop" (a stop string) or "length" (``max_new_tokens`` reached).
        prefill_tokens: context tokens computed for this row before its first sample (the new tokens, plus history
            tokens re-fed to align a batch; the whole context when no cache was reused).
        cached_tokens: context tokens whose K/V came from the row's session instead of being computed.
    """

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"
    prefill_tokens: int = 0
    cached_tokens: int = 0


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Mask logits outside top-k / top-p / min-p with -inf, in transformers' order. logits: (B, V). min-p drops the
    tokens whose probability is below ``min_p`` times the most likely one's (a ratio, so the order after top-p
    does not matter)."""
    if top_k and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))  # (B, V)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)  # (B, V)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)  # (B, V)
        drop_sorted = cum - torch.softmax(sorted_logits, dim=-1) > top_p  # (B, V) keep the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # (B, V) back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))  # (B, V)
    if min_p and min_p > 0.0:
        logp = torch.log_softmax(logits, dim=-1)  # (B, V)
        floor = logp.max(dim=-1, keepdim=True).values + math.log(min_p)  # (B, 1) log(min_p * p_max)
        logits = logits.masked_fill(logp < floor, float("-inf"))  # (B, V)
    return logits


def _eos_ids(tokenizer, model=None) -> set[int]:
    eos = tokenizer.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    gen_cfg = getattr(model, "generation_config", None) if model is not None else None
    cfg_eos = getattr(gen_cfg, "eos_token_id", None) if gen_cfg is not None else None
    if cfg_eos is not None:
        ids |= set(cfg_eos if isinstance(cfg_eos, list) else [cfg_eos])
    return ids


class _StopChecker:
    """Decides whether a row's turn is over after its latest token (EOS, a stop string in the decoded tail, budget)."""

    def __init__(self, tokenizer, eos_ids: set[int], stop_strings: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.tail = 1 + max(
            (len(tokenizer(s, add_special_tokens=False)["input_ids"]) for s in self.stop_strings), default=0
        )

    def __call__(self, ids: list[int], max_new_tokens: int) -> str | None:
        if ids[-1] in self.eos_ids:
            return "eos"
        if self.stop_strings:
            tail = self.tokenizer.decode(ids[-self.tail :], skip_special_tokens=False)
            if any(s in tail for s in self.stop_strings):
                return "stop"
        if len(ids) >= max_new_tokens:
            return "length"
        return None
