"""benchmarks/compiled_decode.py on a tiny random model, with ``torch.compile`` replaced by a wrapper that counts its
calls (inductor's compilation takes minutes): both sides time the same decode step in alternating rounds, the
agreement check compares their logits, and the JSON holds what docs/benchmarks.md reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from repo_scripts import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "compiled_decode.py"


@pytest.mark.slow  # loads SmolLM2's tokenizer and a tiny model, a few decode steps (~10 s)
def test_compiled_decode_benchmark_structure(tmp_path, monkeypatch):
    bench = load_script(SCRIPT, "compiled_decode_benchmark")

    calls = []

    def fake_compile(model, **kwargs):
        calls.append(kwargs)
        return lambda **inputs: model(**inputs)

    monkeypatch.setattr(bench.torch, "compile", fake_compile)
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "freezing", inductor_config.freezing)  # the script sets it; restored after
    out = tmp_path / "compiled.json"
    result = bench.main(["--model", "random-tiny", "--batch-sizes", "2", "3", "--context", "16", "--steps", "2",
                         "--repeats", "2", "--out", str(out)])

    assert calls == [{"dynamic": True}]  # one compilation for every row count and cache length
    saved = json.loads(out.read_text())
    assert saved["benchmark"] == "compiled_decode" and saved["threads"]["torch"] == 1
    assert set(saved["per_batch"]) == {"2", "3"} and len(saved["rounds"]) == 2
    for b, entry in saved["per_batch"].items():
        assert len(entry["eager_over_compiled_per_round"]) == 2
        assert entry["eager_ms_median"] > 0 and entry["compiled_ms_median"] > 0
        # the same function on both sides: identical logits and greedy tokens
        assert saved["agreement"][b] == {"max_abs_logit_diff": 0.0, "greedy_tokens_equal": True}
    assert result["compile_s"] >= 0
