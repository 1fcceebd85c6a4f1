"""Evaluate a search agent: greedy multi-turn rollouts on held-out questions, scored like Search-R1, and the
statistics that tell a real change between two stages from noise.

``evaluate_search_agent`` runs the same rollout loop as training (:class:`~trl_multiturn.rollout.MultiTurnRollout`
with :class:`~trl_multiturn.protocols.TagProtocol` and :class:`SearchEnvironment`) with greedy decoding and reports
exact match (Search-R1's metric), substring match and F1 of the final answer, the average number of searches, the
invalid-action rate and the answer rate, overall and per number of hops. With ``num_samples=k`` it also samples k
trajectories per question at the training temperature and reports their mean exact match (``sampled_exact_match``),
the quantity GRPO's reward actually optimizes.

:func:`heldout_rows` picks the fixed held-out set (:func:`validation_rows` a disjoint one to choose settings on) (half 1-hop, half 2-hop, the same for every stage) and
:func:`compare_evaluations` gives the difference between two stages' per-question records with a paired bootstrap
confidence interval, overall and per hop count: the same questions in both stages, so the question-to-question
spread (most of the variance of an EM) cancels out of the difference (:func:`pool_records` joins several evaluations
into one comparison).

In a multi-process run each rank evaluates its own shard of the questions and the per-question records are
gathered, so the numbers are those of the full set on every rank.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..generation import SamplingParams, TransformersGenerator
from ..generation.merged_lora import merged_lora
from ..hub import framework_versions
from ..host_memory import release_freed_memory
from ..protocols import TagProtocol
from ..rollout import MultiTurnRollout, RolloutConfig
from .environment import query_key
from .rewards import exact_match, f1, substring_match

METRICS = ("exact_match", "substring_match", "f1", "searches", "invalid_rate", "answered", "turns", "answered_bridge",
           "redundant_searches", "repeated_queries")
#: per-question means over the k sampled trajectories (``num_samples``), beside ``sampled_exact_match``
SAMPLED_METRICS = ("searches", "answered", "repeated_queries")


def _queries(traj) -> list[str]:
    """The search queries of a trajectory, in order (the environment's ``step_info``; budget-refused searches too)."""
    return [str(i["query"]) for i in traj.info.get("step_info") or [] if i.get("query") is not None]


def _repeated(queries: Sequence[str]) -> int:
    """Searches whose query (case and spacing ignored) the episode already issued: a deterministic policy that
    repeats a query gets the same documents back and usually the same next action, so under greedy decoding one
    repeat tends to become a loop that runs out of turns."""
    seen, repeats = set(), 0
    for q in queries:
        key = query_key(q)
        repeats += key in seen
        seen.add(key)
    return repeats


def _sampled_fields(row: dict, trajs) -> dict[str, Any]:
    """The k sampled trajectories of one question: their mean exact match (``sampled_exact_match``), the means of
    :data:`SAMPLED_METRICS` (``sampled_searches``, ...) and each sample's queries and answer (``samples``)."""
    k = len(trajs)
    ems = [exact_match(t.info.get("final_answer"), row["golden_answers"]) for t in trajs]
    queries = [_queries(t) for t in trajs]
    searches = [(t.info.get("step_info") or [{}])[-1].get("num_searches", len(q)) for t, q in zip(trajs, queries)]
    return {
        "sampled_exact_match": sum(ems) / k,
        "sampled_searches": sum(searches) / k,
        "sampled_answered": sum(t.info.get("final_answer") is not None for t in trajs) / k,
        "sampled_repeated_queries": sum(_repeated(q) for q in queries) / k,
        "samples": [{"exact_match": em, "queries": q, "answer": t.info.get("final_answer"),
                     "stop_reason": t.info.get("stop_reason")} for em, q, t in zip(ems, queries, trajs)],
    }


def _record(row: dict, traj) -> dict[str, Any]:
    answer = traj.info.get("final_answer")
    golds = row["golden_answers"]
    actions = traj.info.get("actions", [])
    queries = _queries(traj)
    return {
        "id": row.get("id"),
        "question": row.get("question"),
        "hops": int(row.get("hops", 0) or 0),
        "exact_match": exact_match(answer, golds),
        "substring_match": substring_match(answer, golds),
        "f1": f1(answer, golds),
        # the environment's own count (a search past the budget is an action but no search)
        "searches": (traj.info.get("step_info") or [{}])[-1].get("num_searches", sum(a == "tool" for a in actions)),
        # searches issued after a gold answer was already retrieved (SearchEnvironment's redundant_search)
        "redundant_searches": sum(bool(i.get("redundant_search")) for i in traj.info.get("step_info") or []),
        "repeated_queries": _repeated(queries),
        "invalid_rate": (sum(1 for a in actions if a == "invalid") / len(actions)) if actions else 0.0,
        "answered": float(answer is not None),
        "turns": traj.num_turns,
        # the typical 2-hop failure: the answer is the intermediate entity (a search short), e.g. the city, not its country
        "answered_bridge": exact_match(answer, [row["bridge"]]) if row.get("bridge") else 0.0,
        "answer": answer,
        "stop_reason": traj.info.get("stop_reason"),
        "queries": queries,
    }


def _subsets(records: Sequence[Any], hops=lambda r: r["hops"]) -> dict[str, list]:
    """``all`` and one subset per hop count (``hops_1``, ``hops_2``, ...; records without hops only in ``all``)."""
    groups: dict[str, list] = defaultdict(list)
    for r in records:
        groups["all"].append(r)
        if hops(r):
            groups[f"hops_{hops(r)}"].append(r)
    return dict(sorted(groups.items()))


def summarize(records: Sequence[dict]) -> dict[str, Any]:
    """Mean of each metric overall (``all``) and per hop count (``hops_1``, ``hops_2``, ...), with counts ``n``;
    ``sampled_exact_match`` (and any other metric) only when every record has it."""
    sampled = ("sampled_exact_match", *(f"sampled_{m}" for m in SAMPLED_METRICS))
    metrics = [m for m in (*METRICS, *sampled) if records and all(m in r for r in records)]
    return {  # a metric the records lack (sampling not asked for, records from an older version) is left out
        name: {"n": len(rs), **{m: sum(r[m] for r in rs) / len(rs) for m in metrics}}
        for name, rs in _subsets(records).items()
        if rs
    }


def heldout_rows(rows: Sequence[dict], size: int = 256, seed: int = 0) -> list[dict]:
    """The fixed held-out set: ``size`` questions, ``size / 2`` with 1 hop and ``size / 2`` with 2 hops.

    Each half is drawn without replacement by ``random.Random(seed)`` from that hop count's rows sorted by ``id``
    (the row's position when it has none), and the set is returned sorted by ``id``: the same rows give the same
    set whatever their order, so every stage of a run is evaluated on the same questions.
    """
    if size < 2 or size % 2:
        raise ValueError(f"heldout_size={size} must be an even number >= 2 (half 1-hop, half 2-hop), e.g. 256.")
    keyed = [(str(r.get("id")) if r.get("id") is not None else f"{i:09d}", r) for i, r in enumerate(rows)]
    chosen = []
    for hops in (1, 2):
        pool = sorted((kr for kr in keyed if int(kr[1].get("hops", 1) or 1) == hops), key=lambda kr: kr[0])
        if len(pool) < size // 2:
            raise ValueError(
                f"the held-out split has {len(pool)} questions with {hops} hop(s), fewer than heldout_size/2 = "
                f"{size // 2}; lower heldout_size or generate a larger knowledge base (offline_entities)."
            )
        chosen += random.Random(seed * 1_000 + hops).sample(pool, size // 2)
    return [r for _, r in sorted(chosen, key=lambda kr: kr[0])]


def validation_rows(rows: Sequence[dict], size: int = 256, seed: int = 0) -> list[dict]:
    """The validation set: ``size`` questions (half 1-hop, half 2-hop) drawn by :func:`heldout_rows` with seed
    ``seed + 1`` from the rows that the held-out set ``heldout_rows(rows, size, seed)`` leaves out.

    Settings (a learning rate, an optimizer, a reward weight) are chosen on this set and reported once on the
    held-out set, which no choice has seen. On a generated knowledge base both come from the test world: new
    questions, possibly about entities that held-out questions also ask about.
    """
    held = {id(r) for r in heldout_rows(rows, size, seed)}
    rest = [r for r in rows if id(r) not in held]
    try:
        return heldout_rows(rest, size, seed + 1)
    except ValueError as err:
        raise ValueError(f"the validation set is drawn from the questions the held-out set leaves out: {err}") from None


def bootstrap_mean_ci(values: Sequence[float], resamples: int = 10_000, seed: int = 0,
                      confidence: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (n,): ``resamples`` means of n values drawn with
    replacement (``numpy.random.default_rng(seed)``), cut at ``(1 - confidence) / 2`` and ``(1 + confidence) / 2``.
    Given the per-question differences of two stages, this is the paired bootstrap of the difference."""
    x = np.asarray(values, dtype=np.float64)  # (n,)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"bootstrap_mean_ci needs a non-empty 1-D list of values, got shape {x.shape}.")
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)  # (R,)
    for start in range(0, resamples, 1_000):  # in chunks: (1000, n) indices at a time
        stop = min(start + 1_000, resamples)
        means[start:stop] = x[rng.integers(0, x.size, size=(stop - start, x.size))].mean(axis=1)
    low, high = np.quantile(means, [(1 - confidence) / 2, (1 + confidence) / 2])
    return float(low), float(high)


def unpaired_bootstrap_ci(a: Sequence[float], b: Sequence[float], resamples: int = 10_000, seed: int = 0,
                          confidence: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of ``mean(b) - mean(a)`` resampling ``a`` and ``b`` independently, as if the
    two stages had been evaluated on different questions (for comparison: wider than the paired interval when the
    questions' difficulty dominates the spread)."""
    xa, xb = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)  # (n_a,), (n_b,)
    rng = np.random.default_rng(seed)
    diffs = (xb[rng.integers(0, xb.size, size=(resamples, xb.size))].mean(axis=1)
             - xa[rng.integers(0, xa.size, size=(resamples, xa.size))].mean(axis=1))  # (R,)
    low, high = np.quantile(diffs, [(1 - confidence) / 2, (1 + confidence) / 2])
    return float(low), float(high)


def _key(record: dict) -> str:
    return str(record["id"]) if record.get("id") is not None else str(record.get("question"))


def pool_records(evaluations: Sequence[Sequence[dict]]) -> list[dict]:
    """The per-question records of several evaluations as one list for :func:`compare_evaluations`, e.g. the held-out
    sets of several generated knowledge bases: each record's ``id`` is prefixed with its evaluation's position, so
    the same id in two evaluations stays two questions and pairs only with the record at the same position of the
    other stage's list. One evaluation is returned as it is."""
    if len(evaluations) == 1:
        return list(evaluations[0])
    return [{**r, "id": f"{i}:{_key(r)}"} for i, records in enumerate(evaluations) for r in records]


def compare_evaluations(records_a: Sequence[dict], records_b: Sequence[dict], metrics: Sequence[str] | None = None,
                        resamples: int = 10_000, seed: int = 0, confidence: float = 0.95) -> dict[str, Any]:
    """Stage B minus stage A on the same questions, paired by ``id`` (the question text when there is none).

    For each metric (default: ``exact_match`` and, when both stages have it, ``sampled_exact_match``) and each
    subset (``all``, ``hops_1``, ``hops_2``, ...): ``n``, the means ``a`` and ``b``, ``diff = b - a`` and the paired
    bootstrap interval ``ci_low``/``ci_high`` of the per-question differences (:func:`bootstrap_mean_ci`; the
    same seed for every subset). Raises ValueError when the two stages were not evaluated on the same questions.
    """
    by_a, by_b = {_key(r): r for r in records_a}, {_key(r): r for r in records_b}
    only_a, only_b = sorted(set(by_a) - set(by_b)), sorted(set(by_b) - set(by_a))
    if only_a or only_b or len(by_a) != len(records_a) or len(by_b) != len(records_b):
        raise ValueError(
            f"the two evaluations are not on the same questions: {len(only_a)} only in A (e.g. {only_a[:3]}), "
            f"{len(only_b)} only in B (e.g. {only_b[:3]}), {len(records_a) - len(by_a)} + {len(records_b) - len(by_b)} "
            "repeated ids. Evaluate both stages on the same fixed set (--heldout balanced)."
        )
    if metrics is None:
        both = list(records_a) + list(records_b)
        metrics = ["exact_match"] + (["sampled_exact_match"] if all("sampled_exact_match" in r for r in both) else [])
    pairs = [(by_a[k], by_b[k]) for k in sorted(by_a)]
    out: dict[str, Any] = {"resamples": resamples, "seed": seed, "confidence": confidence}
    for metric in metrics:
        out[metric] = {}
        for subset, ps in _subsets(pairs, hops=lambda p: p[0]["hops"]).items():
            a = [float(pa[metric]) for pa, _ in ps]
            b = [float(pb[metric]) for _, pb in ps]
            low, high = bootstrap_mean_ci([y - x for x, y in zip(a, b)], resamples, seed, confidence)
            out[metric][subset] = {"n": len(ps), "a": sum(a) / len(a), "b": sum(b) / len(b),
                                   "diff": (sum(b) - sum(a)) / len(a), "ci_low": low, "ci_high": high}
    return out


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
    num_samples: int = 0,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    turn_layout: str = "sequence",
    context_fn: Callable[[list[dict]], list[dict]] | None = None,
    merge_adapter: bool = False,
) -> dict[str, Any]:
    """Greedy multi-turn evaluation on ``rows`` (dicts with ``question``, ``golden_answers`` and optional ``hops``).

    ``turn_layout`` and ``context_fn``: as the training run's (``RolloutConfig``): a policy trained per turn with a
    context function is evaluated with the contexts it was trained on (``trl_multiturn.context.context_policy``).

    With ``num_samples=k >= 2``, each question is also rolled out k times with ``sampling`` (the training
    temperature / top-p / top-k; default ``SamplingParams()``, temperature 1) from a ``torch.Generator`` seeded with
    ``seed`` (plus the rank), and its record gets ``sampled_exact_match``, the mean exact match of the k samples,
    the samples' mean searches, answer rate and repeated queries (``sampled_searches``, ``sampled_answered``,
    ``sampled_repeated_queries``) and each sample's queries and answer (``samples``). Every record lists the greedy
    trajectory's search ``queries`` and counts the ``repeated_queries`` among them.

    ``merge_adapter``: generate with a LoRA adapter folded into the weights (``generation.merged_lora``; faster, the
    same policy up to float rounding, the weights restored afterwards), as ``rollout_merge_adapter`` in training.

    Returns ``{"summary": summarize(records), "records": [...], "seconds": wall time, "environment": {"versions":
    framework_versions(), "torch_threads": torch's intra-op threads}}``: two records compare question by question
    only when the same versions made them.
    """
    if num_samples == 1 or num_samples < 0:
        raise ValueError(f"num_samples={num_samples}: use 0 (greedy only) or k >= 2 samples per question.")
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
            turn_layout=turn_layout,
            context_fn=context_fn,
        ),
    )
    was_training = model.training
    model.eval()
    generator = TransformersGenerator(model, tokenizer)
    start = time.perf_counter()
    records = []
    merged = contextlib.ExitStack()
    try:
        merged.enter_context(merged_lora(model, merge_adapter))
        for i in range(0, len(shard), batch_size):
            batch = shard[i : i + batch_size]
            trajs = rollout.run(batch, generator, SamplingParams(greedy=True))
            records.extend(_record(r, t) for r, t in zip(batch, trajs))
            if progress:
                done = min(i + batch_size, len(shard))
                em = sum(r["exact_match"] for r in records) / len(records)
                print(f"  eval {done}/{len(shard)} questions, exact match so far {em:.3f}", flush=True)
        if num_samples:
            params = sampling or SamplingParams()
            rank = accelerator.process_index if accelerator is not None else 0
            sampler = TransformersGenerator(model, tokenizer, generator=torch.Generator().manual_seed(seed + rank))
            per_batch = max(1, batch_size // num_samples)  # questions whose k samples are generated together
            for i in range(0, len(shard), per_batch):
                batch = shard[i : i + per_batch]
                trajs = rollout.run([r for r in batch for _ in range(num_samples)], sampler, params)
                for j, row in enumerate(batch):
                    records[i + j].update(_sampled_fields(row, trajs[j * num_samples : (j + 1) * num_samples]))
                if progress:
                    done = min(i + per_batch, len(shard))
                    em = sum(r["sampled_exact_match"] for r in records[:done]) / done
                    print(f"  sampled eval {done}/{len(shard)} questions x {num_samples}, exact match so far "
                          f"{em:.3f}", flush=True)
    finally:
        merged.close()
        rollout.close()
        if was_training:
            model.train()
        release_freed_memory()  # the batch's K/V cache: the next stage's peak does not start at this one's
    if accelerator is not None and accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        records = gather_object(records)
    environment = {"versions": framework_versions(), "torch_threads": torch.get_num_threads()}
    return {"summary": summarize(records), "records": records, "seconds": time.perf_counter() - start,
            "environment": environment}
