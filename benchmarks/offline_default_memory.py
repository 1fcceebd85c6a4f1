"""Where the offline default's memory peaks: the README's main job run under a poller, its peak split by stage.

    python benchmarks/offline_default_memory.py --out benchmarks/results/offline_default_memory_stages.json
    python benchmarks/offline_default_memory.py -- --max_steps 1        # arguments after -- go to the recipe

Runs ``bash scripts/run_search_agent.sh`` (``accelerate launch recipes/search_agent.py``, the recipe's own thread
count) with ``--output_dir`` under a temporary folder unless given, reads its output line by line, and every
``--interval`` seconds reads the resident set (``VmRSS``) and the kernel's high-water mark (``VmHWM``) of every
process of the job. A stage is the recipe's last printed ``[tag]`` line (``[base]``, ``[sft]``, ``[grpo]``; a line
saying ``evaluating`` opens that tag's evaluation, e.g. ``[grpo] eval``). Reported: the largest ``VmRSS`` polled
in each stage (the polls can miss a peak shorter than the interval, so a stage's figure is a lower bound of its
peak, and memory a stage freed can stay in the process, so it is an upper bound of that stage's own need), the
largest ``VmHWM`` of any process (the job's exact peak, what ``/usr/bin/time -v`` reports as maximum resident set
size), the exit status, the wall time, and the exact match the recipe printed at each stage.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import memory as M  # noqa: E402  (no torch: the poller stays light)
GiB = 1024**3
_TAG = re.compile(r"^\[(\w+)\]")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--interval", type=float, default=0.25, help="seconds between polls")
    p.add_argument("--out", default=None, help="write the result JSON here")
    p.add_argument("--command", default="bash scripts/run_search_agent.sh",
                   help="the job to run (from the repository root); the recipe's arguments follow --")
    p.add_argument("recipe_args", nargs="*", help="passed on to the job (after --)")
    return p.parse_args(argv)


def _status_kib(pid: int, field: str) -> int:
    """``field`` of process ``pid`` in KiB (benchmarks/memory.py reads it), 0 when the process is gone or exiting."""
    try:
        return M._status_kib(field, pid)
    except (OSError, RuntimeError):
        return 0


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (read from /proc, no third-party dependency)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def stage_of(line: str, current: str) -> str:
    """The stage a recipe output line opens: ``[tag]`` lines open ``tag`` (``tag eval`` when they say evaluating);
    other lines keep ``current``."""
    match = _TAG.match(line)
    if not match:
        return current
    return f"{match.group(1)} eval" if "evaluating" in line else match.group(1)


def run(command: str, interval: float) -> dict:
    proc = subprocess.Popen(command, shell=True, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    state = {"stage": "load", "lines": []}

    def reader():
        for line in proc.stdout:
            sys.stdout.write(line)
            state["lines"].append(line.rstrip("\n"))
            state["stage"] = stage_of(line, state["stage"])

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    start = time.perf_counter()
    per_stage: dict[str, int] = {}
    hwm: dict[int, int] = {}
    while proc.poll() is None:
        pids = _tree(proc.pid)
        rss = sum(_status_kib(p, "VmRSS") for p in pids)
        for p in pids:
            hwm[p] = max(hwm.get(p, 0), _status_kib(p, "VmHWM"))
        per_stage[state["stage"]] = max(per_stage.get(state["stage"], 0), rss)
        time.sleep(interval)
    thread.join(timeout=10)
    return {
        "exit_status": proc.returncode,
        "wall_s": round(time.perf_counter() - start, 1),
        "per_stage_polled_rss_gib": {k: round(v * 1024 / GiB, 3) for k, v in per_stage.items()},
        "max_vmhwm_gib": round(max(hwm.values(), default=0) * 1024 / GiB, 3),
        "exact_match_lines": [ln for ln in state["lines"] if re.match(r"^(base|sft|grpo|init)\s+\d", ln)],
        "tail": state["lines"][-5:],
    }


def main(argv=None):
    args = parse_args(argv)
    recipe_args = list(args.recipe_args)
    if "--output_dir" not in recipe_args:
        recipe_args += ["--output_dir", tempfile.mkdtemp(prefix="offline_default_memory_")]
    command = " ".join([args.command, *recipe_args])
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    result = {"command": command, "interval_s": args.interval, "started_utc": started, "cpu_count": os.cpu_count(),
              **run(command, args.interval)}
    print(json.dumps({k: v for k, v in result.items() if k != "tail"}, indent=1))
    if args.out:
        from workload import write_result  # imports torch

        write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
