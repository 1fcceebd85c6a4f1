"""A small training run for the resume tests, launched as a real subprocess (``python resume_run.py OUT ...``).

Tiny random Llama with SmolLM2's tokenizer, a LoRA adapter, a scripted feedback environment, ``max_steps=6`` and
``save_steps=2`` (one rollout per optimizer step, so every checkpoint falls on a rollout boundary), 16 prompts so
that the six steps stay inside one epoch. It writes, for the test to watch and compare:

* ``<out>/progress.json``: ``{"begun": N}`` at the beginning of every optimizer step (N = steps finished so far);
* ``<out>/hanging``: when ``--hang-after-step N`` is given, written from inside an environment step of the rollout of
  the optimizer step that begins after N finished steps (its content is N), after which that environment call
  sleeps so the test can kill the process in the middle of that step;
* ``<out>/stalled``: when ``--stall-save-at N`` is given, written from inside the checkpoint save of step N (after
  the weights, optimizer and RNG states were written, before the save finished), after which the process sleeps so
  the test can kill it in the middle of the save;
* ``<out>/final.safetensors`` and ``<out>/final.json``: the trainable parameters and the log history at the end.

``--resume latest`` resumes with ``resume_from_checkpoint=True`` (the newest complete checkpoint); ``--resume PATH``
from that checkpoint. The trainer is ``MultiTurnGRPOTrainer``, which must have ``AtomicCheckpointMixin`` among its
bases (asserted).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

STALL_SECONDS = 120  # bounded: the test kills the process long before


def build(out: Path, stall_at: int | None, hang_after: int | None = None):
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback

    from trl_multiturn import MultiTurnGRPOConfig, MultiTurnGRPOTrainer
    from trl_multiturn.checkpointing import AtomicCheckpointMixin
    from trl_multiturn.environment import Step
    from trl_multiturn.models import load_tokenizer_offline, tiny_random_model

    torch.set_num_threads(1)  # same arithmetic in every run, and room for the runs that go in parallel

    begun = {"steps": -1}  # finished optimizer steps when the current one began

    class FeedbackEnv:
        def reset(self, example):
            return f"Question: {example['q']}"

        def step(self, action):
            if hang_after is not None and begun["steps"] == hang_after:
                (out / "hanging").write_text(str(begun["steps"]))
                time.sleep(STALL_SECONDS)
            return Step(observation="Invalid. Answer inside answer tags.")

    def vowel_reward(completions, **kwargs):
        return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]

    class Progress(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            begun["steps"] = state.global_step
            tmp = out / "progress.json.tmp"
            tmp.write_text(json.dumps({"begun": state.global_step}))
            os.replace(tmp, out / "progress.json")

    assert issubclass(MultiTurnGRPOTrainer, AtomicCheckpointMixin), "MultiTurnGRPOTrainer lost AtomicCheckpointMixin"

    class Trainer(MultiTurnGRPOTrainer):
        def _save_rng_state(self, output_dir):
            super()._save_rng_state(output_dir)
            if stall_at is not None and self.state.global_step == stall_at:
                (out / "stalled").write_text(str(output_dir))
                time.sleep(STALL_SECONDS)

    tokenizer = load_tokenizer_offline()
    args = MultiTurnGRPOConfig(
        output_dir=str(out),
        num_generations=4,
        prompts_per_rollout=2,
        mini_batch_size=8,
        micro_batch_size=4,
        max_completion_length=32,
        max_tokens_per_turn=8,
        max_turns=2,
        max_steps=6,
        save_steps=2,
        save_strategy="steps",
        logging_steps=1,
        learning_rate=5e-3,
        report_to="none",
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=tiny_random_model(tokenizer),
        args=args,
        train_dataset=Dataset.from_dict({"q": [f"question {i}" for i in range(16)]}),
        environment_factory=FeedbackEnv,
        reward_funcs=[vowel_reward],
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        callbacks=[Progress()],
    )
    return trainer


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir")
    parser.add_argument("--resume", default=None, help="'latest' or a checkpoint path")
    parser.add_argument("--stall-save-at", type=int, default=None)
    parser.add_argument("--hang-after-step", type=int, default=None)
    a = parser.parse_args(argv)
    out = Path(a.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    trainer = build(out, a.stall_save_at, a.hang_after_step)
    resume = True if a.resume == "latest" else a.resume
    trainer.train(resume_from_checkpoint=resume)

    from safetensors.torch import save_file

    params = {k: v.detach().clone().contiguous() for k, v in trainer.model.named_parameters() if v.requires_grad}
    save_file(params, str(out / "final.safetensors"))
    history = [h for h in trainer.state.log_history if "loss/pg_loss" in h]
    (out / "final.json").write_text(json.dumps({"global_step": trainer.state.global_step, "history": history}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
