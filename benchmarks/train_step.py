"""Training-step time and useful-token fraction: MultiTurnGRPOTrainer vs TRL's GRPOTrainer on the same rollout batch.

    python benchmarks/train_step.py                               # CPU: a tiny random model (see below)
    python benchmarks/train_step.py --device cuda --dtype bf16 --model smollm2 --trajectories 32
    python benchmarks/train_step.py --sides ours,ours-per-turn --out benchmarks/results/train_step_per_turn.json

The rollout batch is made once: the multi-turn search workload of ``benchmarks/workload.py`` (forced tool calls;
each question gets 1 to 4 turns, so trajectories have uneven lengths as real ones do) rolled out by our
``MultiTurnRollout``. Then each trainer
trains ``--steps`` optimizer steps on exactly that batch, from the same initial weights and with the same batch
knobs (micro-batch size, gradient accumulation, one GRPO iteration, no KL term):

(a) TRL: ``GRPOTrainer(rollout_func=...)`` whose ``rollout_func`` returns the batch's ``prompt_ids``,
    ``completion_ids``, ``logprobs`` and ``env_mask`` (TRL's documented multi-turn seam);
(b) ours: ``MultiTurnGRPOTrainer`` with its rollout replaced by the same trajectories.

(c) ``ours-per-turn`` (``--sides``): ``MultiTurnGRPOTrainer`` with ``turn_layout="per_turn"`` on the same
    trajectories, one row per turn whose context is the sequence so far (the workload's ChatML template keeps the
    prefix property: nested turns share one row, so this is the per-turn layout's overhead where it buys nothing);
    ``ours-per-turn-unmerged``: the same with every turn its own row, the cost of a template or context function
    that rewrites the context at every turn (each row recomputes its whole context).

Reported per side: wall time of ``train()``, time inside ``training_step`` (forward + backward of every
micro-batch), tokens processed by the training forwards (padding included), the useful-token fraction
``(assistant + observation tokens) / tokens processed`` and the real-token fraction ``(prompt + assistant +
observation) / tokens processed``, and on CUDA the peak memory. Whatever micro-batching the trainer has when the
script runs is what is measured. A CPU cannot train SmolLM2 on multi-turn batches in minutes, so the CPU default is
``--model random-tiny`` (SmolLM2's vocabulary, a 2-layer body): the token accounting is the same, the times are
only indicative; pass ``--model smollm2`` on a GPU.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workload as W  # noqa: E402

W.offline_env()

import torch  # noqa: E402


def position_reward(completions, **kwargs) -> list[float]:
    """A reward that varies inside each group (the members of a group wrote the same forced text): 0, 1, 2, 0, ..."""
    return [float(i % 3) for i in range(len(completions))]


def make_batch(model, tok, args):
    """Roll the workload out once with our rollout; returns (dataset rows, trajectories, env class)."""
    from trl_multiturn.generation import SamplingParams, TransformersGenerator
    from trl_multiturn.protocols import ChatToolProtocol
    from trl_multiturn.rollout import MultiTurnRollout, RolloutConfig
    from trl_multiturn.trl_compat import TRLEnvironmentAdapter

    # One question per trajectory: the forced scripts are a function of the prompt, so copies of a prompt would be
    # identical trajectories, which real GRPO groups are not. With --prompts group (default) the members of a group
    # are then given their group's prompt (first member's) and keep their own completions: the token layout of a
    # real GRPO batch (a shared prompt, completions of different lengths), which is all a training step's compute
    # depends on. --prompts distinct keeps one prompt per trajectory.
    wl, retriever = W.build_workload(
        tok, args.trajectories, args.turns, args.seed, args.min_think, args.max_think, 1, args.min_turns
    )
    env_class = W.make_search_env_class(retriever, 3, 0.0, W.EnvClock())
    rollout = MultiTurnRollout(
        lambda: TRLEnvironmentAdapter(env_class()), ChatToolProtocol(max_observation_tokens=None), tok,
        RolloutConfig(max_turns=args.turns, max_completion_length=args.max_completion_length, env_timeout=None),
    )
    gen = TransformersGenerator(model, tok, logits_processor=W.ScriptedToolCalls(tok, wl.scripts))
    trajs = rollout.run([dict(x) for x in wl.examples], gen, SamplingParams())
    rollout.close()
    for t in trajs:  # the sampling log-probs of forced tokens are 0; give them a plausible old policy value
        t.logprobs = [-1.0 if m else 0.0 for m in t.action_mask]
    rows = [dict(x) for x in wl.examples]
    if args.prompts == "group":
        for i, t in enumerate(trajs):  # every member of a GRPO group gets its group's prompt
            leader = i - i % args.group_size
            t.prompt_ids = list(trajs[leader].prompt_ids)
            rows[i] = dict(rows[leader])
    return rows, trajs, env_class


class TrainingMeter:
    """Times ``training_step`` and counts the tokens its forwards process (hook on the model)."""

    def __init__(self, trainer, model):
        self.seconds, self.processed, self.real, self.calls = 0.0, 0, 0, 0
        self.check_processed = 0  # our one-time packing check (first micro-batch scored twice, no gradient)
        self._active = False
        self._trainer = trainer
        original = trainer.training_step

        def timed(*a, **k):
            self._active = True
            start = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.seconds += time.perf_counter() - start
                self._active = False

        trainer.training_step = timed
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        if not self._active:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if getattr(self._trainer, "_in_packing_check", False):
            self.check_processed += ids.numel()
            return
        self.calls += 1
        self.processed += ids.numel()

    def close(self):
        self.handle.remove()


def common_args(args, out_dir: str) -> dict:
    return dict(
        output_dir=out_dir,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.trajectories // args.micro_batch,
        num_generations=args.group_size,
        max_completion_length=args.max_completion_length,
        max_steps=args.steps,
        learning_rate=1e-6,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=args.device == "cpu",
        bf16=args.dtype == "bf16",
        seed=args.seed,
        beta=0.0,
        num_iterations=1,
    )


def train_trl(base_model, tok, rows, trajs, args) -> dict:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    def rollout_func(prompts, trainer):
        if len(prompts) != len(trajs):
            raise RuntimeError(f"rollout_func got {len(prompts)} prompts; the fixed batch has {len(trajs)}.")
        return {
            "prompt_ids": [list(t.prompt_ids) for t in trajs],
            "completion_ids": [list(t.completion_ids) for t in trajs],
            "logprobs": [list(t.logprobs) for t in trajs],
            "env_mask": [list(t.action_mask) for t in trajs],
        }

    model = copy.deepcopy(base_model).train()
    trainer = GRPOTrainer(
        model=model, reward_funcs=[position_reward], args=GRPOConfig(**common_args(args, tempfile.mkdtemp())),
        processing_class=tok, train_dataset=Dataset.from_list(rows), rollout_func=rollout_func,
    )
    return _train(trainer, model, trajs, args)


def per_turn_copy(trajs):
    """The trajectories with each turn's context set to the sequence before its first token (prefix property)."""
    out = copy.deepcopy(trajs)
    for t in out:
        t.turn_contexts = [t.prompt_ids + t.completion_ids[: t.turn_ids.index(k)] for k in range(t.num_turns)]
    return out


def train_ours(base_model, tok, rows, trajs, env_class, args, layout: str = "sequence", merge: bool = True) -> dict:
    from datasets import Dataset

    from trl_multiturn import MultiTurnGRPOConfig, MultiTurnGRPOTrainer

    model = copy.deepcopy(base_model).train()
    kw = common_args(args, tempfile.mkdtemp())
    kw.update(max_turns=args.turns, max_observation_tokens=None, share_prompt_prefix=not args.no_share_prompt_prefix,
              turn_layout=layout)
    if args.max_tokens_per_micro_batch:  # token budget: one accumulation slot per trajectory, the budget decides
        kw.update(per_device_train_batch_size=1, gradient_accumulation_steps=args.trajectories,
                  max_tokens_per_micro_batch=args.max_tokens_per_micro_batch)
    trainer = MultiTurnGRPOTrainer(
        model=model, reward_funcs=[position_reward], args=MultiTurnGRPOConfig(**kw), processing_class=tok,
        train_dataset=Dataset.from_list(rows), environment_factory=env_class,
    )
    trainer._run_rollout = lambda inputs: copy.deepcopy(trajs)  # the fixed batch instead of a fresh rollout
    if trainer._turn_rows is not None:
        trainer._turn_rows.merge = merge
    return _train(trainer, model, trajs, args)


def _train(trainer, model, trajs, args) -> dict:
    meter = TrainingMeter(trainer, model)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    meter.close()
    useful = args.steps * sum(len(t.completion_ids) for t in trajs)
    real = args.steps * sum(len(t.prompt_ids) + len(t.completion_ids) for t in trajs)
    return {
        "train_wall_s": wall,
        "training_step_s": meter.seconds,
        "step_s": meter.seconds / args.steps,
        "forward_calls": meter.calls,
        "tokens_processed": meter.processed,
        "useful_token_fraction": useful / max(meter.processed, 1),
        "real_token_fraction": real / max(meter.processed, 1),
        "one_time_check_tokens": meter.check_processed,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: smollm2 on CUDA, random-tiny on CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--trajectories", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompts", default="group", choices=["group", "distinct"],
                        help="group: the members of a GRPO group share their prompt (as in training); distinct: one "
                        "prompt per trajectory")
    parser.add_argument("--no-share-prompt-prefix", action="store_true",
                        help="ours without the shared-prompt forward (ablation)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4, help="most turns of a trajectory")
    parser.add_argument("--min-turns", type=int, default=1, help="fewest turns (each question draws its own)")
    parser.add_argument("--min-think", type=int, default=2)
    parser.add_argument("--max-think", type=int, default=40)
    parser.add_argument("--max-completion-length", type=int, default=2048)
    parser.add_argument("--max-tokens-per-micro-batch", type=int, default=None,
                        help="ours with token-budget micro-batches (TRL keeps --micro-batch)")
    parser.add_argument("--steps", type=int, default=1, help="optimizer steps per measurement")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sides", default="trl,ours",
                        help="comma-separated, measured in this order (reversed every other round): trl, ours, "
                        "ours-per-turn (turn_layout='per_turn' on the same trajectories), ours-per-turn-unmerged (every turn its own "
                        "row)")
    parser.add_argument("--out", default="benchmarks/results/train_step.json")
    args = parser.parse_args(argv)
    args.model = args.model or ("smollm2" if args.device == "cuda" else "random-tiny")
    if args.trajectories % args.micro_batch:
        raise ValueError(f"--trajectories {args.trajectories} must be a multiple of --micro-batch {args.micro_batch}.")
    if args.device == "cpu" and args.threads:
        torch.set_num_threads(args.threads)

    base, tok = W.load_policy(args.model, args.dtype, args.device)
    rows, trajs, env_class = make_batch(base, tok, args)
    lengths = [len(t.prompt_ids) + len(t.completion_ids) for t in trajs]
    print(f"batch: {len(trajs)} trajectories, {sum(t.num_turns for t in trajs)} turns, lengths {min(lengths)}..{max(lengths)}")
    per_turn = per_turn_copy(trajs)
    known = {"trl": lambda: train_trl(base, tok, rows, trajs, args),
             "ours": lambda: train_ours(base, tok, rows, trajs, env_class, args),
             "ours-per-turn": lambda: train_ours(base, tok, rows, per_turn, env_class, args, layout="per_turn"),
             "ours-per-turn-unmerged": lambda: train_ours(base, tok, rows, per_turn, env_class, args, layout="per_turn",
                                                          merge=False)}
    order = args.sides.split(",")
    if len(order) != 2 or any(name not in known for name in order):
        raise ValueError(f"--sides {args.sides!r}: give two of {list(known)}, comma-separated, e.g. trl,ours.")
    sides = {name: known[name] for name in order}
    rounds = []
    for r in range(args.repeats):
        res = {}
        for name in (order if r % 2 == 0 else order[::-1]):
            res[name] = sides[name]()
            print(f"  round {r}: {name:4s} step {res[name]['step_s']:.2f} s", flush=True)
        rounds.append(res)
    base_side, other = order
    keys = list(rounds[0][base_side])
    med = {s: {k: (statistics.median(rd[s][k] for rd in rounds) if rounds[0][s][k] is not None else None) for k in keys}
           for s in sides}
    table = [
        ("training_step time / step (s)", "step_s", "{:.2f}"),
        ("train() wall (s)", "train_wall_s", "{:.2f}"),
        ("tokens processed", "tokens_processed", "{:.0f}"),
        ("useful-token fraction", "useful_token_fraction", "{:.3f}"),
        ("(prompt+completion) / processed", "real_token_fraction", "{:.3f}"),
        ("forward calls", "forward_calls", "{:.0f}"),
        ("packing check tokens (once)", "one_time_check_tokens", "{:.0f}"),
        ("peak memory (GiB)", "peak_memory_gib", "{:.2f}"),
    ]
    rows_out = [(label, fmt, [med[base_side][key], med[other][key]]) for label, key, fmt in table]
    W.print_table([{"trl": "TRL 1.16"}.get(s, s) for s in order], rows_out, label_width=30, widths=14)
    speed = med[base_side]["step_s"] / med[other]["step_s"]
    ratios = [rd[base_side]["step_s"] / rd[other]["step_s"] for rd in rounds]
    print(f"\nstep-time ratio {base_side} / {other}: {speed:.2f}x (per round: {', '.join(f'{x:.2f}' for x in ratios)})")
    result = {"benchmark": "train_step", "settings": vars(args), "median": med, "step_speedup": speed,
              "round_ratios": ratios, "batch_lengths": lengths, "rounds": rounds,
              "threads": torch.get_num_threads()}
    W.write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
