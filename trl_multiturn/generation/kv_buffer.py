"""K/V buffers of a running batch for :class:`~trl_multiturn.generation.TransformersGenerator`, built on
transformers' cache internals (``Cache``, ``DynamicLayer``).

Per layer one buffer (slots, H_kv, capacity, D) with every row left-padded so that all rows end at the same column;
a decode step writes one column in place. :class:`_RunningKV` keeps a running batch's buffers in place while rows
join (into free slots) and leave (the last row fills the slot), rebuilding them only when a joiner does not fit.
Also here: which models can use it (``_kv_reuse_blocker``) and the name of the forward's cache argument.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache, DynamicLayer


def _cache_kwarg_name() -> str:
    """transformers >= 5.2x renamed ``past_key_values`` to ``cache``; support both."""
    from transformers import LlamaForCausalLM

    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


_CACHE_KWARG = _cache_kwarg_name()


def _cache_of(output):
    return getattr(output, "cache", None) if _CACHE_KWARG == "cache" else output.past_key_values


def _kv_reuse_blocker(model) -> str | None:
    """Why ``model``'s K/V cannot be kept per row across turns, or None when it can: a transformers decoder whose
    layers are all full attention. The forward's cache argument may be called ``cache`` (transformers >= 5.24) or
    ``past_key_values`` (earlier 5.x): both work (the generator tests pass under 5.17 and 5.25)."""
    from transformers import PreTrainedModel

    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    if not isinstance(base, PreTrainedModel):
        return f"{type(base).__name__} is not a transformers PreTrainedModel"
    config = base.config.get_text_config(decoder=True)
    if getattr(config, "is_encoder_decoder", False):
        return "the model is an encoder-decoder"
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        return f"not every layer is full attention (layer_types: {sorted(set(layer_types))})"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return f"the model uses sliding-window attention (sliding_window={config.sliding_window})"
    return None


class _BufferLayer(DynamicLayer):
    """One layer's K/V for a left-padded batch: ``kbuf``/``vbuf`` (A, H_kv, capacity, D) whose visible columns are
    ``[start, end)``; all rows end at column ``end``.

    ``update`` writes the new columns in place at ``end`` and returns views of the visible columns, so a decode step
    costs O(A) writes instead of a copy of the whole cache. ``kbuf`` may itself be a view of some rows of a larger
    buffer (:class:`_RunningKV`): the writes then land in that buffer, which is why a full buffer is an error here
    rather than a reason to grow (a grown copy would leave the batch's buffer behind; the callers make room first).
    Lazily allocated buffers (no ``kbuf`` given) get ``head`` free columns on the left and ``reserve`` on the right.
    """

    def __init__(
        self,
        kbuf: torch.Tensor | None = None,
        vbuf: torch.Tensor | None = None,
        start: int = 0,
        end: int = 0,
        reserve: int = 0,
        head: int = 0,
    ):
        super().__init__()
        self.kbuf, self.vbuf, self.start, self.end, self.reserve, self.head = kbuf, vbuf, start, end, reserve, head
        if kbuf is not None:
            self.is_initialized, self.device = True, kbuf.device
            self.keys, self.values = kbuf[:, :, start:end], vbuf[:, :, start:end]

    @property
    def width(self) -> int:
        return self.end - self.start

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device, self.is_initialized = key_states.device, True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if self.kbuf is None:
            a, h, _, d = key_states.shape
            cols = self.head + n + self.reserve
            self.kbuf = key_states.new_zeros(a, h, cols, d)  # (A, H, head + n + reserve, D)
            self.vbuf = value_states.new_zeros(a, h, cols, value_states.shape[-1])
            self.start = self.end = self.head
        elif self.end + n > self.kbuf.shape[-2]:
            raise RuntimeError(f"K/V buffer full: {n} new columns at column {self.end} of {self.kbuf.shape[-2]}.")
        self.kbuf[:, :, self.end : self.end + n].copy_(key_states)
        self.vbuf[:, :, self.end : self.end + n].copy_(value_states)
        self.end += n
        self.keys, self.values = self.kbuf[:, :, self.start : self.end], self.vbuf[:, :, self.start : self.end]  # views
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.end - self.start

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.end - self.start + query_length, 0

    def get_max_length(self) -> int:
        return -1


def _make_cache(layers: list[_BufferLayer]) -> Cache:
    return Cache(layers=layers)


def _left_room(width: int) -> int:
    """Free columns left of the K/V when the running batch's buffers are (re)built for rows ``width`` long.

    A row that rejoins after its environment answered is longer than when it left (its observation was appended)
    while the batch's end column moved on by one per decode step only; it fits in place as long as it is no longer
    than the batch's end column. Room proportional to the width makes the rebuilds for this growth geometric (a
    handful per rollout), capped so that long contexts do not double the cache's memory.
    """
    return min(max(width // 2, 64), 1024)


class _RunningKV:
    """The K/V of a running batch, kept in place while rows join and leave.

    Per layer one key and one value buffer (C, H_kv, capacity, D) and one attention mask (C, capacity): slots
    ``0 .. n-1`` hold the live rows, every row right-aligned at column ``end`` (its tokens are its last ``length``
    columns, the columns on their left have attention 0); the model sees columns ``[start, end)`` of the first ``n``
    slots, with ``start = end - max(length)``, so the width computed is that of the longest live row. Slots past
    ``n`` are free; buffers are zero-filled when allocated and only ever receive real K/V, so a column under
    attention 0 never holds NaN or inf.

    Why slots rather than a rebuild per event: a rebuild copies every row (O(rows x width)) and a multi-turn
    rollout has two events per turn and trajectory (the row leaves at the end of its turn and rejoins once its
    observation is appended). Here a leaving row is copied out once (to its session, which must own it), and its
    slot is filled by the batch's last live row (one row moved, see :meth:`move`), so the live slots stay packed
    and a decode step computes live rows only; a joining row is written into a free slot (its cached K/V, then its
    prefill forward writes its new tokens in place). Leaving a slot empty instead would save that one copy but cost
    a whole row of forward compute at every decode step until a joiner fills it, more than the copy after a single
    step. The buffers are rebuilt (:meth:`rebuild`) only when a joiner finds no free slot, is longer than the
    columns left of ``end``, or the last column is used.
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor, start: int, end: int):
        self.keys, self.values, self.mask = keys, values, mask  # per layer (C, H, cap, D); (C, cap) long
        self.start, self.end = start, end

    @classmethod
    def from_layers(cls, layers: list[_BufferLayer], attention: torch.Tensor) -> "_RunningKV":
        """Adopt the buffers a prefill forward filled (all rows live); ``attention`` (J, end - start) is its mask."""
        ref = layers[0]
        mask = attention.new_zeros(ref.kbuf.shape[0], ref.kbuf.shape[2])  # (J, cap)
        mask[:, ref.start : ref.end].copy_(attention)
        return cls([layer.kbuf for layer in layers], [layer.vbuf for layer in layers], mask, ref.start, ref.end)

    @property
    def slots(self) -> int:
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def fits(self, rows: int, length: int) -> bool:
        """Whether ``rows`` live rows fit the slots and a row ``length`` long fits left of ``end``."""
        return rows <= self.slots and length <= self.end

    def layers(self, lo: int, hi: int, start: int | None = None, end: int | None = None) -> list[_BufferLayer]:
        """Cache layers over slots ``lo .. hi-1`` (views: the forward's writes land in the buffers)."""
        start = self.start if start is None else start
        end = self.end if end is None else end
        return [_BufferLayer(k[lo:hi], v[lo:hi], start=start, end=end) for k, v in zip(self.keys, self.values)]

    def rebuild(self, n: int, slots: int, width: int, extra: int) -> None:
        """New buffers with ``slots`` slots and room for rows ``width`` long; the first ``n`` slots' visible columns
        are copied over (right-aligned at the new ``end``), with :func:`_left_room` columns on the left and at least
        ``extra`` on the right (at least as many as on the left: the end column moves on across turns, so the right
        side too needs room proportional to the width for the rebuilds to stay few)."""
        old = self.end - self.start
        width = max(width, old)
        room = _left_room(width)
        end = room + width
        cap = end + max(extra, room)
        for buffers in (self.keys, self.values):
            for i, buf in enumerate(buffers):
                out = buf.new_zeros(slots, buf.shape[1], cap, buf.shape[3])  # (C, H, cap, D)
                out[:n, :, end - old : end].copy_(buf[:n, :, self.start : self.end])
                buffers[i] = out
        mask = self.mask.new_zeros(slots, cap)  # (C, cap)
        mask[:n, end - old : end].copy_(self.mask[:n, self.start : self.end])
        self.mask, self.start, self.end = mask, end - old, end

    def take(self, slot: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of the K/V of the row in ``slot`` (its last ``length`` columns): per layer (1, H, length, D)."""
        lo = self.end - length
        return [(k[slot : slot + 1, :, lo : self.end].clone(), v[slot : slot + 1, :, lo : self.end].clone())
                for k, v in zip(self.keys, self.values)]

    def move(self, src: int, dst: int, length: int) -> None:
        """Move the row in slot ``src`` (``length`` tokens) into slot ``dst``, whose row has left."""
        lo = self.end - length
        for buffers in (self.keys, self.values):
            for buf in buffers:
                buf[dst, :, lo : self.end].copy_(buf[src, :, lo : self.end])
        self.mask[dst, : self.end].copy_(self.mask[src, : self.end])

    def set_mask(self, lo: int, attention: torch.Tensor) -> None:
        """The mask of slots ``lo ..`` (rows that just joined): ``attention`` (J, w) right-aligned at ``end``, zeros
        on its left (columns that a later, longer row may bring into view)."""
        rows = slice(lo, lo + attention.shape[0])
        self.mask[rows, : self.end - attention.shape[1]].zero_()
        self.mask[rows, self.end - attention.shape[1] : self.end].copy_(attention)

    def decode_mask(self, n: int) -> torch.Tensor:
        """Mark column ``end`` (where a decode step writes) attended for the ``n`` live rows; the step's mask
        (n, end - start + 1), a view."""
        self.mask[:n, self.end] = 1
        return self.mask[:n, self.start : self.end + 1]
