"""Resume after a SIGKILL: real training subprocesses (``resume_run.py``), real kills, then a comparison with a run
that was never interrupted.

Two subprocesses start side by side: ``killed`` is SIGKILLed while its step 5 is running (after checkpoint-4 was
saved: one of its environment calls in the rollout of step 5 hangs until the kill, so the kill lands inside step 5
by construction, not after a sleep); ``stalled`` is SIGKILLed in the middle of writing checkpoint-4 (its trainer
sleeps inside the save, after the weights, optimizer and RNG files were written). Then, in this process and with the same script, a ``reference`` run
trains six steps uninterrupted and both interrupted runs resume with ``resume_from_checkpoint=True``. Proven:

* a kill during a save leaves no ``checkpoint-4`` at all (only the staging copy), so both our
  :func:`latest_complete_checkpoint` and the Trainer's own ``get_last_checkpoint`` pick checkpoint-2;
* each resumed run ends at global step 6 with trainable (LoRA) parameters, optimizer state, Trainer RNG state and
  rollout-sampling RNG state bit-identical to the reference, and logs the same losses and rewards for the steps it
  re-ran;
* a checkpoint that is incomplete (missing files, a file cut short) is skipped by the lookup and refused when passed
  explicitly, with the newest complete one named in the error.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers.trainer_utils import get_last_checkpoint

from trl_multiturn.checkpointing import (
    MANIFEST_NAME,
    SAMPLING_RNG_NAME,
    STAGING_DIR,
    checkpoint_problem,
    latest_complete_checkpoint,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).with_name("resume_run.py")
WAVE_DEADLINE_S = 420  # bounded waits: each wave of subprocesses must finish within this


class Run:
    """One training subprocess writing into ``out`` (its output also goes to ``out.log``)."""

    def __init__(self, out: Path, *args: str):
        self.out = out
        self.log = out.with_suffix(".log")
        out.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, str(SCRIPT), str(out), *args], stdout=fh, stderr=subprocess.STDOUT, env=os.environ.copy()
            )

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def begun(self) -> int:
        try:
            return json.loads((self.out / "progress.json").read_text())["begun"]
        except (OSError, ValueError, KeyError):
            return -1

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=60)


def wait_until(condition, runs, what: str) -> None:
    """Poll ``condition`` until true; fail with the runs' logs if a run exits before or the deadline passes."""
    deadline = time.monotonic() + WAVE_DEADLINE_S
    while not condition():
        for run in runs:
            if run.proc.poll() not in (None, 0):
                pytest.fail(f"{run.out.name} exited with {run.proc.returncode} while waiting for {what}:\n{run.tail()}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {WAVE_DEADLINE_S} s waiting for {what}:\n" + "\n".join(r.tail() for r in runs))
        time.sleep(0.2)


def run_in_process(*argv: str) -> None:
    """``resume_run.py`` in this process (same code as the subprocesses, without another interpreter start)."""
    import resume_run

    assert resume_run.main([*argv]) == 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    killed = Run(root / "killed", "--hang-after-step", "4")
    stalled = Run(root / "stalled", "--stall-save-at", "4")
    outcome: dict = {}

    def watch_and_kill() -> None:
        """In a thread: kill each subprocess at its moment, while this process trains the reference."""
        try:
            wait_until(lambda: (killed.out / "hanging").exists(), [killed], "killed: the rollout of step 5")
            outcome["killed_at"] = killed.begun()
            killed.kill()
            wait_until(lambda: (stalled.out / "stalled").exists(), [stalled], "stalled: the save of checkpoint-4")
            stalled.kill()
        except BaseException as exc:  # pytest.fail raises an exception that a thread cannot report by itself
            outcome["error"] = exc

    watcher = threading.Thread(target=watch_and_kill, name="resume-watcher", daemon=True)
    watcher.start()
    try:
        run_in_process(str(root / "reference"))  # the uninterrupted run, meanwhile, with the same script
        watcher.join(timeout=WAVE_DEADLINE_S + 60)
        assert not watcher.is_alive(), "the watcher did not finish"
    finally:
        killed.kill()
        stalled.kill()
    if "error" in outcome:
        raise outcome["error"]
    before = {
        "killed": sorted(p.name for p in killed.out.iterdir()),
        "stalled": sorted(p.name for p in stalled.out.iterdir()),
        "stalled_staging": sorted(p.name for p in (stalled.out / STAGING_DIR / "checkpoint-4").iterdir()),
        "stalled_latest": latest_complete_checkpoint(stalled.out),
        "stalled_hf_latest": get_last_checkpoint(str(stalled.out)),
        "killed_latest": latest_complete_checkpoint(killed.out),
        "killed_at": outcome["killed_at"],
    }
    run_in_process(str(killed.out), "--resume", "latest")
    run_in_process(str(stalled.out), "--resume", "latest")
    return {"reference": root / "reference", "killed": killed.out, "stalled": stalled.out, "before": before}


def test_kill_during_a_save_leaves_no_partial_checkpoint_under_its_name(runs):
    before = runs["before"]
    assert "checkpoint-2" in before["stalled"] and "checkpoint-4" not in before["stalled"]
    assert STAGING_DIR in before["stalled"]
    # the staging copy really is partial: weights and optimizer written, trainer state and manifest not
    assert {"adapter_model.safetensors", "optimizer.pt", SAMPLING_RNG_NAME} <= set(before["stalled_staging"])
    assert "trainer_state.json" not in before["stalled_staging"] and MANIFEST_NAME not in before["stalled_staging"]
    assert before["stalled_latest"] == str(runs["stalled"] / "checkpoint-2")
    assert before["stalled_hf_latest"] == str(runs["stalled"] / "checkpoint-2")  # plain Trainer lookup is safe too


def test_kill_mid_training_keeps_the_last_checkpoint(runs):
    before = runs["before"]
    assert {"checkpoint-2", "checkpoint-4"} <= set(before["killed"]) and "checkpoint-6" not in before["killed"]
    assert before["killed_at"] == 4  # killed while step 5 was running
    assert before["killed_latest"] == str(runs["killed"] / "checkpoint-4")


@pytest.mark.parametrize("name", ["killed", "stalled"])
def test_resumed_run_matches_the_uninterrupted_one(runs, name):
    ref, out = runs["reference"], runs[name]
    final = json.loads((out / "final.json").read_text())
    ref_final = json.loads((ref / "final.json").read_text())
    assert final["global_step"] == ref_final["global_step"] == 6
    # adapter: every trainable (LoRA) parameter bit-identical
    mine, theirs = load_file(out / "final.safetensors"), load_file(ref / "final.safetensors")
    assert mine.keys() == theirs.keys() and any("lora_" in k for k in mine)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    # the final checkpoint: optimizer moments, Trainer RNG state and rollout-sampling RNG state
    a, b = out / "checkpoint-6", ref / "checkpoint-6"
    assert checkpoint_problem(a) is None
    opt_a = torch.load(a / "optimizer.pt", weights_only=True)
    opt_b = torch.load(b / "optimizer.pt", weights_only=True)
    assert opt_a["state"].keys() == opt_b["state"].keys() and opt_a["state"]
    for key, state in opt_a["state"].items():
        assert all(torch.equal(state[k], opt_b["state"][key][k]) for k in state)
    rng_a = torch.load(a / "rng_state.pth", weights_only=False)  # our own file, written by this test's runs
    rng_b = torch.load(b / "rng_state.pth", weights_only=False)
    assert torch.equal(rng_a["cpu"], rng_b["cpu"])
    assert torch.equal(load_file(a / SAMPLING_RNG_NAME)["state"], load_file(b / SAMPLING_RNG_NAME)["state"])
    # the steps it re-ran logged what the reference logged
    ref_by_step = {h["step"]: h for h in ref_final["history"]}
    for h in final["history"]:
        for key in ("loss/pg_loss", "rollout/reward_mean", "grad_norm"):
            assert h[key] == ref_by_step[h["step"]][key], (name, h["step"], key)


def test_resume_cleans_the_staging_left_by_a_kill(runs):
    assert not (runs["stalled"] / STAGING_DIR).exists()
    assert sorted(p.name for p in runs["stalled"].glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4",
                                                                             "checkpoint-6"]


# ---------------------------------------------------------------------------------------------------- the lookup
def test_incomplete_checkpoints_are_skipped_and_refused(runs, tmp_path, smollm2_tokenizer):
    out = tmp_path / "out"
    out.mkdir()
    for step in (2, 4):
        shutil.copytree(runs["reference"] / f"checkpoint-{step}", out / f"checkpoint-{step}")
    assert latest_complete_checkpoint(out) == str(out / "checkpoint-4")
    # a file cut short after the manifest was written (an interrupted copy): caught by the sizes
    weights = out / "checkpoint-4" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert "adapter_model.safetensors has 100 bytes" in checkpoint_problem(out / "checkpoint-4")
    assert latest_complete_checkpoint(out) == str(out / "checkpoint-2")
    # a checkpoint left by a trainer without the manifest, killed before its trainer state was written
    legacy = out / "checkpoint-6"
    shutil.copytree(runs["reference"] / "checkpoint-6", legacy)
    (legacy / MANIFEST_NAME).unlink()
    (legacy / "trainer_state.json").unlink()
    assert get_last_checkpoint(str(out)) == str(legacy)  # what the Trainer alone would resume from
    assert "trainer_state.json is missing" in checkpoint_problem(legacy)
    assert latest_complete_checkpoint(out) == str(out / "checkpoint-2")

    # the trainer refuses it when it is passed explicitly, naming the one to use
    from trl_multiturn import MultiTurnGRPOTrainer
    from trl_multiturn.checkpointing import AtomicCheckpointMixin
    from trl_multiturn.models import tiny_random_model

    from reliability_helpers import FaultEnv, fault_dataset, tiny_args

    assert issubclass(MultiTurnGRPOTrainer, AtomicCheckpointMixin)
    trainer = MultiTurnGRPOTrainer(
        model=tiny_random_model(smollm2_tokenizer), args=tiny_args(tmp_path, output_dir=str(out)),
        train_dataset=fault_dataset(["ok"] * 2), environment_factory=FaultEnv, processing_class=smollm2_tokenizer,
    )
    with pytest.raises(ValueError, match=r"checkpoint-6' is incomplete: it has no manifest.*newest complete one is "
                                         r".*checkpoint-2"):
        trainer.train(resume_from_checkpoint=str(legacy))
    shutil.rmtree(out)
    out.mkdir()
    with pytest.raises(ValueError, match=r"resume_from_checkpoint=True but output_dir=.* holds no complete"):
        trainer.train(resume_from_checkpoint=True)


def test_checkpoints_rotate_and_a_save_inside_a_rollout_warns(tmp_path, smollm2_tokenizer, caplog):
    """Two optimizer steps per rollout, a save after every step, at most two checkpoints kept."""
    import logging

    from trl_multiturn import MultiTurnGRPOTrainer
    from trl_multiturn.checkpointing import AtomicCheckpointMixin
    from trl_multiturn.models import tiny_random_model

    from reliability_helpers import FaultEnv, fault_dataset, tiny_args, vowel_reward

    assert issubclass(MultiTurnGRPOTrainer, AtomicCheckpointMixin)
    args = tiny_args(tmp_path, mini_batch_size=2, micro_batch_size=2, max_steps=3, save_strategy="steps",
                     save_steps=1, save_total_limit=2)
    trainer = MultiTurnGRPOTrainer(
        model=tiny_random_model(smollm2_tokenizer), args=args, train_dataset=fault_dataset(["ok"] * 4),
        environment_factory=FaultEnv, reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer,
    )
    with caplog.at_level(logging.WARNING, logger="trl_multiturn.checkpointing"):
        trainer.train()
    out = Path(args.output_dir)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert not (out / STAGING_DIR).exists()
    assert all(checkpoint_problem(p) is None for p in out.glob("checkpoint-*"))
    (warning,) = [r.getMessage() for r in caplog.records if "inside a rollout" in r.getMessage()]
    assert "global step 1" in warning and "save_steps that is a multiple of 2" in warning
