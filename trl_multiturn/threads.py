"""CPU threads for torch: a run on CPU computes on every core it may use, unless someone chose a number.

`accelerate launch` starts its processes with `OMP_NUM_THREADS` set: to the user's `--num_cpu_threads_per_process`
or `OMP_NUM_THREADS` when given, otherwise to 1 (unless `--cpu`). On a machine without a GPU a one-process run then
computes on one core of many. The launched process cannot tell that 1 apart from a user's 1 by its own environment,
so it asks the launcher (its parent process, through /proc on Linux): if the launcher was given neither
`--num_cpu_threads_per_process` nor `OMP_NUM_THREADS`, the 1 is accelerate's default and is replaced by this
process's share of the cores. Any other explicit setting is kept. GPU runs are left as they are.

    from trl_multiturn.threads import configure_cpu_threads
    configure_cpu_threads()        # prints e.g. "torch: 2 CPU threads (accelerate launch's default OMP_NUM_THREADS=1 ...)"
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

# Set by every `accelerate launch` launcher (simple, multi-GPU, DeepSpeed, FSDP) in the processes it starts.
ACCELERATE_LAUNCH_MARKER = "ACCELERATE_DYNAMO_BACKEND"
LAUNCHER_FLAG = "--num_cpu_threads_per_process"


@dataclass(frozen=True)
class ThreadChoice:
    """How many intra-op threads torch gets, and why (the reason is logged)."""

    threads: int
    reason: str


def usable_cores() -> int:
    """Physical cores this process may run on: the CPU affinity mask, capped at the physical core count."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        allowed = os.cpu_count() or 1
    try:
        import psutil

        physical = psutil.cpu_count(logical=False)
    except ImportError:
        physical = None
    return max(1, min(allowed, physical or allowed))


def launcher_setting(pid: int | None = None) -> str | None:
    """The thread count the user gave the launcher (process ``pid``, default: the parent), or None if none was given.

    Reads ``--num_cpu_threads_per_process N`` from its command line and ``OMP_NUM_THREADS`` from the environment it
    was started with. None also when /proc cannot be read (not Linux).
    """
    pid = os.getppid() if pid is None else pid
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    for i, arg in enumerate(argv):
        if arg == LAUNCHER_FLAG and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(LAUNCHER_FLAG + "="):
            return arg.split("=", 1)[1]
    for entry in environ:
        if entry.startswith("OMP_NUM_THREADS="):
            return entry.split("=", 1)[1]
    return None


def choose_cpu_threads(env: Mapping[str, str], cores: int, launcher: str | None) -> ThreadChoice:
    """The thread count for a CPU run, from the environment ``env``, the ``cores`` this process may use and what the
    launcher was given (``launcher_setting()``); pure, so that every case is testable."""
    local = int(env.get("LOCAL_WORLD_SIZE") or 1)  # processes on this machine (set by torchrun / accelerate)
    share = max(1, cores // local)
    where = f"{cores} usable cores" + (f" / {local} processes on this machine" if local > 1 else "")
    value = (env.get("OMP_NUM_THREADS") or "").strip()
    if not value:
        return ThreadChoice(share, f"{where}; OMP_NUM_THREADS unset")
    if value == "1" and ACCELERATE_LAUNCH_MARKER in env and launcher is None:
        return ThreadChoice(share, f"{where}; OMP_NUM_THREADS=1 was accelerate launch's default, not a choice: "
                                   f"pass accelerate launch {LAUNCHER_FLAG} N to choose N")
    try:
        threads = int(value)
    except ValueError:
        threads = 0
    if threads < 1:
        raise ValueError(f"OMP_NUM_THREADS={value!r} is not a positive integer: set it to a thread count (e.g. "
                         f"{share}) or unset it to use {share}.")
    return ThreadChoice(threads, f"OMP_NUM_THREADS={value} as set")


def configure_cpu_threads(log=print) -> ThreadChoice | None:
    """On CPU: choose the thread count (``choose_cpu_threads``), apply it to torch and to ``OMP_NUM_THREADS`` (which
    child processes inherit), and log it. On GPU: nothing is changed and None is returned."""
    import torch

    on_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes") or not torch.cuda.is_available()
    if not on_cpu:
        return None
    choice = choose_cpu_threads(os.environ, usable_cores(), launcher_setting())
    torch.set_num_threads(choice.threads)
    os.environ["OMP_NUM_THREADS"] = str(choice.threads)
    if log is not None:
        log(f"torch: {choice.threads} CPU threads ({choice.reason})")
    return choice
