"""Evaluate a search agent: greedy multi-turn rollouts on held-out questions, scored like Search-R1.

``evaluate_search_agent`` runs the same rollout loop as training (:class:`~trl_multiturn.rollout.MultiTurnRollout`
with :class:`~trl_multiturn.protocols.TagProtocol` and :class:`SearchEnvironment`) with greedy decoding and reports
exact match (Search-R1's metric), substring match and F1 of the final answer, the average number of searches, the
invalid-action rate and the answer rate, overall and per number of hops.

In a multi-process run each rank evaluates its own shard of the questions and the per-question records are
gathered, so the numbers are those of the full set on every rank.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..generation import SamplingParams, TransformersGenerator
from ..protocols import TagProtocol
from ..rollout import MultiTurnRollout, RolloutConfig
from .rewards import exact_match, f1, substring_match

METRICS = ("exact_match", "substring_match", "f1", "searches", "invalid_rate", "answered", "turns")


def _record(row: dict, traj) -> dict[str, Any]:
    answer = traj.info.get("final_answer")
    golds = row["golden_answers"]
    actions = traj.info.get("actions", [])
    return {
        "id": row.get("id"),
        "hops": int(row.get("hops", 0) or 0),
        "exact_match": exact_match(answer, golds),
        "substring_match": substring_match(answer, golds),
        "f1": f1(answer, golds),
        # the environment's own count (a search past the budget is an action but no search)
        "searches": (traj.info.get("step_info") or [{}])[-1].get("num_searches", sum(a == "tool" for a in actions)),
        "invalid_rate": (sum(1 for a in actions if a == "invalid") / len(actions)) if actions else 0.0,
        "answered": float(answer is not None),
        "turns": traj.num_turns,
        "answer": answer,
        "stop_reason": traj.info.get("stop_reason"),
    }


def summarize(records: Sequence[dict]) -> dict[str, Any]:
    """Mean of each metric overall (``all``) and per hop count (``hops_1``, ``hops_2``, ...), with counts ``n``."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        groups["all"].append(r)
        if r["hops"]:
            groups[f"hops_{r['hops']}"].append(r)
    return {
        name: {"n": len(rs), **{m: sum(r[m] for r in rs) / len(rs) for m in METRICS}}
        for name, rs in sorted(groups.items())
        if rs
    }


@torch.no_grad()
def evaluate_search_agent(
    model,
    tokenizer,
    rows: Sequence[dict],
    env_factory: Callable[[], Any],
    *,
    protocol: TagProtocol | None = None,
    max_turns: int = 4,
    max_completion_length: int = 1024,
    max_tokens_per_turn: int | None = 256,
    batch_size: int = 16,
    accelerator=None,
    progress: bool = True,
) -> dict[str, Any]:
    """Greedy multi-turn evaluation on ``rows`` (dicts with ``question``, ``golden_answers`` and optional ``hops``).

    Returns ``{"summary": summarize(records), "records": [...], "seconds": wall time}``.
    """
    protocol = protocol or TagProtocol()
    rows = list(rows)
    if accelerator is not None and accelerator.num_processes > 1:
        shard = rows[accelerator.process_index :: accelerator.num_processes]
    else:
        shard = rows
    rollout = MultiTurnRollout(
        env_factory,
        protocol,
        tokenizer,
        RolloutConfig(
            max_turns=max_turns,
            max_completion_length=max_completion_length,
            max_tokens_per_turn=max_tokens_per_turn,
            max_context_length=getattr(getattr(model, "config", None), "max_position_embeddings", None),
        ),
    )
    was_training = model.training
    model.eval()
    generator = TransformersGenerator(model, tokenizer)
    start = time.perf_counter()
    records = []
    try:
        for i in range(0, len(shard), batch_size):
            batch = shard[i : i + batch_size]
            trajs = rollout.run(batch, generator, SamplingParams(greedy=True))
            records.extend(_record(r, t) for r, t in zip(batch, trajs))
            if progress:
                done = min(i + batch_size, len(shard))
                em = sum(r["exact_match"] for r in records) / len(records)
                print(f"  eval {done}/{len(shard)} questions, exact match so far {em:.3f}", flush=True)
    finally:
        rollout.close()
        if was_training:
            model.train()
    if accelerator is not None and accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        records = gather_object(records)
    return {"summary": summarize(records), "records": records, "seconds": time.perf_counter() - start}
