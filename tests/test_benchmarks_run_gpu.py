"""benchmarks/run_gpu.sh: every step it runs on a GPU passes its benchmark's own argument parser.

A device is lent for minutes at a time, so a step that dies on a misspelt flag loses the measurement. The script is
run as on a GPU (not the SMOKE mode) with ``PYTHON`` pointing at a stand-in that only records each command line;
each benchmark's ``main`` then parses that command line here and stops at ``parse_args``: nothing is computed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from repo_scripts import load_script

REPO = Path(__file__).resolve().parents[1]


class _Parsed(Exception):
    def __init__(self, namespace):
        self.namespace = namespace


def _parse_only(script: str, argv: list[str], monkeypatch) -> argparse.Namespace:
    """The arguments ``script``'s ``main(argv)`` parses, without running the benchmark."""
    parse = argparse.ArgumentParser.parse_args

    def stop_after_parsing(self, args=None, namespace=None):
        raise _Parsed(parse(self, args, namespace))

    module = load_script(script, f"run_gpu_{Path(script).stem}")
    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", stop_after_parsing)
        with pytest.raises(_Parsed) as parsed:
            module.main(argv)
    return parsed.value.namespace


def _recorded_steps(tmp_path, smoke: bool) -> tuple[str, list[list[str]]]:
    """run_gpu.sh's summary and the command line of every step, as the script would start them."""
    stand_in = tmp_path / "python"
    stand_in.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                        "with open(os.environ['RUN_GPU_LOG'], 'a') as log:\n"
                        "    log.write(json.dumps(sys.argv[1:]) + '\\n')\n")
    stand_in.chmod(0o755)
    log, out = tmp_path / "argv.jsonl", tmp_path / "results"
    env = os.environ | {"PYTHON": str(stand_in), "RUN_GPU_LOG": str(log), "DEVICE": "cpu" if smoke else "cuda",
                        "SMOKE": "1" if smoke else "0"}
    subprocess.run(["bash", str(REPO / "benchmarks" / "run_gpu.sh"), str(out)], env=env, check=True,
                   capture_output=True, text=True, timeout=120)
    commands = [json.loads(line) for line in log.read_text().splitlines()]
    assert commands[0][0] == "-c"  # the machine record
    return (out / "summary.txt").read_text(), commands[1:]


@pytest.mark.parametrize("smoke", [False, True], ids=["gpu", "smoke"])
def test_every_gpu_step_parses_its_arguments(tmp_path, monkeypatch, smoke):
    summary, commands = _recorded_steps(tmp_path, smoke)
    steps = [line for line in summary.splitlines() if ": exit " in line]
    assert [line.split(":")[0] for line in steps] == [
        "grpo_step_g8", "rollout_smollm2", "train_step", "continuous_batching", "rollout_1.7b"]
    limits = [int(line.split("(limit ")[1].split(" s")[0]) for line in steps]
    assert sum(limits) <= 8 * 60, limits  # the header promises the whole script within 8 minutes

    parsed = [_parse_only(script, argv, monkeypatch) for script, *argv in commands]
    assert len(parsed) == len(steps)
    for (script, *_), args in zip(commands, parsed):
        assert args.device == ("cpu" if smoke else "cuda") and args.dtype == ("fp32" if smoke else "bf16"), script
        assert Path(args.out).parent == (tmp_path / "results").resolve()
    assert Path(commands[0][0]).name == "grpo_step.py"
    whole_step = parsed[0]
    if smoke:
        assert whole_step.model == "random-tiny"
    else:
        assert (whole_step.group_size, whole_step.prompts, whole_step.model) == (8, 8, "smollm2")
        assert whole_step.steps >= 2 and whole_step.warmup >= 1
