"""Give the host memory a finished stage freed back to the operating system.

glibc's allocator keeps memory that a process freed for its next allocations, and on CPU torch's tensors below its
mmap threshold (up to 32 MiB once the threshold has adapted) come from that heap. A stage that held a lot at once
(the warm start's activations, an evaluation's K/V cache) therefore leaves the process's resident set where its peak
was, and the next stage's own peak lands on top of that floor: in the offline default the process stayed at 2,636 MiB
after the warm start, of which about 1,570 MiB were freed but kept
(``benchmarks/results/offline_default_memory_probes.json``).
:func:`release_freed_memory` runs ``malloc_trim(0)``, which returns the free pages of every heap; the functions that
end such a stage call it (:func:`~trl_multiturn.sft.train_sft`,
:func:`~trl_multiturn.search.evaluation.evaluate_search_agent`, and the GRPO trainer after each rollout, whose
K/V cache the training pass does not need). Elsewhere than glibc on Linux it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import sys


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)  # glibc only (musl has none)
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_memory(collect: bool = True) -> bool:
    """Collect garbage (unless ``collect=False``: the trainer calls this at every rollout and skips it), then return
    the allocator's free pages to the OS; True when ``malloc_trim`` ran. Live memory is untouched."""
    if collect:
        gc.collect()
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
