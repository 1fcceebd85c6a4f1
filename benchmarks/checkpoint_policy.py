"""What activation checkpointing costs a training micro-batch, and what ``activation_checkpointing_policy`` gets
back: one forward and backward of the policy's loss on a micro-batch of multi-turn length, with checkpointing off,
in full (transformers' and TRL's default) and with ``"save_matmuls"``; time, peak memory, and the gradients compared.

The forward is the trainer's: the model with TRL's fused LM head (``fused_lm_head=True``), log-probs at the sampled
positions only (a quarter of each row, as in the search workload: ~25% generated tokens) and a loss over them, LoRA on
every linear layer (the recipes' adapter). Each policy runs in a fresh process, so its peak RSS is its own; the
policies alternate over rounds. Token ids are random: a forward's compute does not depend on them.

    python benchmarks/checkpoint_policy.py --rows 4 --length 700 --repeats 3 --threads 1
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workload as W  # noqa: E402

POLICIES = ("none", "full", "save_matmuls")


def measure(policy: str, args) -> dict:
    """One process: load, enable ``policy``, ``args.steps`` timed forward+backward passes after one warm-up."""
    from types import SimpleNamespace

    from trl_multiturn.activation_checkpointing import checkpointing_suspended
    from trl_multiturn.scoring import CPU_LOGPROB_CHUNK, lm_head_chunk

    torch.set_num_threads(args.threads)
    model = W.lora_policy_with_fused_head(args.model, args.lora_r, seed=0)
    if policy != "none":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
        config = SimpleNamespace(activation_checkpointing=True, gradient_checkpointing=True,
                                 activation_checkpointing_kwargs={"use_reentrant": False},
                                 gradient_checkpointing_kwargs=None, activation_checkpointing_policy=policy)
        with checkpointing_suspended(model, config):  # on again as the trainer turns it on
            pass
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, 49000, (args.rows, args.length), generator=gen)
    labels = torch.full_like(ids, -100)
    sampled = torch.rand(ids.shape, generator=gen) < args.sampled_fraction  # (rows, length) loss positions
    labels[sampled] = ids[sampled]
    rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, grads = [], None
    for step in range(1 + args.steps):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with lm_head_chunk(CPU_LOGPROB_CHUNK):
            out = model(input_ids=ids, labels=labels, fused_lm_head=True)
            loss = -(out.log_probs * sampled[:, 1:]).sum() / sampled[:, 1:].sum()
            loss.backward()
        if step:
            times.append(time.perf_counter() - start)
    grads = {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}
    digest = torch.cat([g.flatten() for g in grads.values()])
    return {"policy": policy, "step_s": times, "median_s": sorted(times)[len(times) // 2], "loss": float(loss),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "peak_above_loaded_gib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_loaded) / 2**20,
            "grad_norm": float(digest.norm()), "grad_sample": digest[:: max(1, digest.numel() // 4096)].tolist()}


def summarize(rounds: list[dict], policies: list[str]) -> dict:
    """Medians over every timed pass of every round, the largest peak, and full checkpointing's time over each
    policy's, per round (each round's processes ran back to back, so their ratio is the paired one)."""
    median = {p: statistics.median(t for x in rounds for t in x[p]["step_s"]) for p in policies}
    out = {"median_s": median, "peak_above_loaded_gib": {p: max(x[p]["peak_above_loaded_gib"] for x in rounds)
                                                         for p in policies}}
    if "full" in policies:
        out["full_over_policy"] = {p: median["full"] / median[p] for p in policies}
        out["full_over_policy_per_round"] = {
            p: [statistics.median(x["full"]["step_s"]) / statistics.median(x[p]["step_s"]) for x in rounds]
            for p in policies}
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, random-<tiny|135m|...> (see workload.py)")
    parser.add_argument("--rows", type=int, default=4, help="trajectories in the micro-batch")
    parser.add_argument("--length", type=int, default=700, help="tokens per trajectory")
    parser.add_argument("--sampled-fraction", type=float, default=0.25, help="share of positions with a loss")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2, help="timed passes per process, after one warm-up")
    parser.add_argument("--repeats", type=int, default=2, help="rounds; the policies' order alternates")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="benchmarks/results/checkpoint_policy.json")
    args = parser.parse_args(argv)
    policies = args.policies.split(",")
    if any(p not in POLICIES for p in policies) or not policies:
        raise ValueError(f"--policies {args.policies!r}: a comma-separated subset of {POLICIES}.")
    W.offline_env()
    if args.worker:
        print(json.dumps(measure(args.worker, args)))
        return {}
    argv = sys.argv[1:] if argv is None else argv
    rounds = []
    for r in range(args.repeats):
        row = {}
        for policy in (policies if r % 2 == 0 else policies[::-1]):
            done = subprocess.run([sys.executable, __file__, *argv, "--worker", policy], capture_output=True,
                                  text=True, check=True)
            row[policy] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"  round {r}: {policy:12s} {row[policy]['median_s']:.2f} s, peak above load "
                  f"{row[policy]['peak_above_loaded_gib']:.2f} GiB", flush=True)
        rounds.append(row)
    ref = rounds[0][policies[0]]
    agree = {p: max(abs(a - b) for a, b in zip(rounds[0][p]["grad_sample"], ref["grad_sample"])) for p in policies}
    for x in rounds:
        for p in policies:
            x[p].pop("grad_sample")
    summary = summarize(rounds, policies)
    summary["grad_max_abs_diff_vs_" + policies[0]] = agree
    median, memory = summary["median_s"], summary["peak_above_loaded_gib"]
    W.print_table(list(policies), [("median fwd+bwd (s)", "{:.2f}", [median[p] for p in policies]),
                                   ("peak above load (GiB)", "{:.2f}", [memory[p] for p in policies])], 24, 14)
    result = W.result_record("checkpoint_policy", args, argv, summary=summary, rounds=rounds)
    W.write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
