"""Where a rollout's time goes in our generator: the model's forward against everything else.

    python benchmarks/decode_profile.py                          # CPU, SmolLM2-135M, batches of 8 and 16, 1 thread
    python benchmarks/decode_profile.py --batch-sizes 8 --repeats 3 --out benchmarks/results/decode_profile.json

For each batch size B the multi-turn search workload of ``benchmarks/workload.py`` (forced tool calls, so every run
does the same work) is rolled out by ``MultiTurnRollout`` + ``TransformersGenerator`` with B trajectories, all
generating together (groups of ``--group-size``). The generator's own counters (``TransformersGenerator.stats``)
split the rollout's wall time into:

- ``forward``: inside the model's forward, prefill (prompts, observations) and decode (one token per running row);
- ``sampling``: logits processing (the forced tool calls' processor included), log-softmax and the draw;
- ``kv bookkeeping``: restacking the K/V buffers when rows join or leave the running batch, restoring sessions;
- ``rest of step()``: stop-string checks, appending ids and log-probs, building the decode inputs (the Python of a
  decode step that is not one of the above);
- ``outside the generator``: the rollout loop (parsing actions, the environment's steps when generation waits for
  them, tokenizing and appending observations).

Reported per batch size: the median over ``--repeats`` runs (after one warm-up run) of each part's seconds and
share of the wall time, and per decode step the milliseconds in the forward and outside it. The first question is
how close the generator is to the model's own cost (the share of the wall time in ``forward``); the second, which
part of the forward is prefill (observations must be prefilled: no generator can skip them) and which decode.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workload as W  # noqa: E402

W.offline_env()

import torch  # noqa: E402

from rollout import run_ours  # noqa: E402

PARTS = ("forward_prefill", "forward_decode", "sampling", "kv_bookkeeping", "rest_of_step", "outside_generator")


def breakdown(result: dict) -> dict:
    """Seconds per part of one rollout (``PARTS``), from its wall time and the generator's counters."""
    g, wall = result["generator_stats"], result["wall_s"]
    parts = {
        "forward_prefill": g["forward_s"] - g["decode_forward_s"],
        "forward_decode": g["decode_forward_s"],
        "sampling": g["sample_s"],
        "kv_bookkeeping": g["kv_s"],
    }
    # prefills run inside step() (rows join there), so step() holds every counted part
    parts["rest_of_step"] = max(g["step_s"] - sum(parts.values()), 0.0)
    parts["outside_generator"] = max(wall - g["step_s"], 0.0)
    return parts


def profile(model, tok, args, batch: int, counter, clock) -> dict:
    wl, retriever = W.build_workload(tok, batch, args.turns, args.seed, args.min_think, args.max_think, args.group_size)
    env_class = W.make_search_env_class(retriever, 3, 0.0, clock)
    script = W.ScriptedToolCalls(tok, wl.scripts)
    run_ours(model, tok, wl.examples[: args.group_size], env_class, script, args, counter, clock)  # warm-up
    runs = []
    for r in range(args.repeats):
        res = run_ours(model, tok, wl.examples, env_class, script, args, counter, clock)
        parts = breakdown(res)
        g = res["generator_stats"]
        runs.append({"wall_s": res["wall_s"], "parts_s": parts, "decode_steps": g["decode_steps"],
                     "prefill_tokens": g["prefill_tokens"], "decode_positions": g["decode_positions"],
                     "generated_tokens": g["generated_tokens"], "generator_stats": g})
        share = (parts["forward_prefill"] + parts["forward_decode"]) / res["wall_s"]
        print(f"  batch {batch}, run {r}: {res['wall_s']:.1f} s, {share:.1%} in the model's forward", flush=True)
    med = {p: statistics.median(run["parts_s"][p] for run in runs) for p in PARTS}
    wall = statistics.median(run["wall_s"] for run in runs)
    steps = statistics.median(run["decode_steps"] for run in runs)
    not_forward_per_step = (med["sampling"] + med["kv_bookkeeping"] + med["rest_of_step"]) / max(steps, 1)
    return {
        "batch": batch,
        "wall_s": wall,
        "parts_s": med,
        "shares": {p: med[p] / wall for p in PARTS},
        "forward_share": (med["forward_prefill"] + med["forward_decode"]) / wall,
        "decode_steps": steps,
        "ms_per_decode_step": {"forward": 1000 * med["forward_decode"] / max(steps, 1),
                               "generator_outside_forward": 1000 * not_forward_per_step},
        "prefill_tokens": runs[0]["prefill_tokens"],
        "decode_positions": runs[0]["decode_positions"],
        "generated_tokens": runs[0]["generated_tokens"],
        "runs": runs,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, random-<tiny|135m|360m|1.7b|3b>, or a model dir")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for torch")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16], help="trajectories generating together")
    parser.add_argument("--group-size", type=int, default=4, help="GRPO group: copies of each question")
    parser.add_argument("--turns", type=int, default=4, help="turns per trajectory: turns-1 searches, then the answer")
    parser.add_argument("--min-think", type=int, default=4)
    parser.add_argument("--max-think", type=int, default=40)
    parser.add_argument("--max-completion-length", type=int, default=2048)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/decode_profile.json")
    args = parser.parse_args(argv)
    args.no_kv_reuse = False  # read by rollout.run_ours
    if args.device == "cpu" and args.threads:
        torch.set_num_threads(args.threads)

    model, tok = W.load_policy(args.model, args.dtype, args.device)
    model.eval()
    counter, clock = W.ForwardCounter(model), W.EnvClock()
    results = [profile(model, tok, args, b, counter, clock) for b in args.batch_sizes]
    counter.close()

    labels = {"forward_prefill": "forward, prefill", "forward_decode": "forward, decode", "sampling": "sampling",
              "kv_bookkeeping": "K/V bookkeeping", "rest_of_step": "rest of step()",
              "outside_generator": "outside the generator"}
    W.print_table([f"B={r['batch']}" for r in results], [
        ("wall time (s)", "{:.1f}", [r["wall_s"] for r in results]),
        *((f"{labels[p]} (share)", "{:.1%}", [r["shares"][p] for r in results]) for p in PARTS),
        ("in the model's forward", "{:.1%}", [r["forward_share"] for r in results]),
        ("ms per decode step, forward", "{:.1f}", [r["ms_per_decode_step"]["forward"] for r in results]),
        ("ms per decode step, generator", "{:.2f}", [r["ms_per_decode_step"]["generator_outside_forward"] for r in results]),
        ("prefill tokens", "{:.0f}", [r["prefill_tokens"] for r in results]),
        ("decode positions", "{:.0f}", [r["decode_positions"] for r in results]),
    ], label_width=34, widths=12)
    result = W.result_record("decode_profile", args, argv, batches=results)
    W.write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
