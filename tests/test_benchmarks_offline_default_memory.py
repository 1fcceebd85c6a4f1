"""benchmarks/offline_default_memory.py on a scripted job: the poller splits the job's resident memory by the stage
its output last opened, and reports the kernel's high-water mark, the exit status and the exact-match lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from repo_scripts import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "offline_default_memory.py"


def test_stage_of_follows_the_recipes_tags():
    bench = load_script(SCRIPT, "offline_default_memory_benchmark")
    assert bench.stage_of("[base] evaluating on 32 held-out questions", "load") == "base eval"
    assert bench.stage_of("[sft] 64/64 expert trajectories kept (100%); training", "base eval") == "sft"
    assert bench.stage_of("  eval 32/32 questions, exact match so far 0.625", "sft eval") == "sft eval"
    assert bench.stage_of("{'loss': 0.1}", "grpo") == "grpo"


def test_a_process_that_is_gone_counts_zero():
    bench = load_script(SCRIPT, "offline_default_memory_benchmark")
    assert bench._status_kib(os.getpid(), "VmRSS") > 0
    child = subprocess.Popen(["true"])
    child.wait()
    assert bench._status_kib(child.pid, "VmRSS") == 0


def test_the_poller_splits_memory_by_stage(tmp_path):
    bench = load_script(SCRIPT, "offline_default_memory_benchmark")
    job = tmp_path / "job.py"
    job.write_text(
        "import time\n"
        "print('[base] evaluating on 2 held-out questions', flush=True)\n"
        "held = b'\\x01' * (400 * 2**20)\n"  # 400 MiB, touched, while the base evaluation runs
        "time.sleep(1.5)\n"
        "del held\n"
        "print('[sft] training', flush=True)\n"
        "time.sleep(1.5)\n"
        "print('base      0.000     0.000     0.000  0.000      0.00    1.000      1.1')\n"
    )
    out = tmp_path / "mem.json"
    result = bench.main(["--command", f"{sys.executable} {job}", "--interval", "0.05", "--out", str(out)])
    stages = result["per_stage_polled_rss_gib"]
    assert set(stages) <= {"load", "base eval", "sft"} and {"base eval", "sft"} <= set(stages)
    assert stages["base eval"] > stages["sft"] + 0.3  # the 400 MiB counted where they were held
    assert result["max_vmhwm_gib"] >= stages["base eval"] - 0.05  # the job's own peak, at least what was polled
    assert result["exit_status"] == 0
    assert result["exact_match_lines"] == ["base      0.000     0.000     0.000  0.000      0.00    1.000      1.1"]
    assert json.loads(out.read_text())["command"].startswith(sys.executable)
