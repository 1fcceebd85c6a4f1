"""The gradient norm of the expert loss at the warm start, to set ``expert_loss_coef`` before a run.

An optimizer step with ``expert_loss_coef = c`` adds ``c`` times the gradient of the mean of its micro-batches' expert
token means (``trl_multiturn.expert_loss``). This script builds the GRPO stage of a recipe config exactly as the recipe
does (model, ``--init_adapter``, the expert trajectories, the trainer and its expert loss with c = 1), then takes the
gradient of the expert loss of the first ``--steps`` optimizer steps (the examples each step draws) at the starting
adapter, for each seed, and writes its norm over the trainable parameters. Nothing is trained and no evaluation data
is read: the held-out and validation questions are not touched.

    python docs/scripts/expert_gradient_scale.py --config recipes/configs/learning_proof_expert_3x32.yaml \\
        --seeds 0 1 --output docs/results/learning_proof/expert_gradient_scale.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def load_recipe():
    spec = importlib.util.spec_from_file_location("search_agent_recipe", ROOT / "recipes" / "search_agent.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def expert_gradient_norms(recipe, config: str, seed: int, steps: int) -> dict:
    from datasets import Dataset
    from peft import PeftModel
    from trl import ModelConfig, TrlParser

    from trl_multiturn import MultiTurnGRPOConfig, MultiTurnGRPOTrainer
    from trl_multiturn.protocols import TagProtocol
    from trl_multiturn.search import SearchEnvironment
    from trl_multiturn.search.rewards import exact_match_reward

    parser = TrlParser((recipe.SearchAgentArguments, MultiTurnGRPOConfig, ModelConfig))
    parser.set_defaults(**recipe.DEFAULTS)
    script_args, training_args, model_args = parser.parse_args_and_config(
        args=["--config", config, "--seed", str(seed), "--expert_loss_coef", "1.0", "--output_dir", "/tmp/expert_scale"])
    corpus, train_rows, _ = recipe.load_data(script_args)
    retriever = recipe.build_retriever(script_args, corpus)

    def env_factory():
        return SearchEnvironment(retriever, topk=script_args.topk, max_searches=script_args.max_searches)

    _, model, tokenizer = recipe.load_model(model_args, training_args)
    model = PeftModel.from_pretrained(model, script_args.init_adapter, is_trainable=True)
    protocol = TagProtocol(max_observation_tokens=training_args.max_observation_tokens)
    keep = ("question", "golden_answers", "id", "hops", "gold_doc_ids")
    trainer = MultiTurnGRPOTrainer(
        model=model, reward_funcs=[exact_match_reward], args=training_args,
        train_dataset=Dataset.from_list([{k: r[k] for k in keep if k in r} for r in train_rows]),
        processing_class=tokenizer, environment_factory=env_factory, protocol=protocol,
        expert_dataset=recipe.expert_dataset(script_args, train_rows, tokenizer, protocol, env_factory, training_args),
    )
    expert, model = trainer._expert_loss, trainer.model
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    out = {"seed": seed, "expert_examples": len(expert.rows), "micro_batches_per_step": expert.accum,
           "expert_micro_batch_size": expert.micro_batch_size, "steps": []}
    for step in range(steps):
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        nlls: dict = {}
        for _ in range(expert.accum):
            expert(model, step, nlls).backward()  # c * L_expert / accum with c = 1, as in training
        norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in params if p.grad is not None))
        out["steps"].append({"step": step + 1, "grad_norm": float(norm),
                             "expert_nll": sum(nlls["loss/expert_nll"]) / len(nlls["loss/expert_nll"]),
                             "seconds": time.perf_counter() - start})
        print(f"seed {seed} step {step + 1}: expert grad norm {float(norm):.5f}", flush=True)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=1, help="optimizer steps whose expert draws are measured")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    recipe = load_recipe()
    results = {"config": args.config, "threads": torch.get_num_threads(),
               "seeds": [expert_gradient_norms(recipe, args.config, s, args.steps) for s in args.seeds]}
    Path(args.output).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
