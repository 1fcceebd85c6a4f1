"""benchmarks/grpo_step.py end to end on a tiny random model: both trainers run one whole GRPO optimizer step on
the same forced multi-turn work, the timed step holds the rollout, and the JSON has what the benchmark reports."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from repo_scripts import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "grpo_step.py"


def _load_script():
    return load_script(SCRIPT, "grpo_step_benchmark")


@pytest.mark.slow  # two trainers, each a whole step with a rollout: ~30 s on 2 busy cores
def test_grpo_step_benchmark_smoke(tmp_path):
    bench = _load_script()
    out = tmp_path / "grpo_step.json"
    result = bench.main([
        "--model", "random-tiny", "--group-size", "2", "--prompts", "2", "--turns", "2",
        "--max-completion-length", "512", "--max-think", "8", "--warmup", "0", "--steps", "1", "--repeats", "1",
        "--threads", "1", "--out", str(out),
    ])

    saved = json.loads(out.read_text())
    assert saved["benchmark"] == "grpo_step"
    (rnd,) = saved["rounds"]
    assert set(rnd) == {"trl", "ours"}
    for side in ("trl", "ours"):
        r = rnd[side]
        assert len(r["step_s"]) == 1 and r["step_s"][0] > 0
        assert r["rollout_inside_step"], f"{side}: the timed step does not hold the rollout"
        assert r["step_s"][0] >= r["rollout_s"][0] > 0
        assert r["first_step_loss"] is not None and abs(r["first_step_loss"]) < 1e-3  # on-policy: ~0
        assert r["train_forward_positions_per_step"] > 0
        assert r["config"]["per_device_train_batch_size"] == 2 and r["config"]["gradient_accumulation_steps"] == 2
        assert r["config"]["steps_per_generation"] == 2 and r["config"]["num_iterations"] == 1
    # the same work: 2 prompts x G=2 trajectories of 2 turns each, the same generated tokens and token ids
    trl, ours = rnd["trl"]["per_step"][0], rnd["ours"]["per_step"][0]
    assert trl["trajectories"] == ours["trajectories"] == 4
    assert trl["turns"] == ours["turns"] == 8
    assert trl["generated_tokens"] == ours["generated_tokens"] > 0
    assert trl["observation_tokens"] == ours["observation_tokens"] > 0
    assert trl["trained_tokens"] == ours["trained_tokens"]
    # ours shares the prompt only: the members' identical forced completions are each computed, as real samples are
    assert saved["settings"]["share_past_prompts"] is False
    assert rnd["ours"]["train_forward_positions_per_step"] >= ours["generated_tokens"] + ours["observation_tokens"]
    assert saved["same_work"] and saved["identical_token_ids"]
    assert set(saved["config_differences_trl_ours"]) <= {"loss_aggregation", "trainable_parameters"}
    # what the benchmark reports
    assert len(saved["step_ratio_trl_over_ours_per_round"]) == 1 and saved["step_ratio_trl_over_ours_median"] > 0
    assert saved["first_step"][0]["loss_near_zero"]
    assert saved["threads"] == {"torch": 1, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}
    assert {"torch", "trl", "transformers"} <= set(saved["versions"])
    assert saved["command"].startswith("python benchmarks/grpo_step.py --model random-tiny")
    assert saved["machine"]["cpu_count"] >= 1
    assert result["median"]["trl"]["generated_tokens_per_step"] == result["median"]["ours"]["generated_tokens_per_step"]
    # the work per step, from the positions the forwards computed (full checkpointing on both sides)
    work, med = saved["step_work"], saved["median"]
    assert work["checkpointing"] == {"trl": "full", "ours": "full"}
    for side in ("trl", "ours"):
        assert work["units_per_step"][side] == (3 * med[side]["train_forward_positions_per_step"]
                                                + med[side]["nograd_forward_positions_per_step"])
    # the LM head's projected positions: TRL's fused head projects every position of its gradient pass on CPU, ours
    # the loss's tokens (the generated ones) only; both project one position per row and forward when generating
    trl_forward = med["trl"]["train_forward_positions_per_step"]  # 2 micro-batches of 2 rows: (2, L - 1) each
    assert trl_forward - 4 <= med["trl"]["train_head_positions_per_step"] <= trl_forward
    assert med["ours"]["train_head_positions_per_step"] == ours["generated_tokens"]
    for side in ("trl", "ours"):
        assert 0 < med[side]["nograd_head_positions_per_step"] < med[side]["nograd_forward_positions_per_step"]
    macs = saved["model_macs_per_position"]
    assert macs["head"] > 0 and macs["body"] > 0
    assert work["head_aware"]["work_ratio_trl_over_ours"] > 0


def test_step_work_counts_forward_position_units_by_checkpointing(tmp_path, capsys):
    """Hand-computed: a gradient position is 3 units under full checkpointing (forward, recompute, backward), 2 without;
    a no-grad position 1. Ours with save_matmuls has no unit count (its recompute is a measured time)."""
    bench = _load_script()
    result = {
        "settings": {"group_size": 8, "no_gradient_checkpointing": False, "checkpoint_policy": "full"},
        "median": {"trl": {"train_forward_positions_per_step": 100, "nograd_forward_positions_per_step": 200},
                   "ours": {"train_forward_positions_per_step": 80, "nograd_forward_positions_per_step": 60}},
        "step_ratio_trl_over_ours_median": 1.7,
    }
    work = bench.step_work(result)
    assert work["units_per_step"] == {"trl": 500.0, "ours": 300.0}
    assert work["work_ratio_trl_over_ours"] == 500 / 300
    assert work["work_ratio_with_free_rollout"] == 500 / 240  # ours's gradient pass alone: 3 x 80
    assert work["work_ratio_without_recompute"] == 500 / 220  # 2 x 80 + 60
    off = bench.step_work({**result, "settings": {**result["settings"], "no_gradient_checkpointing": True}})
    assert off["units_per_step"] == {"trl": 400.0, "ours": 220.0}
    selective = bench.step_work({**result, "settings": {**result["settings"], "checkpoint_policy": "save_matmuls"}})
    assert selective["units_per_step"]["ours"] is None and selective["work_ratio_trl_over_ours"] is None
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    out = bench.main(["--work-of", str(path)])
    assert out["step_work"][0]["work_ratio_trl_over_ours"] == 500 / 300
    assert "work ratio 1.67x, measured step ratio 1.70x" in capsys.readouterr().out
    assert "head_aware" not in work  # a result without the head's positions: the uniform count only


def test_step_work_counts_the_lm_head_where_it_projects(tmp_path, capsys):
    """Hand-computed, with the head a quarter of a position (body 3, head 1 multiply-adds): body share 0.75 x
    positions x (3 with gradient under full checkpointing, 1 without) + head share 0.25 x projected positions x (3
    with gradient: tile, recompute, input gradient; 1 without)."""
    bench = _load_script()
    med = {"trl": {"train_forward_positions_per_step": 100, "nograd_forward_positions_per_step": 200,
                   "train_head_positions_per_step": 100, "nograd_head_positions_per_step": 40},
           "ours": {"train_forward_positions_per_step": 80, "nograd_forward_positions_per_step": 60,
                    "train_head_positions_per_step": 20, "nograd_head_positions_per_step": 40}}
    result = {"settings": {"group_size": 8, "no_gradient_checkpointing": False, "checkpoint_policy": "full"},
              "median": med, "step_ratio_trl_over_ours_median": 1.7, "model_macs_per_position": {"head": 1, "body": 3}}
    h = bench.step_work(result)["head_aware"]
    trl = 0.75 * 3 * 100 + 0.25 * 3 * 100 + 0.75 * 200 + 0.25 * 40  # 460
    ours = 0.75 * 3 * 80 + 0.25 * 3 * 20 + 0.75 * 60 + 0.25 * 40  # 250
    assert h["head_share_of_a_position"] == 0.25
    assert h["units_per_step"] == pytest.approx({"trl": trl, "ours": ours})
    assert h["work_ratio_trl_over_ours"] == pytest.approx(trl / ours)
    assert h["work_ratio_with_free_rollout"] == pytest.approx(trl / (0.75 * 3 * 80 + 0.25 * 3 * 20))
    assert h["work_ratio_without_recompute"] == pytest.approx(trl / (0.75 * 2 * 80 + 0.25 * 3 * 20 + 0.75 * 60 + 10))
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    bench.main(["--work-of", str(path)])
    assert "with the LM head counted where it projects (25.0% of a position)" in capsys.readouterr().out


@pytest.mark.slow  # one trainer, one step: ~10 s
def test_the_score_every_position_ablation_projects_every_position(tmp_path):
    """``--score-every-position`` (ours as before its LM head scored the loss's tokens only) projects every position
    of its gradient pass, not only the generated tokens, and trains on the same work."""
    bench = _load_script()
    result = bench.main([
        "--model", "random-tiny", "--group-size", "2", "--prompts", "2", "--turns", "2", "--sides", "ours",
        "--max-completion-length", "512", "--max-think", "8", "--warmup", "0", "--steps", "1", "--repeats", "1",
        "--threads", "1", "--score-every-position", "--out", str(tmp_path / "ablation.json"),
    ])
    med = result["median"]["ours"]
    assert med["train_head_positions_per_step"] > med["generated_tokens_per_step"] + med["observation_tokens_per_step"]
    assert result["settings"]["score_every_position"] is True
