"""A rollout with the LoRA adapter folded into the weights (``rollout_merge_adapter``) against the adapter as it is.

    python benchmarks/merged_lora.py                         # CPU, SmolLM2-135M + LoRA r 16 on every linear, 2 threads
    python benchmarks/merged_lora.py --batch-sizes 8 16 --repeats 3 --out benchmarks/results/merged_lora.json

The policy is the offline default's: SmolLM2-135M-Instruct with a LoRA adapter (r 16, alpha 32, q/k/v/o and the MLP
projections; ``--rank``), its B matrices random so that the adapter changes the model. The work is the multi-turn
search workload of ``benchmarks/workload.py`` (forced tool calls: every rollout does the same work) through
``MultiTurnRollout`` + ``TransformersGenerator``; each round runs the unmerged and the merged rollout one after the
other (alternating which goes first), after one warm-up of each. Reported per batch size: median wall times, the
per-round ratios (unmerged / merged), milliseconds per decode step in the model's forward, and whether the two
rollouts sampled the same tokens (they should, up to float rounding of the probabilities).
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

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--model", default="smollm2", help="smollm2, random-<tiny|135m|360m|1.7b|3b>, or a model dir")
parser.add_argument("--device", default="cpu")
parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
parser.add_argument("--threads", type=int, default=2, help="CPU threads for torch")
parser.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16], help="trajectories generating together")
parser.add_argument("--group-size", type=int, default=4)
parser.add_argument("--turns", type=int, default=4)
parser.add_argument("--min-think", type=int, default=4)
parser.add_argument("--max-think", type=int, default=40)
parser.add_argument("--max-completion-length", type=int, default=2048)
parser.add_argument("--temperature", type=float, default=1.0)
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--out", default="benchmarks/results/merged_lora.json")


def lora_policy(args):
    from peft import LoraConfig, get_peft_model

    model, tok = W.load_policy(args.model, args.dtype, args.device)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    torch.manual_seed(args.seed)
    model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=targets,
                                             init_lora_weights=False))
    return model.eval(), tok


def one(model, tok, examples, env_class, script, args, counter, clock, merge: bool) -> dict:
    from trl_multiturn.generation import merged_lora

    with merged_lora(model, merge) as merged:
        assert merged == merge, "the adapter could not be merged"
        res = run_ours(model, tok, examples, env_class, script, args, counter, clock)
    g = res["generator_stats"]
    return {"wall_s": res["wall_s"], "decode_forward_s": g["decode_forward_s"], "forward_s": g["forward_s"],
            "decode_steps": g["decode_steps"], "generated_tokens": g["generated_tokens"],
            "ids": [t["ids"] for t in res["_trajs"]]}


def compare(model, tok, args, batch: int, counter, clock) -> dict:
    wl, retriever = W.build_workload(tok, batch, args.turns, args.seed, args.min_think, args.max_think, args.group_size)
    env_class = W.make_search_env_class(retriever, 3, 0.0, clock)
    script = W.ScriptedToolCalls(tok, wl.scripts)
    for merge in (False, True):  # warm-up
        one(model, tok, wl.examples[: args.group_size], env_class, script, args, counter, clock, merge)
    rounds = []
    for r in range(args.repeats):
        order = (False, True) if r % 2 == 0 else (True, False)
        runs = {merge: one(model, tok, wl.examples, env_class, script, args, counter, clock, merge) for merge in order}
        rounds.append({"unmerged": runs[False], "merged": runs[True],
                       "ratio": runs[False]["wall_s"] / runs[True]["wall_s"]})
        print(f"  batch {batch}, round {r}: unmerged {runs[False]['wall_s']:.1f} s, merged {runs[True]['wall_s']:.1f} s, "
              f"ratio {rounds[-1]['ratio']:.2f}", flush=True)

    def med(side, key):
        return statistics.median(x[side][key] for x in rounds)

    per_step = {side: 1000 * med(side, "decode_forward_s") / max(med(side, "decode_steps"), 1)
                for side in ("unmerged", "merged")}
    return {
        "batch": batch,
        "wall_s": {side: med(side, "wall_s") for side in ("unmerged", "merged")},
        "ratio_median": statistics.median(x["ratio"] for x in rounds),
        "ratios": [x["ratio"] for x in rounds],
        "ms_per_decode_step_forward": per_step,
        "decode_step_ratio": per_step["unmerged"] / per_step["merged"],
        "generated_tokens": {side: rounds[0][side]["generated_tokens"] for side in ("unmerged", "merged")},
        "same_tokens_every_round": all(x["unmerged"]["ids"] == x["merged"]["ids"] for x in rounds),
        "rounds": [{k: ({kk: vv for kk, vv in v.items() if kk != "ids"} if isinstance(v, dict) else v)
                    for k, v in x.items()} for x in rounds],
    }


def main(argv=None) -> dict:
    args = parser.parse_args(argv)
    args.no_kv_reuse = False  # read by rollout.run_ours
    if args.device == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    model, tok = lora_policy(args)
    counter, clock = W.ForwardCounter(model), W.EnvClock()
    results = [compare(model, tok, args, b, counter, clock) for b in args.batch_sizes]
    counter.close()
    W.print_table([f"B={r['batch']}" for r in results], [
        ("rollout, unmerged (s)", "{:.1f}", [r["wall_s"]["unmerged"] for r in results]),
        ("rollout, merged (s)", "{:.1f}", [r["wall_s"]["merged"] for r in results]),
        ("ratio (median of rounds)", "{:.2f}", [r["ratio_median"] for r in results]),
        ("ms/decode step, unmerged", "{:.1f}", [r["ms_per_decode_step_forward"]["unmerged"] for r in results]),
        ("ms/decode step, merged", "{:.1f}", [r["ms_per_decode_step_forward"]["merged"] for r in results]),
    ], label_width=30, widths=10)
    result = W.result_record("merged_lora", args, argv, batches=results)
    W.write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
