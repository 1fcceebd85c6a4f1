"""Turn-level credit assignment, ablated: GRPO from one warm-start adapter with turn_advantage = trajectory, mt-grpo
and discounted, same seed, data and budget; held-out exact match after each arm and the training curves.

    python recipes/ablate_turn_credit.py --init_adapter outputs/search_agent_learning_run/sft_adapter

Each arm is one run of recipes/search_agent.py (a subprocess, so arms share nothing but the files):
``--init_adapter A --turn_advantage M --retrieval_hit_reward R --question_hops H`` on top of ``--config``. The
per-turn reward R (a search whose documents contain a gold answer, first hit only) is what the turn-aware modes
credit to the turn that earned it; in the "trajectory" arm the same reward is added to the trajectory's reward, so
every arm sees the same signals and differs only in where the credit goes. The first arm also evaluates the
starting adapter ("init"). Writes ``<output_dir>/ablation.json`` and ``ablation.md`` (a table) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def steps_to_reach(history: list[dict], key: str, target: float, window: int = 3) -> int | None:
    """First optimizer step at which the moving average (over ``window`` logged steps) of ``key`` reaches ``target``."""
    values = [(h["step"], h[key]) for h in history if key in h]
    for i in range(len(values)):
        chunk = [v for _, v in values[max(0, i - window + 1) : i + 1]]
        if len(chunk) == window and sum(chunk) / window >= target:
            return values[i][0]
    return None


def run_arm(mode: str, args, extra: list[str], evaluate_init: bool) -> dict:
    out = Path(args.output_dir) / mode
    cmd = [
        sys.executable, str(HERE / "search_agent.py"), "--config", args.config, "--init_adapter", args.init_adapter,
        "--turn_advantage", mode, "--retrieval_hit_reward", str(args.retrieval_hit_reward),
        "--question_hops", args.question_hops, "--max_steps", str(args.max_steps), "--seed", str(args.seed),
        "--output_dir", str(out), "--eval_before", str(evaluate_init).lower(), *extra,
    ]
    print(f"[ablation] {mode}: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, check=True)
    metrics = json.loads((out / "metrics.json").read_text())
    history = json.loads((out / "log_history.json").read_text())
    return {"metrics": metrics, "history": history}


def table(arms: dict, target: float) -> str:
    lines = [
        f"| arm | held-out EM | held-out F1 | searches | answered | steps to train-rollout EM >= {target:g} | GRPO minutes |",
        "|---|---|---|---|---|---|---|",
    ]
    init = next((a["metrics"]["init"] for a in arms.values() if "init" in a["metrics"]), None)
    if init is not None:
        s = init["summary"]["all"]
        lines.append(f"| start (warm-start adapter) | {s['exact_match']:.3f} | {s['f1']:.3f} | {s['searches']:.2f} | "
                     f"{s.get('answered', float('nan')):.2f} | - | - |")
    for mode, a in arms.items():
        s = a["metrics"]["grpo"]["summary"]["all"]
        reach = steps_to_reach(a["history"], "rewards/exact_match_reward/mean", target)
        lines.append(
            f"| {mode} | {s['exact_match']:.3f} | {s['f1']:.3f} | {s['searches']:.2f} | {s.get('answered', float('nan')):.2f} | "
            f"{reach if reach is not None else 'not reached'} | {a['metrics']['grpo']['stage_seconds'] / 60:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--init_adapter", required=True, help="Warm-start adapter every arm starts from.")
    parser.add_argument("--config", default=str(HERE / "configs" / "learning_run.yaml"))
    parser.add_argument("--modes", nargs="+", default=["trajectory", "mt-grpo", "discounted"])
    parser.add_argument("--max_steps", type=int, default=8)
    parser.add_argument("--retrieval_hit_reward", type=float, default=0.5)
    parser.add_argument("--question_hops", default="2", choices=["1", "2", "all"])
    parser.add_argument("--target_em", type=float, default=0.3, help="Training-rollout EM for 'steps to reach'.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output_dir", default="outputs/turn_credit_ablation")
    args, extra = parser.parse_known_args(argv)  # anything else goes to every arm (e.g. --num_eval_questions 128)
    for mode in args.modes:
        if mode not in ("trajectory", "mt-grpo", "discounted"):
            parser.error(f"--modes: {mode!r} is not one of trajectory, mt-grpo, discounted")
    arms = {mode: run_arm(mode, args, extra, evaluate_init=(i == 0)) for i, mode in enumerate(args.modes)}
    md = table(arms, args.target_em)
    out = Path(args.output_dir)
    (out / "ablation.md").write_text(md + "\n")
    (out / "ablation.json").write_text(json.dumps(
        {"settings": vars(args) | {"extra": extra},
         "arms": {m: {"metrics": a["metrics"], "curve": [{k: h[k] for k in ("step", "reward", "rewards/exact_match_reward/mean") if k in h}
                                                        for h in a["history"] if "reward" in h]} for m, a in arms.items()}},
        indent=2, default=str))
    print("\n" + md, flush=True)
    return arms


if __name__ == "__main__":
    main()
