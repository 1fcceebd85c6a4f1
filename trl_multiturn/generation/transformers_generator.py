"""The transformers backend: :class:`TransformersGenerator`, a batched sampling loop over a Hugging Face causal LM
whose rows join and leave a running batch, with each trajectory's K/V kept across turns in its
:class:`GenerationSession`; and its reference path (full prefill, no K/V kept) for models that cannot reuse K/V.
The design is described in the package docstring (``trl_multiturn/generation/__init__.py``).
"""

from __future__ import annotations

import functools
import itertools
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .kv_buffer import _CACHE_KWARG, _BufferLayer, _cache_of, _kv_reuse_blocker, _left_room, _make_cache, _RunningKV
from .sampling import GenerationOutput, SamplingParams, _eos_ids, _filter_logits, _StopChecker


class GenerationSession:
    """One trajectory's state kept by a generator across turns.

    Attributes:
        cached_ids: the ids whose K/V are held in ``kv``, in order (a prefix of the trajectory's ids).
        kv: per layer ``(keys, values)``, each (1, H_kv, len(cached_ids), D); ``None`` when nothing is cached.
        seed: seed of this trajectory's sampling stream.
        greedy: this trajectory takes the argmax token at every step whatever the sampling settings (a greedy
            member of a sampled group, ``MultiTurnGRPOConfig.greedy_baseline``); its log-probs are still those of
            ``log_softmax(logits / temperature)``, the distribution the trainer scores.
    """

    def __init__(self, seed: int | None = None):
        self.cached_ids: list[int] = []
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.seed = seed
        self.rng: torch.Generator | None = None
        self.greedy = False  # set by the rollout for a group's greedy member

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


#: rows that start a trajectory share their common prefix's K/V when it is at least this long
_MIN_SHARED_PREFIX = 16


@dataclass
class _Request:
    key: Any
    session: GenerationSession
    context: list[int]
    max_new_tokens: int
    keep_cache: bool
    seq: int = 0  # submission order: finished rows are reported in it, whatever slot they decoded in
    output: GenerationOutput = field(default_factory=GenerationOutput)
    length: int = 0  # tokens of this row held in the batch K/V


@dataclass
class _Batch:
    """A running batch: its rows (row ``a`` in slot ``a`` of ``kv``), their K/V and attention mask, and the logits
    each row's next token will be sampled from."""

    rows: list[_Request]
    kv: _RunningKV
    logits: torch.Tensor  # (A, V) float32

    def fit_width(self) -> None:
        """Show the model the columns of the longest live row only (a view: nothing is copied)."""
        self.kv.start = self.kv.end - max(r.length for r in self.rows)


def _argmax_where_greedy(next_ids: torch.Tensor, scaled: torch.Tensor, greedy: list[bool]) -> torch.Tensor:
    """``next_ids`` (A,) with the argmax of ``scaled`` (A, V) on the rows whose session is greedy."""
    if not any(greedy):
        return next_ids
    mask = torch.tensor(greedy, dtype=torch.bool, device=next_ids.device)  # (A,)
    return torch.where(mask, scaled.argmax(dim=-1).to(next_ids.device), next_ids)  # (A,)


def _timed(key: str):
    """Adds the seconds a method spends to ``self.stats[key]``."""

    def wrap(fn):
        @functools.wraps(fn)
        def timed(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                self.stats[key] += time.perf_counter() - t0

        return timed

    return wrap


class TransformersGenerator:
    """Batched sampling with a transformers model, K/V kept per trajectory across turns (see the package docstring).

    Args:
        model: a causal LM (``PreTrainedModel`` or a PEFT wrapper). The caller puts it in eval mode.
        tokenizer: used to decode tails for stop strings and for the pad / eos ids.
        generator: optional ``torch.Generator``; sessions draw their sampling seeds from it (reproducible rollouts).
        kv_reuse: keep K/V across turns and let rows join and leave a running batch. ``False`` (or a model that
            cannot, see the package docstring) takes the reference path: full prefill, one batch per call.
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
        blocker = _kv_reuse_blocker(model) if kv_reuse else None
        self.kv_reuse = bool(kv_reuse) and blocker is None
        if blocker is not None:
            warnings.warn(f"K/V reuse across turns is off: {blocker}. Every turn prefills its whole context and the "
                          "rows of a call decode as one batch (the reference path): slower, same samples.", stacklevel=2)
        self.max_batch_size = max_batch_size
        self.logits_processor = logits_processor
        self._seq = itertools.count()
        self._queue: list[_Request] = []
        self._ready: list[_Request] = []
        self._batch: _Batch | None = None
        self._parked: weakref.WeakSet[GenerationSession] = weakref.WeakSet()  # left with their K/V, may rejoin
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
            "kv_copied_tokens": 0,  # row-tokens of K/V copied: sessions into the batch, rows out to their sessions,
            # a row moved into a freed slot, every row when the batch's buffers are rebuilt
            "kv_rebuilds": 0,  # times the running batch's buffers were rebuilt (a joiner did not fit, or full)
            "forward_s": 0.0,  # inside the model's forward (prefill and decode)
            "decode_forward_s": 0.0,  # the decode steps' share of forward_s
            "sample_s": 0.0,  # sampling: logits processing, log-softmax, the draw
            "kv_s": 0.0,  # cache bookkeeping: K/V copied when rows join or leave, buffers rebuilt, sessions restored
            "step_s": 0.0,  # inside step(): all of the above plus stop checks and the Python between them
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
        request = _Request(key, session, list(context), int(max_new_tokens), keep, next(self._seq))
        (self._queue if max_new_tokens > 0 else self._ready).append(request)

    def step(self) -> list[tuple[Any, GenerationOutput]]:
        """Advance every running row by one token; returns the turns that ended, as ``(key, output)``.

        Queued requests join first (their new tokens are prefilled in one forward and their K/V merged into the
        running batch). Rows whose turn ends leave the batch in the same step; their K/V go to their sessions.
        """
        t_step = time.perf_counter()
        try:
            return self._step()
        finally:
            self.stats["step_s"] += time.perf_counter() - t_step

    def _step(self) -> list[tuple[Any, GenerationOutput]]:
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
        finished: list[_Request] = []
        for a, (row, token, logp) in enumerate(zip(batch.rows, tokens.tolist(), logps.tolist())):
            out = row.output
            out.ids.append(token)
            out.logprobs.append(logp)
            reason = self._stop(out.ids, row.max_new_tokens)
            if reason is None:
                keep.append(a)
            else:
                out.finish_reason = reason
                finished.append(row)
        done += [(row.key, row.output) for row in sorted(finished, key=lambda r: r.seq)]
        self.stats["generated_tokens"] += len(batch.rows)
        if len(keep) < len(batch.rows):
            order = self._leave(batch, keep)
            batch = self._batch
            tokens = tokens[torch.tensor(order, dtype=torch.long, device=tokens.device)] if order else tokens[:0]
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
        """Prefill queued requests (as many as ``max_batch_size`` allows) into the running batch's free slots."""
        if not self._queue:
            return
        running = len(self._batch.rows) if self._batch is not None else 0
        room = len(self._queue) if self.max_batch_size is None else self.max_batch_size - running
        if room <= 0:
            return
        joining, self._queue = self._queue[:room], self._queue[room:]
        self._batch = self._prefill(joining, self._batch)

    @torch.no_grad()
    def _prefill(self, requests: list[_Request], batch: _Batch | None) -> _Batch:
        """One forward over the new tokens of ``requests`` on top of the K/V their sessions hold.

        Row j has context length t_j and a usable cached prefix c_j. With Q = max_j (t_j - c_j) every row feeds its
        last min(t_j, Q) tokens (a row with a shorter new chunk re-feeds a few cached tokens) on top of
        p_j = max(t_j - Q, 0) cached tokens, right-aligned at column P = max_j p_j.

        With a running ``batch`` the rows are written straight into its free slots, right-aligned at its end column
        (the buffers are rebuilt first if they do not fit, :meth:`_RunningKV.fits`), so joining copies the joiners'
        cached K/V only. Without one, the prefill's buffers become the new batch's.
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
        attention = attention.to(device)
        if batch is None:
            reserve = min(max(r.max_new_tokens for r in requests), 1024) + 1
            head = _left_room(p + q)
            if p > 0:
                layers = self._past_layers(requests, past, p, q + reserve, head)
            else:
                layers = [_BufferLayer(reserve=reserve, head=head) for _ in range(self._num_layers())]
        else:
            layers = self._slot_layers(batch, requests, past, p, q)
        for r in requests:  # their cached K/V now live in the batch's buffers; a second copy would double the cache
            r.session.kv, r.session.cached_ids = None, []
        t0 = time.perf_counter()
        out = self.model(
            input_ids=input_ids.to(device),
            attention_mask=attention,
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
        logits = out.logits[:, -1, :].float()  # (J, V)
        if batch is None:
            return _Batch(rows=list(requests), kv=_RunningKV.from_layers(layers, attention), logits=logits)
        batch.kv.set_mask(len(batch.rows), attention)
        batch.rows += requests
        batch.logits = torch.cat([batch.logits, logits], dim=0)  # (A+J, V)
        batch.fit_width()
        return batch

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

    def _slots_for(self, rows: list[_Request]) -> int:
        """Slots of rebuilt buffers: ``rows`` (live and joining) plus the rows that may join while they run, the queued
        requests and the rows parked between turns (they left with their K/V kept and their session still holds
        them), at most ``max_batch_size``. Sized to what is in flight rather than to the largest batch seen: slots
        cost memory for every column, and once most trajectories have finished a rebuild for the few still running
        would otherwise allocate the whole batch's cache again."""
        here = {id(r.session) for r in [*rows, *self._queue]}
        parked = sum(1 for s in self._parked if s.kv is not None and id(s) not in here)
        want = len(rows) + len(self._queue) + parked
        return want if self.max_batch_size is None else max(len(rows), min(want, self.max_batch_size))

    @staticmethod
    def _extra_columns(rows: list[_Request]) -> int:
        """Columns to leave right of the K/V for the tokens the rows may still sample (capped; the buffers grow)."""
        return min(max(r.max_new_tokens - len(r.output.ids) for r in rows), 1024) + 1

    @_timed("kv_s")
    def _past_layers(
        self, requests: list[_Request], past: list[int], p: int, extra: int, head: int
    ) -> list[_BufferLayer]:
        """New buffers holding, for each row, its first ``past[j]`` cached tokens right-aligned at column
        ``head + p``, with ``head`` free columns on the left and ``extra`` on the right."""
        ref = next(r.session.kv for r, pj in zip(requests, past) if pj > 0)
        layers = []
        for k0, v0 in ref:
            kbuf = k0.new_zeros(len(requests), k0.shape[1], head + p + extra, k0.shape[3])  # (J, H, cap, D)
            vbuf = v0.new_zeros(len(requests), v0.shape[1], head + p + extra, v0.shape[3])
            layers.append(_BufferLayer(kbuf, vbuf, start=head, end=head + p))
        self._copy_past(layers, requests, past)
        return layers

    def _copy_past(self, layers: list[_BufferLayer], requests: list[_Request], past: list[int]) -> None:
        """Copy each row's first ``past[j]`` cached tokens from its session into ``layers`` (row j, right-aligned at
        the layers' ``end``)."""
        for layer_idx, layer in enumerate(layers):
            for row, (r, pj) in enumerate(zip(requests, past)):
                if pj > 0:
                    k, v = r.session.kv[layer_idx]
                    layer.kbuf[row, :, layer.end - pj : layer.end].copy_(k[0, :, :pj])
                    layer.vbuf[row, :, layer.end - pj : layer.end].copy_(v[0, :, :pj])
        self.stats["kv_copied_tokens"] += sum(past)

    @_timed("kv_s")
    def _slot_layers(
        self, batch: _Batch, requests: list[_Request], past: list[int], p: int, q: int
    ) -> list[_BufferLayer]:
        """Cache layers over the free slots that ``requests`` take in ``batch``: their prefill (P cached + Q fed
        columns) ends at the batch's end column, and their cached tokens are copied in. The batch's buffers are
        rebuilt first when the joiners do not fit (no free slot, or a joiner longer than the batch's end column)."""
        kv, n = batch.kv, len(batch.rows)
        if not kv.fits(n + len(requests), p + q):
            extra = self._extra_columns(batch.rows + requests)
            kv.rebuild(n, self._slots_for(batch.rows + requests), p + q, extra)
            self.stats["kv_rebuilds"] += 1
            self.stats["kv_copied_tokens"] += sum(r.length for r in batch.rows)
        layers = kv.layers(n, n + len(requests), start=kv.end - p - q, end=kv.end - q)
        if p > 0:
            self._copy_past(layers, requests, past)
        return layers

    @_timed("kv_s")
    def _leave(self, batch: _Batch, keep: list[int]) -> list[int]:
        """Store the K/V of the rows not in ``keep`` in their sessions and refill their slots with the kept rows
        from the batch's tail (one row copied per leaving row at most; the kept rows are not restacked).

        Returns the kept rows' former slots in their new slot order (to reorder what was sampled for them).
        """
        kept = set(keep)
        for a, row in enumerate(batch.rows):
            if a in kept:
                continue
            if row.keep_cache:
                row.session.kv = batch.kv.take(a, row.length)
                row.session.cached_ids = row.context + row.output.ids[:-1]
                self._parked.add(row.session)
                self.stats["kv_copied_tokens"] += row.length
            else:
                row.session.drop()
        if not keep:
            self._batch = None
            return []
        n = len(keep)
        holes = [a for a in range(n) if a not in kept]  # freed slots among the first n ...
        movers = [a for a in keep if a >= n]  # ... and as many kept rows past them; the others stay in place
        order = list(range(n))
        for dst, src in zip(holes, movers):
            batch.kv.move(src, dst, batch.rows[src].length)
            self.stats["kv_copied_tokens"] += batch.rows[src].length
            order[dst] = src
        batch.rows = [batch.rows[a] for a in order]
        batch.logits = batch.logits[torch.tensor(order, dtype=torch.long, device=batch.logits.device)]  # (A', V)
        batch.fit_width()
        return order

    @torch.no_grad()
    def _decode(self, batch: _Batch, tokens: torch.Tensor) -> None:
        """Feed each row's sampled token (one column for every row) and keep the logits of the next."""
        a = len(batch.rows)
        kv = batch.kv
        device = kv.mask.device
        if kv.end >= kv.capacity:  # the last column is used: rebuild with room on the right
            self._rebuild(batch)
        attention = kv.decode_mask(a)  # (A, W+1)
        position_ids = torch.tensor([[r.length] for r in batch.rows], dtype=torch.long, device=device)  # (A, 1)
        t0 = time.perf_counter()
        out = self.model(
            input_ids=tokens.view(a, 1).to(device),
            attention_mask=attention,
            position_ids=position_ids,
            use_cache=True,
            **{_CACHE_KWARG: _make_cache(kv.layers(0, a))},
        )
        self.stats["forward_s"] += time.perf_counter() - t0
        self.stats["decode_forward_s"] += time.perf_counter() - t0
        self.stats["decode_steps"] += 1
        self.stats["decode_positions"] += a
        kv.end += 1
        for r in batch.rows:
            r.length += 1
        batch.logits = out.logits[:, -1, :].float()  # (A, V)

    @_timed("kv_s")
    def _rebuild(self, batch: _Batch) -> None:
        """New buffers for ``batch`` with room on both sides (its last column is used)."""
        n = len(batch.rows)
        batch.kv.rebuild(n, self._slots_for(batch.rows), batch.kv.end - batch.kv.start, self._extra_columns(batch.rows))
        self.stats["kv_rebuilds"] += 1
        self.stats["kv_copied_tokens"] += sum(r.length for r in batch.rows)

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
            next_ids = _argmax_where_greedy(next_ids, scaled, [r.session.greedy for r in batch.rows])  # (A,)
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
        greedy_rows = [bool(sessions is not None and sessions[i] is not None and sessions[i].greedy) for i in active]

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
                next_ids = _argmax_where_greedy(next_ids, scaled, greedy_rows)  # (A,)
            chosen_logp = logp.gather(-1, next_ids.unsqueeze(-1)).squeeze(-1)  # (A,)
            step_ids, step_logps = next_ids.tolist(), chosen_logp.tolist()  # one device sync per step, not per row
            for row, i in enumerate(active):
                if not running[row]:
                    continue
                o = outputs[i]
                o.ids.append(step_ids[row])
                o.logprobs.append(step_logps[row])
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
            self.stats["decode_forward_s"] += time.perf_counter() - t0
            self.stats["decode_steps"] += 1
            self.stats["decode_positions"] += len(active)
            past = _cache_of(out)
            logits = out.logits[:, -1, :].float()  # (A, V)
        return outputs
