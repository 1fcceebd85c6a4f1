"""CPU threads: accelerate launch's default OMP_NUM_THREADS=1 is replaced by this process's share of the cores, an
explicit setting (OMP_NUM_THREADS before launching, --num_cpu_threads_per_process) is kept, and the choice is logged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trl_multiturn.threads import ACCELERATE_LAUNCH_MARKER, choose_cpu_threads, launcher_setting, usable_cores

REPO = Path(__file__).resolve().parents[1]
UNDER_ACCELERATE = {ACCELERATE_LAUNCH_MARKER: "no", "ACCELERATE_USE_CPU": "False"}


def test_accelerate_default_of_one_thread_becomes_every_core():
    choice = choose_cpu_threads({**UNDER_ACCELERATE, "OMP_NUM_THREADS": "1"}, cores=8, launcher=None)
    assert choice.threads == 8 and "accelerate launch's default" in choice.reason


def test_an_explicit_setting_is_kept():
    # the user gave the launcher OMP_NUM_THREADS=1 or --num_cpu_threads_per_process 1
    assert choose_cpu_threads({**UNDER_ACCELERATE, "OMP_NUM_THREADS": "1"}, cores=8, launcher="1").threads == 1
    # a number other than accelerate's default 1 is always someone's choice
    assert choose_cpu_threads({**UNDER_ACCELERATE, "OMP_NUM_THREADS": "3"}, cores=8, launcher=None).threads == 3
    # without accelerate, OMP_NUM_THREADS is the user's
    assert choose_cpu_threads({"OMP_NUM_THREADS": "1"}, cores=8, launcher=None).threads == 1


def test_cores_are_shared_between_the_processes_of_a_machine():
    assert choose_cpu_threads({}, cores=8, launcher=None).threads == 8
    env = {**UNDER_ACCELERATE, "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "3"}
    assert choose_cpu_threads(env, cores=8, launcher=None).threads == 2  # 8 // 3
    assert choose_cpu_threads({"LOCAL_WORLD_SIZE": "4"}, cores=2, launcher=None).threads == 1


def test_a_bad_value_is_named():
    with pytest.raises(ValueError, match="OMP_NUM_THREADS='two'"):
        choose_cpu_threads({"OMP_NUM_THREADS": "two"}, cores=2, launcher=None)


def test_launcher_setting_reads_the_parent_process():
    if not Path(f"/proc/{os.getpid()}/environ").exists():
        pytest.skip("needs /proc (Linux)")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    code = "import sys, time; print('ready', flush=True); time.sleep(30)"
    for extra_env, argv, expected in (
        ({}, [], None),
        ({"OMP_NUM_THREADS": "1"}, [], "1"),
        ({}, ["--num_cpu_threads_per_process", "5"], "5"),
        ({}, ["--num_cpu_threads_per_process=6"], "6"),
    ):
        proc = subprocess.Popen([sys.executable, "-c", code, *argv], env={**env, **extra_env}, stdout=subprocess.PIPE,
                                text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"  # exec'd: /proc shows its own command line
            assert launcher_setting(proc.pid) == expected, (extra_env, argv)
        finally:
            proc.kill()
            proc.communicate()


CHILD = """
import torch
from trl_multiturn.threads import configure_cpu_threads
configure_cpu_threads()
print("threads in use:", torch.get_num_threads())
"""


def _accelerate_launch(tmp_path, launch_args=(), extra_env=None):
    """Runs CHILD under `accelerate launch --num_processes 1` with a CPU-only view; returns its stdout."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE")}
    env.update({"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO), **(extra_env or {})})
    accelerate = [sys.executable, "-m", "accelerate.commands.launch"]
    proc = subprocess.run([*accelerate, "--num_processes", "1", *launch_args, str(script)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_under_accelerate_launch_every_core_is_used_and_logged(tmp_path):
    cores = usable_cores()
    out = _accelerate_launch(tmp_path)
    assert f"torch: {cores} CPU threads" in out and "accelerate launch's default" in out, out
    assert f"threads in use: {cores}" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("how", ["OMP_NUM_THREADS", "--num_cpu_threads_per_process"])
def test_under_accelerate_launch_an_explicit_one_is_kept(tmp_path, how):
    if how == "OMP_NUM_THREADS":
        out = _accelerate_launch(tmp_path, extra_env={"OMP_NUM_THREADS": "1"})
    else:
        out = _accelerate_launch(tmp_path, launch_args=["--num_cpu_threads_per_process", "1"])
    assert "torch: 1 CPU threads (OMP_NUM_THREADS=1 as set)" in out, out
    assert "threads in use: 1" in out, out


@pytest.mark.slow
def test_the_evaluation_recipe_under_accelerate_launch_logs_every_core(tmp_path, smollm2_tokenizer, tiny_model_factory):
    """The recipes call configure_cpu_threads after parsing their arguments: the evaluation recipe, launched as the
    docs launch the training recipe, prints the thread count it runs with (every usable core, not accelerate's 1)."""
    model_dir = tmp_path / "tiny"
    tiny_model_factory(hidden_size=32, num_layers=2).save_pretrained(model_dir)
    smollm2_tokenizer.save_pretrained(model_dir)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE")}
    env.update({"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)})
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1",
         str(REPO / "recipes" / "evaluate_search_agent.py"), "--model_name_or_path", str(model_dir),
         "--offline_entities", "20", "--num_eval_questions", "2", "--eval_batch_size", "2",
         "--eval_max_tokens_per_turn", "4", "--max_turns", "1", "--max_completion_length", "64"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"torch: {usable_cores()} CPU threads (" in proc.stdout, proc.stdout[-2000:]
    assert "on 2 test questions" in proc.stdout
