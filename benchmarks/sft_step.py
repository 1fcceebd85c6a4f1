"""Multi-turn SFT step time: ``MultiTurnSFTTrainer`` (the warm start's trainer) vs TRL's ``SFTTrainer`` on the same
gold trajectories.

    python benchmarks/sft_step.py                 # CPU: SmolLM2-135M + LoRA r=16, 16 search-agent expert trajectories

The data is what the search recipe's warm start trains on: expert trajectories on the offline knowledge base
(``build_expert_trajectories``), built turn by turn through the protocol (observations masked). Both sides train
the same LoRA adapter from the same initial weights with the same ``SFTConfig`` (batch 1, no padding; the
recipe's default) for ``--steps`` optimizer steps. On CPU TRL's fused LM head scores every position of a row (only
Triton devices compact to the supervised ones); ours applies the head to the positions whose next token is
supervised, which for these trajectories are ~20% of them. Reports seconds per trajectory, the final losses (equal
up to float error: same loss, same gradients) and the ratio, alternating which side goes first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workload as W  # noqa: E402

W.offline_env()

import torch  # noqa: E402


def trajectories(n: int, topk: int, tok):
    from trl_multiturn.protocols import TagProtocol
    from trl_multiturn.search import BM25Retriever, SearchEnvironment, build_expert_trajectories, build_offline_dataset
    from trl_multiturn.sft import trajectory_from_tag_text

    data = build_offline_dataset(num_entities=300, seed=0)
    retriever = BM25Retriever(data.corpus)
    experts, _ = build_expert_trajectories(
        data.train_rows[:n], env_factory=lambda: SearchEnvironment(retriever, topk=topk), seed=0
    )
    protocol = TagProtocol(max_observation_tokens=256)
    return [trajectory_from_tag_text(e.prompt, e.to_text(), tok, protocol) for e in experts]


def run(side: str, trajs, args) -> dict:
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    from trl_multiturn.models import load_smollm2
    from trl_multiturn.sft import MultiTurnSFTTrainer, sft_dataset

    model, tok = load_smollm2()
    cls = SFTTrainer if side == "trl" else MultiTurnSFTTrainer
    config = SFTConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=1, gradient_accumulation_steps=1,
        max_steps=args.steps, learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no",
        bf16=False, max_length=None, seed=0, disable_tqdm=True, lr_scheduler_type="constant",
    )
    peft = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = cls(model=model, args=config, train_dataset=sft_dataset(trajs), processing_class=tok, peft_config=peft)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"seconds": wall, "s_per_trajectory": wall / args.steps, "losses": losses}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps (one trajectory each)")
    parser.add_argument("--topk", type=int, default=3, help="documents per search in the expert trajectories")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/sft_step.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from trl_multiturn.models import load_tokenizer_offline

    trajs = trajectories(args.trajectories, args.topk, load_tokenizer_offline())
    lengths = [len(t.input_ids) for t in trajs]
    supervised = sum(t.num_action_tokens for t in trajs) / sum(lengths)
    print(f"{len(trajs)} trajectories, {min(lengths)}..{max(lengths)} tokens, supervised fraction {supervised:.3f}")
    rounds = []
    for r in range(args.repeats):
        res = {}
        for side in (["trl", "ours"] if r % 2 == 0 else ["ours", "trl"]):
            res[side] = run(side, trajs, args)
            print(f"  round {r}: {side:4s} {res[side]['s_per_trajectory']:.2f} s/trajectory", flush=True)
        rounds.append(res)
    med = {s: statistics.median(rd[s]["s_per_trajectory"] for rd in rounds) for s in ("trl", "ours")}
    loss_diff = max(abs(a - b) for a, b in zip(rounds[0]["trl"]["losses"], rounds[0]["ours"]["losses"]))
    W.print_table(["TRL 1.16", "ours"], [("s / trajectory (median)", "{:.2f}", [med["trl"], med["ours"]])],
                  label_width=28, widths=10)
    print(f"speed-up TRL / ours: {med['trl'] / med['ours']:.2f}x; largest logged-loss difference {loss_diff:.2e}")
    result = {"benchmark": "sft_step", "settings": vars(args), "lengths": lengths, "supervised_fraction": supervised,
              "median_s_per_trajectory": med, "speedup": med["trl"] / med["ours"], "max_loss_diff": loss_diff,
              "rounds": rounds}
    W.write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
