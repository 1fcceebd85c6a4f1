"""release_freed_memory returns what the allocator kept after a stage freed it: in a fresh process, 400 MiB of
10 KiB buffers (the heap, below any mmap threshold) are freed around live ones (so the heap cannot shrink from its
top); the resident set stays up until the call, and drops after it."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from trl_multiturn.host_memory import _malloc_trim, release_freed_memory

CHILD = r"""
import json, sys
from pathlib import Path
from trl_multiturn.host_memory import release_freed_memory

def rss_mib():
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024

chunks = [bytearray(b"\x01" * 10240) for _ in range(40960)]  # 400 MiB, touched
keep = chunks[::16]  # one live buffer in 16: the freed ones are holes, not the heap's top
del chunks
freed = rss_mib()
ran = release_freed_memory() if sys.argv[1] == "release" else False
print(json.dumps({"freed": freed, "after": rss_mib(), "ran": ran, "kept": len(keep)}))
"""


def _child(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(_malloc_trim() is None, reason="glibc's malloc_trim is not available here")
def test_release_returns_the_freed_heap_to_the_os():
    kept = _child("keep")
    released = _child("release")
    assert released["ran"] is True
    assert kept["after"] > kept["freed"] - 20  # without the call the freed heap stays resident
    assert released["after"] < released["freed"] - 250  # 375 MiB were freed; most of it goes back


def test_release_is_harmless_to_live_memory():
    import torch

    live = [torch.randn(n) for n in (10, 3000, 300_000, 5_000_000)]  # small, heap and mmap-sized tensors
    copies = [t.numpy().tobytes() for t in live]
    release_freed_memory()
    assert [t.numpy().tobytes() for t in live] == copies


def test_the_stages_that_free_much_release_it(monkeypatch, tmp_path, smollm2_tokenizer, tiny_model_factory):
    """train_sft and evaluate_search_agent end by releasing what they freed (so the next stage's peak does not
    start at theirs)."""
    from scripted import ScriptedLM
    from test_evaluation_stats import AnswerEnv
    from test_sft import sft_args, three_trajectories

    import trl_multiturn.search.evaluation as evaluation
    import trl_multiturn.sft as sft
    from trl_multiturn.models import tool_chat_template
    from trl_multiturn.protocols import TagProtocol

    calls = []
    monkeypatch.setattr(evaluation, "release_freed_memory", lambda: calls.append("evaluate"))
    monkeypatch.setattr(sft, "release_freed_memory", lambda: calls.append("sft"))
    tok = smollm2_tokenizer
    lm = ScriptedLM([tok("<answer>Paris</answer>", add_special_tokens=False)["input_ids"]], len(tok), tok.eos_token_id)
    rows = [{"id": "a", "question": "capital of France?", "golden_answers": ["Paris"], "hops": 1}]
    evaluation.evaluate_search_agent(lm, tok, rows, AnswerEnv, protocol=TagProtocol(), max_turns=1,
                                     max_completion_length=32, max_tokens_per_turn=16, batch_size=2, progress=False)
    assert calls == ["evaluate"]
    sft_tok = copy.deepcopy(tok)
    sft_tok.chat_template = tool_chat_template()
    sft.train_sft(tiny_model_factory(seed=3), sft_tok, three_trajectories(sft_tok), sft_args(tmp_path, max_steps=1))
    assert calls == ["evaluate", "sft"]
