"""Compare two evaluations of a search agent question by question: stage B minus stage A, with a paired bootstrap
95% confidence interval, overall and per hop count.

    python recipes/compare_evaluations.py eval_warm.json eval_grpo.json --output_json grpo_vs_warm.json

Each file is what `recipes/evaluate_search_agent.py --output_json` or the training recipe's `eval_<stage>.json`
writes (a `records` list with one record per question). Both must hold the same questions (evaluate both stages
with `--heldout balanced`). Several evaluations pool into one comparison when A and B each name their files joined
by commas, in the same order (e.g. the held-out sets of two generated knowledge bases,
`warm_kb2.json,warm_kb3.json grpo_kb2.json,grpo_kb3.json`): the i-th file of B is paired with the i-th of A question
by question, and the pooled questions are resampled together. Exact match is compared always; sampled exact match
when both files have it (`--num_samples`). An interval that excludes 0 is a change that resampling the questions
does not explain. Where two paired files name the library versions that made them (`environment.versions`) and
these differ, the comparison says so (`versions_differ`): a paired difference then mixes the training with the
change of libraries.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> dict:
    from trl_multiturn.search.evaluation import compare_evaluations, pool_records

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="the evaluation of the earlier stage (e.g. the warm start); several: comma-separated")
    parser.add_argument("b", help="the evaluation of the later stage (e.g. GRPO), as many files as A, in A's order")
    parser.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples (default 10000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the bootstrap (default 0)")
    parser.add_argument("--confidence", type=float, default=0.95, help="level of the interval (default 0.95)")
    parser.add_argument("--output_json", default=None, help="also write the comparison here")
    args = parser.parse_args(argv)
    paths = [args.a.split(","), args.b.split(",")]
    if len(paths[0]) != len(paths[1]):
        parser.error(f"A names {len(paths[0])} files and B {len(paths[1])}: give B one file per file of A, "
                     "in the same order (the i-th of B is paired with the i-th of A).")
    files = [[json.loads(Path(p).read_text()) for p in side] for side in paths]
    records = [pool_records([f["records"] for f in side]) for side in files]
    out = compare_evaluations(*records, resamples=args.resamples, seed=args.seed, confidence=args.confidence)
    out.update(a=args.a, b=args.b)
    if len(paths[0]) > 1:
        out["pooled_files"] = len(paths[0])
    differ = {}
    for fa, fb in zip(*files):  # the versions of each paired A and B file
        va, vb = (f.get("environment", {}).get("versions", {}) for f in (fa, fb))
        differ.update({k: [va[k], vb[k]] for k in va.keys() & vb.keys() if va[k] != vb[k] and k not in differ})
    if differ:
        out["versions_differ"] = differ
        print(f"note: A and B were made with different library versions: {differ}")
    level = f"{args.confidence:.0%} CI"
    print(f"B = {args.b}\nA = {args.a}")
    print(f"{'metric':<20} {'subset':<7} {'n':>5} {'A':>6} {'B':>6} {'B - A':>7} {level:>18}")
    for metric in ("exact_match", "sampled_exact_match"):
        for subset, r in out.get(metric, {}).items():
            print(f"{metric:<20} {subset:<7} {r['n']:>5} {r['a']:>6.3f} {r['b']:>6.3f} {r['diff']:>+7.3f} "
                  f"[{r['ci_low']:+.3f}, {r['ci_high']:+.3f}]")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
