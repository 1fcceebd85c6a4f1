"""Our turn engine vs transformers' continuous batching (paged attention, prefix sharing) on the same multi-turn
generation work.

    python benchmarks/continuous_batching.py                   # CPU, SmolLM2-135M, the rollout workload's turns

Why this exists: transformers 5.x ships a continuous-batching engine (``model.generate_batch``,
``ContinuousBatchingManager``: paged K/V, requests that join and leave, block sharing for common prefixes). It
could replace our own K/V bookkeeping, so both are measured on the same work, and the faster one is kept.

The work: the rollout workload of ``benchmarks/rollout.py`` is rolled out once (forced tool calls) and replayed
turn by turn. Each trajectory's turn k is a request with its recorded context and ``n_k`` new tokens (EOS is
disabled so every request generates exactly ``n_k`` tokens, greedy); its next turn is submitted as soon as it
returns. The generated tokens are not the recorded ones, so on both sides the next context shares the previous
context, not the previous generation: both engines reuse the K/V of the previous context (ours through the
trajectory's ``GenerationSession``, transformers through its shared pages, whole pages only) and recompute the rest.
Continuous batching has no stop strings and no per-trajectory sampling stream; this measures speed only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workload as W  # noqa: E402

W.offline_env()

import torch  # noqa: E402


def record_turns(model, tok, wl, retriever, args) -> list[list[tuple[list[int], int]]]:
    """Roll the workload out once; per trajectory, the (context, new tokens) of every turn."""
    from trl_multiturn.generation import SamplingParams, TransformersGenerator
    from trl_multiturn.protocols import ChatToolProtocol
    from trl_multiturn.rollout import MultiTurnRollout, RolloutConfig
    from trl_multiturn.trl_compat import TRLEnvironmentAdapter

    env_class = W.make_search_env_class(retriever, 3, 0.0, W.EnvClock())
    rollout = MultiTurnRollout(
        lambda: TRLEnvironmentAdapter(env_class()), ChatToolProtocol(max_observation_tokens=None), tok,
        RolloutConfig(max_turns=args.turns, max_completion_length=2048, env_timeout=None),
    )
    gen = TransformersGenerator(model, tok, logits_processor=W.ScriptedToolCalls(tok, wl.scripts))
    trajs = rollout.run([dict(x) for x in wl.examples], gen, SamplingParams())
    rollout.close()
    turns = []
    for t in trajs:
        per, start = [], None
        for j, (m, turn) in enumerate(zip(t.action_mask, t.turn_ids)):
            if m == 1 and (j == 0 or t.action_mask[j - 1] == 0):
                start = j
            if m == 1 and (j + 1 == len(t.action_mask) or t.action_mask[j + 1] == 0):
                per.append((t.prompt_ids + t.completion_ids[:start], j + 1 - start))
        turns.append(per)
    return turns


def no_eos(eos_id):
    def processor(rows, logits):
        logits = logits.clone()
        logits[:, eos_id] = float("-inf")
        return logits

    return processor


def replay_ours(model, tok, turns) -> float:
    from trl_multiturn.generation import SamplingParams, TransformersGenerator

    gen = TransformersGenerator(model, tok, logits_processor=no_eos(tok.eos_token_id))
    sessions = [gen.new_session() for _ in turns]
    params = SamplingParams(greedy=True)
    start = time.perf_counter()
    for i, per in enumerate(turns):
        gen.submit((i, 0), per[0][0], per[0][1], params, session=sessions[i])
    while gen.has_work:
        for (i, k), _ in gen.step():
            if k + 1 < len(turns[i]):
                context, n = turns[i][k + 1]
                gen.submit((i, k + 1), context, n, params, session=sessions[i])
    return time.perf_counter() - start


def replay_cb(model, tok, turns, page_size: int) -> float:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    longest = max(len(per[-1][0]) + per[-1][1] for per in turns)
    blocks = len(turns) * (longest // page_size + 2) * 2
    config = ContinuousBatchingConfig(
        page_size=page_size, num_blocks=blocks, max_batch_tokens=4096, allow_block_sharing=True,
        max_requests_per_batch=len(turns),
    )
    gc = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=tok.pad_token_id, max_new_tokens=64)
    manager = model.init_continuous_batching(generation_config=gc, continuous_batching_config=config)
    manager.start()
    try:
        start = time.perf_counter()
        for i, per in enumerate(turns):
            manager.add_request(per[0][0], request_id=f"{i}-0", max_new_tokens=per[0][1], eos_token_id=-1)
        outstanding = len(turns)
        while outstanding:
            result = manager.get_result(timeout=600)
            if result is None:
                raise RuntimeError("continuous batching returned no result within 600 s")
            i, k = map(int, result.request_id.split("-"))
            outstanding -= 1
            if k + 1 < len(turns[i]):
                context, n = turns[i][k + 1]
                manager.add_request(context, request_id=f"{i}-{k + 1}", max_new_tokens=n, eos_token_id=-1)
                outstanding += 1
        return time.perf_counter() - start
    finally:
        manager.stop(block=True)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/continuous_batching.json")
    args = parser.parse_args(argv)
    if args.device == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    model, tok = W.load_policy(args.model, args.dtype, args.device)
    wl, retriever = W.build_workload(tok, args.trajectories, args.turns, group_size=args.group_size)
    turns = record_turns(model, tok, wl, retriever, args)
    generated = sum(n for per in turns for _, n in per)
    print(f"replaying {len(turns)} trajectories, {sum(len(p) for p in turns)} turns, {generated} generated tokens")
    times = {"ours": [], "transformers_cb": []}
    computed = {}
    replay_ours(model, tok, turns[:2])  # warm-up
    replay_cb(model, tok, turns[:2], args.page_size)
    counter = W.ForwardCounter(model)
    for r in range(args.repeats):
        for name in (["ours", "transformers_cb"] if r % 2 == 0 else ["transformers_cb", "ours"]):
            counter.reset()
            seconds = replay_ours(model, tok, turns) if name == "ours" else replay_cb(model, tok, turns, args.page_size)
            times[name].append(seconds)
            # every query position a forward computed (continuous batching packs prefill and decode in one row)
            computed[name] = counter.counts["prefill_positions"] + counter.counts["decode_positions"]
            print(f"  round {r}: {name:16s} {seconds:.2f} s", flush=True)
    counter.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    sides = ("ours", "transformers_cb")
    W.print_table(["ours", "transformers CB"], [
        ("wall time (s)", "{:.2f}", [med[s] for s in sides]),
        ("generated tokens/s", "{:.1f}", [generated / med[s] for s in sides]),
        ("positions computed", "{:d}", [computed[s] for s in sides]),
    ], label_width=24, widths=[12, 18])
    result = {"benchmark": "continuous_batching", "settings": vars(args), "generated_tokens": generated,
              "seconds": times, "median_s": med, "positions_computed": computed,
              "ours_over_cb_speed": med["transformers_cb"] / med["ours"]}
    print(f"speed ours / transformers CB: {result['ours_over_cb_speed']:.2f}x")
    W.write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
