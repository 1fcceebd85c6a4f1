"""Generation backends: sample one turn for a batch of contexts, returning exact ids and their log-probs.

``TransformersGenerator`` is a small batched sampling loop over a Hugging Face causal LM with a KV cache. It is
ours rather than ``model.generate`` for three reasons: the sampling log-prob of every token comes from the very
logits it was sampled from (``log_softmax(logits / temperature)``, the quantity TRL and VeRL recompute as the old
policy), each row stops on its own at EOS or at a stop string (checked on the decoded tail, so a stop string that
spans several tokens is caught), and nothing is generated for a row after it stopped.

Log-prob convention: like TRL and VeRL, the log-prob is taken under the temperature-scaled distribution before
top-k / top-p filtering.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """Sampling settings for one turn (mirrors TRL's ``GRPOConfig`` generation fields)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    stop_strings: tuple[str, ...] = ()


@dataclass
class GenerationOutput:
    """One sampled turn.

    Attributes:
        ids: (n,) sampled token ids, up to and including the stop token (EOS or the token completing a stop string).
        logprobs: (n,) log-prob of each sampled id under ``log_softmax(logits / temperature)``.
        finish_reason: "eos", "stop" (a stop string) or "length" (``max_new_tokens`` reached).
        prefill_tokens: how many context tokens were (re)computed for this row before sampling (for speed metrics).
    """

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"
    prefill_tokens: int = 0


def _cache_kwarg_name() -> str:
    """transformers >= 5.2x renamed ``past_key_values`` to ``cache``; support both."""
    from transformers import LlamaForCausalLM

    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


_CACHE_KWARG = _cache_kwarg_name()


def _cache_of(output):
    return getattr(output, "cache", None) if _CACHE_KWARG == "cache" else output.past_key_values


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits outside top-k / top-p with -inf. logits: (B, V)."""
    if top_k and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))  # (B, V)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)  # (B, V)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)  # (B, V)
        drop_sorted = cum - torch.softmax(sorted_logits, dim=-1) > top_p  # (B, V) keep the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # (B, V) back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))  # (B, V)
    return logits


class TransformersGenerator:
    """Batched sampling with a transformers model.

    Args:
        model: a causal LM (``PreTrainedModel`` or a PEFT wrapper). The caller puts it in eval mode.
        tokenizer: used to decode tails for stop strings and for the pad / eos ids.
        generator: optional ``torch.Generator`` for reproducible sampling.
    """

    def __init__(self, model, tokenizer, generator: torch.Generator | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.generator = generator
        eos = tokenizer.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        gen_cfg = getattr(model, "generation_config", None)
        cfg_eos = getattr(gen_cfg, "eos_token_id", None) if gen_cfg is not None else None
        if cfg_eos is not None:
            eos_ids |= set(cfg_eos if isinstance(cfg_eos, list) else [cfg_eos])
        self.eos_token_ids = eos_ids
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos_ids), 0)

    @torch.no_grad()
    def generate(
        self, contexts: list[list[int]], max_new_tokens: list[int] | int, params: SamplingParams
    ) -> list[GenerationOutput]:
        """Sample one turn for each context. ``contexts[i]`` is the full token history of row i."""
        n = len(contexts)
        if n == 0:
            return []
        if isinstance(max_new_tokens, int):
            max_new_tokens = [max_new_tokens] * n
        outputs = [GenerationOutput(prefill_tokens=len(c)) for c in contexts]
        active = [i for i in range(n) if max_new_tokens[i] > 0]
        if not active:
            return outputs
        device = next(self.model.parameters()).device
        stop_strings = tuple(s for s in params.stop_strings if s)
        tail_tokens = 1 + max((len(self.tokenizer(s, add_special_tokens=False)["input_ids"]) for s in stop_strings), default=0)

        # Left-pad the active contexts: (A, L)
        width = max(len(contexts[i]) for i in active)
        input_ids = torch.full((len(active), width), self.pad_token_id, dtype=torch.long)  # (A, L)
        attention = torch.zeros((len(active), width), dtype=torch.long)  # (A, L)
        for row, i in enumerate(active):
            ctx = contexts[i]
            input_ids[row, width - len(ctx) :] = torch.tensor(ctx, dtype=torch.long)
            attention[row, width - len(ctx) :] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        position_ids = (attention.cumsum(-1) - 1).clamp(min=0)  # (A, L)

        out = self.model(
            input_ids=input_ids, attention_mask=attention, position_ids=position_ids, use_cache=True, logits_to_keep=1
        )
        past = _cache_of(out)
        logits = out.logits[:, -1, :].float()  # (A, V)
        running = torch.ones(len(active), dtype=torch.bool)  # (A,)
        limit = max(max_new_tokens[i] for i in active)
        for step in range(limit):
            scaled = logits / max(params.temperature, 1e-6) if not params.greedy else logits  # (A, V)
            logp = torch.log_softmax(scaled, dim=-1)  # (A, V)
            if params.greedy:
                next_ids = scaled.argmax(dim=-1)  # (A,)
            else:
                probs = torch.softmax(_filter_logits(scaled, params.top_k, params.top_p), dim=-1)  # (A, V)
                next_ids = torch.multinomial(probs.cpu(), 1, generator=self.generator).squeeze(-1).to(device)  # (A,)
            chosen_logp = logp.gather(-1, next_ids.unsqueeze(-1)).squeeze(-1)  # (A,)
            for row, i in enumerate(active):
                if not running[row]:
                    continue
                token = int(next_ids[row])
                o = outputs[i]
                o.ids.append(token)
                o.logprobs.append(float(chosen_logp[row]))
                if token in self.eos_token_ids:
                    o.finish_reason, running[row] = "eos", False
                elif stop_strings and any(
                    s in self.tokenizer.decode(o.ids[-tail_tokens:], skip_special_tokens=False) for s in stop_strings
                ):
                    o.finish_reason, running[row] = "stop", False
                elif len(o.ids) >= max_new_tokens[i]:
                    o.finish_reason, running[row] = "length", False
            if not running.any() or step == limit - 1:
                break
            feed = torch.where(running.to(device), next_ids, torch.full_like(next_ids, self.pad_token_id))  # (A,)
            attention = torch.cat([attention, running.to(device).long().unsqueeze(-1)], dim=-1)  # (A, L+t+1)
            position_ids = position_ids[:, -1:] + 1  # (A, 1)
            out = self.model(
                input_ids=feed.unsqueeze(-1),
                attention_mask=attention,
                position_ids=position_ids,
                use_cache=True,
                **{_CACHE_KWARG: past},
            )
            past = _cache_of(out)
            logits = out.logits[:, -1, :].float()  # (A, V)
        return outputs
