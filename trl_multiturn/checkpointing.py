"""Crash-safe checkpoints: a checkpoint directory gets its final name only once every file in it is on disk.

The Hugging Face ``Trainer`` writes ``checkpoint-N`` in place, file by file. A run killed during a save (SIGKILL,
out-of-memory killer, pre-emption) leaves a ``checkpoint-N`` with some files missing or cut short, and
``resume_from_checkpoint=True`` (``get_last_checkpoint``) picks exactly that one, because it is the newest.

:class:`AtomicCheckpointMixin` changes one thing: the Trainer's own ``_save_checkpoint`` writes into a staging
directory ``<output_dir>/.staging/checkpoint-N``; then every file is flushed (``fsync``), a manifest of the files and
their sizes is written, and the directory is renamed to ``<output_dir>/checkpoint-N`` in one atomic ``rename``. A
kill at any moment leaves either the complete ``checkpoint-N`` or nothing under that name (the leftover staging
directory is removed at the next save). :func:`latest_complete_checkpoint` finds the newest checkpoint that passes
the manifest check, so even directories written by an older run or copied incompletely are skipped.

The mixin also saves what the Trainer's RNG checkpoint does not cover: the state of the trainer's sampling generator
(``self._sampling_generator``, used to sample rollouts), as ``sampling_rng.safetensors`` (no pickle), and restores
it on resume. With it, a resumed run samples the same rollouts as an uninterrupted one.

Limits of an exact resume (the run always resumes; these only decide whether it is bit-identical):

* the checkpoint must fall on a rollout boundary (``save_steps`` a multiple of the optimizer steps per rollout):
  the buffered rollout of a half-used generation batch is not saved, so a mid-rollout resume samples a new one;
* the resume must stay in the epoch of the checkpoint: TRL's ``RepeatSampler`` draws each epoch's order from one
  generator that is not saved, so after an epoch boundary a resumed run sees the first epoch's order again.

Usage: ``MultiTurnGRPOTrainer`` has the mixin among its bases; any other ``transformers.Trainer`` subclass can too::

    class MyTrainer(AtomicCheckpointMixin, GRPOTrainer): ...
    trainer.train(resume_from_checkpoint=True)     # newest COMPLETE checkpoint in output_dir
    latest_complete_checkpoint("out/")             # the same lookup, for scripts
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

#: the manifest written last, inside a checkpoint, before it is renamed into place
MANIFEST_NAME = "checkpoint_manifest.json"
#: where checkpoints are written before they are complete (inside output_dir, so the rename stays on one filesystem)
STAGING_DIR = ".staging"
#: state of the trainer's sampling generator (one file per process when world_size > 1)
SAMPLING_RNG_NAME = "sampling_rng.safetensors"

_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


# ---------------------------------------------------------------------------------------------------- file helpers
def _fsync_path(path: str | os.PathLike, directory: bool = False) -> None:
    """Flush one file (or a directory entry table) to disk. Directories cannot be opened on Windows: skipped."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except (IsADirectoryError, PermissionError):
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems (and directories on some OSes) refuse fsync; the rename is still atomic
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> list[dict]:
    """Flush every file and directory under ``root``; returns ``[{"path", "size"}]`` for the manifest, sorted."""
    files = []
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            full = Path(dirpath) / name
            _fsync_path(full)
            files.append({"path": full.relative_to(root).as_posix(), "size": full.stat().st_size})
        _fsync_path(dirpath, directory=True)
    return sorted(files, key=lambda f: f["path"])


def write_manifest(checkpoint_dir: str | os.PathLike, step: int) -> Path:
    """Flush ``checkpoint_dir`` and write its manifest (file list and sizes) last, flushed too. Returns its path."""
    root = Path(checkpoint_dir)
    files = [f for f in _fsync_tree(root) if f["path"] != MANIFEST_NAME]
    manifest = root / MANIFEST_NAME
    tmp = root / (MANIFEST_NAME + ".tmp")
    with open(tmp, "w") as fh:
        json.dump({"global_step": int(step), "files": files}, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, manifest)
    _fsync_path(root, directory=True)
    return manifest


def checkpoint_problem(checkpoint_dir: str | os.PathLike) -> str | None:
    """Why ``checkpoint_dir`` cannot be resumed from, or None when it is complete.

    Complete means: a readable manifest whose files all exist with the recorded sizes. A checkpoint written without
    the mixin (no manifest) counts as complete when its ``trainer_state.json`` (the Trainer writes it after the
    weights, optimizer and RNG states) parses and, for a ``checkpoint-N`` directory, names step N.
    """
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return f"{root} is not a directory"
    manifest = root / MANIFEST_NAME
    if manifest.is_file():
        try:
            files = json.loads(manifest.read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"its manifest {manifest} is unreadable ({type(exc).__name__}: {exc})"
        for entry in files:
            path = root / entry["path"]
            if not path.is_file():
                return f"{entry['path']} is missing"
            if path.stat().st_size != entry["size"]:
                return f"{entry['path']} has {path.stat().st_size} bytes, the manifest says {entry['size']}"
        return None
    try:
        saved_step = json.loads((root / "trainer_state.json").read_text()).get("global_step")
    except (OSError, ValueError, AttributeError) as exc:
        return f"it has no manifest and its trainer_state.json is missing or unreadable ({type(exc).__name__})"
    match = _CHECKPOINT_RE.match(root.name)
    if match is not None and saved_step != int(match.group(1)):
        return f"it has no manifest and its trainer_state.json says global_step={saved_step}, not {match.group(1)}"
    return None


def latest_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """Path of the newest complete ``checkpoint-N`` in ``output_dir`` (None when there is none).

    Partial checkpoints (a kill during a save, an interrupted copy) are skipped with a warning that says why; the
    staging directory is never considered.
    """
    root = Path(output_dir)
    if not root.is_dir():
        return None
    candidates = []
    for child in root.iterdir():
        match = _CHECKPOINT_RE.match(child.name)
        if match and child.is_dir():
            candidates.append((int(match.group(1)), child))
    for _, path in sorted(candidates, reverse=True):
        problem = checkpoint_problem(path)
        if problem is None:
            return str(path)
        logger.warning("Skipping incomplete checkpoint %s: %s.", path, problem)
    return None


# ---------------------------------------------------------------------------------------------------- the mixin
class AtomicCheckpointMixin:
    """Mix into a ``transformers.Trainer`` subclass (first in the bases) for crash-safe checkpoints and exact resume.

    Overrides, each calling ``super()``: ``_get_output_dir`` (only while a checkpoint is being written, to point the
    Trainer at the staging directory), ``_save_checkpoint`` (flush, manifest, rename, rotation), ``_save_rng_state``
    and ``_load_rng_state`` (the sampling generator), and ``train`` (``resume_from_checkpoint=True`` resolves to
    :func:`latest_complete_checkpoint`).
    """

    _staging_root: str | None = None

    def _get_output_dir(self, trial):
        run_dir = super()._get_output_dir(trial)
        if self._staging_root is not None:
            return self._staging_root
        return run_dir

    def _save_checkpoint(self, model, trial) -> None:
        run_dir = Path(super()._get_output_dir(trial))
        name = f"checkpoint-{self.state.global_step}"
        staging_root = run_dir / STAGING_DIR
        staged, final = staging_root / name, run_dir / name
        is_writer = self.args.should_save
        if is_writer:
            if staging_root.exists():  # what a kill during an earlier save left behind
                shutil.rmtree(staging_root)
            staging_root.mkdir(parents=True)
        self._barrier()
        self._warn_if_mid_rollout()
        self._staging_root = str(staging_root)
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging_root = None
        best = self.state.best_model_checkpoint
        if best is not None and Path(best).parent == staging_root:
            # The Trainer pointed best_model_checkpoint at the staging copy: point it at the final name, and save the
            # state again so the checkpoint's own trainer_state.json agrees.
            self.state.best_model_checkpoint = str(run_dir / Path(best).name)
            if is_writer:
                self.state.save_to_json(str(staged / "trainer_state.json"))
        self._barrier()  # every process has written its shards and RNG state into the staging directory
        if is_writer:
            write_manifest(staged, self.state.global_step)
            if final.exists():  # a save at the same step again (e.g. the end of training): replace it
                shutil.rmtree(final)
            os.replace(staged, final)
            _fsync_path(run_dir, directory=True)
            shutil.rmtree(staging_root, ignore_errors=True)
            from transformers.trainer_utils import rotate_checkpoints

            rotate_checkpoints(
                output_dir=str(run_dir),
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=False,  # step order; mtimes of renamed directories say nothing about age
            )
        self._barrier()

    def _barrier(self) -> None:
        accelerator = getattr(self, "accelerator", None)
        if accelerator is not None and accelerator.num_processes > 1:
            accelerator.wait_for_everyone()

    def _warn_if_mid_rollout(self) -> None:
        step = getattr(self, "_step", None)
        spg, iters = getattr(self.args, "steps_per_generation", None), getattr(self, "num_iterations", 1)
        if step is None or not spg or getattr(self, "_warned_mid_rollout", False):
            return
        every = spg * iters  # micro-steps between two rollouts
        if step % every != 0:
            per_rollout = every // max(self.args.gradient_accumulation_steps, 1)
            logger.warning(
                "Checkpoint at global step %d falls inside a rollout (save_steps=%s; %d optimizer steps per rollout): "
                "a resume from it samples a new rollout instead of replaying the rest of this one. Use a save_steps "
                "that is a multiple of %d for an exact resume.",
                self.state.global_step, self.args.save_steps, per_rollout, per_rollout,
            )
            self._warned_mid_rollout = True

    # ---- the sampling generator ----
    def _sampling_rng_file(self, checkpoint: str) -> Path:
        if self.args.world_size > 1:
            stem, ext = SAMPLING_RNG_NAME.split(".", 1)
            return Path(checkpoint) / f"{stem}_{self.args.process_index}.{ext}"
        return Path(checkpoint) / SAMPLING_RNG_NAME

    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        generator = getattr(self, "_sampling_generator", None)
        if generator is not None:
            from safetensors.torch import save_file

            Path(output_dir).mkdir(parents=True, exist_ok=True)
            save_file({"state": generator.get_state()}, str(self._sampling_rng_file(output_dir)))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        super()._load_rng_state(checkpoint)
        generator = getattr(self, "_sampling_generator", None)
        if checkpoint is None or generator is None:
            return
        path = self._sampling_rng_file(checkpoint)
        if not path.is_file():
            logger.warning(
                "%s has no %s: the rollout sampler restarts from seed=%s, so the resumed run samples different "
                "rollouts than an uninterrupted one would.", checkpoint, path.name, self.args.seed,
            )
            return
        from safetensors.torch import load_file

        generator.set_state(load_file(str(path))["state"])

    # ---- resume ----
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if resume_from_checkpoint is True:
            found = latest_complete_checkpoint(self.args.output_dir)
            if found is None:
                raise ValueError(
                    f"resume_from_checkpoint=True but output_dir={self.args.output_dir!r} holds no complete "
                    "checkpoint-N directory. Pass a checkpoint path, or start without resume_from_checkpoint."
                )
            resume_from_checkpoint = found
        elif resume_from_checkpoint:
            problem = checkpoint_problem(resume_from_checkpoint)
            if problem is not None:
                found = latest_complete_checkpoint(Path(resume_from_checkpoint).parent)
                raise ValueError(
                    f"resume_from_checkpoint={str(resume_from_checkpoint)!r} is incomplete: {problem}. "
                    + (f"The newest complete one is {found!r}." if found else "No complete checkpoint is next to it.")
                )
        return super().train(resume_from_checkpoint, *args, **kwargs)
