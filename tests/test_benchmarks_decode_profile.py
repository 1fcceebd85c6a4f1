"""benchmarks/decode_profile.py on a tiny random model: the parts of a rollout's wall time add up to it, each part is
read from the generator's own counters, and the forward's split into prefill and decode is consistent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from repo_scripts import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "decode_profile.py"


@pytest.mark.slow  # a warm-up rollout and a measured one per batch size (~10 s on 2 busy cores)
def test_decode_profile_parts_add_up_to_the_wall_time(tmp_path):
    bench = load_script(SCRIPT, "decode_profile_benchmark")
    out = tmp_path / "profile.json"
    result = bench.main(["--model", "random-tiny", "--batch-sizes", "2", "4", "--group-size", "2", "--turns", "2",
                         "--max-think", "8", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text())["benchmark"] == "decode_profile"
    for b, entry in zip((2, 4), result["batches"]):
        assert entry["batch"] == b
        (run,) = entry["runs"]
        parts, stats = run["parts_s"], run["generator_stats"]
        assert set(parts) == set(bench.PARTS) and all(v >= 0 for v in parts.values())
        assert sum(parts.values()) == pytest.approx(run["wall_s"], rel=1e-6)  # nothing left out, nothing twice
        assert parts["forward_prefill"] + parts["forward_decode"] == pytest.approx(stats["forward_s"])
        assert 0 < stats["decode_forward_s"] < stats["forward_s"] <= stats["step_s"] <= run["wall_s"]
        assert stats["decode_steps"] > 0 and stats["kv_s"] > 0  # rows left and joined between turns
        assert 0 < entry["forward_share"] < 1
