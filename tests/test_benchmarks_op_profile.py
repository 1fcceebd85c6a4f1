"""benchmarks/op_profile.py on a tiny random model: the training micro-batch and the rollout are profiled, the
operator table adds up, and the matmuls' FLOPs are counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from repo_scripts import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "op_profile.py"


@pytest.mark.slow  # two model loads, a profiled training pass and rollout: ~20 s on 1 busy core
def test_op_profile_smoke(tmp_path):
    bench = load_script(SCRIPT, "op_profile_benchmark")
    out = tmp_path / "op.json"
    bench.main(["--model", "random-tiny", "--rows", "2", "--length", "64", "--prompts", "1", "--group-size", "2",
                "--turns", "2", "--rollout-skip", "1", "--rollout-forwards", "6", "--gemm-weights", "6", "--top", "40", "--out", str(out)])
    saved = json.loads(out.read_text())
    for part in ("train", "rollout"):
        r = saved[part]
        assert abs(sum(row["share"] for row in r["ops"]) - 1.0) < 0.05  # 40 rows hold (nearly) every operator
        assert 0 < r["matmul_share"] < 1 and r["matmul_gflop"] > 0 and r["matmul_gflops"] > 0
        mm = next(row for row in r["ops"] if row["op"] == "aten::mm")
        assert mm["gflop"] > 0 and mm["calls"] > 0
    assert saved["rollout"]["decode_steps"] > 0 and saved["rollout"]["trajectories"] == 2
    # the training pass: 2 rows x 64 tokens through every LoRA linear, forward, recompute and backward
    assert saved["train"]["matmul_gflop"] > 3 * 2 * 64 * 2e-9
    assert set(saved["gemm"]) == {"M=16", "M=2048"}
    assert all(v["gflops_weights_cached"] > 0 for v in saved["gemm"].values())
    assert saved["command"].startswith("python benchmarks/op_profile.py --model random-tiny")
    assert sum(saved["rollout"]["profiled_forwards"].values()) == 6  # the profiled window of forward calls
