"""What projecting only the loss's tokens through the LM head saves a training micro-batch on this device: one forward
and backward of the policy's loss with TRL's fused LM head projecting every position (TRL's path on devices without
Triton) against the labelled positions only (``trl_multiturn.scoring.lm_head_on_labelled_positions``), alternating in
one process, with the log-probs and gradients compared.

The forward is the trainer's: SmolLM2 with TRL's fused LM head, LoRA on every linear layer, full activation
checkpointing, 4096-column head tiles (``CPU_LOGPROB_CHUNK``), log-probs at a ``--scored-fraction`` of the positions
(the loss's tokens: ~25% in the search workload, where prompts and observations are the rest). Token ids are random: a
forward's compute does not depend on them.

    python benchmarks/lm_head_positions.py --rows 4 --length 700 --repeats 3 --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workload as W  # noqa: E402


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, random-<tiny|135m|...> (see workload.py)")
    parser.add_argument("--rows", type=int, default=4, help="trajectories in the micro-batch")
    parser.add_argument("--length", type=int, default=700, help="tokens per trajectory")
    parser.add_argument("--scored-fraction", type=float, default=0.25, help="share of positions with a loss")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of one pass each way, the order alternating")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="benchmarks/results/lm_head_positions.json")
    args = parser.parse_args(argv)
    W.offline_env()
    from trl_multiturn.scoring import CPU_LOGPROB_CHUNK, lm_head_chunk, lm_head_on_labelled_positions

    torch.set_num_threads(args.threads)
    model = W.lora_policy_with_fused_head(args.model, args.lora_r, args.seed)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, 49000, (args.rows, args.length), generator=gen)
    scored = torch.rand(ids.shape, generator=gen) < args.scored_fraction  # (rows, length) the loss's tokens
    labels = ids.masked_fill(~scored, -100)
    weight = scored[:, 1:]  # (rows, length - 1) column t scores token t + 1

    def one_pass(labelled_only: bool) -> tuple[float, torch.Tensor, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        switch = lm_head_on_labelled_positions(ids.device) if labelled_only else contextlib.nullcontext()
        with lm_head_chunk(CPU_LOGPROB_CHUNK), switch:
            out = model(input_ids=ids, labels=labels, fused_lm_head=True)
            loss = -(out.log_probs * weight).sum() / weight.sum()
            loss.backward()
        seconds = time.perf_counter() - start
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        return seconds, out.log_probs.detach()[weight], grads

    one_pass(True), one_pass(False)  # warm-up
    rounds, last = [], {}
    for r in range(args.repeats):
        row = {}
        for name in (("every", "labelled") if r % 2 == 0 else ("labelled", "every")):
            row[name], lp, g = one_pass(name == "labelled")
            last[name] = (lp, g)
        rounds.append(row)
        print(f"  round {r}: every position {row['every']:.2f} s, labelled only {row['labelled']:.2f} s", flush=True)
    median = {k: statistics.median(x[k] for x in rounds) for k in ("every", "labelled")}
    ratios = [x["every"] / x["labelled"] for x in rounds]
    summary = {
        "median_s": median, "every_over_labelled_per_round": ratios,
        "every_over_labelled_median": statistics.median(ratios),
        "positions": args.rows * (args.length - 1), "projected_labelled_only": int(weight.sum()),
        "log_probs_max_abs_diff": float((last["every"][0] - last["labelled"][0]).abs().max()),
        "grads_max_abs_diff": float((last["every"][1] - last["labelled"][1]).abs().max()),
        "threads": torch.get_num_threads(),
    }
    W.print_table(["every position", "labelled only"],
                  [("median fwd+bwd (s)", "{:.2f}", [median["every"], median["labelled"]])], 24, 16)
    print(f"every / labelled per round: {', '.join(f'{x:.2f}' for x in ratios)}; log-probs differ by at most "
          f"{summary['log_probs_max_abs_diff']:.1e}, gradients by {summary['grads_max_abs_diff']:.1e}")
    result = W.result_record("lm_head_positions", args, argv, summary=summary, rounds=rounds)
    W.write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
