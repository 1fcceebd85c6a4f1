"""Whole GRPO optimizer steps: TRL 1.16's own multi-turn path vs this package's trainer, on the same work.

    python benchmarks/grpo_step.py --group-size 4        # CPU: SmolLM2-135M + LoRA r=16, 2 prompts x G=4 x 3 turns
    python benchmarks/grpo_step.py --group-size 8 --micro-batch 4 --out benchmarks/results/grpo_step_g8.json
    python benchmarks/grpo_step.py --device cuda --dtype bf16 --model random-1.7b --prompts 8 --group-size 8
    python benchmarks/grpo_step.py --model random-tiny --group-size 2 --warmup 0 --steps 1 --repeats 1  # smoke

Both sides train on the multi-turn search workload of ``benchmarks/workload.py`` through ``trainer.train()``, from
the same initial weights: the same model, prompts, chat template, tool schema, BM25 environment class, forced tool
calls (every trajectory takes the same turns and writes the same tokens on both sides: checked), reward
(``train_step.position_reward``, which varies inside each group, plus the environment's own ``get_reward``), group
size G, B prompts per step, token budget (``max_completion_length``, actions and observations together), temperature,
LoRA adapter (same r, alpha, target modules, no dropout), learning rate, ``beta=0``, ``disable_dropout=True``,
gradient checkpointing (TRL's default, on), ``loss_type`` and one optimizer step per rollout of B x G trajectories
(micro-batches of ``--micro-batch``, ``B*G / micro-batch`` accumulation steps, one GRPO iteration):

(a) TRL: ``GRPOTrainer(environment_factory=SearchTool, reward_funcs=[position_reward])`` with
    ``per_device_train_batch_size = micro-batch``, ``gradient_accumulation_steps = steps_per_generation = B*G /
    micro-batch``, ``num_iterations=1``, ``max_tool_calling_iterations = turns - 1``. Its rollout is
    ``_generate`` -> ``_tool_call_loop`` (``model.generate`` per turn, the whole history prefilled again each turn);
    the forced tool calls reach it as a ``LogitsProcessor`` added to every ``model.generate`` call, as in
    ``benchmarks/rollout.py`` (TRL's ``generation_kwargs`` build a ``GenerationConfig``, which cannot carry one).
(b) ours: ``MultiTurnGRPOTrainer(environment_factory=SearchTool, protocol=ChatToolProtocol(...))`` with
    ``prompts_per_rollout=B``, ``mini_batch_size=B*G``, ``micro_batch_size`` = the same micro-batch (which gives
    the same TRL fields), ``max_turns = turns``; its rollout is ``MultiTurnRollout`` + ``TransformersGenerator``
    (K/V kept across turns), the forced tool calls passed as the generator's ``logits_processor``.

What is timed: a ``TrainerCallback`` takes ``time.perf_counter()`` at ``on_step_begin`` and ``on_step_end`` of every
optimizer step (CUDA synchronized). transformers' loop calls ``on_step_begin`` before the step's first
``training_step``, and both trainers roll out inside that first ``training_step`` (``_prepare_inputs`` ->
``_generate_and_score_completions``), so on BOTH sides the interval holds the whole step: rollout (environment
resets and tool calls included), rewards and advantages, the forward + backward of every micro-batch, gradient
clipping and the optimizer update. This is checked, not assumed: the calls to ``_generate_and_score_completions``
are timed too, and the script reports (and the JSON records, ``rollout_inside_step``) that every step holds exactly
one of them. Between ``on_step_end`` and the next ``on_step_begin`` only the logging and the fetch of the next
prompts happen; the ``on_step_end`` -> ``on_step_end`` interval is reported as well (``cycle_s``). Old log-probs:
with one optimizer step per rollout and one iteration, neither trainer runs a separate pi_old pass (both use the
loss forward's detached log-probs, as TRL does in this configuration), so there is none to time; with beta=0 there
is no reference pass either. Ours runs its one-time layout checks (packing / shared prompt, no gradient) in its
first step; that step is a warm-up step and is discarded with the default ``--warmup 1``.

Each round builds a fresh trainer per side from a deep copy of the loaded weights and runs ``warmup + steps``
optimizer steps; the first ``--warmup`` are discarded. Sides alternate which goes first over ``--repeats`` rounds.
Reported per side: median step time, its rollout part (TRL ``_generate``, ours ``_run_rollout``) and the rest,
the per-round ratios TRL / ours of the median step times, trajectories, turns, generated and observation tokens
per step, trained tokens (prompt + completion tokens of the batch, and the positions the gradient forwards
computed, padding included), the first step's ``loss`` and ``grad_norm`` of each side (the same batch on the same
weights: the loss is ~0 on-policy, as the ratio is 1 and the advantages of a group sum to zero), and peak memory
(CPU: the process's ``VmHWM``, reset through ``/proc/self/clear_refs`` right before ``train()``, as
``benchmarks/memory.py`` does, minus the resident set at that moment; CUDA: ``torch.cuda.max_memory_allocated``
after ``reset_peak_memory_stats``). One process holds both sides: memory freed by an earlier run may stay in the process
(allocator caches), so CPU peaks of later runs are lower bounds; compare them across sides of the same round.

Where the two sides cannot do exactly the same: (1) the loss aggregation. ``--loss-type`` is given to both;
"grpo" (default; mean over trajectories of each one's token mean) and "dapo" (token mean over the optimizer step)
and "dr_grpo" compute the same objective on both sides for equal-sized micro-batches (TRL normalizes per micro-batch
and divides by the accumulation steps, ours uses mini-batch-global normalizers); TRL's "bnpo" (token mean per
micro-batch) has no equal here and is not offered. (2) Advantages: TRL divides by ``std + 1e-4``, ours by ``std +
advantage_eps``; ours is given ``advantage_eps=1e-4`` to match. (3) Turns: TRL counts tool-calling iterations after
the first generation, ours counts actions; ``max_tool_calling_iterations = turns - 1`` and ``max_turns = turns``
allow the same turns, and the forced scripts end every trajectory with an answer at turn ``--turns``. (4) TRL has no
per-turn token cap; ours is left without one (``max_tokens_per_turn=None``). (5) Micro-batches: TRL slices the
shuffled rollout in order, ours sorts and balances them and computes each group's prompt once (its defaults), so
the positions its forwards compute differ: that is part of what is measured. (6) Ours logs rollout metrics TRL does
not. (7) The gradient itself is float noise on both sides: the forced scripts are a function of the prompt, so the
G members of a group write the same text, and with advantages that sum to zero over the group their policy
gradients cancel (``grad_norm`` ~1e-8). The compute of the step is that of a real one (every forward and backward
runs in full, and the optimizer updates the adapter), but the first-step gradient norms cannot be compared beyond
"both ~0"; the first-step loss (~0 on both) and the identical token ids are what show that both trained on the same
batch. (8) Because the members of a group write the same text, our prefix-tree forward would compute a group's
completions once (it lays out a run that rows continue alike past their prompt once): a saving that real samples,
which diverge right after the prompt, do not give. Ours is therefore run with that deeper sharing off and shares
the prompt only (``--share-past-prompts`` turns it back on, to see the identical-text case). The work check compares, per step, the trajectories, their turns, generated and observation tokens and their
token ids; a difference is printed and recorded (``same_work``), not hidden.

Results go to ``--out`` as JSON (the command, machine, thread counts and versions included).
"""

from __future__ import annotations

import argparse
import copy
import contextlib
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workload as W  # noqa: E402

W.offline_env()

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import memory as M  # noqa: E402  (VmHWM reset and read)
from train_step import position_reward  # noqa: E402

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SIDES = ("trl", "ours")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepMeter(TrainerCallback):
    """Per optimizer step: ``perf_counter`` at ``on_step_begin`` / ``on_step_end``, the positions computed by the
    model's forwards (with gradient: the training forwards; without: generation and scoring) and, of those, the
    positions projected onto the vocabulary by the LM head (generation: ``logits_to_keep`` per row, or every
    position; the fused log-prob head of both trainers: the rows TRL's ``_ChunkedLogProbFunction`` is given), the
    logged loss. Also records the intervals of the trainer's rollout calls (see :meth:`wrap`)."""

    def __init__(self, model):
        from trl.trainer import utils as trl_utils

        self.begin, self.end, self.logs = [], [], []
        self.score, self.rollout, self.work = [], [], []  # (start, end) of _generate_and_score / the rollout
        self.grad_positions, self.nograd_positions = [], []
        self.grad_head_positions, self.nograd_head_positions = [], []
        self._grad = self._nograd = self._head_grad = self._head_nograd = 0
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)
        self._trl_utils, self._head = trl_utils, trl_utils._ChunkedLogProbFunction
        meter = self

        class CountedHead:  # the fused head looks this name up at every call, on both sides
            @staticmethod
            def apply(hidden, *rest):
                meter._count_head(hidden.size(0))
                return meter._head.apply(hidden, *rest)

        trl_utils._ChunkedLogProbFunction = CountedHead

    def _count_head(self, rows: int) -> None:
        if torch.is_grad_enabled():
            self._head_grad += rows
        else:
            self._head_nograd += rows

    def _hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            return
        if torch.is_grad_enabled():
            self._grad += ids.numel()
        else:
            self._nograd += ids.numel()
        if not kwargs.get("fused_lm_head"):  # the model's own head: logits_to_keep positions per row, or all
            keep = kwargs.get("logits_to_keep")
            self._count_head(ids.size(0) * keep if isinstance(keep, int) and keep > 0 else ids.numel())

    def on_step_begin(self, args, state, control, **kwargs):
        _sync()
        self.begin.append(time.perf_counter())
        self._grad = self._nograd = self._head_grad = self._head_nograd = 0

    def on_step_end(self, args, state, control, **kwargs):
        _sync()
        self.end.append(time.perf_counter())
        self.grad_positions.append(self._grad)
        self.nograd_positions.append(self._nograd)
        self.grad_head_positions.append(self._head_grad)
        self.nograd_head_positions.append(self._head_nograd)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logs.append({k: logs.get(k) for k in ("loss", "grad_norm", "step_time")})

    def wrap(self, trainer, rollout_name: str, summarize) -> None:
        """Time ``trainer._generate_and_score_completions`` and the rollout method ``rollout_name`` (its result
        summarized per trajectory by ``summarize``), through instance attributes."""
        score, rollout = trainer._generate_and_score_completions, getattr(trainer, rollout_name)

        def timed_score(*a, **k):
            _sync()
            start = time.perf_counter()
            out = score(*a, **k)
            _sync()
            self.score.append((start, time.perf_counter()))
            return out

        def timed_rollout(*a, **k):
            start = time.perf_counter()
            out = rollout(*a, **k)
            _sync()
            self.rollout.append((start, time.perf_counter()))
            self.work.append(summarize(out))
            return out

        trainer._generate_and_score_completions = timed_score
        setattr(trainer, rollout_name, timed_rollout)

    def close(self) -> None:
        self.handle.remove()
        self._trl_utils._ChunkedLogProbFunction = self._head


def trl_work(result) -> list[dict]:
    """Per trajectory of TRL's ``_generate`` result: token ids, turns (runs of generated tokens), token counts."""
    prompt_ids, completion_ids, tool_mask = result[0], result[1], result[2]
    out = []
    for p, c, m in zip(prompt_ids, completion_ids, tool_mask):
        turns = sum(1 for j, v in enumerate(m) if v == 1 and (j == 0 or m[j - 1] == 0))
        out.append({"ids": list(p) + list(c), "turns": turns, "generated": int(sum(m)),
                    "observation": len(m) - int(sum(m)), "prompt": len(p), "completion": len(c)})
    return out


def ours_work(trajs) -> list[dict]:
    return [{"ids": list(t.prompt_ids) + list(t.completion_ids), "turns": t.num_turns,
             "generated": t.num_action_tokens, "observation": t.num_observation_tokens,
             "prompt": len(t.prompt_ids), "completion": len(t.completion_ids)} for t in trajs]


def shared_config(args, out_dir: str) -> dict:
    """The config fields both trainers get with the same value."""
    return dict(
        output_dir=out_dir, num_generations=args.group_size, max_completion_length=args.max_completion_length,
        temperature=args.temperature, learning_rate=args.learning_rate, max_steps=args.warmup + args.steps,
        beta=0.0, num_iterations=1, loss_type=args.loss_type, scale_rewards="group", disable_dropout=True,
        logging_steps=1, report_to="none",
        save_strategy="no", use_cpu=args.device == "cpu", bf16=args.dtype == "bf16", fp16=args.dtype == "fp16",
        seed=args.seed,
        # TRL's default is gradient checkpointing on; the field is only passed to turn it off (passing it at all
        # makes transformers warn that it is deprecated in favour of activation_checkpointing)
        **({"gradient_checkpointing": False} if args.no_gradient_checkpointing else {}),
    )


def peft_config(args):
    if not args.lora_r:
        return None
    from peft import LoraConfig

    return LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0, target_modules=LORA_TARGETS,
                      task_type="CAUSAL_LM")


def build_trl(model, tok, dataset, env_class, script, args, out_dir):
    from trl import GRPOConfig, GRPOTrainer

    micro_steps = args.prompts * args.group_size // args.micro_batch
    config = GRPOConfig(
        **shared_config(args, out_dir), per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=micro_steps, steps_per_generation=micro_steps,
        max_tool_calling_iterations=args.turns - 1,
    )
    processor = W.hf_logits_processor(script)
    original_generate = model.generate  # forced tool calls: every model.generate call gets the processor
    model.generate = lambda *a, **k: original_generate(*a, logits_processor=[processor], **k)
    return GRPOTrainer(model=model, reward_funcs=[position_reward], args=config, processing_class=tok,
                       train_dataset=dataset, environment_factory=env_class, peft_config=peft_config(args))


def build_ours(model, tok, dataset, env_class, args, out_dir):
    from trl_multiturn import MultiTurnGRPOConfig, MultiTurnGRPOTrainer
    from trl_multiturn.protocols import ChatToolProtocol

    config = MultiTurnGRPOConfig(
        **shared_config(args, out_dir), prompts_per_rollout=args.prompts,
        mini_batch_size=args.prompts * args.group_size, micro_batch_size=args.micro_batch, max_turns=args.turns,
        max_tokens_per_turn=None, max_observation_tokens=None, env_timeout=None, advantage_eps=1e-4,
        activation_checkpointing_policy=args.checkpoint_policy,
    )
    trainer = MultiTurnGRPOTrainer(model=model, reward_funcs=[position_reward], args=config, processing_class=tok,
                                   train_dataset=dataset, environment_factory=env_class,
                                   protocol=ChatToolProtocol(max_observation_tokens=None), peft_config=peft_config(args))
    if not args.share_past_prompts:
        trainer._scorer.tree = False  # the prompt only, as on real samples (see (8) above)
    if args.score_every_position:  # ablation: the LM head projects every completion position, and on CPU every one
        from trl_multiturn.scoring import CPU_LOGPROB_CHUNK, lm_head_chunk

        scorer = trainer._scorer

        def score_all(model, ids, mask, width, batch_size=None, compute_entropy=False, training=True, scored=None):
            with lm_head_chunk(CPU_LOGPROB_CHUNK if ids.device.type == "cpu" else None):  # as score(), no compaction
                rows = batch_size or ids.size(0)
                return scorer._score(model, ids, mask, width, rows, compute_entropy, training, None)

        scorer.score = score_all
    return trainer


@contextlib.contextmanager
def forced_generator(script):
    """Our trainer builds its ``TransformersGenerator`` in ``_run_rollout``; while this is active it gets the
    forced tool calls as its ``logits_processor``."""
    import trl_multiturn.trainer as trainer_module

    original = trainer_module.TransformersGenerator

    class Forced(original):
        def __init__(self, *a, **k):
            super().__init__(*a, logits_processor=script, **k)

    trainer_module.TransformersGenerator = Forced
    try:
        yield
    finally:
        trainer_module.TransformersGenerator = original


def _peak_start() -> int | None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        M._reset_peak()
        return M._status_kib("VmRSS")
    except (OSError, RuntimeError):  # not Linux, or clear_refs not writable
        return None


def _peak_end(rss_kib: int | None) -> dict:
    peak = {"cuda_max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
            "cpu_vmhwm_gib": None, "cpu_peak_above_start_gib": None}
    if rss_kib is not None:
        hwm = M._status_kib("VmHWM")
        peak.update(cpu_vmhwm_gib=hwm / 2**20, cpu_peak_above_start_gib=(hwm - rss_kib) / 2**20)
    return peak


def run_side(name, base, tok, dataset, env_class, script, args) -> dict:
    """Build a fresh trainer for ``name`` on a copy of ``base``, train ``warmup + steps`` steps, measure."""
    from datasets import Dataset

    out_dir = tempfile.mkdtemp(prefix=f"bench_grpo_{name}_")
    model = copy.deepcopy(base).train()
    meter = StepMeter(model)
    data = Dataset.from_list(dataset)
    if name == "trl":
        trainer = build_trl(model, tok, data, env_class, script, args, out_dir)
        meter.wrap(trainer, "_generate", trl_work)
        forcing = contextlib.nullcontext()
    else:
        trainer = build_ours(model, tok, data, env_class, args, out_dir)
        meter.wrap(trainer, "_run_rollout", ours_work)
        forcing = forced_generator(script)
    trainer.add_callback(meter)
    a = trainer.args
    effective = {k: getattr(a, k) for k in ("per_device_train_batch_size", "gradient_accumulation_steps",
                                            "steps_per_generation", "num_iterations", "num_generations", "beta",
                                            "loss_type", "max_completion_length", "temperature", "learning_rate",
                                            "gradient_checkpointing", "disable_dropout", "max_steps", "bf16")}
    effective["loss_aggregation"] = getattr(a, "loss_aggregation", None)  # ours only
    effective["trainable_parameters"] = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    rss = _peak_start()
    start = time.perf_counter()
    with forcing:
        trainer.train()
    wall = time.perf_counter() - start
    peak = _peak_end(rss)
    meter.close()
    del trainer, model
    shutil.rmtree(out_dir, ignore_errors=True)
    result = summarize(meter, wall, peak, args)
    result["config"] = effective
    return result


def summarize(meter: StepMeter, wall: float, peak: dict, args) -> dict:
    n = len(meter.end)
    if n != args.warmup + args.steps or len(meter.rollout) != n or len(meter.score) != n:
        raise RuntimeError(f"expected {args.warmup + args.steps} steps, each with one rollout; got {n} steps, "
                           f"{len(meter.rollout)} rollouts, {len(meter.score)} scoring calls.")
    inside = [sum(1 for s, e in meter.score if b <= s and e <= f) == 1 for b, f in zip(meter.begin, meter.end)]
    step = [f - b for b, f in zip(meter.begin, meter.end)]
    rollout = [e - s for s, e in meter.rollout]
    score = [e - s for s, e in meter.score]
    cycle = [meter.end[i] - (meter.end[i - 1] if i else meter.begin[0]) for i in range(n)]
    keep = slice(args.warmup, n)
    per_step = [{
        "trajectories": len(w), "turns": sum(t["turns"] for t in w), "generated_tokens": sum(t["generated"] for t in w),
        "observation_tokens": sum(t["observation"] for t in w),
        "trained_tokens": sum(t["prompt"] + t["completion"] for t in w),
    } for w in meter.work]
    kept = meter.work[keep]
    return {
        "step_s": step[keep], "rollout_s": rollout[keep], "generate_and_score_s": score[keep], "cycle_s": cycle[keep],
        "rest_s": [a - b for a, b in zip(step[keep], rollout[keep])],
        "median_step_s": statistics.median(step[keep]), "median_rollout_s": statistics.median(rollout[keep]),
        "median_rest_s": statistics.median(a - b for a, b in zip(step[keep], rollout[keep])),
        "median_cycle_s": statistics.median(cycle[keep]),
        "warmup_step_s": step[: args.warmup], "train_wall_s": wall,
        "rollout_inside_step": all(inside), "rollout_inside_step_per_step": inside,
        "per_step": per_step[keep],
        "trajectories_per_step": statistics.median(p["trajectories"] for p in per_step[keep]),
        "turns_per_step": statistics.median(p["turns"] for p in per_step[keep]),
        "generated_tokens_per_step": statistics.median(p["generated_tokens"] for p in per_step[keep]),
        "observation_tokens_per_step": statistics.median(p["observation_tokens"] for p in per_step[keep]),
        "trained_tokens_per_step": statistics.median(p["trained_tokens"] for p in per_step[keep]),
        "train_forward_positions_per_step": statistics.median(meter.grad_positions[keep]),
        "nograd_forward_positions_per_step": statistics.median(meter.nograd_positions[keep]),
        "train_forward_positions": meter.grad_positions[keep], "nograd_forward_positions": meter.nograd_positions[keep],
        "train_head_positions_per_step": statistics.median(meter.grad_head_positions[keep]),
        "nograd_head_positions_per_step": statistics.median(meter.nograd_head_positions[keep]),
        "logs": meter.logs,
        "first_step_loss": meter.logs[0]["loss"] if meter.logs else None,
        "first_step_grad_norm": meter.logs[0]["grad_norm"] if meter.logs else None,
        "peak_memory": peak,
        "_work": meter.work,  # all steps, warm-up included (dropped from the JSON)
        "_kept_work": kept,
    }


def compare_work(a: dict, b: dict) -> dict:
    """Step by step over all steps (warm-up included): trajectories, turns, generated / observation tokens, ids."""
    same_counts, same_ids, lines = True, True, []
    for i, (wa, wb) in enumerate(zip(a["_work"], b["_work"])):
        key = lambda w: [(t["turns"], t["generated"], t["observation"]) for t in w]  # noqa: E731
        counts = len(wa) == len(wb) and key(wa) == key(wb)
        ids = len(wa) == len(wb) and all(x["ids"] == y["ids"] for x, y in zip(wa, wb))
        same_counts &= counts
        same_ids &= ids
        lines.append(f"    step {i}: trajectories {len(wa)} / {len(wb)}, turns {sum(t['turns'] for t in wa)} / "
                     f"{sum(t['turns'] for t in wb)}, generated {sum(t['generated'] for t in wa)} / "
                     f"{sum(t['generated'] for t in wb)}, observation {sum(t['observation'] for t in wa)} / "
                     f"{sum(t['observation'] for t in wb)}" + ("" if counts else "  <-- DIFFERENT")
                     + ("" if ids else "  (token ids differ)"))
    same_counts &= len(a["_work"]) == len(b["_work"])
    return {"same_work": same_counts, "identical_token_ids": same_ids, "lines": lines}


#: forward-position units of one position of the gradient pass: its forward and its backward (with the base weights
#: frozen, the input gradients cost about one forward, the adapter's own gradients little), plus, under full
#: activation checkpointing, the decoder layers' forward once more in the backward. A no-grad position (rollout,
#: prefill or decode) is one unit.
GRAD_POSITION_UNITS = {"off": 2.0, "full": 3.0}


#: LM-head units of one projected position: with gradient, TRL's fused head computes its tile, recomputes it in the
#: backward and takes the input gradient (the head's weight is frozen under LoRA); without, the tile once.
HEAD_UNITS = {"grad": 3.0, "nograd": 1.0}


def macs_per_position(model) -> dict:
    """Multiply-adds per position of ``model``'s forward: the LM head's (hidden x vocabulary) and the rest of its
    linear layers' (the decoder body; the attention scores, which grow with the context, are left out)."""
    head = model.get_output_embeddings()
    body = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    return {"head": head.weight.numel(), "body": body}


def _head_aware_units(med: dict, grad_units: float, head_share: float) -> float:
    """A step's forward-position units with the LM head counted where it projects: body share x positions, head
    share x projected positions, each with its gradient multiplier."""
    body = 1.0 - head_share
    return (grad_units * body * med["train_forward_positions_per_step"]
            + HEAD_UNITS["grad"] * head_share * med["train_head_positions_per_step"]
            + body * med["nograd_forward_positions_per_step"]
            + HEAD_UNITS["nograd"] * head_share * med["nograd_head_positions_per_step"])


def step_work(result: dict) -> dict:
    """What bounds the step ratio on a device where the step is compute-bound (a CPU: the model's forwards are ~96%
    of a rollout, matmuls ~60% of a training micro-batch): each side's arithmetic per step in forward-position units
    (:data:`GRAD_POSITION_UNITS` x gradient positions + no-grad positions, from the positions the forward hook
    counted), their ratio (TRL / ours: the step ratio that doing the same work faster per unit cannot exceed by much),
    and what the step ratio is beside it. ``None`` where a side's checkpointing has no unit count (ours with
    ``save_matmuls``: its recompute skips the matmuls, whose share is a measured time, not a count)."""
    settings = result["settings"]
    modes = {"trl": "off" if settings.get("no_gradient_checkpointing") else "full"}
    modes["ours"] = modes["trl"] if settings.get("checkpoint_policy", "full") == "full" else None
    out = {"grad_position_units": dict(GRAD_POSITION_UNITS), "checkpointing": modes, "units_per_step": {}}
    for side, mode in modes.items():
        med = result["median"].get(side)
        if med is None or mode is None:
            out["units_per_step"][side] = None
            continue
        out["units_per_step"][side] = (GRAD_POSITION_UNITS[mode] * med["train_forward_positions_per_step"]
                                       + med["nograd_forward_positions_per_step"])
    trl, ours = out["units_per_step"].get("trl"), out["units_per_step"].get("ours")
    out["work_ratio_trl_over_ours"] = trl / ours if trl and ours else None
    out["step_ratio_trl_over_ours"] = result.get("step_ratio_trl_over_ours_median")
    if trl and ours:
        med = result["median"]["ours"]
        grad_only = GRAD_POSITION_UNITS[modes["ours"]] * med["train_forward_positions_per_step"]
        # the most the step ratio could be with ours's rollout free and its gradient pass as it is
        out["work_ratio_with_free_rollout"] = trl / grad_only
        out["work_ratio_without_recompute"] = trl / (GRAD_POSITION_UNITS["off"] * med["train_forward_positions_per_step"]
                                                     + med["nograd_forward_positions_per_step"])
    macs, meds = result.get("model_macs_per_position"), result["median"]
    if trl and ours and macs and all("train_head_positions_per_step" in meds[s] for s in ("trl", "ours")):
        # the LM head counted where it projects (runs that recorded it): on CPU TRL's fused head projects every
        # position of its gradient pass, ours the loss's tokens only
        share = macs["head"] / (macs["head"] + macs["body"])
        units = {s: _head_aware_units(meds[s], GRAD_POSITION_UNITS[modes[s]], share) for s in ("trl", "ours")}
        free = dict(meds["ours"], nograd_forward_positions_per_step=0, nograd_head_positions_per_step=0)
        out["head_aware"] = {
            "head_share_of_a_position": share, "units_per_step": units,
            "work_ratio_trl_over_ours": units["trl"] / units["ours"],
            "work_ratio_with_free_rollout": units["trl"] / _head_aware_units(free, GRAD_POSITION_UNITS[modes["ours"]],
                                                                              share),
            "work_ratio_without_recompute": units["trl"] / _head_aware_units(meds["ours"], GRAD_POSITION_UNITS["off"],
                                                                              share),
        }
    return out


def print_step_work(paths: list[str]) -> list[dict]:
    """``--work-of``: :func:`step_work` of result files written earlier."""
    import json

    rows = []
    for path in paths:
        result = json.loads(Path(path).read_text())
        w = step_work(result)
        rows.append({"file": path, **w})
        fmt = lambda x, f="{:.2f}x": "n/a" if x is None else f.format(x)  # noqa: E731
        print(f"{path}: G={result['settings']['group_size']}, checkpointing TRL {w['checkpointing']['trl']} / ours "
              f"{w['checkpointing']['ours'] or result['settings'].get('checkpoint_policy')}")
        print(f"  units per step TRL {fmt(w['units_per_step'].get('trl'), '{:.0f}')}, ours "
              f"{fmt(w['units_per_step'].get('ours'), '{:.0f}')}: work ratio {fmt(w['work_ratio_trl_over_ours'])}, "
              f"measured step ratio {fmt(w['step_ratio_trl_over_ours'])}; with ours's rollout free "
              f"{fmt(w.get('work_ratio_with_free_rollout'))}, without its recompute "
              f"{fmt(w.get('work_ratio_without_recompute'))}")
        if "head_aware" in w:
            h = w["head_aware"]
            print(f"  with the LM head counted where it projects ({h['head_share_of_a_position']:.1%} of a position): "
                  f"units TRL {h['units_per_step']['trl']:.0f}, ours {h['units_per_step']['ours']:.0f}: work ratio "
                  f"{fmt(h['work_ratio_trl_over_ours'])}; with ours's rollout free "
                  f"{fmt(h['work_ratio_with_free_rollout'])}, without its recompute "
                  f"{fmt(h['work_ratio_without_recompute'])}")
    return rows


def compare_first_step(a: dict, b: dict, dtype: str) -> dict:
    """The first optimizer step of a round: same weights, same batch. The loss is ~0 on-policy on both sides (the
    ratio is 1 and a group's advantages sum to zero). The gradient norms are compared when they are not float noise:
    in this workload the members of a group write the same forced text, so their advantage-weighted gradients cancel
    and both norms are ~0; then ``grad_norm_match`` says whether both are below ``noise``."""
    tol, noise = (1e-3, 1e-5) if dtype == "fp32" else (5e-2, 1e-2)
    la, lb = a["first_step_loss"], b["first_step_loss"]
    ga, gb = a["first_step_grad_norm"], b["first_step_grad_norm"]
    known = ga is not None and gb is not None
    rel = abs(ga - gb) / max(abs(ga), abs(gb), 1e-30) if known else None
    both_noise = known and max(abs(ga), abs(gb)) < noise
    return {"loss": [la, lb], "grad_norm": [ga, gb], "grad_norm_rel_diff": rel,
            "loss_near_zero": la is not None and lb is not None and abs(la) < 1e-3 and abs(lb) < 1e-3,
            "grad_norm_both_noise": both_noise,
            "grad_norm_match": known and (both_noise or rel < tol), "tolerance": tol, "noise": noise}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, random-<tiny|135m|360m|1.7b|3b>, or a local dir")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadiest on a shared CPU)")
    parser.add_argument("--group-size", type=int, default=4, help="G: trajectories per prompt")
    parser.add_argument("--prompts", type=int, default=2, help="B: prompts per optimizer step (one rollout each)")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="trajectories per forward/backward on both sides (default: G); must divide B*G")
    parser.add_argument("--turns", type=int, default=3, help="turns per trajectory: turns-1 searches, then the answer")
    parser.add_argument("--min-think", type=int, default=4, help="fewest filler words before each action")
    parser.add_argument("--max-think", type=int, default=40, help="most filler words before each action")
    parser.add_argument("--max-completion-length", type=int, default=2048,
                        help="token budget of a trajectory's completion (actions and observations)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--loss-type", default="grpo", choices=["grpo", "dapo", "dr_grpo"],
                        help="given to both trainers (aggregations both compute the same way)")
    parser.add_argument("--lora-r", type=int, default=16, help="LoRA rank on every linear layer; 0: full fine-tuning")
    parser.add_argument("--lora-alpha", type=int, default=32)
    parser.add_argument("--no-gradient-checkpointing", action="store_true", help="both sides without it")
    parser.add_argument("--checkpoint-policy", default="full", choices=["full", "save_matmuls"],
                        help="ours: activation_checkpointing_policy (TRL's side always checkpoints in full)")
    parser.add_argument("--share-past-prompts", action="store_true",
                        help="let ours's prefix tree also share what a group's members write alike past the prompt; "
                        "the forced members write identical text, real samples do not (default: the prompt only)")
    parser.add_argument("--score-every-position", action="store_true",
                        help="ablation: ours's LM head projects every position, as before it scored the loss's tokens "
                        "only (TRL's fused head on CPU projects every position)")
    parser.add_argument("--steps", type=int, default=3, help="measured optimizer steps per side and round")
    parser.add_argument("--warmup", type=int, default=1, help="optimizer steps run first and discarded")
    parser.add_argument("--repeats", type=int, default=2, help="rounds; each builds fresh trainers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sides", default="trl,ours", help="comma-separated subset of trl,ours, first side first")
    parser.add_argument("--out", default="benchmarks/results/grpo_step.json")
    parser.add_argument("--work-of", nargs="+", metavar="RESULT_JSON",
                        help="print each earlier result's work per step (step_work) and exit; runs nothing")
    args = parser.parse_args(argv)
    if args.work_of:
        return {"step_work": print_step_work(args.work_of)}
    args.micro_batch = args.micro_batch or args.group_size
    order = args.sides.split(",")
    if not order or len(set(order)) != len(order) or any(s not in SIDES for s in order):
        raise ValueError(f"--sides {args.sides!r}: give trl, ours or both, comma-separated.")
    if args.group_size < 2 or (args.prompts * args.group_size) % args.micro_batch:
        raise ValueError(f"--group-size must be >= 2 and --micro-batch ({args.micro_batch}) must divide "
                         f"--prompts x --group-size ({args.prompts * args.group_size}).")
    if args.turns < 1 or args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        raise ValueError("--turns, --steps and --repeats must be >= 1, --warmup >= 0.")
    if args.threads:
        torch.set_num_threads(args.threads)
    command = " ".join(["python", "benchmarks/grpo_step.py", *(sys.argv[1:] if argv is None else argv)])

    base, tok = W.load_policy(args.model, args.dtype, args.device)
    model_macs = macs_per_position(base)
    max_steps = args.warmup + args.steps
    # B distinct questions per step (fresh ones every step), each question's G members share its forced script
    wl, retriever = W.build_workload(tok, args.prompts * args.group_size * max_steps, args.turns, args.seed,
                                     args.min_think, args.max_think, args.group_size)
    dataset = [dict(x) for x in wl.examples[:: args.group_size]]
    env_class = W.make_search_env_class(retriever, 3, 0.0, W.EnvClock())
    script = W.ScriptedToolCalls(tok, wl.scripts)
    print(f"{args.model} on {args.device} ({args.dtype}, {torch.get_num_threads()} thread(s)): {args.prompts} prompts "
          f"x G={args.group_size} x {args.turns} turns per step, micro-batch {args.micro_batch}, "
          f"{args.warmup}+{args.steps} steps per side, {args.repeats} round(s)", flush=True)

    rounds = []
    for r in range(args.repeats):
        res = {}
        for name in (order if r % 2 == 0 else order[::-1]):
            res[name] = run_side(name, base, tok, dataset, env_class, script, args)
            x = res[name]
            print(f"  round {r}: {name:4s} median step {x['median_step_s']:.2f} s (rollout {x['median_rollout_s']:.2f}"
                  f" s), steps {', '.join(f'{s:.2f}' for s in x['step_s'])}, rollout inside every step: "
                  f"{x['rollout_inside_step']}", flush=True)
        rounds.append(res)

    sides = [s for s in SIDES if s in order]
    keys = ["median_step_s", "median_rollout_s", "median_rest_s", "median_cycle_s", "trajectories_per_step",
            "turns_per_step", "generated_tokens_per_step", "observation_tokens_per_step", "trained_tokens_per_step",
            "train_forward_positions_per_step", "nograd_forward_positions_per_step", "train_head_positions_per_step",
            "nograd_head_positions_per_step", "train_wall_s"]
    med = {s: {k: statistics.median(rd[s][k] for rd in rounds) for k in keys} for s in sides}
    for s in sides:
        for k in ("cuda_max_allocated_gib", "cpu_vmhwm_gib", "cpu_peak_above_start_gib"):
            values = [rd[s]["peak_memory"][k] for rd in rounds if rd[s]["peak_memory"][k] is not None]
            med[s][k] = statistics.median(values) if values else None
    both = len(sides) == 2
    ratios = [rd["trl"]["median_step_s"] / rd["ours"]["median_step_s"] for rd in rounds] if both else []
    checks = [{"work": compare_work(rd["trl"], rd["ours"]), "first_step": compare_first_step(rd["trl"], rd["ours"],
               args.dtype)} for rd in rounds] if both else []
    config_diff = {}
    if both:
        cfg = {s: rounds[0][s]["config"] for s in sides}
        config_diff = {k: [cfg["trl"][k], cfg["ours"][k]] for k in cfg["trl"] if cfg["trl"][k] != cfg["ours"][k]}

    table = [
        ("step time, median (s)", "median_step_s", "{:.2f}"),
        ("  rollout part (s)", "median_rollout_s", "{:.2f}"),
        ("  the rest: rewards, fwd/bwd, optim (s)", "median_rest_s", "{:.2f}"),
        ("step_end -> step_end (s)", "median_cycle_s", "{:.2f}"),
        ("trajectories / step", "trajectories_per_step", "{:.0f}"),
        ("turns / step", "turns_per_step", "{:.0f}"),
        ("generated tokens / step", "generated_tokens_per_step", "{:.0f}"),
        ("observation tokens / step", "observation_tokens_per_step", "{:.0f}"),
        ("trained tokens / step (prompt+compl.)", "trained_tokens_per_step", "{:.0f}"),
        ("gradient forward positions / step", "train_forward_positions_per_step", "{:.0f}"),
        ("no-grad forward positions / step", "nograd_forward_positions_per_step", "{:.0f}"),
        ("LM-head positions / step, gradient", "train_head_positions_per_step", "{:.0f}"),
        ("LM-head positions / step, no-grad", "nograd_head_positions_per_step", "{:.0f}"),
        ("peak CPU memory above start (GiB)", "cpu_peak_above_start_gib", "{:.2f}"),
        ("peak CPU memory, VmHWM (GiB)", "cpu_vmhwm_gib", "{:.2f}"),
        ("peak CUDA memory allocated (GiB)", "cuda_max_allocated_gib", "{:.2f}"),
    ]
    W.print_table([{"trl": "TRL 1.16"}.get(s, s) for s in sides],
                  [(label, fmt, [med[s][k] for s in sides]) for label, k, fmt in table], label_width=40, widths=14)
    for s in sides:
        print(f"first-step loss / grad_norm, {s:4s}: " + ", ".join(
            f"round {r}: {rd[s]['first_step_loss']} / {rd[s]['first_step_grad_norm']}" for r, rd in enumerate(rounds)))
    if both:
        print("effective config fields that differ (TRL, ours): "
              + (", ".join(f"{k}={v}" for k, v in config_diff.items()) or "none"))
        print(f"\nstep-time ratio TRL / ours per round: {', '.join(f'{x:.2f}' for x in ratios)}; "
              f"median {statistics.median(ratios):.2f}x")
        for r, c in enumerate(checks):
            w, f = c["work"], c["first_step"]
            print(f"round {r}: same trajectories, turns, generated and observation tokens every step: {w['same_work']};"
                  f" identical token ids: {w['identical_token_ids']}")
            print("\n".join(w["lines"]))
            norms = (f"both below {f['noise']} (float noise: a group's members write the same forced text, so "
                     "its advantages cancel)" if f["grad_norm_both_noise"] else
                     f"relative difference {f['grad_norm_rel_diff']:.2e} (within {f['tolerance']}: "
                     f"{f['grad_norm_match']})")
            print(f"  first step (same weights, same batch): loss TRL {f['loss'][0]} / ours {f['loss'][1]} "
                  f"(~0 on-policy: {f['loss_near_zero']}); grad_norm TRL {f['grad_norm'][0]} / ours "
                  f"{f['grad_norm'][1]}, {norms}")
            if not (w["same_work"] and f["loss_near_zero"] and f["grad_norm_match"]):
                print("  NOTE: the two sides did not do the same work on some point above.")

    import peft
    import transformers
    import trl

    result = {
        "benchmark": "grpo_step",
        "command": command,
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpu_count": os.cpu_count(),
                    "device": args.device,
                    "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                    "load_average_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None},
        "threads": {"torch": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
                     "peft": peft.__version__},
        "settings": vars(args),
        "timed_interval": "on_step_begin -> on_step_end of each optimizer step (rollout, rewards, forward/backward, "
                          "optimizer); step_end -> step_end in cycle_s",
        "median": med,
        "step_ratio_trl_over_ours_per_round": ratios,
        "step_ratio_trl_over_ours_median": statistics.median(ratios) if ratios else None,
        "same_work": all(c["work"]["same_work"] for c in checks) if both else None,
        "identical_token_ids": all(c["work"]["identical_token_ids"] for c in checks) if both else None,
        "first_step": [c["first_step"] for c in checks],
        "config_differences_trl_ours": config_diff,
        "rollout_inside_step": {s: all(rd[s]["rollout_inside_step"] for rd in rounds) for s in sides},
        "rounds": [{s: {k: v for k, v in rd[s].items() if not k.startswith("_")} for s in rd} for rd in rounds],
        "model_macs_per_position": model_macs,
    }
    if both:
        result["step_work"] = step_work(result)
        work_ratio = result["step_work"]["work_ratio_trl_over_ours"]
        if work_ratio is not None:
            print(f"work per step (forward-position units, benchmarks/grpo_step.py step_work) TRL / ours: "
                  f"{work_ratio:.2f}x")
    W.write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
