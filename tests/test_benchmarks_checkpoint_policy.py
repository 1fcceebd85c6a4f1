"""benchmarks/checkpoint_policy.py on a tiny random model: each policy in its own process, alternating rounds, the
same loss and gradients under every policy, and the JSON holds what docs/benchmarks.md reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "checkpoint_policy.py"


@pytest.mark.slow  # four processes that each load SmolLM2's tokenizer and a tiny model (~40 s)
def test_checkpoint_policy_benchmark_structure(tmp_path):
    out = tmp_path / "policy.json"
    subprocess.run([sys.executable, str(SCRIPT), "--model", "random-tiny", "--rows", "2", "--length", "48",
                    "--steps", "1", "--repeats", "2", "--policies", "full,save_matmuls", "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=600)
    saved = json.loads(out.read_text())
    assert saved["benchmark"] == "checkpoint_policy" and len(saved["rounds"]) == 2
    assert [list(r) for r in saved["rounds"]] == [["full", "save_matmuls"], ["save_matmuls", "full"]]  # alternating
    summary = saved["summary"]
    assert summary["grad_max_abs_diff_vs_full"] == {"full": 0.0, "save_matmuls": 0.0}
    assert len({r[p]["loss"] for r in saved["rounds"] for p in r}) == 1  # one loss under every policy
    assert set(summary["full_over_policy_per_round"]) == {"full", "save_matmuls"}
    assert all(v > 0 for v in summary["peak_above_loaded_gib"].values())
    assert "--policies full,save_matmuls" in saved["command"]
