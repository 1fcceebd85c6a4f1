"""Rollout throughput: TRL 1.16's own multi-turn path vs this package's rollout, on the same work.

    python benchmarks/rollout.py                                  # CPU, SmolLM2-135M, 8 trajectories x 4 turns
    python benchmarks/rollout.py --device cuda --dtype bf16 --model random-1.7b --trajectories 64 --repeats 3

Both sides roll out the same multi-turn search workload (``benchmarks/workload.py``): the same model, prompts,
chat template, tool schema, BM25 retriever, sampling settings, turn and token limits, and the same forced tool
calls, so every trajectory has the same turns, generated tokens and observation tokens on both sides (printed
next to the times, and the token ids are compared one by one).

(a) TRL: ``GRPOTrainer(environment_factory=...)`` driven through its ``_generate_and_score_completions`` ->
    ``_generate`` -> ``_tool_call_loop`` (``model.generate`` per turn, lock step, tools called one after the other,
    the whole history prefilled again at every turn). The call is stopped right after ``_generate`` returns, so
    only the rollout is timed (TRL's reward and log-prob passes that follow are not).
(b) ours: ``MultiTurnRollout`` + ``TransformersGenerator`` (K/V kept across turns, rows join and leave the running
    batch, environment steps overlapped with generation) with ``ChatToolProtocol`` and ``TRLEnvironmentAdapter``
    around the same environment class.

One process alternates (a) and (b) for ``--repeats`` rounds after a warm-up round of each; the table reports the
median of each quantity and the ratio b/a of throughputs per round. Prefill tokens are counted by a hook on the
model's forward (real tokens; "positions" include padding). Results go to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workload as W  # noqa: E402

W.offline_env()

import torch  # noqa: E402


class _StopAfterGenerate(Exception):
    pass


def build_trl_trainer(model, tok, wl, env_class, args, out_dir: str):
    """A ``GRPOTrainer`` whose ``_generate`` records its result and stops the scoring that follows."""
    from trl import GRPOConfig, GRPOTrainer

    from datasets import Dataset

    config = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=len(wl.examples),
        num_generations=max(2, args.group_size),
        max_completion_length=args.max_completion_length,
        max_tool_calling_iterations=args.turns - 1,
        temperature=args.temperature,
        report_to="none",
        use_cpu=args.device == "cpu",
        bf16=args.dtype == "bf16",
        logging_steps=1,
        seed=args.seed,
    )
    trainer = GRPOTrainer(
        model=model,
        args=config,
        processing_class=tok,
        train_dataset=Dataset.from_list(wl.examples),
        environment_factory=env_class,
    )
    captured: dict = {}
    original = trainer._generate

    def generate_then_stop(prompts):
        captured["result"] = original(prompts)
        raise _StopAfterGenerate

    trainer._generate = generate_then_stop
    return trainer, captured


def run_trl(trainer, captured, examples, counter, clock) -> dict:
    counter.reset()
    clock.reset()
    inputs = [dict(x) for x in examples]
    start = time.perf_counter()
    try:
        trainer._generate_and_score_completions(inputs)
    except _StopAfterGenerate:
        pass
    wall = time.perf_counter() - start
    prompt_ids, completion_ids, tool_mask, *_ = captured["result"]
    trajs = []
    for p, c, m in zip(prompt_ids, completion_ids, tool_mask):
        turns = sum(1 for j, v in enumerate(m) if v == 1 and (j == 0 or m[j - 1] == 0))
        trajs.append({"ids": list(p) + list(c), "turns": turns, "generated": int(sum(m)), "observation": len(m) - int(sum(m))})
    result = _summary(wall, trajs, counter.counts, env_busy=clock.seconds, env_blocked=clock.seconds)
    result["first_turn_prefill_tokens"] = sum(len(p) for p in prompt_ids)  # TRL prefills every prompt in full
    return result


def run_ours(model, tok, examples, env_class, script, args, counter, clock) -> dict:
    from trl_multiturn.generation import SamplingParams, TransformersGenerator
    from trl_multiturn.protocols import ChatToolProtocol
    from trl_multiturn.rollout import MultiTurnRollout, RolloutConfig
    from trl_multiturn.trl_compat import TRLEnvironmentAdapter

    counter.reset()
    clock.reset()
    rollout = MultiTurnRollout(
        lambda: TRLEnvironmentAdapter(env_class()),
        ChatToolProtocol(max_observation_tokens=None),
        tok,
        RolloutConfig(max_turns=args.turns, max_completion_length=args.max_completion_length, env_timeout=None),
    )
    generator = TransformersGenerator(
        model, tok, generator=torch.Generator().manual_seed(args.seed), logits_processor=script,
        kv_reuse=not args.no_kv_reuse,
    )
    start = time.perf_counter()
    with torch.no_grad():
        out = rollout.run([dict(x) for x in examples], generator, SamplingParams(temperature=args.temperature))
    wall = time.perf_counter() - start
    stats = rollout.last_stats
    rollout.close()
    trajs = [
        {"ids": t.input_ids, "turns": t.num_turns, "generated": t.num_action_tokens, "observation": t.num_observation_tokens}
        for t in out
    ]
    result = _summary(wall, trajs, counter.counts, env_busy=clock.seconds, env_blocked=stats["env_time_s"])
    result["first_turn_prefill_tokens"] = stats["first_turn_prefill_tokens"]
    result["generator_stats"] = {k: round(v, 3) if isinstance(v, float) else v for k, v in generator.stats.items()}
    return result


def _summary(wall: float, trajs: list[dict], counts: dict, env_busy: float, env_blocked: float) -> dict:
    generated = sum(t["generated"] for t in trajs)
    return {
        "wall_s": wall,
        "trajectories_per_s": len(trajs) / wall,
        "generated_tokens_per_s": generated / wall,
        "generated_tokens": generated,
        "observation_tokens": sum(t["observation"] for t in trajs),
        "turns": [t["turns"] for t in trajs],
        "prefill_tokens": counts["prefill_tokens"],
        "prefill_positions": counts["prefill_positions"],
        "decode_positions": counts["decode_positions"],
        "forward_calls": counts["prefill_calls"] + counts["decode_calls"],
        "prefill_per_generated": counts["prefill_tokens"] / max(generated, 1),
        "env_busy_s": env_busy,
        "env_wait_s": env_blocked,
        "_trajs": trajs,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, random-<135m|360m|1.7b|3b>, or a local model dir")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for torch (1: steadiest on a shared CPU)")
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=2, help="GRPO group: copies of each question in a row")
    parser.add_argument("--turns", type=int, default=4, help="turns per trajectory: turns-1 searches, then the answer")
    parser.add_argument("--min-think", type=int, default=4, help="fewest filler words before each action")
    parser.add_argument("--max-think", type=int, default=40, help="most filler words before each action")
    parser.add_argument("--max-completion-length", type=int, default=2048)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--env-latency", type=float, default=0.0, help="seconds added to each search (a server's RTT)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-kv-reuse", action="store_true", help="ours without K/V reuse (ablation)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/rollout.json")
    args = parser.parse_args(argv)
    if args.device == "cpu" and args.threads:
        torch.set_num_threads(args.threads)

    model, tok = W.load_policy(args.model, args.dtype, args.device)
    wl, retriever = W.build_workload(
        tok, args.trajectories, args.turns, args.seed, args.min_think, args.max_think, args.group_size
    )
    clock = W.EnvClock()
    env_class = W.make_search_env_class(retriever, 3, args.env_latency, clock)
    script = W.ScriptedToolCalls(tok, wl.scripts)
    original_generate = model.generate
    processor = W.hf_logits_processor(script)
    model.generate = lambda *a, **k: original_generate(*a, logits_processor=[processor], **k)  # TRL's side forced
    counter = W.ForwardCounter(model)
    import tempfile

    trainer, captured = build_trl_trainer(model, tok, wl, env_class, args, tempfile.mkdtemp(prefix="bench_trl_"))
    model.eval()

    sides = {"trl": lambda ex=wl.examples: run_trl(trainer, captured, ex, counter, clock),
             "ours": lambda ex=wl.examples: run_ours(model, tok, ex, env_class, script, args, counter, clock)}
    print(f"{args.model} on {args.device}: {args.trajectories} trajectories x {args.turns} turns; warm-up ...", flush=True)
    for side in sides.values():
        side(wl.examples[: args.group_size])  # one group: first-call costs out of the way
    rounds = []
    for r in range(args.repeats):
        order = ["trl", "ours"] if r % 2 == 0 else ["ours", "trl"]
        res = {}
        for name in order:
            res[name] = sides[name]()
            print(f"  round {r}: {name:4s} {res[name]['wall_s']:.2f} s", flush=True)
        rounds.append(res)

    same_ids = all(a["ids"] == b["ids"] for a, b in zip(rounds[0]["trl"]["_trajs"], rounds[0]["ours"]["_trajs"]))
    same_work = all(
        (a["turns"], a["generated"], a["observation"]) == (b["turns"], b["generated"], b["observation"])
        for a, b in zip(rounds[0]["trl"]["_trajs"], rounds[0]["ours"]["_trajs"])
    )
    keys = ["wall_s", "trajectories_per_s", "generated_tokens_per_s", "generated_tokens", "observation_tokens",
            "prefill_tokens", "first_turn_prefill_tokens", "prefill_positions", "decode_positions", "forward_calls", "prefill_per_generated",
            "env_busy_s", "env_wait_s"]
    med = {side: {k: statistics.median(rd[side][k] for rd in rounds) for k in keys} for side in sides}
    ratios = [rd["ours"]["trajectories_per_s"] / rd["trl"]["trajectories_per_s"] for rd in rounds]
    later_prefill = {side: med[side]["prefill_tokens"] - med[side]["first_turn_prefill_tokens"] for side in sides}
    later = {side: later_prefill[side] / max(med[side]["generated_tokens"], 1) for side in sides}
    # tokens appended after the first turn: every observation, plus each turn's last sampled token (it is fed to the
    # model only with the next turn's prefill)
    appended = med["ours"]["observation_tokens"] + sum(t - 1 for t in rounds[0]["ours"]["turns"])
    per_new = {side: later_prefill[side] / max(appended, 1) for side in sides}

    rows = [
        ("trajectories / s", "trajectories_per_s", "{:.3f}"),
        ("generated tokens / s", "generated_tokens_per_s", "{:.1f}"),
        ("wall time (s)", "wall_s", "{:.2f}"),
        ("generated tokens", "generated_tokens", "{:.0f}"),
        ("observation tokens", "observation_tokens", "{:.0f}"),
        ("prefill tokens", "prefill_tokens", "{:.0f}"),
        ("  of which first turn (prompts)", "first_turn_prefill_tokens", "{:.0f}"),
        ("prefill positions (with padding)", "prefill_positions", "{:.0f}"),
        ("decode positions (with padding)", "decode_positions", "{:.0f}"),
        ("forward calls", "forward_calls", "{:.0f}"),
        ("prefill / generated token", "prefill_per_generated", "{:.2f}"),
        ("env time, calls (s)", "env_busy_s", "{:.3f}"),
        ("env time, waited (s)", "env_wait_s", "{:.3f}"),
    ]
    W.print_table(["TRL 1.16", "ours"], [
        *((label, fmt, [med[side][key] for side in ("trl", "ours")]) for label, key, fmt in rows),
        ("prefill / generated, turns >= 2", "{:.2f}", [later["trl"], later["ours"]]),
        ("prefill / appended token, turns >= 2", "{:.2f}", [per_new["trl"], per_new["ours"]]),
    ], label_width=34, widths=14)
    print(f"{'turns per trajectory':34s}{str(rounds[0]['trl']['turns']):>14s}  {rounds[0]['ours']['turns']}")
    print(f"\nspeed-up ours / TRL (trajectories/s), per round: {', '.join(f'{x:.2f}' for x in ratios)}; "
          f"median {statistics.median(ratios):.2f}x")
    print(f"same turns, generated and observation tokens per trajectory: {same_work}; identical token ids: {same_ids}")

    result = {
        "benchmark": "rollout",
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": torch.get_num_threads(),
                    "device": args.device, "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
        "settings": {k: v for k, v in vars(args).items()},
        "versions": _versions(),
        "median": med,
        "speedup_per_round": ratios,
        "speedup_median": statistics.median(ratios),
        "prefill_per_generated_after_first_turn": later,
        "prefill_per_appended_token_after_first_turn": per_new,
        "same_work": same_work,
        "identical_token_ids": same_ids,
        "turns": {side: rounds[0][side]["turns"] for side in sides},
        "ours_generator_stats": rounds[0]["ours"].get("generator_stats"),
        "rounds": [{side: {k: v for k, v in rd[side].items() if k != "_trajs"} for side in sides} for rd in rounds],
    }
    W.write_result(result, args.out)
    counter.close()
    return result


def _versions() -> dict:
    import transformers
    import trl

    return {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__}


if __name__ == "__main__":
    main()
