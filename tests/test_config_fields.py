"""Every field of TRL's ``GRPOConfig`` is honored or refused by ``MultiTurnGRPOTrainer``; none is silently ignored.

``trl_multiturn.config.GRPO_FIELDS`` classifies each field TRL adds (and the two ``TrainingArguments`` fields whose
effect lives in the ``compute_loss`` this trainer replaces); ``TRAINER_FIELDS`` lists the ``TrainingArguments``
fields that transformers' ``Trainer`` applies as usual. A TRL or transformers upgrade that adds a field fails
``test_every_grpo_config_field_is_classified`` until the field is classified.
"""

import dataclasses
import math

import pytest
import torch
from datasets import Dataset
from transformers import TrainingArguments
from trl import GRPOConfig

from trl_multiturn import MultiTurnGRPOConfig, MultiTurnGRPOTrainer
from trl_multiturn.config import GRPO_FIELDS, HONORED, REFUSED, TRAINER_FIELDS, resolve_loss_aggregation
from trl_multiturn.environment import Step
from trl_multiturn.loss import aggregate_loss, policy_loss
from trl_multiturn.protocols import TagProtocol


class FeedbackEnv:
    """Every action gets feedback; the episode ends only on a limit."""

    def reset(self, example):
        return f"Question: {example['q']}"

    def step(self, action):
        return Step(observation="Invalid. Answer inside answer tags.")


def vowel_reward(completions, **kwargs):
    return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]


def config(tmp_path, **overrides):
    kw = dict(
        output_dir=str(tmp_path / "out"), num_generations=2, prompts_per_rollout=2, mini_batch_size=4,
        micro_batch_size=2, max_completion_length=24, max_tokens_per_turn=8, max_turns=2, max_steps=1,
        learning_rate=1e-3, report_to="none", save_strategy="no", seed=0, logging_steps=1,
    )
    kw.update(overrides)
    return MultiTurnGRPOConfig(**kw)


def dataset(n=4):
    return Dataset.from_dict({"q": [f"question {i}" for i in range(n)]})


# ---------------------------------------------------------------------------------------------------- the walk
def test_every_grpo_config_field_is_classified():
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    trainer_args = {f.name for f in dataclasses.fields(TrainingArguments)}
    unclassified = names - set(GRPO_FIELDS) - TRAINER_FIELDS
    assert not unclassified, f"classify these GRPOConfig fields in trl_multiturn/config.py: {sorted(unclassified)}"
    assert not (set(GRPO_FIELDS) - names) and not (TRAINER_FIELDS - names), "a classified field no longer exists"
    assert not set(GRPO_FIELDS) & TRAINER_FIELDS
    assert TRAINER_FIELDS <= trainer_args  # "inherited" means a field transformers' Trainer itself applies
    for name, (status, note) in GRPO_FIELDS.items():
        assert status in (HONORED, REFUSED) and len(note) > 10, name


#: a non-default value of every refused field (a newly refused field needs one here)
BAD_VALUES = {
    "router_aux_loss_coef": 0.01,
    "pad_to_multiple_of": 64,
    "chat_template_kwargs": {"enable_thinking": False},
    "repetition_penalty": 1.2,
    "cache_implementation": "static",
    "vllm_enable_sleep_mode": True,
    "vllm_structured_outputs_regex": "<answer>.*</answer>",
    "sapo_temperature_neg": 2.0,
    "sapo_temperature_pos": 2.0,
    "vespo_k_pos": 1.0,
    "vespo_lambda_pos": 1.0,
    "vespo_k_neg": 1.0,
    "vespo_lambda_neg": 1.0,
    "top_entropy_quantile": 0.2,
    "entropy_coef": 0.01,
    "use_adaptive_entropy": True,
    "entropy_coef_min": 0.1,
    "entropy_coef_max": 0.5,
    "entropy_coef_delta": 0.01,
    "entropy_target": 0.5,
    "max_tool_calling_iterations": 3,
    "off_policy_mask_threshold": 0.5,
    "use_transformers_continuous_batching": True,
    "transformers_continuous_batching_config": {"block_size": 128},
    "use_transformers_paged": True,
    "label_smoothing_factor": 0.1,
    "average_tokens_across_devices": False,
}


def test_every_refused_field_has_a_test_value():
    refused = {name for name, (status, _) in GRPO_FIELDS.items() if status == REFUSED}
    assert refused == set(BAD_VALUES)


@pytest.mark.parametrize("name", sorted(BAD_VALUES))
def test_refused_field_raises_naming_the_field_and_the_alternative(tmp_path, name):
    with pytest.raises(ValueError) as err:
        config(tmp_path, **{name: BAD_VALUES[name]})
    text = str(err.value)
    assert f"{name}={BAD_VALUES[name]!r} is not supported" in text
    assert GRPO_FIELDS[name][1] in text  # what to use instead


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(generation_kwargs={"seed": 1}), "generation_kwargs={'seed': 1} is not supported"),
        (dict(multi_objective_aggregation="normalize_then_sum"), "use 'sum_then_normalize'"),
        (dict(importance_sampling_level="tokens"), "importance_sampling_level='tokens' is not supported"),
        (dict(min_p=0.1, use_vllm=True), r"min_p=0.1 is not supported.*use_vllm=False"),
        (dict(min_p=1.5), r"min_p=1.5 is not supported.*in \(0, 1\]"),
    ],
)
def test_honored_fields_refuse_the_values_they_cannot_honor(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        config(tmp_path, **overrides)


def test_honored_values_are_accepted(tmp_path):
    cfg = config(tmp_path, generation_kwargs={"seed": 1}, use_vllm=True, importance_sampling_level="sequence",
                 delta=1.5, router_aux_loss_coef=0.0, min_p=0.0, use_bias_correction_kl=False)
    assert (cfg.delta, cfg.importance_sampling_level) == (1.5, "sequence")


def test_template_check_takes_warn_error_or_off(tmp_path):
    """``template_check`` (this package's own field; the check is tested in tests/test_templates.py)."""
    assert config(tmp_path).template_check == "warn"
    assert config(tmp_path, template_check="off").template_check == "off"
    with pytest.raises(ValueError, match="template_check='ignore' is not valid; use 'warn', 'error' or 'off'"):
        config(tmp_path, template_check="ignore")


def test_turn_reward_gate_takes_none_or_finished(tmp_path):
    """``turn_reward_gate`` (what it does: tests/test_rollout.py and tests/test_trainer_rewards.py)."""
    assert config(tmp_path).turn_reward_gate == "none"
    assert config(tmp_path, turn_reward_gate="finished").turn_reward_gate == "finished"
    with pytest.raises(ValueError, match="turn_reward_gate='answered' is not valid; use 'none' \\(default\\) or 'finished'"):
        config(tmp_path, turn_reward_gate="answered")


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("entropy_coef", 0.05, "entropy_coef=0.05 is not supported"),
        ("loss_type", "grpo", "loss_type='grpo' means loss_aggregation='seq-mean-token-mean'"),  # config: token-mean
        ("steps_per_generation", 3, "steps_per_generation=3 .* is not a multiple of gradient_accumulation_steps=2"),
    ],
)
def test_a_field_changed_after_the_config_was_built_is_refused_by_the_trainer(tmp_path, field, value, message):
    args = config(tmp_path, loss_aggregation="token-mean")  # the batch plan: gradient_accumulation_steps=2
    setattr(args, field, value)
    with pytest.raises(ValueError, match=message):
        MultiTurnGRPOTrainer(model=None, args=args, environment_factory=FeedbackEnv)


def test_moe_auxiliary_loss_from_the_model_config_is_refused(tmp_path, smollm2_tokenizer):
    """A MoE model whose config declares router_aux_loss_coef would get TRL's auxiliary loss; this trainer does not
    add it, so it refuses unless router_aux_loss_coef=0.0."""
    from transformers import MixtralConfig, MixtralForCausalLM

    def moe():
        cfg = MixtralConfig(vocab_size=len(smollm2_tokenizer), hidden_size=16, intermediate_size=16,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=1,
                            router_aux_loss_coef=0.02, pad_token_id=smollm2_tokenizer.pad_token_id)
        return MixtralForCausalLM(cfg)

    kw = dict(train_dataset=dataset(), environment_factory=FeedbackEnv, reward_funcs=[vowel_reward],
              processing_class=smollm2_tokenizer)
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=0.02.*Set router_aux_loss_coef=0.0"):
        MultiTurnGRPOTrainer(model=moe(), args=config(tmp_path), **kw)
    trainer = MultiTurnGRPOTrainer(model=moe(), args=config(tmp_path, router_aux_loss_coef=0.0), **kw)
    assert not trainer.aux_loss_enabled


# ---------------------------------------------------------------------------------------------------- loss_type
@pytest.mark.parametrize(
    "overrides, aggregation",
    [
        ({}, "seq-mean-token-mean"),  # neither set: the project default, not TRL's "dapo"
        (dict(loss_type="grpo"), "seq-mean-token-mean"),
        (dict(loss_type="dr_grpo"), "seq-mean-token-sum-norm"),
        (dict(loss_type="dapo"), "token-mean"),
        (dict(loss_type="bnpo"), "token-mean"),
        (dict(loss_aggregation="seq-mean-token-sum"), "seq-mean-token-sum"),
        (dict(loss_aggregation="grpo"), "seq-mean-token-mean"),  # an alias is resolved
        (dict(loss_type="dapo", loss_aggregation="token-mean"), "token-mean"),  # both set, agreeing
    ],
)
def test_loss_type_is_mapped_onto_loss_aggregation(tmp_path, overrides, aggregation):
    assert config(tmp_path, **overrides).loss_aggregation == aggregation


def test_disagreeing_loss_type_and_loss_aggregation_raise(tmp_path):
    with pytest.raises(ValueError, match=r"loss_type='grpo' means loss_aggregation='seq-mean-token-mean', but "
                                         r"loss_aggregation='token-mean'"):
        config(tmp_path, loss_type="grpo", loss_aggregation="token-mean")
    # an explicit project default still disagrees with TRL's "dapo"
    with pytest.raises(ValueError, match="loss_type='dapo'"):
        config(tmp_path, loss_type="dapo", loss_aggregation="seq-mean-token-mean")


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "vespo", "luspo"])
def test_trl_losses_this_trainer_does_not_compute_are_refused(tmp_path, loss_type):
    with pytest.raises(ValueError, match=f"loss_type='{loss_type}' is not supported.*leave loss_type unset"):
        config(tmp_path, loss_type=loss_type)


def test_mapped_aggregations_equal_trl_loss_types_on_one_micro_batch():
    """TRL 1.16 ``_compute_loss`` aggregation of a per-token loss ``l`` with mask ``m`` (one micro-batch, every row
    with a loss token) against ``aggregate_loss`` under the mapped mode."""
    g = torch.Generator().manual_seed(0)
    l = torch.randn(3, 5, generator=g)  # (B, T)
    m = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 0, 0, 0]])  # (B, T)
    max_completion_length = 8
    trl = {
        "grpo": ((l * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean(),
        "bnpo": (l * m).sum() / m.sum().clamp(min=1.0),
        "dapo": (l * m).sum() / m.sum(),  # normalizer: the loss tokens of the accumulation window (here: this batch)
        "dr_grpo": (l * m).sum() / (l.size(0) * max_completion_length),
    }
    for loss_type, expected in trl.items():
        ours = aggregate_loss(l, m, resolve_loss_aggregation(loss_type, None), norm_constant=max_completion_length)
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6, msg=loss_type)


# ---------------------------------------------------------------------------------------------------- delta, GSPO
def test_delta_caps_the_unclipped_ratio_as_trl():
    # one token, rho = 2, A = -1, eps = 0.2: -A rho = 2, -A clip(rho) = 1.2; with delta = 1.5: -A min(rho, delta) = 1.5
    logp, old = torch.tensor([[math.log(2.0)]]), torch.zeros(1, 1)
    adv, mask = torch.tensor([-1.0]), torch.ones(1, 1)
    plain, _ = policy_loss(logp, old, adv, mask)
    capped, _ = policy_loss(logp, old, adv, mask, delta=1.5)
    assert plain.item() == pytest.approx(2.0, abs=1e-6) and capped.item() == pytest.approx(1.5, abs=1e-6)


def test_sequence_importance_sampling_uses_one_ratio_per_trajectory():
    # two tokens with log-ratios 0.1 and -0.1, A = 1, no clipping (|log rho| small, eps = 0.2):
    # token level: -(e^0.1 + e^-0.1) / 2 = -cosh(0.1); sequence level (GSPO): -exp(mean) = -1
    logp, old = torch.tensor([[0.1, -0.1, 5.0]]), torch.zeros(1, 3)
    adv, mask = torch.tensor([1.0]), torch.tensor([[1, 1, 0]])
    token, _ = policy_loss(logp, old, adv, mask)
    seq, stats = policy_loss(logp, old, adv, mask, importance_sampling_level="sequence")
    assert token.item() == pytest.approx(-math.cosh(0.1), abs=1e-6)
    assert seq.item() == pytest.approx(-1.0, abs=1e-6)
    assert stats["ratio_min"].item() == pytest.approx(1.0, abs=1e-6)  # the masked 5.0 does not enter the mean


def _loss_inputs(trainer, tokenizer, log_ratio: torch.Tensor, ref_shift: float | None = None):
    """A two-row batch whose old log-probs are the model's minus ``log_ratio`` (B, C) on the completion tokens."""
    prompt = tokenizer(["Question: one", "Question: two"], return_tensors="pt", padding=True, padding_side="left")
    completion_ids = torch.randint(100, 1000, (2, 3), generator=torch.Generator().manual_seed(0))
    completion_mask = torch.ones(2, 3, dtype=torch.long)
    ids = torch.cat([prompt["input_ids"], completion_ids], 1)
    mask = torch.cat([prompt["attention_mask"], completion_mask], 1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 3)  # (2, 3)
    inputs = dict(prompt_ids=prompt["input_ids"], prompt_mask=prompt["attention_mask"], completion_ids=completion_ids,
                  completion_mask=completion_mask, tool_mask=completion_mask.clone(),
                  advantages=torch.tensor([1.0, -1.0]), old_per_token_logps=logps - log_ratio)
    if ref_shift is not None:
        inputs["ref_per_token_logps"] = logps - ref_shift
    return inputs


def test_trainer_loss_honors_delta_importance_level_and_kl_bias_correction(tmp_path, smollm2_tokenizer,
                                                                            tiny_model_factory):
    """compute_loss reads delta, importance_sampling_level and use_bias_correction_kl (eval mode: the batch's own
    normalizers, seq-mean-token-mean)."""
    trainer = MultiTurnGRPOTrainer(
        model=tiny_model_factory(), args=config(tmp_path), train_dataset=dataset(),
        environment_factory=FeedbackEnv, reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer,
    )
    trainer.beta = 0.1  # the KL term with the reference log-probs given below (no reference model is built)
    trainer.model.eval()
    log2 = math.log(2.0)

    def loss(**fields):
        for k, v in fields.items():
            setattr(trainer.args, k, v)
        return trainer.compute_loss(trainer.model, inputs).item()

    # rho = 2 on every token; row 0 A = +1: -A clip = -1.2 wins; row 1 A = -1: -A rho = 2 (1.5 with delta)
    # KL: d = logp - ref = 0.5, k3 = e^-0.5 + 0.5 - 1, times rho = 2 with the bias correction (TRL's default)
    inputs = _loss_inputs(trainer, smollm2_tokenizer, torch.full((2, 3), log2), ref_shift=0.5)
    k3 = math.exp(-0.5) + 0.5 - 1.0
    assert loss() == pytest.approx((-1.2 + 2.0) / 2 + 0.1 * 2 * k3, abs=1e-5)
    assert loss(delta=1.5) == pytest.approx((-1.2 + 1.5) / 2 + 0.1 * 2 * k3, abs=1e-5)
    assert loss(delta=None, use_bias_correction_kl=False) == pytest.approx((-1.2 + 2.0) / 2 + 0.1 * k3, abs=1e-5)

    # token log-ratios +-0.1 (no clipping): token level averages e^{+-0.1}, sequence level uses e^{mean} = 1
    inputs = _loss_inputs(trainer, smollm2_tokenizer, torch.tensor([[0.1, -0.1, 0.0]] * 2), ref_shift=0.0)
    token_mean = (math.exp(0.1) + math.exp(-0.1) + 1.0) / 3
    assert loss(importance_sampling_level="token") == pytest.approx((-token_mean + token_mean) / 2, abs=1e-5)
    inputs["advantages"] = torch.tensor([1.0, 1.0])
    assert loss(importance_sampling_level="token") == pytest.approx(-token_mean, abs=1e-5)
    assert loss(importance_sampling_level="sequence") == pytest.approx(-1.0, abs=1e-5)


# ---------------------------------------------------------------------------------------------------- item: steps
@pytest.mark.parametrize(
    "overrides",
    [
        dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, steps_per_generation=1),  # fewer than accum
        dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, steps_per_generation=3),  # not a multiple
        dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, generation_batch_size=12),  # derived: 3
        dict(per_device_train_batch_size=4, gradient_accumulation_steps=4, steps_per_generation=6,
             balance_micro_batches=False),
    ],
)
def test_steps_per_generation_not_a_multiple_of_accumulation_is_refused(tmp_path, overrides):
    kw = dict(output_dir=str(tmp_path), num_generations=2, max_completion_length=16, report_to="none")
    with pytest.raises(ValueError) as err:
        MultiTurnGRPOConfig(**kw, **overrides)
    text = str(err.value)
    accum = overrides["gradient_accumulation_steps"]
    assert "is not a multiple of gradient_accumulation_steps=" + str(accum) in text
    assert "steps_per_generation=" in text and f"a multiple of {accum}" in text


def test_steps_per_generation_multiples_are_accepted(tmp_path):
    kw = dict(output_dir=str(tmp_path), num_generations=2, max_completion_length=16, report_to="none",
              per_device_train_batch_size=4, gradient_accumulation_steps=2)
    assert MultiTurnGRPOConfig(**kw, steps_per_generation=4).steps_per_generation == 4
    assert MultiTurnGRPOConfig(**kw).steps_per_generation == 2  # unset: TRL's default, one optimizer step


# ---------------------------------------------------------------------------------------------------- item: no mutation
def test_two_trainers_from_the_same_config_and_protocol(tmp_path, smollm2_tokenizer, tiny_model_factory):
    """The trainer neither extends the caller's reward_weights nor rewrites the caller's protocol: a second trainer
    built from the same objects is built and trains like the first."""
    args = config(tmp_path, reward_weights=[0.5], max_observation_tokens=7)
    protocol = TagProtocol(max_observation_tokens=99)
    for _ in range(2):
        trainer = MultiTurnGRPOTrainer(
            model=tiny_model_factory(), args=args, train_dataset=dataset(), environment_factory=FeedbackEnv,
            reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer, protocol=protocol,
        )
        assert trainer.reward_weights.tolist() == [0.5, 1.0]
        assert trainer.protocol.max_observation_tokens == 7
        trainer.train()
        assert trainer.state.global_step == 1
        assert args.reward_weights == [0.5] and protocol.max_observation_tokens == 99


def test_rollout_passes_ds3_gather_for_generation(tmp_path, smollm2_tokenizer, tiny_model_factory, monkeypatch):
    import trl_multiturn.trainer as trainer_module

    seen = []
    real = trainer_module.unwrap_model_for_generation

    def recording(*args, **kwargs):
        seen.append(kwargs.get("gather_deepspeed3_params", "not passed"))
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "unwrap_model_for_generation", recording)
    trainer = MultiTurnGRPOTrainer(
        model=tiny_model_factory(), args=config(tmp_path, ds3_gather_for_generation=False), train_dataset=dataset(),
        environment_factory=FeedbackEnv, reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer,
    )
    trajectories = trainer._run_rollout([{"q": "a"}, {"q": "a"}])
    assert len(trajectories) == 2 and seen == [False]


# ---------------------------------------------------------------------------------------------------- min_p
def test_min_p_filters_the_sampling_distribution_as_transformers():
    from transformers.generation.logits_process import MinPLogitsWarper

    from trl_multiturn.generation import _filter_logits

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))  # (2, 4)
    kept = torch.isfinite(_filter_logits(logits, 0, 1.0, min_p=0.2))  # floor: 0.2 x 0.5 = 0.1, then 0.05
    assert kept.tolist() == [[True, True, True, False], [True, True, True, True]]
    reference = torch.isfinite(MinPLogitsWarper(min_p=0.2)(None, logits.clone()))
    assert torch.equal(kept, reference)
    assert torch.equal(_filter_logits(logits, 0, 1.0), logits)  # off by default


def test_trainer_samples_with_min_p(tmp_path, smollm2_tokenizer, tiny_model_factory):
    trainer = MultiTurnGRPOTrainer(
        model=tiny_model_factory(), args=config(tmp_path, min_p=0.05, top_k=20), train_dataset=dataset(),
        environment_factory=FeedbackEnv, reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer,
    )
    params = trainer._sampling_params()
    assert (params.min_p, params.top_k) == (0.05, 20)
