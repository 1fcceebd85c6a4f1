"""Does a compiled decode step pay on CPU? One decode step of the policy's forward, eager against ``torch.compile``.

    python benchmarks/compiled_decode.py                                  # SmolLM2-135M, rows 8 and 16, 1 thread
    python benchmarks/compiled_decode.py --out benchmarks/results/compiled_decode.json

The decode step is what is left of a rollout's time outside prefill (``benchmarks/decode_profile.py``: 96% of our
rollout is in the model's forward). This times that forward alone: ``--batch-sizes`` rows, each with a K/V cache of
``--context`` tokens, one new token per row, the model's own ``DynamicCache`` (copied fresh before every timed call,
outside the timing). Both sides are timed in alternating rounds in one process: eager, then the model compiled with
inductor (``dynamic=True``, so one compilation serves every row count and cache length; ``--freezing`` turns on
inductor's weight prepacking for CPU GEMMs). Reported: the compilation's seconds (the first compiled call), the
median milliseconds per step of each side per batch size and round, their ratio, and the largest logit difference
and whether the greedy next tokens agree (compiled kernels reorder floating-point sums).
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workload as W  # noqa: E402

W.offline_env()

import torch  # noqa: E402

from rollout import _versions  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2, random-<size>, or a local dir")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16], help="rows decoding together")
    p.add_argument("--context", type=int, default=600, help="tokens already in each row's K/V cache")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per side, batch size and round")
    p.add_argument("--repeats", type=int, default=2, help="rounds, alternating eager and compiled")
    p.add_argument("--freezing", action=argparse.BooleanOptionalAction, default=True,
                   help="inductor freezing (weight prepacking on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the result JSON here")
    return p.parse_args(argv)


def _step_ms(fn, next_ids, cache, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        fresh = copy.deepcopy(cache)
        start = time.perf_counter()
        fn(input_ids=next_ids, past_key_values=fresh, use_cache=True)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, tok = W.load_policy(args.model, "fp32", "cpu")
    vocab = model.config.vocab_size
    inputs = {}
    with torch.no_grad():
        for b in args.batch_sizes:
            ids = torch.randint(0, vocab, (b, args.context))
            cache = model(input_ids=ids, use_cache=True).past_key_values
            inputs[b] = (torch.randint(0, vocab, (b, 1)), cache)

        import torch._inductor.config as inductor_config

        inductor_config.freezing = args.freezing
        compiled = torch.compile(model, dynamic=True)
        first_b = args.batch_sizes[0]
        start = time.perf_counter()
        compiled(input_ids=inputs[first_b][0], past_key_values=copy.deepcopy(inputs[first_b][1]), use_cache=True)
        compile_s = time.perf_counter() - start

        agreement = {}
        for b, (next_ids, cache) in inputs.items():
            eager_logits = model(input_ids=next_ids, past_key_values=copy.deepcopy(cache), use_cache=True).logits
            compiled_logits = compiled(input_ids=next_ids, past_key_values=copy.deepcopy(cache), use_cache=True).logits
            agreement[str(b)] = {
                "max_abs_logit_diff": float((eager_logits - compiled_logits).abs().max()),
                "greedy_tokens_equal": bool(torch.equal(eager_logits.argmax(-1), compiled_logits.argmax(-1))),
            }
            _step_ms(compiled, next_ids, cache, 1)  # a new row count may compile once more: outside the timing

        rounds = []
        for _ in range(args.repeats):
            rnd = {}
            for b, (next_ids, cache) in inputs.items():
                eager = statistics.median(_step_ms(model, next_ids, cache, args.steps))
                comp = statistics.median(_step_ms(compiled, next_ids, cache, args.steps))
                rnd[str(b)] = {"eager_ms": eager, "compiled_ms": comp, "eager_over_compiled": eager / comp}
            rounds.append(rnd)

    per_batch = {}
    for b in args.batch_sizes:
        ratios = [r[str(b)]["eager_over_compiled"] for r in rounds]
        per_batch[str(b)] = {
            "eager_ms_median": statistics.median(r[str(b)]["eager_ms"] for r in rounds),
            "compiled_ms_median": statistics.median(r[str(b)]["compiled_ms"] for r in rounds),
            "eager_over_compiled_per_round": ratios,
            "eager_over_compiled_median": statistics.median(ratios),
        }
    result = {
        "benchmark": "compiled_decode",
        "command": "python benchmarks/compiled_decode.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": args.model, "context": args.context, "steps": args.steps, "repeats": args.repeats,
        "freezing": args.freezing, "threads": {"torch": torch.get_num_threads()},
        "compile_s": compile_s, "per_batch": per_batch, "rounds": rounds, "agreement": agreement,
        "machine": {"platform": platform.platform(), "processor": platform.processor()}, "versions": _versions(),
    }
    W.print_table(
        ["eager ms", "compiled ms", "ratio"],
        [(f"rows {b}", "{:.1f}", [v["eager_ms_median"], v["compiled_ms_median"], v["eager_over_compiled_median"]])
         for b, v in per_batch.items()],
        12, 12,
    )
    print(f"compilation: {compile_s:.1f} s")
    if args.out:
        W.write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
