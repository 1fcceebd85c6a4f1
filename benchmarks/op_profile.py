"""Where the arithmetic of a GRPO step goes on this device: operator shares and matmul rates.

    python benchmarks/op_profile.py --out benchmarks/results/op_profile.json      # CPU, SmolLM2-135M, 1 thread

Three measurements, each with ``torch.profiler`` (``with_flops=True``: the profiler counts the FLOPs of every matmul):

- ``train``: one forward + backward of a training micro-batch as the trainer computes it (TRL's fused LM head,
  log-probs at the sampled positions only, a quarter of each row; LoRA r16 on every linear layer, no dropout;
  full activation checkpointing, turned on as the trainer turns it on), after one warm-up pass.
- ``rollout``: one multi-turn rollout of ``benchmarks/workload.py``'s forced search work (``--prompts`` x ``--group-size``
  trajectories, ``--turns`` turns) by ``MultiTurnRollout`` + ``TransformersGenerator``, after a warm-up rollout,
  profiled over a window of ``--rollout-forwards`` model forward calls (a whole rollout's events would take tens of
  GiB); the generator's counters split the whole rollout's wall time into prefill and decode forwards.
- ``gemm``: ``torch.mm`` of M rows against the model's largest weight shape (576 x 1536), M = 16 (a decode step of
  16 rows) and M = 2048 (a training micro-batch), with the weights in cache (one weight) and out of it (200 weights,
  ~700 MB, read once each).

Reported: per part the operators with the most self time (seconds, share, calls, GFLOP and GFLOPS where the profiler
counts FLOPs), the share of all matmul-like operators, and their rate. The profiler adds overhead per operator,
so the seconds are a little above an unprofiled run's; the shares are what compare.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workload as W  # noqa: E402

W.offline_env()

import torch  # noqa: E402

MATMULS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm")


def op_table(prof, top: int) -> dict:
    """Self time per operator (top ``top``), the matmuls' share and their FLOP rate."""
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events) / 1e6  # s
    rows = []
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        s = e.self_cpu_time_total / 1e6
        flops = getattr(e, "flops", 0) or 0
        rows.append({"op": e.key, "self_s": s, "share": s / total, "calls": e.count,
                     "gflop": flops / 1e9 if flops else None, "gflops": flops / 1e9 / s if flops and s else None})
    mm = [e for e in events if e.key in MATMULS]
    mm_s = sum(e.self_cpu_time_total for e in mm) / 1e6
    mm_flop = sum(getattr(e, "flops", 0) or 0 for e in mm)
    return {"self_s": total, "ops": rows, "matmul_share": mm_s / total if total else None,
            "matmul_gflop": mm_flop / 1e9, "matmul_gflops": mm_flop / 1e9 / mm_s if mm_s else None}


def profile_train(args) -> dict:
    from types import SimpleNamespace

    from peft import LoraConfig, get_peft_model
    from torch.profiler import ProfilerActivity, profile
    from trl.trainer.utils import add_fused_lm_head

    from trl_multiturn.activation_checkpointing import checkpointing_suspended
    from trl_multiturn.scoring import CPU_LOGPROB_CHUNK, lm_head_chunk

    base, _ = W.load_policy(args.model, "fp32", "cpu")
    add_fused_lm_head(base)
    torch.manual_seed(args.seed)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                            task_type="CAUSAL_LM")).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    config = SimpleNamespace(activation_checkpointing=True, gradient_checkpointing=True,
                             activation_checkpointing_kwargs={"use_reentrant": False},
                             gradient_checkpointing_kwargs=None, activation_checkpointing_policy="full")
    with checkpointing_suspended(model, config):  # switched back on as the trainer does
        pass
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, 49000, (args.rows, args.length), generator=gen)
    labels = torch.where(torch.rand(ids.shape, generator=gen) < 0.25, ids, torch.full_like(ids, -100))

    def step():
        with lm_head_chunk(CPU_LOGPROB_CHUNK):
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, fused_lm_head=True)
            (-(out.log_probs * (labels[:, 1:] != -100)).sum() / max(int((labels != -100).sum()), 1)).backward()

    step()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        step()
    wall = time.perf_counter() - start
    return {"rows": args.rows, "length": args.length, "wall_s": wall, **op_table(prof, args.top)}


def profile_rollout(args) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from rollout import run_ours

    model, tok = W.load_policy(args.model, "fp32", "cpu")
    model.eval()
    n = args.prompts * args.group_size
    wl, retriever = W.build_workload(tok, n, args.turns, args.seed, 4, 40, args.group_size)
    clock = W.EnvClock()
    env_class = W.make_search_env_class(retriever, 3, 0.0, clock)
    script = W.ScriptedToolCalls(tok, wl.scripts)
    counter = W.ForwardCounter(model)
    ns = argparse.Namespace(turns=args.turns, max_completion_length=2048, seed=args.seed, temperature=1.0,
                            no_kv_reuse=False)
    run_ours(model, tok, wl.examples[: args.group_size], env_class, script, ns, counter, clock)  # warm-up
    # a whole rollout's events take tens of GiB in the profiler: profile a window of the model's forward calls,
    # from the --rollout-skip-th on (past the first prefills), and the Python between them
    prof = profile(activities=[ProfilerActivity.CPU], with_flops=True)
    calls = {"n": 0, "decode": 0, "prefill": 0, "on": False}

    def before(module, args_, kwargs):
        calls["n"] += 1
        if calls["n"] == args.rollout_skip + 1:
            prof.start()
            calls["on"] = True
        if calls["on"]:
            ids = kwargs.get("input_ids", args_[0] if args_ else None)
            calls["decode" if ids is not None and ids.shape[-1] == 1 else "prefill"] += 1

    def after(module, args_, kwargs, output):
        if calls["on"] and calls["n"] == args.rollout_skip + args.rollout_forwards:
            prof.stop()
            calls["on"] = False

    hooks = [model.register_forward_pre_hook(before, with_kwargs=True),
             model.register_forward_hook(after, with_kwargs=True)]
    try:
        res = run_ours(model, tok, wl.examples, env_class, script, ns, counter, clock)
    finally:
        for h in hooks:
            h.remove()
        if calls["on"]:
            prof.stop()
    counter.close()
    g = res["generator_stats"]
    return {"trajectories": n, "turns": args.turns, "wall_s": res["wall_s"],
            "profiled_forwards": {"decode": calls["decode"], "prefill": calls["prefill"]},
            "forward_prefill_s": g["forward_s"] - g["decode_forward_s"], "forward_decode_s": g["decode_forward_s"],
            "decode_steps": g["decode_steps"], "decode_positions": g["decode_positions"],
            "prefill_tokens": g["prefill_tokens"], "generated_tokens": g["generated_tokens"],
            "ms_per_decode_step": 1000 * g["decode_forward_s"] / max(g["decode_steps"], 1),
            **op_table(prof, args.top)}


def gemm_rates(args) -> dict:
    gen = torch.Generator().manual_seed(args.seed)
    n = args.gemm_weights  # 200: ~700 MB, out of cache, each read once
    weights = [torch.randn(1536, 576, generator=gen) for _ in range(n)]
    out = {}
    for m in (16, 2048):
        x = torch.randn(m, 576, generator=gen)
        count = n if m == 16 else min(n, 30)
        for w in weights[:5]:
            x @ w.T
        start = time.perf_counter()
        for w in weights[:count]:
            x @ w.T
        uncached = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(count):
            x @ weights[0].T
        cached = time.perf_counter() - start
        flop = 2 * m * 1536 * 576 * count
        out[f"M={m}"] = {"gflops_weights_uncached": flop / uncached / 1e9, "gflops_weights_cached": flop / cached / 1e9}
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, random-<tiny|135m|...>, or a model dir")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--rows", type=int, default=4, help="training micro-batch rows")
    parser.add_argument("--length", type=int, default=700, help="tokens per training row")
    parser.add_argument("--prompts", type=int, default=2, help="rollout: prompts")
    parser.add_argument("--group-size", type=int, default=8, help="rollout: trajectories per prompt")
    parser.add_argument("--turns", type=int, default=3, help="rollout: turns per trajectory")
    parser.add_argument("--rollout-skip", type=int, default=20, help="rollout: forward calls before the profiled window")
    parser.add_argument("--rollout-forwards", type=int, default=60, help="rollout: forward calls profiled")
    parser.add_argument("--parts", default="train,rollout,gemm", help="comma-separated subset of train,rollout,gemm")
    parser.add_argument("--gemm-weights", type=int, default=200,
                        help="gemm: distinct 576 x 1536 weights (200: ~700 MB, more than the caches hold)")
    parser.add_argument("--top", type=int, default=12, help="operators listed per part")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/op_profile.json")
    args = parser.parse_args(argv)
    args.device = "cpu"  # the profile is of this CPU; a GPU's kernels need torch.profiler's CUDA activity
    parts = args.parts.split(",")
    if not parts or any(p not in ("train", "rollout", "gemm") for p in parts):
        raise ValueError(f"--parts {args.parts!r}: choose from train, rollout, gemm (comma-separated).")
    torch.set_num_threads(args.threads)
    results = {}
    for part, fn in (("train", profile_train), ("rollout", profile_rollout), ("gemm", gemm_rates)):
        if part in parts:
            results[part] = fn(args)
            print(f"{part}: done", flush=True)
    for part in ("train", "rollout"):
        if part in results:
            r = results[part]
            window = f" ({r['profiled_forwards']} forwards)" if "profiled_forwards" in r else ""
            print(f"\n{part}: {r['wall_s']:.1f} s{window}; matmuls {r['matmul_share']:.1%} of the operators' self "
                  f"time at {r['matmul_gflops'] or 0:.1f} GFLOPS")
            for row in r["ops"]:
                rate = f", {row['gflops']:.1f} GFLOPS" if row["gflops"] else ""
                print(f"  {row['op'][:60]:60s} {row['self_s']:8.2f} s {row['share']:6.1%} {row['calls']:6d} calls{rate}")
    if "gemm" in results:
        print("\ntorch.mm against a 576 x 1536 weight (GFLOPS):", ", ".join(
            f"{m}: cached {v['gflops_weights_cached']:.1f} / uncached {v['gflops_weights_uncached']:.1f}"
            for m, v in results["gemm"].items()))
    result = W.result_record("op_profile", args, argv, **results)
    W.write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
