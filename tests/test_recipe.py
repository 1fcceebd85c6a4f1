"""The search agent recipe end to end: parsing its configs, a tiny random model through every stage, SmolLM2 for one
GRPO step, and the Hub push against a local stand-in (see tests/test_hub.py for the stand-in itself)."""

import json
from pathlib import Path

import pytest
import yaml

from trl_multiturn import MultiTurnGRPOConfig
from test_hub import hub  # noqa: F401  (the local Hub stand-in fixture)
from repo_scripts import load_recipe, load_script

REPO = Path(__file__).resolve().parents[1]


def parse(recipe, argv):
    from trl import ModelConfig, TrlParser

    parser = TrlParser((recipe.SearchAgentArguments, MultiTurnGRPOConfig, ModelConfig))
    parser.set_defaults(**recipe.DEFAULTS)
    return parser.parse_args_and_config(args=argv)


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "recipes" / "configs").glob("*.yaml")))
def test_recipe_configs_parse(config, monkeypatch):
    recipe = load_recipe()
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = ["--config", str(REPO / "recipes" / "configs" / config)]
    import torch

    if not torch.cuda.is_available():
        argv += ["--bf16", "false"]  # GPU configs use bf16, which transformers refuses on a CPU-only machine
    script_args, training_args, model_args = parse(recipe, argv)
    assert training_args.batch_plan is not None
    assert training_args.gradient_accumulation_steps == training_args.batch_plan.gradient_accumulation_steps


def test_no_argument_default_matches_cpu_default_yaml():
    recipe = load_recipe()
    defaults = parse(recipe, [])
    spelled = parse(recipe, ["--config", str(REPO / "recipes" / "configs" / "cpu_default.yaml")])
    for a, b in zip(defaults, spelled):
        da, db = vars(a), vars(b)
        keys = [k for k in da if k not in ("logging_dir", "distributed_state", "batch_plan") and not k.startswith("_")]
        assert {k: da[k] for k in keys} == {k: db[k] for k in keys}


@pytest.mark.parametrize("name", ["single_gpu", "ddp", "zero2", "zero3", "fsdp"])
def test_accelerate_configs_parse(name):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(REPO / "recipes" / "accelerate_configs" / f"{name}.yaml"))
    assert cfg.compute_environment.value == "LOCAL_MACHINE"
    raw = yaml.safe_load((REPO / "recipes" / "accelerate_configs" / f"{name}.yaml").read_text())
    expected = {"single_gpu": "NO", "ddp": "MULTI_GPU", "zero2": "DEEPSPEED", "zero3": "DEEPSPEED", "fsdp": "FSDP"}[name]
    assert raw["distributed_type"] == expected == cfg.distributed_type.value


SMALL = [
    "--offline_entities", "20", "--num_train_questions", "8", "--num_eval_questions", "4", "--sft_num_examples", "8",
    "--eval_batch_size", "4", "--eval_max_tokens_per_turn", "16", "--max_steps", "1", "--prompts_per_rollout", "2",
    "--num_generations", "2", "--mini_batch_size", "4", "--micro_batch_size", "2", "--max_turns", "2",
    "--max_completion_length", "256", "--max_tokens_per_turn", "16", "--max_observation_tokens", "64",
]


def test_recipe_end_to_end_tiny_model(tmp_path, tiny_model_dir, capsys):
    recipe = load_recipe()
    out = tmp_path / "run"
    args = parse(recipe, ["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(out), "--warm_start", "on", *SMALL])
    results = recipe.main(*args)
    printed = capsys.readouterr().out
    for stage in ("base", "sft", "grpo"):
        summary = results[stage]["summary"]
        assert summary["all"]["n"] == 4  # --num_eval_questions 4
        assert sum(v["n"] for k, v in summary.items() if k.startswith("hops_")) == 4  # each question has its hops
        assert f"\n{stage} " in printed  # the stage table
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics) >= {"base", "sft", "grpo", "sft_train"}
    assert metrics["sft_train"]["kept_fraction"] > 0
    assert (out / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    adapter = out / "adapter"
    assert (adapter / "adapter_config.json").exists() and (adapter / "README.md").exists()
    card = (adapter / "README.md").read_text()
    assert "trl-multiturn" in card and "sft" in card and "grpo" in card
    history = json.loads((out / "log_history.json").read_text())
    assert any("loss/pg_loss" in h for h in history)
    assert (out / "sft_adapter" / "adapter_config.json").exists()  # the warm start is kept
    for stage in ("base", "sft", "grpo"):
        records = json.loads((out / f"eval_{stage}.json").read_text())["records"]
        assert len(records) == results[stage]["summary"]["all"]["n"]


@pytest.mark.parametrize("warm_start", ["off", "on"])  # on: the warm start's own trajectories are reused
def test_recipe_adds_the_warm_start_experts_as_the_expert_loss(tmp_path, tiny_model_dir, capsys, monkeypatch,
                                                               warm_start):
    """``--expert_loss_coef`` in the GRPO stage: the warm start's expert trajectories are the expert loss's data, built
    once, by the expert of ``--expert_seed`` (the warm start's seed) rather than the run's ``--seed``."""
    import trl_multiturn.search as search

    built, build = [], search.build_expert_trajectories
    monkeypatch.setattr(search, "build_expert_trajectories",
                        lambda rows, env_factory, seed: built.append(seed) or build(rows, env_factory=env_factory, seed=seed))
    recipe = load_recipe()
    out = tmp_path / "run"
    args = parse(recipe, ["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(out), "--warm_start", warm_start,
                          "--eval_before", "false", "--use_peft", "true", *SMALL, "--expert_loss_coef", "0.2",
                          "--seed", "1", "--expert_seed", "0"])
    recipe.main(*args)
    assert "[grpo] expert loss (coef 0.2) on 8 expert trajectories" in capsys.readouterr().out
    assert built == [0]
    history = json.loads((out / "log_history.json").read_text())
    assert [h["loss/expert_nll"] > 0 for h in history if "loss/expert_nll" in h] == [True]


def test_recipe_trains_and_evaluates_per_turn_with_a_context_policy(tmp_path, tiny_model_dir, monkeypatch):
    """--turn_layout per_turn --keep_last_observations 1: the trainer and every evaluation roll out with the same
    context function (a policy is evaluated on the contexts it was trained on)."""
    from trl_multiturn.search import evaluation

    seen = []
    original = evaluation.evaluate_search_agent

    def spy(*a, **k):
        seen.append((k.get("turn_layout"), k.get("context_fn")))
        return original(*a, **k)

    recipe = load_recipe()
    monkeypatch.setattr(recipe, "evaluate_search_agent", spy)
    out = tmp_path / "run"
    args = parse(recipe, ["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(out), "--warm_start", "off",
                          "--turn_layout", "per_turn", "--keep_last_observations", "1", *SMALL])
    assert args[1].turn_layout == "per_turn" and args[1].keep_last_observations == 1
    recipe.main(*args)
    assert seen and all(layout == "per_turn" and callable(fn) for layout, fn in seen)
    history = json.loads((out / "log_history.json").read_text())
    assert any("loss/pg_loss" in h for h in history)
    with pytest.raises(ValueError, match="turn_layout='per_turn'"):
        parse(recipe, ["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(out),
                       "--truncate_observations", "8", *SMALL])


def test_recipe_rejects_bad_arguments(tmp_path, tiny_model_dir):
    recipe = load_recipe()
    args = parse(recipe, ["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(tmp_path), "--dataset",
                          "some/qa", *SMALL])
    with pytest.raises(ValueError, match="--corpus"):
        recipe.main(*args)
    args = parse(recipe, ["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(tmp_path), "--retriever",
                          "http", *SMALL])
    with pytest.raises(ValueError, match="--retriever_url"):
        recipe.main(*args)
    args = parse(recipe, ["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(tmp_path), "--grpo", "false",
                          "--warm_start", "off", *SMALL])
    with pytest.raises(ValueError, match="trains nothing"):
        recipe.main(*args)


def test_recipe_sampled_evaluation_at_the_training_sampling(tmp_path, tiny_model_dir, monkeypatch):
    """--eval_num_samples k: every stage's evaluation also samples k trajectories per question with the training
    run's temperature / top_p / top_k and the fixed eval_sample_seed; every record has sampled_exact_match and the
    paired comparison against a baseline that has it compares it too. k = 1 is refused before anything runs."""
    recipe = load_recipe()
    i = SMALL.index("--num_eval_questions")
    small = SMALL[:i] + SMALL[i + 2 :]
    common = ["--model_name_or_path", str(tiny_model_dir), "--heldout", "balanced", "--heldout_size", "4",
              "--eval_num_samples", "2", "--eval_sample_seed", "3", "--temperature", "0.9", "--top_p", "0.95", *small]
    calls = []
    real = recipe.evaluate_search_agent

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(recipe, "evaluate_search_agent", spy)
    warm = tmp_path / "warm"
    recipe.main(*parse(recipe, [*common, "--output_dir", str(warm), "--warm_start", "on", "--grpo", "false",
                                "--eval_before", "false"]))
    out = tmp_path / "grpo"
    results = recipe.main(*parse(recipe, [*common, "--output_dir", str(out), "--init_adapter", str(warm / "sft_adapter"),
                                          "--eval_before", "false", "--baseline_eval", str(warm / "eval_sft.json")]))
    assert len(calls) == 2
    for kw in calls:
        assert kw["num_samples"] == 2 and kw["seed"] == 3
        assert (kw["sampling"].temperature, kw["sampling"].top_p, kw["sampling"].greedy) == (0.9, 0.95, False)
    for path in (warm / "eval_sft.json", out / "eval_grpo.json"):
        saved = json.loads(path.read_text())
        assert all(0.0 <= r["sampled_exact_match"] <= 1.0 for r in saved["records"])
        assert "sampled_exact_match" in saved["summary"]["all"]
        assert saved["settings"]["num_samples"] == 2 and saved["settings"]["temperature"] == 0.9
    paired = results["paired_vs_baseline"]
    assert paired["sampled_exact_match"]["all"]["n"] == paired["exact_match"]["all"]["n"] == 4

    args = parse(recipe, ["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(tmp_path / "bad"),
                          "--eval_num_samples", "1", *SMALL])
    with pytest.raises(ValueError, match="--eval_num_samples 1"):
        recipe.main(*args)


def test_recipe_full_fine_tune_saves_the_model(tmp_path, tiny_model_dir):
    """--use_peft false trains the whole model: it is saved (output_dir/model, with its card), never lost."""
    from transformers import AutoModelForCausalLM

    recipe = load_recipe()
    out = tmp_path / "run"
    recipe.main(*parse(recipe, ["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(out), "--use_peft",
                                "false", "--warm_start", "off", "--eval_before", "false", *SMALL]))
    saved = AutoModelForCausalLM.from_pretrained(out / "model")
    assert saved.config.num_hidden_layers == 2 and "grpo" in (out / "model" / "README.md").read_text()
    assert not (out / "adapter").exists()
    with pytest.raises(ValueError, match="--merge_adapter true needs an adapter"):
        recipe.main(*parse(recipe, ["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(out), "--use_peft",
                                    "false", "--merge_adapter", "true", *SMALL]))


@pytest.mark.slow
def test_recipe_smollm2_one_step(tmp_path, smollm2_dir):
    recipe = load_recipe()
    out = tmp_path / "run"
    args = parse(recipe, ["--output_dir", str(out), "--warm_start", "off", "--eval_before", "false", *SMALL])
    results = recipe.main(*args)
    assert "grpo" in results and (out / "adapter" / "adapter_model.safetensors").exists()


def test_recipe_publishes_and_the_adapter_reloads(tmp_path, tiny_model_dir, hub, capsys):
    """`--push_to_hub --hub_model_id me/agent` publishes the adapter with its card (against the local Hub stand-in),
    and the evaluation recipe with `--adapter` reproduces the trained model's evaluation."""
    from test_hub import TOKEN

    recipe = load_recipe()
    out = tmp_path / "run"
    args = parse(recipe, ["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(out), "--warm_start", "off",
                          "--eval_before", "false", "--push_to_hub", "--hub_model_id", "me/agent", "--hub_token", TOKEN,
                          *SMALL])
    results = recipe.main(*args)
    repo = hub.repos["me/agent"]
    assert len(repo["commits"]) == 1
    assert {"README.md", "adapter_config.json", "adapter_model.safetensors", "training_curves.png"} <= set(repo["files"])
    assert b"trl-multiturn" in repo["files"]["README.md"]

    evaluate = load_script("recipes/evaluate_search_agent.py", "evaluate_recipe")
    from trl import ModelConfig, TrlParser

    eval_args = TrlParser((evaluate.EvalArguments, ModelConfig)).parse_args_and_config(args=[
        "--model_name_or_path", str(tiny_model_dir), "--adapter", str(out / "adapter"), "--offline_entities", "20",
        "--num_eval_questions", "4", "--eval_batch_size", "4", "--eval_max_tokens_per_turn", "16", "--max_turns", "2",
        "--max_completion_length", "256", "--max_observation_tokens", "64",
    ])
    reloaded = evaluate.main(*eval_args)
    assert reloaded["summary"] == results["grpo"]["summary"]


@pytest.mark.slow  # two recipe runs with evaluations: ~30 s
def test_turn_credit_ablation_runs_every_arm_from_one_adapter(tmp_path, tiny_model_dir, capsys):
    """The ablation driver: each arm a real recipe run from the same warm-start adapter, restricted to 2-hop
    questions, with the per-turn retrieval reward on; the table has the start row and one row per arm."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapter = tmp_path / "sft_adapter"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")).save_pretrained(adapter)
    ablation = load_script("recipes/ablate_turn_credit.py")
    out = tmp_path / "ablation"
    arms = ablation.main([
        "--init_adapter", str(adapter), "--modes", "trajectory", "mt-grpo", "--max_steps", "1", "--output_dir", str(out),
        "--model_name_or_path", str(tiny_model_dir), *[a for a in SMALL if a not in ("--max_steps", "1")],
    ])
    assert set(arms) == {"trajectory", "mt-grpo"}
    assert "init" in arms["trajectory"]["metrics"] and "init" not in arms["mt-grpo"]["metrics"]
    for mode, arm in arms.items():
        assert arm["metrics"]["grpo"]["summary"]["all"]["n"] > 0
        assert all(r["hops"] == 2 for r in json.loads((out / mode / "eval_grpo.json").read_text())["records"])
    md = (out / "ablation.md").read_text()
    assert "| start (warm-start adapter) |" in md and "| trajectory |" in md and "| mt-grpo |" in md
    summary = json.loads((out / "ablation.json").read_text())
    assert summary["settings"]["question_hops"] == "2" and summary["settings"]["retrieval_hit_reward"] == 0.5


def test_steps_to_reach_uses_a_moving_average():
    ablation = load_script("recipes/ablate_turn_credit.py")
    history = [{"step": i + 1, "em": v} for i, v in enumerate([0.0, 0.5, 0.0, 0.4, 0.4, 0.4, 0.9])]
    assert ablation.steps_to_reach(history, "em", 0.4) == 6  # 0.5 alone at step 2 is not enough
    assert ablation.steps_to_reach(history, "em", 0.3, window=1) == 2
    assert ablation.steps_to_reach(history, "em", 0.95) is None


def test_recipe_heldout_curve_paired_comparison_and_resume(tmp_path, tiny_model_dir):
    """The learning-proof stages: a warm start saved; GRPO from it with held-out evaluations every step on the
    balanced set (eval_step<N>.json, learning_curve.png), the final evaluation paired with the warm start's; a run
    resumed from its checkpoint keeps the earlier points and does not redo them."""
    recipe = load_recipe()
    i = SMALL.index("--num_eval_questions")
    small = SMALL[:i] + SMALL[i + 2 :]
    common = ["--model_name_or_path", str(tiny_model_dir), "--heldout", "balanced", "--heldout_size", "4", *small]
    warm = tmp_path / "warm"
    recipe.main(*parse(recipe, [*common, "--output_dir", str(warm), "--warm_start", "on", "--grpo", "false",
                                "--eval_before", "false"]))
    baseline = json.loads((warm / "eval_sft.json").read_text())
    assert [r["hops"] for r in baseline["records"]].count(1) == 2 and baseline["settings"]["heldout"] == "balanced"

    out = tmp_path / "grpo"
    grpo = [*common, "--output_dir", str(out), "--init_adapter", str(warm / "sft_adapter"), "--eval_before", "false",
            "--baseline_eval", str(warm / "eval_sft.json"), "--eval_every_steps", "1", "--save_strategy", "steps",
            "--save_steps", "1"]
    results = recipe.main(*parse(recipe, [*grpo, "--max_steps", "2"]))
    assert json.loads((out / "eval_step2.json").read_text()) == json.loads((out / "eval_grpo.json").read_text())
    assert [p["step"] for p in results["curve"]] == [0, 1, 2]
    assert results["curve"][0]["summary"] == baseline["summary"]
    assert (out / "learning_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    paired = results["paired_vs_baseline"]["exact_match"]
    final = json.loads((out / "eval_grpo.json").read_text())["records"]
    diffs = {r["id"]: r["exact_match"] for r in final}
    expected = sum(diffs[r["id"]] - r["exact_match"] for r in baseline["records"]) / 4
    assert paired["all"]["n"] == 4 and paired["all"]["diff"] == pytest.approx(expected)
    assert paired["all"]["ci_low"] <= paired["all"]["diff"] <= paired["all"]["ci_high"]

    kept = {n: (out / f"eval_step{n}.json").stat().st_mtime_ns for n in (1, 2)}
    resumed = recipe.main(*parse(recipe, [*grpo, "--max_steps", "3", "--resume_from_checkpoint",
                                          str(out / "checkpoint-2")]))
    assert resumed["grpo"]["step"] == 3
    assert {n: (out / f"eval_step{n}.json").stat().st_mtime_ns for n in (1, 2)} == kept  # not redone
    assert [p["step"] for p in resumed["curve"]] == [0, 1, 2, 3]


def test_recipe_time_budget_stops_grpo_after_a_whole_step(tmp_path, tiny_model_dir):
    """--max_grpo_minutes: training stops after the first optimizer step that ends past the budget (here any step
    does), then the final evaluation and the save run as usual; that step is evaluated once, by the final evaluation."""
    recipe = load_recipe()
    out = tmp_path / "run"
    argv = ["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(out), "--warm_start", "off",
            "--eval_before", "false", "--use_peft", "true", *SMALL]
    argv[argv.index("--max_steps") + 1] = "3"
    results = recipe.main(*parse(recipe, [*argv, "--max_grpo_minutes", "1e-9", "--eval_every_steps", "1"]))
    assert results["grpo"]["step"] == 1 and results["grpo"]["stopped_by_time_budget"] is True
    assert sorted(p.name for p in out.glob("eval_step*.json")) == ["eval_step1.json"]
    assert (out / "adapter" / "adapter_config.json").exists()

    unbounded = recipe.main(*parse(recipe, [*argv, "--output_dir", str(tmp_path / "free"), "--max_steps", "2"]))
    assert unbounded["grpo"]["step"] == 2 and unbounded["grpo"]["stopped_by_time_budget"] is False
    with pytest.raises(ValueError, match="--max_grpo_minutes -1"):
        recipe.main(*parse(recipe, [*argv, "--max_grpo_minutes", "-1"]))
