"""Render the table of every learning-proof run on the held-out set from the committed paired comparisons.

    python docs/scripts/learning_proof_table.py            # print the table
    python docs/scripts/learning_proof_table.py --write    # rewrite it in docs/search_agent.md (between the markers)

Each row is one seed of one run: the paired difference of held-out exact match against the run's own warm start
with its bootstrap 95% interval (``*_vs_warm_start.json``, written by ``recipes/compare_evaluations.py``), overall,
per hop count and, where it was measured, sampled. ``target`` applies the learning proof's rule to that seed:
overall greedy interval above 0 and neither hop subset's interval below 0. tests/test_docs_examples.py checks that
the page holds what this script renders.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1]
RESULTS = DOCS / "results" / "learning_proof"
PAGE = DOCS / "search_agent.md"
START = "<!-- learning-proof-table:start (docs/scripts/learning_proof_table.py --write) -->"
END = "<!-- learning-proof-table:end -->"

# (section anchor on the page, what the run is, optimizer steps x kept groups per step, learning rate,
#  comparison file pattern with {seed}, seeds)
RUNS = (
    ("measured-so-far-not-a-proof-yet", "exact match, 2 steps per rollout (the second off-policy)", "4 x 6", "5e-5",
     "grpo_seed{seed}_step4_vs_warm_start.json", (0,)),
    ("turn-level-credit-on-the-search-that-the-warm-start-skips-two-seeds", "+ hit credit (mt-grpo), hops balanced",
     "4 x 6", "5e-5", "turn_seed{seed}_step4_vs_warm_start.json", (0, 1)),
    ("the-hit-credit-gated-on-answering", "+ gate on answering", "4 x 6", "5e-5",
     "gated_seed{seed}_step4_vs_warm_start.json", (0,)),
    ("one-on-policy-step-per-rollout", "hit credit, gated; one on-policy step per rollout", "2 x 12", "5e-5",
     "onestep_seed{seed}_step2_vs_warm_start.json", (0, 1)),
    ("one-on-policy-step-over-24-groups", "the same, one step", "1 x 24", "5e-5",
     "bigstep_seed{seed}_step1_vs_warm_start.json", (0, 1)),
    ("one-on-policy-step-over-32-groups", "the same, one step", "1 x 32", "5e-5",
     "step32_seed{seed}_step1_vs_warm_start.json", (0, 1)),
    ("a-cost-on-redundant-searches-32-groups", "+ cost on a search after the answer was found", "1 x 32", "5e-5",
     "cost32_seed{seed}_step1_vs_warm_start.json", (0, 1)),
    ("one-on-policy-step-over-64-groups", "hit credit, gated, one step", "1 x 64", "5e-5",
     "step64_seed{seed}_step1_vs_warm_start.json", (0, 1)),
    ("the-chosen-step-on-the-held-out-set", "the same at the validation-chosen step size", "1 x 64", "1.25e-5",
     "lr125_seed{seed}_step1_vs_warm_start.json", (0, 1)),
    ("a-cost-on-repeated-queries-64-groups", "hit credit + cost on a repeated query", "1 x 64", "5e-5",
     "repeat64_seed{seed}_step1_vs_warm_start.json", (0, 1)),
    ("exact-match-alone-64-groups", "exact match alone (Search-R1's reward)", "1 x 64", "5e-5",
     "outcome64_seed{seed}_step1_vs_warm_start.json", (0, 1)),
    ("rollouts-at-temperature-05-64-groups", "the same, rollouts at temperature 0.5", "1 x 64", "5e-5",
     "outcome64_t05_seed{seed}_step1_vs_warm_start.json", (0, 1)),
    ("two-on-policy-steps-of-32-groups", "exact match alone, two on-policy steps: after the first", "1 x 32", "2.5e-5",
     "outcome2x32_seed{seed}_step1_vs_warm_start.json", (0, 1)),
    ("two-on-policy-steps-of-32-groups", "exact match alone, two on-policy steps: after the second", "2 x 32",
     "2.5e-5", "outcome2x32_seed{seed}_step2_vs_warm_start.json", (0, 1)),
    ("three-on-policy-steps-of-32-groups", "exact match alone, three on-policy steps", "3 x 32", "2.5e-5",
     "outcome3x32_seed{seed}_step3_vs_warm_start.json", (0, 1)),
    ("a-kl-anchor-to-the-warm-start-three-steps-of-32-groups", "the same + KL anchor to the warm start (beta 0.1)",
     "3 x 32", "2.5e-5", "kl3x32_seed{seed}_step3_vs_warm_start.json", (0, 1)),
    ("a-greedy-baseline-three-steps-of-32-groups", "the same with a greedy baseline (ReMax), no KL", "3 x 32",
     "2.5e-5", "greedy3x32_seed{seed}_step3_vs_warm_start.json", (0, 1)),
    ("an-expert-loss-three-steps-of-32-groups", "the same + expert loss (PPO-ptx, c 0.5), no KL", "3 x 32",
     "2.5e-5", "expert3x32_seed{seed}_step3_vs_warm_start.json", (0, 1)),
)
SUBSETS = ("all", "hops_1", "hops_2")


def _cell(m: dict) -> str:
    text = f"{m['diff']:+.3f} [{m['ci_low']:+.3f}, {m['ci_high']:+.3f}]"
    return f"**{text}**" if m["ci_low"] > 0 else text


def _meets_target(em: dict) -> bool:
    return em["all"]["ci_low"] > 0 and all(em[s]["ci_high"] >= 0 for s in ("hops_1", "hops_2"))


def rows() -> list[dict]:
    out = []
    for anchor, what, steps, lr, pattern, seeds in RUNS:
        for seed in seeds:
            path = RESULTS / pattern.format(seed=seed)
            data = json.loads(path.read_text(encoding="utf-8"))
            em = data["exact_match"]
            sampled = data.get("sampled_exact_match", {}).get("all")
            out.append({"anchor": anchor, "what": what, "steps": steps, "lr": lr, "seed": seed, "file": path.name,
                        "em": {s: em[s] for s in SUBSETS}, "sampled": sampled, "target": _meets_target(em)})
    return out


def render() -> str:
    lines = [
        "| run | steps x groups | lr | seed | overall, greedy | 1-hop | 2-hop | overall, sampled | target |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows():
        sampled = _cell(r["sampled"]) if r["sampled"] else "not measured"
        lines.append(
            f"| [{r['what']}](#{r['anchor']}) | {r['steps']} | {r['lr']} | [{r['seed']}](results/learning_proof/{r['file']}) | "
            + " | ".join(_cell(r["em"][s]) for s in SUBSETS)
            + f" | {sampled} | {'met' if r['target'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def write(page: Path = PAGE) -> None:
    text = page.read_text(encoding="utf-8")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    page.write_text(f"{head}{START}\n{render()}{END}{tail}", encoding="utf-8")


def on_page(page: Path = PAGE) -> str:
    text = page.read_text(encoding="utf-8")
    return text.split(START, 1)[1].split(END, 1)[0].lstrip("\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the table in docs/search_agent.md")
    if parser.parse_args().write:
        write()
    else:
        print(render(), end="")
