"""recipes/diagnose_gradient_noise.py: the Gram-matrix cosines on hand-made vectors, and the whole diagnostic on a
tiny random model (real rollout, real gradients; the rewards come from a stub, because a random model never answers,
so that two groups have reward variance and two do not)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import repo_scripts


def load_script():
    return repo_scripts.load_script("recipes/diagnose_gradient_noise.py")


def gram_of(*vectors) -> np.ndarray:
    v = np.array(vectors, dtype=np.float64)  # (n, D)
    return v @ v.T  # (n, n)


def test_set_cosine_on_hand_made_vectors():
    script = load_script()
    # e1, e2, e1, -e1, and (1, 1)
    gram = gram_of([1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [-1.0, 0.0], [1.0, 1.0])
    assert script.set_cosine(gram, [0], [1]) == pytest.approx(0.0, abs=1e-12)  # orthogonal
    assert script.set_cosine(gram, [0], [2]) == pytest.approx(1.0, abs=1e-12)  # identical
    assert script.set_cosine(gram, [0], [3]) == pytest.approx(-1.0, abs=1e-12)  # opposite
    assert script.set_cosine(gram, [0], [4]) == pytest.approx(1 / math.sqrt(2), abs=1e-12)  # 45 degrees
    assert script.set_cosine(gram, [0, 1], [4]) == pytest.approx(1.0, abs=1e-12)  # e1 + e2 = (1, 1)
    assert script.set_cosine(gram, [1, 4], [1, 4]) == pytest.approx(1.0, abs=1e-12)  # a set with itself
    assert math.isnan(script.set_cosine(gram, [0, 3], [1]))  # e1 - e1 = 0: no direction


def test_batch_sizes_and_split_cosines():
    script = load_script()
    assert script.batch_sizes(1) == [] and script.batch_sizes(2) == [1]
    assert script.batch_sizes(8) == [1, 2, 4] and script.batch_sizes(13) == [1, 2, 4, 6]
    # four identical vectors: every split points the same way
    rows = script.split_cosines(gram_of(*[[1.0, 2.0, 3.0]] * 4), splits=10)
    assert [r["b"] for r in rows] == [1, 2]
    for r in rows:
        assert r["cos_mean"] == pytest.approx(1.0) and r["cos_std"] == pytest.approx(0.0, abs=1e-12)
        assert r["frac_positive"] == 1.0 and r["cos_full_mean"] == pytest.approx(1.0)
    # four orthonormal vectors: any two disjoint sets are orthogonal; a set of b out of 4 has cos sqrt(b/4) with all
    rows = script.split_cosines(gram_of(*np.eye(4)), splits=10)
    for r in rows:
        assert r["cos_mean"] == pytest.approx(0.0, abs=1e-12) and r["frac_positive"] == 0.0
        assert r["cos_full_mean"] == pytest.approx(math.sqrt(r["b"] / 4))


def test_noise_model_by_hand():
    script = load_script()
    # g_i = mu + e_i with mu = e1 and e_i = +-e2, +-e3: every |g_i|^2 = 2; of the 12 ordered pairs, 8 have dot 1
    # (different noise axes) and 4 have dot 1 - 1 = 0 (opposite noise): d = 2, m = 8 / 12
    gram = gram_of([1, 1, 0, 0], [1, -1, 0, 0], [1, 0, 1, 0], [1, 0, -1, 0])
    nm = script.noise_model(gram, [2])
    m, d = 8 / 12, 2.0
    assert nm["mean_sq_norm"] == pytest.approx(d) and nm["mean_cross_dot"] == pytest.approx(m)
    assert nm["b_for_cos_0.5"] == pytest.approx((d - m) / m)
    assert nm["predicted_cos"]["2"] == pytest.approx(2 * m / (2 * m + d - m))
    assert script.noise_model(gram_of([1.0, 0.0], [-1.0, 0.0]))["b_for_cos_0.5"] is None  # opposite: no direction


@pytest.fixture
def tiny_adapter_dir(tmp_path, tiny_model_factory):
    """A LoRA adapter on the tiny model with random A and B (so both carry gradient)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(tiny_model_factory(hidden_size=32, num_layers=2),
                           LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                      init_lora_weights=False))
    model.save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter"


def stub_reward(group_size: int):
    """Group 0: rewards 1, 0, 1, 0; group 1: 1, 1, 1, 0; group 2: all 1; group 3: all 0."""
    table = {0: [1, 0, 1, 0], 1: [1, 1, 1, 0], 2: [1, 1, 1, 1], 3: [0, 0, 0, 0]}

    def reward(completions, golden_answers, **kwargs):
        assert len(completions) == len(golden_answers) == 4 * group_size and len(kwargs["hops"]) == len(completions)
        return [float(table[i // group_size][i % group_size]) for i in range(len(completions))]

    return reward


def test_diagnostic_on_a_tiny_model(tmp_path, tiny_model_dir, tiny_adapter_dir, capsys):
    script = load_script()
    out = tmp_path / "noise.json"
    args = script.DiagnoseArguments(
        model=str(tiny_model_dir), adapter=str(tiny_adapter_dir), num_prompts=4, group_size=4, max_turns=2,
        max_completion_length=256, max_tokens_per_turn=8, max_observation_tokens=16, offline_entities=20,
        num_train_questions=16, splits=20, rollout_groups=2, output_json=str(out),
    )
    result = script.main(args, reward_fn=stub_reward(4))
    printed = capsys.readouterr().out
    assert "cos(A,B)" in printed and "torch threads" in printed

    saved = json.loads(out.read_text())
    assert set(saved) >= {"settings", "summary", "cosines", "noise_model", "gram", "groups"}
    s = saved["summary"]
    for key in ("reward_mean", "signal", "zero_variance_groups", "searches_per_trajectory", "rollout_s",
                "gradients_s", "torch_threads", "max_abs_ratio_minus_1", "sampler_logp_diff"):
        assert key in s
    assert s["torch_threads"] == torch.get_num_threads()
    assert s["reward_mean"] == pytest.approx((2 + 3 + 4 + 0) / 16)
    # groups 0 and 1 carry signal; 2 (all correct) and 3 (all wrong) are counted as zero-variance
    assert [g["signal"] for g in saved["groups"]] == [True, True, False, False]
    assert s["zero_variance_groups"] == 2 and s["signal"]["all"] == {"groups": 4, "signal": 2, "frac": 0.5}
    assert s["all_correct"]["all"]["all_correct"] == 1 and s["all_wrong"]["all"]["all_wrong"] == 1
    assert sum(v["groups"] for k, v in s["signal"].items() if k != "all") == 4  # every group has its hop count
    for g in saved["groups"]:
        assert set(g) >= {"id", "hops", "rewards", "advantages", "grad_norm"} and len(g["rewards"]) == 4
        if not g["signal"]:
            assert g["grad_norm"] == 0.0 and set(g["advantages"]) == {0.0}
    # on-policy: the ratio is exactly 1, and the learner's log-probs are the sampler's (up to float error)
    assert s["max_abs_ratio_minus_1"] == 0.0 and s["sampler_logp_diff"] < 1e-4
    # the Gram matrix holds the two signal groups; its diagonal is their squared gradient norms
    gram = np.array(saved["gram"])
    assert gram.shape == (2, 2)
    norms = [g["grad_norm"] for g in saved["groups"] if g["signal"]]
    assert all(n > 0 for n in norms)
    np.testing.assert_allclose(np.diag(gram), np.square(norms), rtol=1e-9)
    # a set with itself has cosine 1; two disjoint sets lie in [-1, 1]
    assert script.set_cosine(gram, [0], [0]) == pytest.approx(1.0, abs=1e-12)
    assert script.set_cosine(gram, [0, 1], [0, 1]) == pytest.approx(1.0, abs=1e-12)
    assert [r["b"] for r in saved["cosines"]] == [1]
    row = saved["cosines"][0]
    assert -1.0 <= row["cos_mean"] <= 1.0 and 0.0 <= row["frac_positive"] <= 1.0
    assert row["cos_mean"] == pytest.approx(gram[0, 1] / math.sqrt(gram[0, 0] * gram[1, 1]))  # b=1: the only pair
    assert result["summary"]["groups_in_cosines"] == 2


def test_a_zero_variance_group_has_exactly_zero_gradient(tiny_model_factory, smollm2_tokenizer):
    """Through the real forward and backward: advantages 0 give a gradient of exactly 0; others do not."""
    from peft import LoraConfig, get_peft_model

    from trl_multiturn.advantages import group_advantages
    from trl_multiturn.trajectory import Trajectory

    script = load_script()
    torch.manual_seed(0)
    model = get_peft_model(tiny_model_factory(), LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj"],
                                                           init_lora_weights=False)).eval()
    params = [p for p in model.parameters() if p.requires_grad]
    trajs = []
    for k in range(4):
        t = Trajectory(prompt_ids=[1, 2, 3 + k])
        t.add_action([10 + k, 11, 12], [-1.0, -1.0, -1.0])
        t.add_observation([20, 21])
        t.add_action([30, 31 + k], [-1.0, -1.0])
        trajs.append(t)
    equal = group_advantages(torch.tensor([1.0, 1.0, 1.0, 1.0]), 4)  # (4,) all 0
    flat, stats = script.group_gradient(model, params, trajs, equal, 0.7, [True] * 4)
    assert stats["loss_tokens"] == 4 * 5 and torch.count_nonzero(flat) == 0
    mixed = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 4)  # (4,) +-0.866
    flat, stats = script.group_gradient(model, params, trajs, mixed, 0.7, [True] * 4)
    assert flat.norm() > 0 and stats["max_abs_ratio_minus_1"] == 0.0
    # a trajectory that carries no loss (masked) changes nothing; the sum over trajectories is additive
    first, _ = script.group_gradient(model, params, trajs, mixed, 0.7, [True, True, False, False])
    rest, _ = script.group_gradient(model, params, trajs, mixed, 0.7, [False, False, True, True])
    torch.testing.assert_close(first + rest, flat, rtol=1e-5, atol=1e-7)
