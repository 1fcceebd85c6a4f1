"""K/V buffers of a running batch for :class:`~trl_multiturn.generation.TransformersGenerator`, built on
transformers' cache internals (``Cache``, ``DynamicLayer``).

Per layer one buffer (A, H_kv, capacity, D) with every row left-padded so that all rows end at the same column; a
decode step writes one column in place and the capacity doubles when full. Also here: which models can use it
(``_supports_kv_reuse``), the name of the forward's cache argument, and the helpers that restack buffers and masks
when rows join or leave.
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
