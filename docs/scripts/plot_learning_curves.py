"""Draw the learning curves of the measured search-agent runs from the JSON files in docs/results/.

    python docs/scripts/plot_learning_curves.py                  # rewrite docs/images/*.png from docs/results/
    python docs/scripts/plot_learning_curves.py --out /tmp/figs  # elsewhere

Two figures, each naming the run and the JSON file it was drawn from:

* ``learning_curves.png`` -- per GRPO optimizer step, the training reward (``reward`` in ``log_history``: exact match
  plus the retrieval-hit reward, mean over the step's 16 sampled trajectories) and the exact match of those samples
  (``rewards/exact_match_reward/mean``), one panel per run; the held-out exact match of the warm start and of the
  GRPO adapter, measured on the same questions with the same budget, are drawn as horizontal lines.
* ``heldout_em.png`` -- held-out exact match, warm start against GRPO, per question type, with +-1 binomial
  standard error ``sqrt(p (1 - p) / n)``.

Runs (docs/search_agent.md, "Measured runs", describes them):

* ``learning_run_grpo_2hop.json`` -- 8 GRPO steps on two-hop questions; held-out: 129 two-hop questions, the warm
  start's exact match at the same budget under ``sft_same_questions_same_budget``.
* ``learning_run_grpo_2hop_eval_1hop.json`` -- the same adapter evaluated on the 127 held-out one-hop questions.
* ``learning_run_grpo_mix.json`` -- 8 GRPO steps on the mix of one- and two-hop questions; held-out: all 256
  questions, the warm start's numbers at the same budget under ``warm_start_same_budget``.

The warm start is the same adapter in every run, so its one-hop exact match (from ``learning_run_grpo_mix.json``)
is the reference for the two-hop run's one-hop evaluation too.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1]
RESULTS = DOCS / "results"
IMAGES = DOCS / "images"

TWO_HOP = "learning_run_grpo_2hop.json"
TWO_HOP_EVAL_ONE_HOP = "learning_run_grpo_2hop_eval_1hop.json"
MIX = "learning_run_grpo_mix.json"


@dataclass
class Curve:
    """One GRPO run's training log: optimizer steps and what was logged at each."""

    title: str
    source: str
    steps: list[int]
    reward: list[float]
    exact_match: list[float]
    heldout: dict[str, tuple[float, float]]  # label -> (warm start EM, GRPO EM) on the held-out questions


@dataclass
class Level:
    """Held-out exact match of the warm start and of GRPO on one kind of question."""

    run: str
    questions: str
    n: int
    warm_start: float
    grpo: float
    source: str


def _read(results: Path, name: str) -> dict:
    path = results / name
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: the figures are drawn from the committed run results in docs/results/."
        )
    return json.loads(path.read_text())


def _get(data: dict, keys: tuple[str, ...], source: str):
    value = data
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            raise KeyError(f"{source} has no {'.'.join(keys)} (missing {key!r}); it is not a measured-run result file.")
        value = value[key]
    return value


def training_curve(data: dict, source: str, title: str, heldout: dict[str, tuple[float, float]]) -> Curve:
    """The per-step series of ``data["log_history"]``; entries without ``reward`` (the final summary) are skipped."""
    history = [h for h in _get(data, ("log_history",), source) if "reward" in h]
    if not history:
        raise ValueError(f"{source}: log_history has no entry with a 'reward'; nothing to draw.")
    missing = [h.get("step") for h in history if "rewards/exact_match_reward/mean" not in h]
    if missing:
        raise KeyError(f"{source}: steps {missing} of log_history have no 'rewards/exact_match_reward/mean'.")
    return Curve(
        title=title,
        source=source,
        steps=[int(h["step"]) for h in history],
        reward=[float(h["reward"]) for h in history],
        exact_match=[float(h["rewards/exact_match_reward/mean"]) for h in history],
        heldout=heldout,
    )


def load_runs(results: Path = RESULTS) -> tuple[list[Curve], list[Level]]:
    """Read the three result files; returns the training curves and the held-out exact-match levels."""
    two_hop, one_hop_eval, mix = (_read(results, name) for name in (TWO_HOP, TWO_HOP_EVAL_ONE_HOP, MIX))
    warm_2hop = float(_get(two_hop, ("sft_same_questions_same_budget", "exact_match_2hop"), TWO_HOP))
    grpo_2hop = _get(two_hop, ("grpo", "summary", "hops_2"), TWO_HOP)
    grpo_1hop = _get(one_hop_eval, ("summary", "hops_1"), TWO_HOP_EVAL_ONE_HOP)
    warm_mix = _get(mix, ("warm_start_same_budget",), MIX)
    grpo_mix = _get(mix, ("summary",), MIX)
    levels = [
        Level("GRPO on two-hop questions", "two-hop", int(grpo_2hop["n"]), warm_2hop, float(grpo_2hop["exact_match"]),
              TWO_HOP),
        Level("GRPO on two-hop questions", "one-hop", int(grpo_1hop["n"]), float(_get(warm_mix, ("hops_1",), MIX)),
              float(grpo_1hop["exact_match"]), TWO_HOP_EVAL_ONE_HOP),
    ]
    for label, key, warm_key in (("all", "all", "exact_match"), ("one-hop", "hops_1", "hops_1"),
                                 ("two-hop", "hops_2", "hops_2")):
        level = _get(grpo_mix, (key,), MIX)
        levels.append(Level("GRPO on the one- and two-hop mix", label, int(level["n"]),
                            float(_get(warm_mix, (warm_key,), MIX)), float(level["exact_match"]), MIX))
    curves = [
        training_curve(two_hop, TWO_HOP, "GRPO on two-hop questions",
                       {f"two-hop (n={levels[0].n})": (levels[0].warm_start, levels[0].grpo)}),
        training_curve(mix, MIX, "GRPO on the one- and two-hop mix",
                       {f"all (n={levels[2].n})": (levels[2].warm_start, levels[2].grpo)}),
    ]
    return curves, levels


def standard_error(p: float, n: int) -> float:
    """Binomial standard error of an exact-match rate ``p`` measured on ``n`` questions."""
    return math.sqrt(p * (1.0 - p) / n)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_learning_curves(curves: list[Curve], path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(curves), figsize=(5.2 * len(curves), 4.2), sharey=True, squeeze=False)
    for ax, curve in zip(axes[0], curves):
        ax.plot(curve.steps, curve.reward, "o-", color="C0", label="training reward (EM + retrieval hit)")
        ax.plot(curve.steps, curve.exact_match, "s-", color="C1", label="training exact match")
        for label, (warm, grpo) in curve.heldout.items():
            ax.axhline(warm, linestyle="--", color="gray", label=f"held-out EM, warm start, {label}: {warm:.3f}")
            ax.axhline(grpo, linestyle="-", color="C2", label=f"held-out EM after GRPO, {label}: {grpo:.3f}")
        ax.set_title(f"{curve.title}\n{curve.source}", fontsize=9)
        ax.set_xlabel("GRPO optimizer step (16 trajectories: 2 prompts x 8)")
        ax.set_xticks(curve.steps)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    axes[0][0].set_ylabel("mean over the step's samples / held-out EM")
    axes[0][0].set_ylim(0, 1.45)
    fig.suptitle("SmolLM2-135M + LoRA, search agent on the offline knowledge base, 2 CPU cores", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path


def plot_heldout_em(levels: list[Level], path: Path) -> Path:
    plt = _pyplot()
    runs = list(dict.fromkeys(level.run for level in levels))
    fig, axes = plt.subplots(1, len(runs), figsize=(5.2 * len(runs), 4.4), sharey=True, squeeze=False,
                             gridspec_kw={"width_ratios": [sum(lv.run == r for lv in levels) for r in runs]})
    width = 0.38
    for ax, run in zip(axes[0], runs):
        mine = [level for level in levels if level.run == run]
        x = list(range(len(mine)))
        for offset, attr, color, name in ((-width / 2, "warm_start", "gray", "warm start"),
                                          (width / 2, "grpo", "C2", "after 8 GRPO steps")):
            values = [getattr(level, attr) for level in mine]
            errors = [standard_error(v, level.n) for v, level in zip(values, mine)]
            bars = ax.bar([i + offset for i in x], values, width, yerr=errors, capsize=3, color=color, label=name)
            ax.bar_label(bars, labels=[f"{v:.3f}" for v in values], fontsize=7, padding=2)
        ax.set_xticks(x, [f"{level.questions}\n(n={level.n})" for level in mine])
        sources = list(dict.fromkeys(level.source for level in mine))
        ax.set_title("\n".join([run, *sources]), fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    axes[0][0].set_ylabel("held-out exact match")
    axes[0][0].set_ylim(0, 1.15)
    fig.suptitle("Held-out exact match, warm start vs GRPO (greedy, 1024-token budget; error bars: +-1 binomial "
                 "standard error)", fontsize=10)
    fig.text(0.5, 0.01, f"The warm start is the same adapter in both runs; its one-hop exact match is the one in {MIX} "
             "(warm_start_same_budget).", ha="center", fontsize=7, color="dimgray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict[str, Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder holding the run result JSON files")
    parser.add_argument("--out", type=Path, default=IMAGES, help="folder the PNG files are written to")
    args = parser.parse_args(argv)
    curves, levels = load_runs(args.results)
    written = {
        "learning_curves": plot_learning_curves(curves, args.out / "learning_curves.png"),
        "heldout_em": plot_heldout_em(levels, args.out / "heldout_em.png"),
    }
    for path in written.values():
        print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()
