"""Evaluate a search agent (a base model, or a base model + adapter) on any QA file and corpus.

    python recipes/evaluate_search_agent.py                                          # base SmolLM2, offline KB
    python recipes/evaluate_search_agent.py --adapter outputs/search_agent/adapter   # the trained adapter
    python recipes/evaluate_search_agent.py --adapter me/search-agent \
        --dataset RUC-NLPIR/FlashRAG_datasets:nq --eval_split test --corpus wiki-18.jsonl

Reports exact match (Search-R1's metric), substring match, F1, average searches, invalid-action rate and answer
rate, overall and per number of hops, with greedy decoding through the same rollout loop as training. With
`--output_json` the summary and every per-question record are written to a file.

The fixed held-out set for comparing stages (256 questions, half 1-hop, half 2-hop, the same for every stage), with
sampled exact match at the training temperature (k = 4 samples per question):

    python recipes/evaluate_search_agent.py --adapter outputs/warm_start/adapter --heldout balanced \
        --num_samples 4 --temperature 0.7 --output_json eval_warm.json
    python recipes/compare_evaluations.py eval_warm.json eval_grpo.json   # paired bootstrap 95% CI of the difference

`--heldout validation` draws as many questions, the same way, from those the held-out set leaves out: choose a
setting there, then evaluate it once with `--heldout balanced`.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from trl import ModelConfig, TrlParser

_spec = importlib.util.spec_from_file_location("search_agent_recipe", Path(__file__).with_name("search_agent.py"))
recipe = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("search_agent_recipe", recipe)
_spec.loader.exec_module(recipe)


@dataclass
class EvalArguments(recipe.SearchAgentArguments):
    """> Parameters of the evaluation (the task parameters are those of recipes/search_agent.py)."""

    adapter: str | None = field(default=None, metadata={"help": "A PEFT adapter to load on the base model: a local path or a Hub repo id."})
    split: str = field(default="test", metadata={"help": "'test' (held-out) or 'train' questions of the offline KB."})
    max_turns: int = field(default=4, metadata={"help": "Maximum actions per trajectory."})
    max_completion_length: int = field(default=1024, metadata={"help": "Token budget of a trajectory (actions and observations)."})
    max_observation_tokens: int = field(default=256, metadata={"help": "Observations are cut to this many tokens."})
    output_json: str | None = field(default=None, metadata={"help": "Write the summary and per-question records here."})
    num_samples: int = field(default=0, metadata={"help": "Also sample this many trajectories per question (0 = greedy only, else >= 2) and report their mean exact match (sampled_exact_match)."})
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature of --num_samples (use the training temperature; 0.7 in recipes/configs)."})
    eval_seed: int = field(default=0, metadata={"help": "Seed of the sampled trajectories of --num_samples."})
    turn_layout: str = field(default="sequence", metadata={"help": "'sequence' or 'per_turn': as the training run (with a context policy below, per_turn)."})
    keep_last_observations: int | None = field(default=None, metadata={"help": "Context policy of the training run: observations older than the last N replaced by a placeholder (needs --turn_layout per_turn)."})
    truncate_observations: int | None = field(default=None, metadata={"help": "Context policy of the training run: observations but the latest cut to M tokens (needs --turn_layout per_turn)."})


def main(args: EvalArguments, model_args: ModelConfig) -> dict:
    from trl_multiturn.protocols import TagProtocol
    from trl_multiturn.search import SearchEnvironment
    from trl_multiturn.search.evaluation import evaluate_search_agent

    from trl_multiturn.context import context_policy
    from trl_multiturn.generation import SamplingParams
    from trl_multiturn.search.evaluation import heldout_rows, validation_rows

    corpus, train_rows, test_rows = recipe.load_data(args)  # --heldout balanced: the fixed held-out set
    rows = test_rows
    if args.split == "train":
        pick = {"balanced": heldout_rows, "validation": validation_rows}.get(args.heldout)
        rows = pick(train_rows, args.heldout_size, args.heldout_seed) if pick else train_rows
    retriever = recipe.build_retriever(args, corpus)
    _, model, tokenizer = recipe.load_model(model_args, None)
    if args.adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, args.adapter)
    out = evaluate_search_agent(
        model, tokenizer, rows,
        lambda: SearchEnvironment(retriever, topk=args.topk, max_searches=args.max_searches),
        protocol=TagProtocol(max_observation_tokens=args.max_observation_tokens), max_turns=args.max_turns,
        max_completion_length=args.max_completion_length, max_tokens_per_turn=args.eval_max_tokens_per_turn,
        batch_size=args.eval_batch_size, num_samples=args.num_samples,
        sampling=SamplingParams(temperature=args.temperature), seed=args.eval_seed,
        turn_layout=args.turn_layout, context_fn=context_policy(args, tokenizer),
    )
    out["settings"] = {"heldout": args.heldout, "heldout_size": len(rows), "heldout_seed": args.heldout_seed,
                       "split": args.split, "num_samples": args.num_samples, "temperature": args.temperature,
                       "adapter": args.adapter, "kb_seed": args.kb_seed, "turn_layout": args.turn_layout,
                       "keep_last_observations": args.keep_last_observations,
                       "truncate_observations": args.truncate_observations}
    name = f"{model_args.model_name_or_path or 'SmolLM2-135M-Instruct'}" + (f" + {args.adapter}" if args.adapter else "")
    print(f"\n{name} on {len(rows)} {args.split} questions ({out['seconds']:.0f} s)")
    print(f"{'subset':<8} {'n':>5} {'EM':>6} {'substr':>7} {'F1':>6} {'searches':>9} {'invalid':>8} {'answered':>9}")
    for subset, m in out["summary"].items():
        print(f"{subset:<8} {m['n']:>5} {m['exact_match']:>6.3f} {m['substring_match']:>7.3f} {m['f1']:>6.3f} "
              f"{m['searches']:>9.2f} {m['invalid_rate']:>8.3f} {m['answered']:>9.3f}"
              + (f"  sampled EM {m['sampled_exact_match']:.3f}" if "sampled_exact_match" in m else ""))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(out, indent=2, default=str))
    return out


if __name__ == "__main__":
    parser = TrlParser((EvalArguments, ModelConfig))
    parsed = parser.parse_args_and_config()
    from trl_multiturn.threads import configure_cpu_threads

    configure_cpu_threads()  # on CPU: every usable core, unless OMP_NUM_THREADS was chosen (not accelerate's default 1)
    main(*parsed)
