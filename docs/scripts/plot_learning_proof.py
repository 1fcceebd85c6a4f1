"""Draw the learning proof's held-out curve from the evaluation records in docs/results/learning_proof/.

    python docs/scripts/plot_learning_proof.py                  # rewrite docs/images/learning_proof.png
    python docs/scripts/plot_learning_proof.py --out /tmp/figs  # elsewhere

It also draws ``learning_proof_groups.png``: the paired change against the warm start of the runs that take one
on-policy optimizer step per rollout, by the number of groups with reward variance in that step (``GROUP_RUNS``:
12 groups x 2 steps, 24 x 1, 32 x 1, 32 x 1 with the redundant-search cost, 64 x 1), per seed and subset, each point with
its paired bootstrap 95% interval.

Step 0 is the warm start (``eval_warm_start.json``); each ``grpo_seed<S>_eval_step<N>.json`` is seed S's adapter after
N GRPO optimizer steps, evaluated greedily on the same 256 questions (128 1-hop, 128 2-hop). One panel per subset
(overall, 1-hop, 2-hop): exact match per step and seed, with the paired bootstrap 95% interval of the difference to
the warm start drawn around each point (``trl_multiturn.search.evaluation.compare_evaluations``, 10,000 resamples).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1]
RESULTS = DOCS / "results" / "learning_proof"
IMAGES = DOCS / "images"
SUBSETS = (("all", "overall"), ("hops_1", "1-hop"), ("hops_2", "2-hop"))
# (label, evaluation file pattern with {seed}, the warm start's evaluation it is paired with): one on-policy step
# per rollout, by the kept groups in that step. The 64-group runs started from a warm start regenerated with another
# transformers release, whose answers differ on 22 of the 256 questions; each run is paired with its own start.
GROUP_RUNS = (
    ("12 groups x 2 steps", "onestep_seed{seed}_eval_step2.json", "eval_warm_start.json"),
    ("24 groups x 1 step", "bigstep_seed{seed}_eval_step1.json", "eval_warm_start.json"),
    ("32 groups x 1 step", "step32_seed{seed}_eval_step1.json", "eval_warm_start.json"),
    ("32 groups x 1 step + search cost", "cost32_seed{seed}_eval_step1.json", "eval_warm_start.json"),
    ("64 groups x 1 step", "step64_seed{seed}_eval_step1.json", "eval_warm_start_step64_start.json"),
)


def _against_warm_start(warm: dict, path: Path) -> dict:
    """``{"summary", "paired"}`` of the evaluation at ``path``: its summary and its paired exact-match comparison
    with the warm start's records ``warm``."""
    from trl_multiturn.search.evaluation import compare_evaluations

    data = json.loads(path.read_text())
    paired = compare_evaluations(warm["records"], data["records"], metrics=["exact_match"])["exact_match"]
    return {"summary": data["summary"], "paired": paired}


def load_points(results: Path = RESULTS) -> dict[int, list[dict]]:
    """Seed -> ``[{"step", "summary", "paired"}]`` sorted by step, step 0 being the warm start."""
    warm = json.loads((results / "eval_warm_start.json").read_text())
    seeds: dict[int, list[dict]] = {}
    for path in sorted(results.glob("grpo_seed*_eval_step*.json")):
        seed, step = map(int, re.fullmatch(r"grpo_seed(\d+)_eval_step(\d+)\.json", path.name).groups())
        seeds.setdefault(seed, [{"step": 0, "summary": warm["summary"], "paired": None}])
        seeds[seed].append({"step": step, **_against_warm_start(warm, path)})
    return {s: sorted(p, key=lambda p: p["step"]) for s, p in seeds.items()}


def load_group_runs(results: Path = RESULTS, seeds: tuple[int, ...] = (0, 1)) -> dict[int, list[dict]]:
    """Seed -> ``[{"label", "summary", "paired"}]`` in ``GROUP_RUNS`` order, for the runs whose records exist, each
    paired with the evaluation of the warm start it started from."""
    starts = {start: json.loads((results / start).read_text()) for _, _, start in GROUP_RUNS}
    runs: dict[int, list[dict]] = {}
    for seed in seeds:
        for label, pattern, start in GROUP_RUNS:
            path = results / pattern.format(seed=seed)
            if path.exists():
                runs.setdefault(seed, []).append({"label": label, **_against_warm_start(starts[start], path)})
    return runs


def plot_group_runs(runs: dict[int, list[dict]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [label for label, *_ in GROUP_RUNS]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8), sharey=True)
    for ax, (key, name) in zip(axes, SUBSETS):
        for offset, (seed, points) in zip((-0.08, 0.08), runs.items()):
            x = [labels.index(p["label"]) + offset for p in points]
            diff = [p["paired"][key]["diff"] for p in points]
            yerr = [[p["paired"][key]["diff"] - p["paired"][key]["ci_low"] for p in points],
                    [p["paired"][key]["ci_high"] - p["paired"][key]["diff"] for p in points]]
            ax.errorbar(x, diff, yerr=yerr, marker="o", capsize=3, linestyle="none", label=f"seed {seed}")
        ax.axhline(0.0, color="gray", linestyle=":")
        ticks = [label.replace(" x ", "\nx ").replace(" + ", "\n+ ") for label in labels]
        ax.set_xticks(range(len(labels)), ticks, fontsize=8)
        ax.set_title(name)
    axes[0].set_ylabel("held-out EM minus warm start (greedy)")
    axes[0].legend(fontsize=8)
    fig.suptitle("one on-policy step per rollout, by kept groups in the step, against the warm start it started from; bars: "
                 "paired 95% CI (docs/results/learning_proof)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(seeds: dict[int, list[dict]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8), sharey=True)
    for ax, (key, label) in zip(axes, SUBSETS):
        for seed, points in seeds.items():
            steps = [p["step"] for p in points]
            em = [p["summary"][key]["exact_match"] for p in points]
            # the point is warm start + diff; its bar spans warm start + [ci_low, ci_high]
            paired = [p["paired"][key] if p["paired"] else {"diff": 0.0, "ci_low": 0.0, "ci_high": 0.0} for p in points]
            yerr = [[q["diff"] - q["ci_low"] for q in paired], [q["ci_high"] - q["diff"] for q in paired]]
            ax.errorbar(steps, em, yerr=yerr, marker="o", capsize=3, label=f"seed {seed}")
        ax.axhline(points[0]["summary"][key]["exact_match"], color="gray", linestyle=":", label="warm start")
        ax.set_title(f"{label} (n={points[0]['summary'][key]['n']})")
        ax.set_xlabel("GRPO optimizer step")
        ax.set_ylim(0, 1)
    axes[0].set_ylabel("held-out exact match (greedy)")
    axes[0].legend(fontsize=8)
    fig.suptitle("learning_proof_grpo.yaml from the warm start; bars: paired 95% CI of the change (docs/results/learning_proof)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=IMAGES,
                        help="Folder for learning_proof.png and learning_proof_groups.png.")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    plot_group_runs(load_group_runs(), args.out / "learning_proof_groups.png")
    return plot(load_points(), args.out / "learning_proof.png")


if __name__ == "__main__":
    print(main())
