"""Draw the data flow of one training step of ``MultiTurnGRPOTrainer`` (docs/images/trainer_data_flow.svg).

    python docs/scripts/draw_trainer_data_flow.py                 # rewrite docs/images/trainer_data_flow.svg
    python docs/scripts/draw_trainer_data_flow.py --out flow.png  # any format matplotlib writes

rollout -> trajectories -> advantages -> micro-batches -> scored log-probs -> loss, each stage with the module that
owns it (``trl_multiturn.trainer`` only wires them into TRL) and the shape of what it hands on (B prompts, G samples per prompt, C completion tokens, K turns). The
stages and their wording live in ``STAGES`` below; docs/trainer.md shows the picture.
"""

from __future__ import annotations

import argparse
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "images" / "trainer_data_flow.svg"

#: (stage, module that owns it, what happens) -- drawn top to bottom
STAGES: list[tuple[str, str, str]] = [
    ("rollout", "trl_multiturn.rollout",
     "B rows x G samples: env.reset(row), then per turn: generate -> protocol.parse -> env.step ->\n"
     "observation ids appended with action mask 0; sampled ids kept exactly as sampled"),
    ("trajectories", "trl_multiturn.trajectory",
     "B*G Trajectory: prompt_ids, completion_ids (C,), action_mask (C,) 1 = sampled,\n"
     "logprobs (C,), turn_ids (C,), turn_rewards (K,); reward = env reward + reward_funcs"),
    ("advantages", "trl_multiturn.advantages",
     "rollout_advantages: A = (r - mean_G r) / (std_G r + eps), (B*G,) per trajectory\n"
     "or per token (B*G, C) for turn-level credit (turn_advantage); failed or non-finite rewards leave the baseline"),
    ("micro-batches", "trl_multiturn.batching",
     "shuffle_groups -> mini-batches (one optimizer step each) -> balanced_micro_batches (gradient accumulation),\n"
     "balanced by tokens or cut to a token budget; attach_normalizers: its mini-batch's counts over all ranks"),
    ("scored log-probs", "trl_multiturn.scoring",
     "LayoutScorer: one forward per micro-batch in compact, packed or shared-prompt rows (trl_multiturn.layouts,\n"
     "each checked once): log pi_theta of the sampled tokens (b, C); log pi_old scored the same way"),
    ("loss", "trl_multiturn.loss",
     "grpo_loss: ratio = exp(log pi_theta - log pi_old), clipped to [1 - eps_low, 1 + eps_high], times A, + beta KL;\n"
     "aggregated by loss_aggregation (default: per-trajectory N_g) -> backward; optimizer step per mini-batch"),
]

#: what travels along each arrow (between stage i and stage i + 1)
EDGES: list[str] = [
    "B*G trajectories",
    "rewards r (B*G,)",
    "advantages",
    "micro-batch tensors (b, P + C)",
    "log-probs (b, C)",
]


def draw(path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    plt.rcParams["svg.hashsalt"] = "trl-multiturn"  # stable ids: the file changes only when the picture does
    plt.rcParams["svg.fonttype"] = "none"  # text stays text: small, searchable, sharp at any zoom
    n = len(STAGES)
    box_h, gap = 1.0, 0.55
    height = n * box_h + (n - 1) * gap
    fig = plt.figure(figsize=(9.6, 0.62 * height + 0.5))
    ax = fig.add_axes((0.01, 0.01, 0.98, 0.98))
    ax.set_xlim(0, 10)
    ax.set_ylim(-0.1, height + 0.1)
    ax.axis("off")
    for i, (stage, module, text) in enumerate(STAGES):
        top = height - i * (box_h + gap)
        ax.add_patch(FancyBboxPatch((0.05, top - box_h), 9.9, box_h, boxstyle="round,pad=0,rounding_size=0.12",
                                    facecolor="#eef3fb", edgecolor="#3b6ab0", linewidth=1.2))
        ax.text(0.2, top - 0.22, f"{i + 1}. {stage}", fontsize=10.5, fontweight="bold", va="center", color="#1d3d6e")
        ax.text(9.8, top - 0.22, module, fontsize=8, va="center", ha="right", family="monospace", color="#555555")
        ax.text(0.2, top - 0.63, text, fontsize=7.6, va="center", linespacing=1.35)
        if i < len(EDGES):
            ax.annotate("", xy=(1.2, top - box_h - gap + 0.02), xytext=(1.2, top - box_h - 0.02),
                        arrowprops={"arrowstyle": "-|>", "color": "#3b6ab0", "linewidth": 1.4})
            ax.text(1.4, top - box_h - gap / 2, EDGES[i], fontsize=8, va="center", style="italic", color="#333333")
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"Date": None} if path.suffix == ".svg" else {}
    fig.savefig(path, metadata=metadata)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="file to write (.svg or .png)")
    args = parser.parse_args(argv)
    path = draw(args.out)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
