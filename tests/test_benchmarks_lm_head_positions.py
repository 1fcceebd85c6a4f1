"""benchmarks/lm_head_positions.py on a tiny random model: both ways alternate over rounds, project what they say, and
give the same log-probs and gradients."""

from __future__ import annotations

import json
from pathlib import Path

from repo_scripts import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "lm_head_positions.py"


def test_lm_head_positions_benchmark_structure(tmp_path):
    bench = load_script(SCRIPT, "lm_head_positions_benchmark")
    out = tmp_path / "head.json"
    bench.main(["--model", "random-tiny", "--rows", "2", "--length", "40", "--repeats", "2", "--out", str(out)])
    saved = json.loads(out.read_text())
    summary = saved["summary"]
    assert saved["benchmark"] == "lm_head_positions" and len(saved["rounds"]) == 2
    assert [list(r) for r in saved["rounds"]] == [["every", "labelled"], ["labelled", "every"]]  # alternating
    assert summary["positions"] == 2 * 39 and 0 < summary["projected_labelled_only"] < summary["positions"]
    assert summary["log_probs_max_abs_diff"] < 1e-5 and summary["grads_max_abs_diff"] < 1e-6
    assert len(summary["every_over_labelled_per_round"]) == 2 and summary["every_over_labelled_median"] > 0
    assert saved["command"].startswith("python benchmarks/lm_head_positions.py --model random-tiny")
