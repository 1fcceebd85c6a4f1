"""Generation backends: sample one turn for a batch of contexts, returning exact ids and their log-probs.

Two backends share one API, ``generate(contexts, max_new_tokens, params) -> list[GenerationOutput]``:

``TransformersGenerator`` is a batched sampling loop over a Hugging Face causal LM. It is ours rather than
``model.generate`` (which TRL's own multi-turn path calls once per turn) because a multi-turn rollout needs what
``generate`` does not give:

* the sampling log-prob of every token from the very logits it was sampled from (``log_softmax(logits / T)``, the
  quantity TRL and VeRL recompute as the old policy);
* stop strings checked on the decoded tail of each row (a stop string spanning several tokens is caught) and
  nothing generated for a row after it stopped;
* **no recomputation of the history across turns.** Each trajectory owns a :class:`GenerationSession` that keeps the
  K/V of every token it has seen. At turn k+1 only the tokens appended since turn k (the last sampled token, the
  observation and its template tokens) are prefilled; TRL re-prefills the whole history at every turn;
* **shared prompt prefixes computed once.** Rows that start a trajectory together and begin with the same ids
  (the system prompt and tool schema; the G copies of a GRPO prompt) share the K/V of their common prefix;
* **rows that join and leave a running batch.** Besides the batch call ``generate``, the backend exposes
  ``submit`` / ``step``: a request joins the running batch at the next decode step (its new tokens are prefilled on
  their own and its K/V merged into the batch), and a row whose turn ended leaves the batch at once, so one slow
  trajectory never holds the others back. :class:`~trl_multiturn.rollout.MultiTurnRollout` drives this from its
  main thread while environment steps run in its thread pool.

How the K/V are kept: a running batch holds, per layer, one buffer of shape (A, H_kv, capacity, D) with every row
left-padded so that all rows end at the same column ``W``; a decode step writes one column in place (capacity
doubles when full), so a step never copies the cache (transformers' ``DynamicCache`` concatenates the whole cache
at every step). The buffer is rebuilt only when rows join or leave. A row that leaves stores its own K/V, without
padding, in its session. Padding and position ids: each row's positions count its own tokens only
(``0 .. L_i - 1``); padding columns get attention 0. When joining rows have new chunks of different lengths, a
row with a shorter chunk re-feeds the last few tokens of its history instead of padding (same compute, and every
row's K/V stays contiguous). Models whose cache is not a transformers ``Cache`` (a scripted test model), or
whose layers are not all full attention (sliding-window, linear-attention), or ``kv_reuse=False``, take the
reference path: one batch per call, full prefill of every context, nothing kept between calls.

Sampling is reproducible per trajectory: each session draws its own seed from the generator's
``torch.Generator`` when it is created (in trajectory order) and samples from its own stream (inverse-CDF, one
uniform per token), so the ids of a trajectory do not depend on which other rows shared its batch or on when its
environment answered. (The reference path samples the batch from the shared generator.)

``VLLMGenerator`` sends each turn's token-id prompts through TRL's vLLM integration (``use_vllm=True``): an
in-process ``vllm.LLM`` (colocate mode) or ``VLLMClient`` (server mode), with the protocol's stop strings and
per-row token budgets. vLLM keeps its own prefix cache, so history is not recomputed there either.

Log-prob convention: like TRL and VeRL, the log-prob is taken under the temperature-scaled distribution before
top-k / top-p filtering (greedy decoding: under the raw logits).
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers.cache_utils import Cache, DynamicLayer

# ---------------------------------------------------------------------------------------------------------------
# Shared types
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class SamplingParams:
    """Sampling settings for one turn (mirrors TRL's ``GRPOConfig`` generation fields)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    greedy: bool = False
    stop_strings: tuple[str, ...] = ()


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


class GenerationSession:
    """One trajectory's state kept by a generator across turns.

    Attributes:
        cached_ids: the ids whose K/V are held in ``kv``, in order (a prefix of the trajectory's ids).
        kv: per layer ``(keys, values)``, each (1, H_kv, len(cached_ids), D); ``None`` when nothing is cached.
        seed: seed of this trajectory's sampling stream.
    """

    def __init__(self, seed: int | None = None):
        self.cached_ids: list[int] = []
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.seed = seed
        self.rng: torch.Generator | None = None

    def drop(self) -> None:
        """Forget the cached K/V (the next turn prefills the whole context). The sampling stream is kept."""
        self.cached_ids, self.kv = [], None

    @property
    def num_cached_tokens(self) -> int:
        return len(self.cached_ids) if self.kv is not None else 0

    def usable_prefix(self, context: list[int]) -> int:
        """How many leading tokens of ``context`` have K/V here; at most ``len(context) - 1`` (one token is always
        fed, to get the logits of the next one)."""
        if self.kv is None or not self.cached_ids:
            return 0
        n = min(len(self.cached_ids), len(context) - 1)
        if self.cached_ids[:n] == context[:n]:
            return n
        same = 0
        for a, b in zip(self.cached_ids[:n], context[:n]):
            if a != b:
                break
            same += 1
        return same


def _cache_kwarg_name() -> str:
    """transformers >= 5.2x renamed ``past_key_values`` to ``cache``; support both."""
    from transformers import LlamaForCausalLM

    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


_CACHE_KWARG = _cache_kwarg_name()


def _cache_of(output):
    return getattr(output, "cache", None) if _CACHE_KWARG == "cache" else output.past_key_values


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


# ---------------------------------------------------------------------------------------------------------------
# transformers backend: K/V buffers of a running batch
# ---------------------------------------------------------------------------------------------------------------


#: rows that start a trajectory share their common prefix's K/V when it is at least this long
_MIN_SHARED_PREFIX = 16


def _supports_kv_reuse(model) -> bool:
    """True for transformers models whose decoder layers are all full attention (their K/V can be split by row)."""
    from transformers import PreTrainedModel

    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    if not isinstance(base, PreTrainedModel) or _CACHE_KWARG != "cache":
        return False
    config = base.config.get_text_config(decoder=True)
    if getattr(config, "is_encoder_decoder", False):
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        return False
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return False
    return True


class _BufferLayer(DynamicLayer):
    """One layer's K/V for a left-padded batch: ``kbuf``/``vbuf`` (A, H_kv, capacity, D), all rows end at ``width``.

    ``update`` writes the new columns in place (doubling the capacity when full) and returns views of the first
    ``width`` columns, so a decode step costs O(A) writes instead of a copy of the whole cache.
    """

    def __init__(self, kbuf: torch.Tensor | None = None, vbuf: torch.Tensor | None = None, width: int = 0, reserve: int = 0):
        super().__init__()
        self.kbuf, self.vbuf, self.width, self.reserve = kbuf, vbuf, width, reserve
        if kbuf is not None:
            self.is_initialized, self.device = True, kbuf.device
            self.keys, self.values = kbuf[:, :, :width], vbuf[:, :, :width]

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device, self.is_initialized = key_states.device, True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if self.kbuf is None:
            a, h, _, d = key_states.shape
            self.kbuf = key_states.new_zeros(a, h, n + self.reserve, d)  # (A, H, cap, D)
            self.vbuf = value_states.new_zeros(a, h, n + self.reserve, value_states.shape[-1])
        elif self.width + n > self.kbuf.shape[-2]:
            cap = max(2 * self.kbuf.shape[-2], self.width + n)
            self.kbuf = _grow(self.kbuf, self.width, cap)
            self.vbuf = _grow(self.vbuf, self.width, cap)
        self.kbuf[:, :, self.width : self.width + n].copy_(key_states)
        self.vbuf[:, :, self.width : self.width + n].copy_(value_states)
        self.width += n
        self.keys, self.values = self.kbuf[:, :, : self.width], self.vbuf[:, :, : self.width]  # (A, H, W, D) views
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.width

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.width + query_length, 0

    def get_max_length(self) -> int:
        return -1


def _grow(buf: torch.Tensor, width: int, cap: int) -> torch.Tensor:
    out = buf.new_zeros(buf.shape[0], buf.shape[1], cap, buf.shape[3])  # (A, H, cap, D)
    out[:, :, :width].copy_(buf[:, :, :width])
    return out


def _make_cache(layers: list[_BufferLayer]) -> Cache:
    return Cache(layers=layers)


@dataclass
class _Request:
    key: Any
    session: GenerationSession
    context: list[int]
    max_new_tokens: int
    keep_cache: bool
    output: GenerationOutput = field(default_factory=GenerationOutput)
    length: int = 0  # tokens of this row held in the batch K/V


@dataclass
class _Batch:
    """A running batch: rows, per-layer buffers (all rows end at column ``width``), the attention mask and the logits
    each row's next token will be sampled from."""

    rows: list[_Request]
    layers: list[_BufferLayer]
    attention: torch.Tensor  # (A, W) long, 1 on real tokens
    logits: torch.Tensor  # (A, V) float32

    @property
    def width(self) -> int:
        return self.attention.shape[1]


class TransformersGenerator:
    """Batched sampling with a transformers model, with K/V kept per trajectory across turns (see module docstring).

    Args:
        model: a causal LM (``PreTrainedModel`` or a PEFT wrapper). The caller puts it in eval mode.
        tokenizer: used to decode tails for stop strings and for the pad / eos ids.
        generator: optional ``torch.Generator``; sessions draw their sampling seeds from it (reproducible rollouts).
        kv_reuse: keep K/V across turns and let rows join and leave a running batch. ``False`` (or a model that
            cannot, see module docstring) takes the reference path: full prefill, one batch per call.
        max_batch_size: at most this many rows decode together (``None``: no limit); others wait in the queue.
        logits_processor: optional ``fn(row_ids, logits) -> logits`` applied to the raw (A, V) logits before
            sampling, with ``row_ids[a]`` the full ids of row ``a`` (context + sampled so far). For forcing text in
            tests and benchmarks; the log-probs are taken after it.
    """

    supports_streaming = True

    def __init__(
        self,
        model,
        tokenizer,
        generator: torch.Generator | None = None,
        kv_reuse: bool = True,
        max_batch_size: int | None = None,
        logits_processor: Callable[[list[list[int]], torch.Tensor], torch.Tensor] | None = None,
    ):
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1 or None; got {max_batch_size}.")
        self.model = model
        self.tokenizer = tokenizer
        self.generator = generator
        self.eos_token_ids = _eos_ids(tokenizer, model)
        self.pad_token_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(self.eos_token_ids), 0)
        )
        self.kv_reuse = bool(kv_reuse) and _supports_kv_reuse(model)
        self.max_batch_size = max_batch_size
        self.logits_processor = logits_processor
        self._queue: list[_Request] = []
        self._ready: list[_Request] = []
        self._batch: _Batch | None = None
        self._params: SamplingParams | None = None
        self._stop: _StopChecker | None = None
        self.stats: dict[str, float] = {}
        self.reset_stats()

    # ------------------------------------------------------------------ public API
    def reset_stats(self) -> None:
        """Zero the counters in ``stats`` (what each counts is noted next to it)."""
        self.stats = {
            "prefill_tokens": 0,  # real context tokens computed by prefill forwards
            "prefill_positions": 0,  # prefill query positions computed, padding included
            "cached_tokens": 0,  # context tokens whose K/V came from a session
            "shared_prefix_tokens": 0,  # context tokens not computed because rows shared a common prefix
            "decode_positions": 0,  # decode query positions computed (one per running row and step)
            "decode_steps": 0,
            "prefill_calls": 0,
            "generated_tokens": 0,
            "kv_copied_tokens": 0,  # row-tokens of K/V copied when rows joined or left a batch
            "forward_s": 0.0,
            "sample_s": 0.0,
        }

    def new_session(self) -> GenerationSession:
        """A session for one trajectory, with a sampling seed drawn from ``generator`` (or torch's default RNG).

        On the reference path sessions are accepted and ignored (no seed is drawn: that path samples each batch from
        ``generator`` itself)."""
        if not self.kv_reuse:
            return GenerationSession()
        seed = int(torch.randint(0, 2**62, (1,), generator=self.generator))
        return GenerationSession(seed=seed)

    @property
    def has_work(self) -> bool:
        """Whether a call to :meth:`step` would make progress (queued, running or finished-but-unreported rows)."""
        return bool(self._queue or self._ready or (self._batch is not None and self._batch.rows))

    def submit(
        self,
        key: Any,
        context: list[int],
        max_new_tokens: int,
        params: SamplingParams,
        session: GenerationSession | None = None,
    ) -> None:
        """Queue one turn: sample up to ``max_new_tokens`` ids after ``context`` (the trajectory's full ids).

        With a ``session`` the K/V it holds for a prefix of ``context`` are reused and the turn's K/V are kept in it;
        the result comes back from :meth:`step` as ``(key, GenerationOutput)``. All requests in flight share one
        ``params``.
        """
        if self.has_work and params != self._params:
            raise ValueError(
                f"submit got SamplingParams {params} while requests with {self._params} are in flight; finish them "
                "(step until has_work is False) before changing sampling settings."
            )
        if not context:
            raise ValueError(f"submit got an empty context for request {key!r}; a context needs at least one token.")
        if self._params != params or self._stop is None:
            self._params = params
            self._stop = _StopChecker(self.tokenizer, self.eos_token_ids, tuple(params.stop_strings))
        keep = session is not None
        if session is None:  # a one-off row: its K/V are not kept
            session = self.new_session()
        request = _Request(key, session, list(context), int(max_new_tokens), keep)
        (self._queue if max_new_tokens > 0 else self._ready).append(request)

    def step(self) -> list[tuple[Any, GenerationOutput]]:
        """Advance every running row by one token; returns the turns that ended, as ``(key, output)``.

        Queued requests join first (their new tokens are prefilled in one forward and their K/V merged into the
        running batch). Rows whose turn ends leave the batch in the same step; their K/V go to their sessions.
        """
        done = [(r.key, r.output) for r in self._ready]
        self._ready = []
        if not self.kv_reuse:
            if self._queue:
                requests, self._queue = self._queue, []
                outs = self._generate_reference(
                    [r.context for r in requests], [r.max_new_tokens for r in requests], self._params,
                    [r.session for r in requests],
                )
                done += [(r.key, o) for r, o in zip(requests, outs)]
            return done
        self._admit()
        batch = self._batch
        if batch is None or not batch.rows:
            return done
        t0 = time.perf_counter()
        tokens, logps = self._sample(batch)  # (A,), (A,)
        self.stats["sample_s"] += time.perf_counter() - t0
        keep: list[int] = []
        for a, (row, token, logp) in enumerate(zip(batch.rows, tokens.tolist(), logps.tolist())):
            out = row.output
            out.ids.append(token)
            out.logprobs.append(logp)
            reason = self._stop(out.ids, row.max_new_tokens)
            if reason is None:
                keep.append(a)
            else:
                out.finish_reason = reason
                done.append((row.key, out))
        self.stats["generated_tokens"] += len(batch.rows)
        if len(keep) < len(batch.rows):
            self._leave(batch, keep)
            batch = self._batch
            tokens = tokens[torch.tensor(keep, dtype=torch.long, device=tokens.device)] if keep else tokens[:0]
        if batch is not None and batch.rows:
            self._decode(batch, tokens)
        return done

    def cancel(self) -> None:
        """Drop every queued and running request (their sessions lose their K/V)."""
        for r in self._queue + (self._batch.rows if self._batch is not None else []):
            r.session.drop()
        self._queue, self._ready, self._batch = [], [], None

    @torch.no_grad()
    def generate(
        self,
        contexts: list[list[int]],
        max_new_tokens: list[int] | int,
        params: SamplingParams,
        sessions: list[GenerationSession] | None = None,
    ) -> list[GenerationOutput]:
        """Sample one turn for each context. ``contexts[i]`` is the full token history of row i.

        ``sessions[i]`` (optional) holds row i's K/V from earlier turns: only the tokens of ``contexts[i]`` past its
        cached prefix are prefilled, and this turn's K/V are kept in it for the next.
        """
        n = len(contexts)
        if n == 0:
            return []
        if isinstance(max_new_tokens, int):
            max_new_tokens = [max_new_tokens] * n
        if sessions is not None and len(sessions) != n:
            raise ValueError(f"generate got {n} contexts but {len(sessions)} sessions; give one session per context.")
        if self.has_work:
            raise RuntimeError(
                "generate() was called while submitted requests are in flight; step() until has_work is False first."
            )
        outputs: list[GenerationOutput | None] = [None] * n
        for i, (ctx, budget) in enumerate(zip(contexts, max_new_tokens)):
            self.submit(i, ctx, budget, params, session=sessions[i] if sessions is not None else None)
        while self.has_work:
            for key, out in self.step():
                outputs[key] = out
        return outputs  # type: ignore[return-value]

    # ------------------------------------------------------------------ running batch
    def _admit(self) -> None:
        """Prefill queued requests (as many as ``max_batch_size`` allows) and merge them into the running batch."""
        if not self._queue:
            return
        running = len(self._batch.rows) if self._batch is not None else 0
        room = len(self._queue) if self.max_batch_size is None else self.max_batch_size - running
        if room <= 0:
            return
        joining, self._queue = self._queue[:room], self._queue[room:]
        self._batch = self._merge(self._batch, self._prefill(joining))

    @torch.no_grad()
    def _prefill(self, requests: list[_Request]) -> _Batch:
        """One forward over the new tokens of ``requests`` on top of the K/V their sessions hold.

        Row j has context length t_j and a usable cached prefix c_j. With Q = max_j (t_j - c_j) every row feeds its
        last min(t_j, Q) tokens (a row with a shorter new chunk re-feeds a few cached tokens) on top of
        p_j = max(t_j - Q, 0) cached tokens, right-aligned at column P = max_j p_j.
        """
        device = next(self.model.parameters()).device
        shared = self._share_prefix(requests, device)
        usable = [r.session.usable_prefix(r.context) for r in requests]
        q = max(len(r.context) - c for r, c in zip(requests, usable))
        past = [max(len(r.context) - q, 0) for r in requests]
        p = max(past)
        j = len(requests)
        input_ids = torch.full((j, q), self.pad_token_id, dtype=torch.long)  # (J, Q)
        attention = torch.zeros((j, p + q), dtype=torch.long)  # (J, P+Q)
        position_ids = torch.zeros((j, q), dtype=torch.long)  # (J, Q)
        for row, (r, pj) in enumerate(zip(requests, past)):
            fed = r.context[pj:]
            t = len(r.context)
            input_ids[row, q - len(fed) :] = torch.tensor(fed, dtype=torch.long)
            attention[row, p - pj : p] = 1
            attention[row, p + q - len(fed) :] = 1
            position_ids[row, q - len(fed) :] = torch.arange(pj, t)
            r.length = t
            r.output.prefill_tokens, r.output.cached_tokens = len(fed), pj
        if shared is not None:  # the row that paid for the shared prefix computed it, the others reused it
            leader, n = shared
            leader.output.prefill_tokens += n
            leader.output.cached_tokens -= n
        reserve = min(max(r.max_new_tokens for r in requests), 1024) + 1
        layers = self._past_layers(requests, past, p, q + reserve) if p > 0 else None
        if layers is None:
            n_layers = self._num_layers()
            layers = [_BufferLayer(reserve=reserve) for _ in range(n_layers)]
        t0 = time.perf_counter()
        out = self.model(
            input_ids=input_ids.to(device),
            attention_mask=attention.to(device),
            position_ids=position_ids.to(device),
            use_cache=True,
            logits_to_keep=1,
            **{_CACHE_KWARG: _make_cache(layers)},
        )
        self.stats["forward_s"] += time.perf_counter() - t0
        self.stats["prefill_calls"] += 1
        self.stats["prefill_positions"] += j * q
        self.stats["prefill_tokens"] += sum(len(r.context) - pj for r, pj in zip(requests, past))
        self.stats["cached_tokens"] += sum(past)
        return _Batch(rows=list(requests), layers=layers, attention=attention.to(device), logits=out.logits[:, -1, :].float())

    @torch.no_grad()
    def _share_prefix(self, requests: list[_Request], device) -> tuple[_Request, int] | None:
        """Rows with nothing cached that start with the same ids (the system prompt and tool schema, the G copies
        of a GRPO prompt) get the K/V of their longest common prefix from one forward of batch size 1."""
        fresh = [r for r in requests if r.session.usable_prefix(r.context) == 0]
        if len(fresh) < 2:
            return None
        first = fresh[0].context
        n = min(len(r.context) for r in fresh) - 1
        for r in fresh[1:]:
            ctx = r.context
            if ctx[:n] != first[:n]:
                n = next(i for i, (a, b) in enumerate(zip(first[:n], ctx[:n])) if a != b)
        if n < _MIN_SHARED_PREFIX:
            return None
        layers = [_BufferLayer() for _ in range(self._num_layers())]
        t0 = time.perf_counter()
        self.model(
            input_ids=torch.tensor([first[:n]], dtype=torch.long, device=device),
            attention_mask=torch.ones((1, n), dtype=torch.long, device=device),
            position_ids=torch.arange(n, device=device).unsqueeze(0),
            use_cache=True,
            logits_to_keep=1,
            **{_CACHE_KWARG: _make_cache(layers)},
        )
        self.stats["forward_s"] += time.perf_counter() - t0
        self.stats["prefill_calls"] += 1
        self.stats["prefill_positions"] += n
        self.stats["prefill_tokens"] += n
        self.stats["shared_prefix_tokens"] += n * (len(fresh) - 1)
        self.stats["cached_tokens"] -= n  # counted again as cached for every row by _prefill
        kv = [(layer.keys, layer.values) for layer in layers]  # (1, H, n, D) each, shared read-only by the rows
        for r in fresh:
            r.session.kv, r.session.cached_ids = kv, list(first[:n])
        return fresh[0], n

    def _num_layers(self) -> int:
        base = self.model.get_base_model() if callable(getattr(self.model, "get_base_model", None)) else self.model
        return base.config.get_text_config(decoder=True).num_hidden_layers

    def _past_layers(self, requests: list[_Request], past: list[int], p: int, extra: int) -> list[_BufferLayer]:
        """Buffers holding, for each row, its first ``past[j]`` cached tokens right-aligned at column ``p``."""
        ref = next(r.session.kv for r, pj in zip(requests, past) if pj > 0)
        layers = []
        for layer_idx, (k0, v0) in enumerate(ref):
            kbuf = k0.new_zeros(len(requests), k0.shape[1], p + extra, k0.shape[3])  # (J, H, P+Q+reserve, D)
            vbuf = v0.new_zeros(len(requests), v0.shape[1], p + extra, v0.shape[3])
            for row, (r, pj) in enumerate(zip(requests, past)):
                if pj > 0:
                    k, v = r.session.kv[layer_idx]
                    kbuf[row, :, p - pj : p].copy_(k[0, :, :pj])
                    vbuf[row, :, p - pj : p].copy_(v[0, :, :pj])
            layers.append(_BufferLayer(kbuf, vbuf, width=p, reserve=extra))
        self.stats["kv_copied_tokens"] += sum(past)
        return layers

    def _merge(self, a: _Batch | None, b: _Batch) -> _Batch:
        """Rows of ``a`` then rows of ``b`` in one batch, trimmed to the longest row."""
        if a is None or not a.rows:
            return b
        rows = a.rows + b.rows
        w = max(r.length for r in rows)
        extra = min(max(r.max_new_tokens - len(r.output.ids) for r in rows), 1024) + 1
        layers = []
        for la, lb in zip(a.layers, b.layers):
            kbuf = _stack_right_aligned([(la.kbuf, a.width), (lb.kbuf, b.width)], w, w + extra)
            vbuf = _stack_right_aligned([(la.vbuf, a.width), (lb.vbuf, b.width)], w, w + extra)
            layers.append(_BufferLayer(kbuf, vbuf, width=w, reserve=extra))
        attention = torch.cat([_right_cols(a.attention, w), _right_cols(b.attention, w)], dim=0)  # (A+J, W)
        self.stats["kv_copied_tokens"] += sum(r.length for r in rows)
        return _Batch(rows=rows, layers=layers, attention=attention, logits=torch.cat([a.logits, b.logits], dim=0))

    def _leave(self, batch: _Batch, keep: list[int]) -> None:
        """Store the K/V of the rows not in ``keep`` in their sessions and rebuild the batch from the kept rows."""
        w_old = batch.width
        kept = set(keep)
        for a, row in enumerate(batch.rows):
            if a in kept:
                continue
            if row.keep_cache:
                n = row.length
                row.session.kv = [
                    (layer.kbuf[a : a + 1, :, w_old - n : w_old].clone(), layer.vbuf[a : a + 1, :, w_old - n : w_old].clone())
                    for layer in batch.layers
                ]
                row.session.cached_ids = row.context + row.output.ids[:-1]
                self.stats["kv_copied_tokens"] += n
            else:
                row.session.drop()
        if not keep:
            self._batch = None
            return
        rows = [batch.rows[a] for a in keep]
        idx = torch.tensor(keep, dtype=torch.long, device=batch.attention.device)
        w = max(r.length for r in rows)
        extra = min(max(r.max_new_tokens - len(r.output.ids) for r in rows), 1024) + 1
        layers = []
        for layer in batch.layers:
            kbuf = _stack_right_aligned([(layer.kbuf.index_select(0, idx), w_old)], w, w + extra)
            vbuf = _stack_right_aligned([(layer.vbuf.index_select(0, idx), w_old)], w, w + extra)
            layers.append(_BufferLayer(kbuf, vbuf, width=w, reserve=extra))
        self.stats["kv_copied_tokens"] += sum(r.length for r in rows)
        self._batch = _Batch(
            rows=rows, layers=layers, attention=_right_cols(batch.attention[idx], w), logits=batch.logits[idx]
        )

    @torch.no_grad()
    def _decode(self, batch: _Batch, tokens: torch.Tensor) -> None:
        """Feed each row's sampled token (one column for every row) and keep the logits of the next."""
        a = len(batch.rows)
        device = batch.attention.device
        batch.attention = torch.cat([batch.attention, torch.ones((a, 1), dtype=torch.long, device=device)], dim=1)
        position_ids = torch.tensor([[r.length] for r in batch.rows], dtype=torch.long, device=device)  # (A, 1)
        t0 = time.perf_counter()
        out = self.model(
            input_ids=tokens.view(a, 1).to(device),
            attention_mask=batch.attention,
            position_ids=position_ids,
            use_cache=True,
            **{_CACHE_KWARG: _make_cache(batch.layers)},
        )
        self.stats["forward_s"] += time.perf_counter() - t0
        self.stats["decode_steps"] += 1
        self.stats["decode_positions"] += a
        for r in batch.rows:
            r.length += 1
        batch.logits = out.logits[:, -1, :].float()  # (A, V)

    @staticmethod
    def _rng_of(session: GenerationSession) -> torch.Generator:
        if session.rng is None:
            session.rng = torch.Generator().manual_seed(session.seed if session.seed is not None else 0)
        return session.rng

    def _sample(self, batch: _Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Next token and its log-prob for every row of ``batch``: (A,), (A,)."""
        params = self._params
        logits = batch.logits  # (A, V)
        if self.logits_processor is not None:
            logits = self.logits_processor([r.context + r.output.ids for r in batch.rows], logits)
        if params.greedy:
            logp = torch.log_softmax(logits, dim=-1)  # (A, V)
            next_ids = logits.argmax(dim=-1)  # (A,)
        else:
            scaled = logits / max(params.temperature, 1e-6)  # (A, V)
            logp = torch.log_softmax(scaled, dim=-1)  # (A, V)
            probs = torch.softmax(_filter_logits(scaled, params.top_k, params.top_p, params.min_p), dim=-1)  # (A, V)
            cdf = probs.double().cumsum(dim=-1)  # (A, V)
            # inverse-CDF sampling with one uniform per row from the row's own stream: u in (0, 1] never lands on a
            # zero-probability token (its CDF step is empty)
            u = torch.tensor([1.0 - float(torch.rand(1, generator=self._rng_of(r.session), dtype=torch.float64))
                              for r in batch.rows], dtype=torch.float64, device=cdf.device)  # (A,)
            u = (u * cdf[:, -1]).unsqueeze(-1)  # (A, 1)
            next_ids = torch.searchsorted(cdf, u).squeeze(-1).clamp(max=cdf.shape[-1] - 1)  # (A,)
        chosen = logp.gather(-1, next_ids.unsqueeze(-1)).squeeze(-1)  # (A,)
        return next_ids, chosen

    # ------------------------------------------------------------------ reference path (no K/V reuse)
    @torch.no_grad()
    def _generate_reference(
        self,
        contexts: list[list[int]],
        max_new_tokens: list[int],
        params: SamplingParams,
        sessions: list[GenerationSession],
    ) -> list[GenerationOutput]:
        """Full prefill of every context, one batch until every row stopped; the model owns its cache."""
        n = len(contexts)
        outputs = [GenerationOutput(prefill_tokens=len(c)) for c in contexts]
        active = [i for i in range(n) if max_new_tokens[i] > 0]
        if not active:
            return outputs
        device = next(self.model.parameters()).device
        stop = _StopChecker(self.tokenizer, self.eos_token_ids, tuple(params.stop_strings))

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

        t0 = time.perf_counter()
        out = self.model(
            input_ids=input_ids, attention_mask=attention, position_ids=position_ids, use_cache=True, logits_to_keep=1
        )
        self.stats["forward_s"] += time.perf_counter() - t0
        self.stats["prefill_calls"] += 1
        self.stats["prefill_positions"] += len(active) * width
        self.stats["prefill_tokens"] += sum(len(contexts[i]) for i in active)
        past = _cache_of(out)
        logits = out.logits[:, -1, :].float()  # (A, V)
        running = torch.ones(len(active), dtype=torch.bool)  # (A,)
        limit = max(max_new_tokens[i] for i in active)
        for step in range(limit):
            if self.logits_processor is not None:
                logits = self.logits_processor([contexts[i] + outputs[i].ids for i in active], logits)
            scaled = logits / max(params.temperature, 1e-6) if not params.greedy else logits  # (A, V)
            logp = torch.log_softmax(scaled, dim=-1)  # (A, V)
            if params.greedy:
                next_ids = scaled.argmax(dim=-1)  # (A,)
            else:
                probs = torch.softmax(_filter_logits(scaled, params.top_k, params.top_p, params.min_p), dim=-1)  # (A, V)
                next_ids = torch.multinomial(probs.cpu(), 1, generator=self.generator).squeeze(-1).to(device)  # (A,)
            chosen_logp = logp.gather(-1, next_ids.unsqueeze(-1)).squeeze(-1)  # (A,)
            for row, i in enumerate(active):
                if not running[row]:
                    continue
                o = outputs[i]
                o.ids.append(int(next_ids[row]))
                o.logprobs.append(float(chosen_logp[row]))
                self.stats["generated_tokens"] += 1
                reason = stop(o.ids, max_new_tokens[i])
                if reason is not None:
                    o.finish_reason, running[row] = reason, False
            if not running.any() or step == limit - 1:
                break
            feed = torch.where(running.to(device), next_ids, torch.full_like(next_ids, self.pad_token_id))  # (A,)
            attention = torch.cat([attention, running.to(device).long().unsqueeze(-1)], dim=-1)  # (A, L+t+1)
            position_ids = position_ids[:, -1:] + 1  # (A, 1)
            t0 = time.perf_counter()
            out = self.model(
                input_ids=feed.unsqueeze(-1),
                attention_mask=attention,
                position_ids=position_ids,
                use_cache=True,
                **{_CACHE_KWARG: past},
            )
            self.stats["forward_s"] += time.perf_counter() - t0
            self.stats["decode_steps"] += 1
            self.stats["decode_positions"] += len(active)
            past = _cache_of(out)
            logits = out.logits[:, -1, :].float()  # (A, V)
        return outputs


def _right_cols(t: torch.Tensor, w: int) -> torch.Tensor:
    """The last ``w`` columns of a (R, W0) mask, left-padded with zeros when W0 < w."""
    if t.shape[1] >= w:
        return t[:, t.shape[1] - w :]
    return torch.cat([t.new_zeros(t.shape[0], w - t.shape[1]), t], dim=1)


def _stack_right_aligned(parts: list[tuple[torch.Tensor, int]], w: int, cap: int) -> torch.Tensor:
    """Stack buffers (R_i, H, cap_i, D) whose rows end at column ``width_i`` into one (sum R_i, H, cap, D) buffer
    whose rows end at column ``w`` (the last min(width_i, w) columns of each part are kept)."""
    ref = parts[0][0]
    total = sum(buf.shape[0] for buf, _ in parts)
    out = ref.new_empty(total, ref.shape[1], cap, ref.shape[3])  # (R, H, cap, D)
    start = 0
    for buf, width in parts:
        rows = buf.shape[0]
        cols = min(width, w)
        if cols < w:
            out[start : start + rows, :, : w - cols].zero_()
        out[start : start + rows, :, w - cols : w].copy_(buf[:, :, width - cols : width])
        start += rows
    return out


# ---------------------------------------------------------------------------------------------------------------
# vLLM backend through TRL's integration
# ---------------------------------------------------------------------------------------------------------------


class Collectives:
    """The collective operations :class:`VLLMGenerator` needs, over the ranks that share one vLLM engine.

    ``all_gather(obj)`` returns the objects of every rank in rank order, ``broadcast(obj)`` returns rank 0's object
    on every rank; ``rank`` and ``is_main`` say where this process stands. The default for one process is the
    identity; :meth:`for_server` uses ``accelerate`` over all processes (server mode), :meth:`for_group` uses
    ``torch.distributed`` on a tensor-parallel group (colocate mode). Tests pass a stand-in with the same methods.
    """

    rank = 0
    is_main = True

    def all_gather(self, obj) -> list:
        return [obj]

    def broadcast(self, obj):
        return obj

    @staticmethod
    def for_server(accelerator) -> Collectives:
        if accelerator is None or accelerator.num_processes == 1:
            return Collectives()
        return _AccelerateCollectives(accelerator)

    @staticmethod
    def for_group(group) -> Collectives:
        return Collectives() if group is None else _GroupCollectives(group)


class _AccelerateCollectives(Collectives):
    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.rank, self.is_main = accelerator.process_index, accelerator.is_main_process

    def all_gather(self, obj) -> list:
        from accelerate.utils import gather_object

        return gather_object([obj])

    def broadcast(self, obj):
        from accelerate.utils import broadcast_object_list

        box = [obj]
        broadcast_object_list(box, from_process=0)
        return box[0]


class _GroupCollectives(Collectives):
    def __init__(self, group):
        import torch.distributed as dist

        self.group, self.dist = group, dist
        self.rank = dist.get_rank(group=group)
        self.is_main = self.rank == 0

    def all_gather(self, obj) -> list:
        out = [None] * self.dist.get_world_size(group=self.group)
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj):
        box = [obj]
        self.dist.broadcast_object_list(box, group_src=0, group=self.group)
        return box[0]


class VLLMGenerator:
    """One turn for a batch of token-id contexts through TRL's vLLM integration (``use_vllm=True``).

    Departures from TRL's ``VLLMGeneration.generate``, which serves single-turn prompts: each row has its own token
    budget and the protocol's stop strings (vLLM ``stop`` with ``include_stop_str_in_output=True``, so a turn never
    runs past ``</search>``), ranks may hold different numbers of rows (each rank's rows are gathered as one list),
    and the sampled ids come back with their log-probs and a finish reason. Prompts are token ids, never re-encoded
    text; vLLM's prefix cache keeps the history of a trajectory from being recomputed at the next turn.

    Collective-call rule: in server mode every rank gathers its rows to the main process, which calls the server,
    and receives the results by broadcast; in colocate mode with tensor parallelism the ranks of a group gather
    their rows and all call the engine. Both are collective, so **every rank must call** :meth:`generate` **the
    same number of times**, also with no rows. This backend sets ``requires_collective_calls = True``, and
    :class:`~trl_multiturn.rollout.MultiTurnRollout` then makes exactly ``max_turns`` calls per rollout on every
    rank, with an empty list once its own trajectories are done (the engine is not called when no rank has a row).

    Args:
        tokenizer: the policy's tokenizer (stop-string checks and EOS ids).
        mode: "colocate" (``llm`` is an in-process ``vllm.LLM``) or "server" (``client`` is TRL's ``VLLMClient``).
        llm: the ``vllm.LLM`` of colocate mode (TRL's ``trainer.vllm_generation.llm``).
        client: the ``VLLMClient`` of server mode (TRL's ``trainer.vllm_generation.vllm_client``).
        collectives: a :class:`Collectives` (default: one process; :meth:`from_trl` picks the right one).
        sampling_params_cls: vLLM's ``SamplingParams`` (imported from ``vllm`` when not given; tests pass a stand-in).
        generation_kwargs: extra vLLM sampling parameters (``seed``, ``repetition_penalty``, ...), as TRL's
            ``generation_kwargs``.
    """

    supports_streaming = False
    requires_collective_calls = True

    def __init__(
        self,
        tokenizer,
        mode: str,
        llm=None,
        client=None,
        collectives: Collectives | None = None,
        sampling_params_cls=None,
        generation_kwargs: dict | None = None,
    ):
        if mode not in ("colocate", "server"):
            raise ValueError(f"VLLMGenerator mode must be 'colocate' or 'server'; got {mode!r} (TRL's vllm_mode).")
        if mode == "colocate" and llm is None:
            raise ValueError("VLLMGenerator(mode='colocate') needs llm (TRL's trainer.vllm_generation.llm).")
        if mode == "server" and client is None:
            raise ValueError("VLLMGenerator(mode='server') needs client (TRL's trainer.vllm_generation.vllm_client).")
        self.tokenizer = tokenizer
        self.mode = mode
        self.llm = llm
        self.client = client
        self.collectives = collectives or Collectives()
        self._sampling_params_cls = sampling_params_cls
        self.generation_kwargs = dict(generation_kwargs or {})
        self.eos_token_ids = _eos_ids(tokenizer)
        self.calls = 0

    @classmethod
    def from_trl(cls, vllm_generation, tokenizer, generation_kwargs: dict | None = None) -> VLLMGenerator:
        """Build from TRL's ``trainer.vllm_generation`` (``trl.generation.vllm_generation.VLLMGeneration``)."""
        mode = vllm_generation.mode
        kwargs = dict(vllm_generation.generation_kwargs or {})
        kwargs.update(generation_kwargs or {})
        if mode == "server":
            collectives = Collectives.for_server(vllm_generation.accelerator)
        else:
            tp = getattr(vllm_generation, "tensor_parallel_size", 1)
            collectives = Collectives.for_group(vllm_generation.tp_group if tp > 1 else None)
        return cls(
            tokenizer,
            mode,
            llm=getattr(vllm_generation, "llm", None) if mode == "colocate" else None,
            client=getattr(vllm_generation, "vllm_client", None) if mode == "server" else None,
            collectives=collectives,
            generation_kwargs=kwargs,
        )

    def _sampling_kwargs(self, params: SamplingParams, max_tokens: int) -> dict:
        kwargs = {
            "n": 1,
            "temperature": 0.0 if params.greedy else params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "max_tokens": max_tokens,
            "logprobs": 0,
            "skip_special_tokens": False,
        }
        stops = [s for s in params.stop_strings if s]
        if stops:
            kwargs["stop"] = stops
            kwargs["include_stop_str_in_output"] = True
        kwargs.update(self.generation_kwargs)
        return kwargs

    def generate(
        self, contexts: list[list[int]], max_new_tokens: list[int] | int, params: SamplingParams
    ) -> list[GenerationOutput]:
        """Sample one turn for each context (collective: see the class docstring)."""
        n = len(contexts)
        if isinstance(max_new_tokens, int):
            max_new_tokens = [max_new_tokens] * n
        self.calls += 1
        stop = _StopChecker(self.tokenizer, self.eos_token_ids, tuple(params.stop_strings))
        rows = [(list(c), int(b)) for c, b in zip(contexts, max_new_tokens) if b > 0]
        gathered = self.collectives.all_gather(rows)  # one list of (ids, budget) per rank
        flat = [row for part in gathered for row in part]
        if self.mode == "colocate":
            results = self._generate_colocate(flat, params) if flat else []
        else:
            results = self._generate_server(flat, params) if self.collectives.is_main and flat else None
            results = self.collectives.broadcast(results) or []
        start = sum(len(part) for part in gathered[: self.collectives.rank])
        mine = iter(results[start : start + len(rows)])
        outputs = []
        for ctx, budget in zip(contexts, max_new_tokens):
            if budget <= 0:
                outputs.append(GenerationOutput())
                continue
            ids, logprobs = next(mine)
            ids, logprobs = list(ids)[:budget], list(logprobs)[:budget]  # server mode asks for the largest budget
            reason = (stop(ids, budget) or "length") if ids else "length"
            outputs.append(GenerationOutput(ids=ids, logprobs=logprobs, finish_reason=reason, prefill_tokens=len(ctx)))
        return outputs

    def _generate_colocate(self, rows, params) -> list[tuple[list[int], list[float]]]:
        cls = self._sampling_params_cls
        if cls is None:
            from vllm import SamplingParams as cls  # noqa: N813
        sampling = [cls(**self._sampling_kwargs(params, budget)) for _, budget in rows]
        outs = self.llm.generate([{"prompt_token_ids": ids} for ids, _ in rows], sampling_params=sampling, use_tqdm=False)
        results = []
        for request in outs:
            o = request.outputs[0]
            ids = list(o.token_ids)
            logprobs = [float(step[t].logprob) for step, t in zip(o.logprobs or [], ids)]
            if len(logprobs) != len(ids):
                raise RuntimeError(
                    f"vLLM returned {len(ids)} ids but {len(logprobs)} log-probs; the sampling parameters must ask for "
                    "logprobs=0 (the sampled token's log-prob)."
                )
            results.append((ids, logprobs))
        return results

    def _generate_server(self, rows, params) -> list[tuple[list[int], list[float]]]:
        """One request to the server for every rank's rows (main process only); ``max_tokens`` is the largest
        budget and each row is cut to its own afterwards."""
        kwargs = self._sampling_kwargs(params, max(b for _, b in rows))
        direct = {k: kwargs.pop(k) for k in ("temperature", "top_p", "top_k", "max_tokens", "logprobs")}
        kwargs.pop("n")
        out = self.client.generate(prompts=[ids for ids, _ in rows], n=1, generation_kwargs=kwargs, **direct)
        token_lists = out.get("logprob_token_ids") or [None] * len(rows)
        results = []
        for ids, steps, step_ids in zip(out["completion_ids"], out["logprobs"], token_lists):
            picked = []
            for t, (token, step) in enumerate(zip(ids, steps)):
                k = step_ids[t].index(token) if step_ids is not None and token in step_ids[t] else 0
                picked.append(float("nan") if step[k] is None else float(step[k]))
            results.append((list(ids), picked))
        return results
