"""How two evaluations of the same held-out questions search, greedy and sampled: per hop count, the searches, the
repeated queries (a query the episode already issued), the questions left unanswered, and what the questions one
stage lost or gained did in the other.

    python docs/scripts/search_behaviour.py docs/results/learning_proof/eval_warm_start_step64_start_queries.json \\
        outputs/lp/step64_seed0_queries/eval_step1.json --out docs/results/learning_proof/<name>.json

Both files come from ``recipes/evaluate_search_agent.py`` (or the recipe's in-run evaluation) with the search
queries recorded (``queries`` per record; ``samples`` with ``--num_samples``). A stage without sampled records is
described greedily only.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def describe(records: list[dict]) -> dict:
    """Per hop count (``hops_1``, ``hops_2``): greedy and, where recorded, sampled search behaviour."""
    out = {}
    for hops in (1, 2):
        rs = [r for r in records if r["hops"] == hops]
        d = {
            "n": len(rs),
            "greedy": {
                "exact_match": _mean(r["exact_match"] for r in rs),
                "searches": _mean(r["searches"] for r in rs),
                "with_a_repeated_query": sum(r.get("repeated_queries", 0) > 0 for r in rs),
                "unanswered": sum(not r["answered"] for r in rs),
                "stop_reasons": dict(Counter(r.get("stop_reason") for r in rs)),
            },
        }
        samples = [s for r in rs for s in r.get("samples", [])]
        if samples:
            d["sampled"] = {
                "trajectories": len(samples),
                "exact_match": _mean(s["exact_match"] for s in samples),
                "searches": _mean(len(s["queries"]) for s in samples),
                "with_a_repeated_query": sum(len({" ".join(q.lower().split()) for q in s["queries"]}) < len(s["queries"])
                                             for s in samples),
                "unanswered": sum(s["answer"] is None for s in samples),
                "stop_reasons": dict(Counter(s.get("stop_reason") for s in samples)),
            }
        out[f"hops_{hops}"] = d
    return out


def changed(a: list[dict], b: list[dict]) -> dict:
    """The questions B lost (A right, B wrong, greedy) and gained, per hop count: how B's greedy trajectory ended,
    its searches and repeated queries, and both stages' sampled exact match on them."""
    by_a = {r["id"]: r for r in a}
    out = {}
    for hops in (1, 2):
        for name, test in (("lost", lambda x, y: x == 1 and y == 0), ("gained", lambda x, y: x == 0 and y == 1)):
            ids = [r["id"] for r in b if r["hops"] == hops and test(by_a[r["id"]]["exact_match"], r["exact_match"])]
            rb = [r for r in b if r["id"] in set(ids)]
            out[f"hops_{hops}_{name}"] = {
                "n": len(ids),
                "stop_reasons_b": dict(Counter(r.get("stop_reason") for r in rb)),
                "searches_a": dict(Counter(by_a[i]["searches"] for i in ids)),
                "searches_b": dict(Counter(r["searches"] for r in rb)),
                "with_a_repeated_query_b": sum(r.get("repeated_queries", 0) > 0 for r in rb),
                "sampled_exact_match_a": _mean(by_a[i].get("sampled_exact_match") for i in ids
                                               if "sampled_exact_match" in by_a[i]),
                "sampled_exact_match_b": _mean(r.get("sampled_exact_match") for r in rb if "sampled_exact_match" in r),
                "ids": ids,
            }
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="stage A's evaluation JSON (e.g. the warm start)")
    parser.add_argument("b", help="stage B's evaluation JSON, on the same questions")
    parser.add_argument("--out", help="write the result here as JSON")
    args = parser.parse_args(argv)
    a = json.loads(Path(args.a).read_text())["records"]
    b = json.loads(Path(args.b).read_text())["records"]
    if sorted(r["id"] for r in a) != sorted(r["id"] for r in b):
        raise ValueError(f"{args.a} and {args.b} are not evaluations of the same questions.")
    result = {"a": args.a, "b": args.b, "stage_a": describe(a), "stage_b": describe(b), "changed": changed(a, b)}
    print(json.dumps({k: v for k, v in result.items() if k != "changed"}, indent=1))
    for key, c in result["changed"].items():
        print(f"{key}: {c['n']} questions; B ended {c['stop_reasons_b']}, searches A {c['searches_a']} -> B "
              f"{c['searches_b']}, B repeated a query on {c['with_a_repeated_query_b']}; sampled EM A "
              f"{c['sampled_exact_match_a']} -> B {c['sampled_exact_match_b']}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
