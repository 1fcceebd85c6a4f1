"""MultiTurnGRPOTrainer through its real entry point (``trainer.train()``) on a tiny random model.

The tiny model writes random text, so every turn is an invalid action answered by the environment's feedback:
trajectories are genuinely multi-turn (actions with mask 1, feedback observations with mask 0) and the reward
(a text statistic of the sampled turns) varies inside each group, so advantages and gradients are not zero.
"""

import copy
import math

import pytest
import torch
from datasets import Dataset

from scripted import Recorder, SnapshotAfterFirstStep, logged

from trl_multiturn import MultiTurnGRPOConfig, MultiTurnGRPOTrainer
from trl_multiturn.advantages import turn_advantages
from trl_multiturn.environment import Step
from trl_multiturn.loss import policy_loss
from trl_multiturn.protocols import ChatToolProtocol, TagProtocol


class FeedbackEnv:
    """Every action gets feedback; the episode ends only on a limit. Rewards come from `vowel_reward`."""

    required_columns = ("q",)

    def reset(self, example):
        return f"Question: {example['q']}"

    def step(self, action):
        return Step(observation="Invalid. Answer inside answer tags.")


def vowel_reward(completions, num_turns, **kwargs):
    """Fraction of vowels in the completion text (varies between samples of a random model)."""
    return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]


def make_args(tmp_path, **overrides):
    kw = dict(
        output_dir=str(tmp_path / "out"),
        num_generations=4,
        prompts_per_rollout=2,
        mini_batch_size=8,
        micro_batch_size=4,
        max_completion_length=48,
        max_tokens_per_turn=12,
        max_turns=3,
        max_steps=2,
        logging_steps=1,
        learning_rate=5e-3,
        report_to="none",
        save_strategy="no",
        seed=0,
    )
    kw.update(overrides)
    return MultiTurnGRPOConfig(**kw)


def dataset(n=8):
    return Dataset.from_dict({"q": [f"question {i}" for i in range(n)]})


def test_one_minibatch_per_rollout_pg_loss_zero_and_model_learns(tmp_path, smollm2_tokenizer, tiny_model_factory,
                                                                 monkeypatch):
    import trl_multiturn.trainer as trainer_module

    released = []  # the rollout's freed K/V go back to the OS before the training pass (host_memory)
    monkeypatch.setattr(trainer_module, "release_freed_memory", lambda collect=True: released.append(collect))
    model = tiny_model_factory()
    before = copy.deepcopy(model.state_dict())
    trainer = MultiTurnGRPOTrainer(
        model=model, args=make_args(tmp_path), train_dataset=dataset(), environment_factory=FeedbackEnv,
        reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer,
    )
    rec = Recorder(trainer)
    trainer.train()
    # one mini-batch per rollout, one epoch: ratio = 1 and zero-mean advantages -> pg_loss = 0 at every step ...
    pg = logged(trainer, "loss/pg_loss")
    assert len(pg) == 2 and all(abs(x) < 1e-6 for x in pg), pg
    assert logged(trainer, "loss/ratio_mean") == pytest.approx([1.0, 1.0], abs=1e-6)
    assert released == [False, False]  # after each of the two rollouts, without a garbage collection
    # ... while the gradient is not zero and the parameters move
    assert all(g > 0 for g in logged(trainer, "grad_norm"))
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed
    # masks: every sampled token has mask 1, every inserted token mask 0, turns > 1
    for trajs, batch in zip(rec.rollouts, rec.batches):
        mask = batch["tool_mask"] * batch["completion_mask"]
        for row, t in enumerate(trajs):
            n = len(t.completion_ids)
            assert batch["completion_ids"][row, :n].tolist() == t.completion_ids
            assert mask[row, :n].tolist() == t.action_mask
            assert mask[row, n:].sum() == 0  # padding never carries loss
            assert t.num_turns > 1 and t.num_observation_tokens > 0
            obs = smollm2_tokenizer.decode([i for i, m in zip(t.completion_ids, t.action_mask) if m == 0])
            # every turn's action got the feedback, except a last turn cut by the token budget (no step ran, or its
            # observation did not fit)
            answered = t.num_turns - (1 if t.info["stop_reason"] == "max_tokens" else 0)
            assert obs.count("Invalid. Answer inside answer tags.") == answered, (obs, t.info["stop_reason"])
    assert logged(trainer, "rollout/turns_mean")[0] > 1
    assert logged(trainer, "rollout/observation_tokens_mean")[0] > 0


def merge_chunks(chunks):
    """Concatenate micro-batches that were trimmed to different widths (prompts left-, completions right-padded)."""
    p_w = max(c["prompt_ids"].size(1) for c in chunks)
    c_w = max(c["completion_ids"].size(1) for c in chunks)
    out = {}
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask", "advantages",
                "old_per_token_logps"):
        parts = []
        for c in chunks:
            v = c[key]
            if key.startswith("prompt"):
                v = torch.nn.functional.pad(v, (p_w - v.size(1), 0))
            elif v.dim() == 2:
                v = torch.nn.functional.pad(v, (0, c_w - v.size(1)))
            parts.append(v)
        out[key] = torch.cat(parts)
    return out


def test_logged_pg_loss_equals_recomputed_two_minibatches(tmp_path, smollm2_tokenizer, tiny_model_factory):
    model = tiny_model_factory()
    args = make_args(tmp_path, mini_batch_size=4, micro_batch_size=2)  # 2 optimizer steps of 2 micro-batches
    assert (args.gradient_accumulation_steps, args.steps_per_generation) == (2, 4)
    trainer = MultiTurnGRPOTrainer(
        model=model, args=args, train_dataset=dataset(), environment_factory=FeedbackEnv,
        reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer,
    )
    snap = SnapshotAfterFirstStep(model)
    trainer.add_callback(snap)
    trainer.train()
    pg = logged(trainer, "loss/pg_loss")
    assert abs(pg[0]) < 1e-6  # first mini-batch: whole group, ratio 1
    # recompute mini-batch 2 (micro-batches 2 and 3 of the rollout) with the weights after step 1
    batch = merge_chunks(trainer._buffered_inputs[2:4])
    replica = tiny_model_factory()  # a fresh module: the trainer patched the forward of `model` in place
    replica.load_state_dict(snap.state)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    att = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        logits = replica(input_ids=ids, attention_mask=att).logits[:, :-1].float() / args.temperature
    c = batch["completion_ids"].size(1)
    logps = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0][:, -c:]
    expected, stats = policy_loss(
        logps, batch["old_per_token_logps"], batch["advantages"], batch["completion_mask"] * batch["tool_mask"]
    )
    assert pg[1] == pytest.approx(float(expected), abs=1e-5)
    assert abs(pg[1]) > 1e-7  # off-policy after one update: no longer zero
    assert logged(trainer, "loss/ratio_max")[1] == pytest.approx(float(stats["ratio_max"]), abs=1e-4)


def test_groups_stay_whole_in_minibatches(tmp_path, smollm2_tokenizer, tiny_model_factory):
    args = make_args(tmp_path, mini_batch_size=4, micro_batch_size=2, max_steps=2)
    trainer = MultiTurnGRPOTrainer(
        model=tiny_model_factory(), args=args, train_dataset=dataset(), environment_factory=FeedbackEnv,
        reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer,
    )
    trainer.train()
    for mb in range(2):
        chunks = trainer._buffered_inputs[2 * mb : 2 * mb + 2]
        prompts = torch.cat([c["prompt_ids"] for c in chunks])
        assert all(torch.equal(prompts[0], p) for p in prompts)  # one whole group of 4 per mini-batch
        adv = torch.cat([c["advantages"] for c in chunks])
        assert float(adv.sum()) == pytest.approx(0.0, abs=1e-5)
        assert float(chunks[0]["mb_num_sequences"]) == 4


@pytest.mark.parametrize("mode", ["mt-grpo", "discounted"])
def test_turn_level_advantages_train(tmp_path, smollm2_tokenizer, tiny_model_factory, mode):
    class TurnRewardEnv(FeedbackEnv):
        def reset(self, example):
            self.turn = 0
            return super().reset(example)

        def step(self, action):
            self.turn += 1
            return Step(observation="Invalid.", reward=float(len(action.text) % 3 == self.turn % 3))

    args = make_args(tmp_path, max_steps=1, turn_advantage=mode, turn_advantage_gamma=0.5, turn_advantage_weight=0.7)
    trainer = MultiTurnGRPOTrainer(
        model=tiny_model_factory(), args=args, train_dataset=dataset(), environment_factory=TurnRewardEnv,
        reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer,
    )
    rec = Recorder(trainer)
    trainer.train()
    (trajs,), (batch,) = rec.rollouts, rec.batches
    adv = batch["advantages"]  # (B, C) in rollout order
    mask = batch["tool_mask"] * batch["completion_mask"]
    assert adv.dim() == 2 and adv.shape == mask.shape
    assert torch.all(adv[mask == 0] == 0)  # observation and padding tokens get no advantage
    # the exact values: the outcome is the reward functions' part of the reward (the environment's per-turn rewards
    # enter as turn rewards, not twice), each turn's tokens get their own turn's advantage, with gamma and weight
    turn_rewards = [t.turn_rewards for t in trajs]
    assert len({tuple(r) for r in turn_rewards}) > 1  # the per-turn rewards differ: a real turn-level signal
    outcome = [t.reward - sum(r) for t, r in zip(trajs, turn_rewards)]
    turn_ids = torch.full(adv.shape, -1, dtype=torch.long)
    action_mask = torch.zeros(adv.shape, dtype=torch.long)
    for row, t in enumerate(trajs):
        turn_ids[row, : len(t.turn_ids)] = torch.tensor(t.turn_ids)
        action_mask[row, : len(t.action_mask)] = torch.tensor(t.action_mask)
    expected = turn_advantages(mode, outcome, turn_rewards, turn_ids, action_mask, 4, gamma=0.5, turn_weight=0.7)
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-6)
    assert logged(trainer, "grad_norm")[0] > 0


class SometimesFailingEnv(FeedbackEnv):
    created = 0

    def reset(self, example):
        SometimesFailingEnv.created += 1
        self.fail = SometimesFailingEnv.created % 3 == 0  # every third trajectory's tool backend is down
        return super().reset(example)

    def step(self, action):
        if self.fail:
            raise RuntimeError("tool backend down")
        return super().step(action)


def test_environment_failures_are_recorded_and_training_continues(tmp_path, smollm2_tokenizer, tiny_model_factory):
    trainer = MultiTurnGRPOTrainer(
        model=tiny_model_factory(), args=make_args(tmp_path), train_dataset=dataset(),
        environment_factory=SometimesFailingEnv, reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer,
    )
    rec = Recorder(trainer)
    trainer.train()
    assert trainer.state.global_step == 2
    failed = logged(trainer, "env/failed_frac")
    assert any(f > 0 for f in failed)
    for trajs, batch in zip(rec.rollouts, rec.batches):
        for row, t in enumerate(trajs):
            if t.info.get("failed"):
                assert math.isnan(t.reward)
                assert float((batch["tool_mask"][row]).sum()) == 0  # dropped from the loss
                assert "tool backend down" in t.info["env_errors"][0]


def test_lora_and_ppo_epochs(tmp_path, smollm2_tokenizer, tiny_model_factory):
    from peft import LoraConfig

    args = make_args(tmp_path, ppo_epochs=2, max_steps=2)
    assert args.num_iterations == 2
    trainer = MultiTurnGRPOTrainer(
        model=tiny_model_factory(), args=args, train_dataset=dataset(), environment_factory=FeedbackEnv,
        reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    lora_before = {k: v.clone() for k, v in trainer.model.named_parameters() if "lora_B" in k}
    rec = Recorder(trainer)
    trainer.train()
    assert len(rec.batches) == 1  # the second epoch reuses the rollout (old log-probs computed once)
    assert "old_per_token_logps" in rec.batches[0]
    pg = logged(trainer, "loss/pg_loss")
    assert abs(pg[0]) < 1e-6 and abs(pg[1]) > 0  # epoch 2 is off-policy
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(v, after[k]) for k, v in lora_before.items())


# ---------------------------------------------------------------------------------------------------- bad input
def test_bad_input_is_rejected_at_construction(tmp_path, smollm2_tokenizer, tiny_model_factory):
    model = tiny_model_factory()
    with pytest.raises(ValueError, match=r"lacks the column\(s\) \['q'\]"):
        MultiTurnGRPOTrainer(model=model, args=make_args(tmp_path), train_dataset=Dataset.from_dict({"x": [1] * 8}),
                             environment_factory=FeedbackEnv, processing_class=smollm2_tokenizer)
    with pytest.raises(ValueError, match="tool"):
        MultiTurnGRPOTrainer(model=model, args=make_args(tmp_path), train_dataset=dataset(),
                             environment_factory=FeedbackEnv, protocol=ChatToolProtocol(),
                             processing_class=smollm2_tokenizer)

    class NoStops(TagProtocol):
        stop_strings = ()

        def __init__(self):
            super().__init__()
            self.stop_strings = ()

    with pytest.raises(ValueError, match="no stop strings"):
        MultiTurnGRPOTrainer(model=model, args=make_args(tmp_path), train_dataset=dataset(),
                             environment_factory=FeedbackEnv, protocol=NoStops(), processing_class=smollm2_tokenizer)
    with pytest.raises(ValueError, match="environment_factory"):
        MultiTurnGRPOTrainer(model=model, args=make_args(tmp_path), train_dataset=dataset(),
                             processing_class=smollm2_tokenizer)


def test_bad_config_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="max_turns"):
        make_args(tmp_path, max_turns=0)
    with pytest.raises(ValueError, match="loss"):
        make_args(tmp_path, loss_aggregation="seq-mean")
    with pytest.raises(ValueError, match="turn_advantage"):
        make_args(tmp_path, turn_advantage="gae")
    with pytest.raises(ValueError, match="micro_batch_size"):
        MultiTurnGRPOConfig(output_dir=str(tmp_path), prompts_per_rollout=2, mini_batch_size=8, report_to="none")
    with pytest.raises(ValueError, match="mini_batch_size"):
        make_args(tmp_path, mini_batch_size=6)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=0 must be a positive int"):
        make_args(tmp_path, max_tokens_per_micro_batch=0)
    with pytest.raises(ValueError, match="needs balance_micro_batches=True"):
        make_args(tmp_path, max_tokens_per_micro_batch=4096, balance_micro_batches=False)


def test_token_budget_parts():
    from trl_multiturn.batching import _token_budget_parts

    # sorted 50, 40, 30, 20, 10 under 90: [50] (2 x 50 > 90), [40, 30] (2 x 40), [20, 10] (2 x 20)
    assert _token_budget_parts([50, 40, 30, 20, 10], 90, 5) == [[0], [1, 2], [3, 4]]
    assert _token_budget_parts([10, 50, 20, 40, 30], 90, 5) == [[1], [3, 4], [0, 2]]  # order of the rows is free
    assert _token_budget_parts([70, 10], 60, 2) == [[0], [1]]  # longer than the budget: alone
    assert _token_budget_parts([50, 40, 30, 20, 10], 90, 2) is None  # needs 3 of 2 slots
    assert _token_budget_parts([5] * 8, 1000, 8) == [list(range(8))]


def test_trl_private_seams_are_still_there():
    """The methods this trainer extends: if TRL renames or reshapes them, this fails before users do."""
    import inspect

    import trl
    from packaging.version import Version
    from trl import GRPOTrainer

    assert Version("1.16") <= Version(trl.__version__) < Version("1.17"), trl.__version__
    params = lambda name: list(inspect.signature(getattr(GRPOTrainer, name)).parameters)  # noqa: E731
    assert params("_generate_and_score_completions") == ["self", "inputs"]
    assert params("_calculate_rewards") == ["self", "inputs", "prompts", "completions", "completion_ids_list"]
    assert params("_prepare_inputs") == ["self", "generation_batch"]
    assert params("_get_per_token_logps_and_entropies")[:5] == [
        "self", "model", "input_ids", "attention_mask", "logits_to_keep"]
    assert "rollout_func" in inspect.signature(GRPOTrainer.__init__).parameters
    assert GRPOTrainer.loss_is_scaled_for_ga is True  # our compute_loss returns the accumulated-step share
    # the fused LM head's seams the scorer sets (tile width, labelled positions only on CPU)
    from trl.trainer import utils as trl_utils

    assert isinstance(trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE, int) and callable(trl_utils._use_triton)
    assert "_use_triton(" in inspect.getsource(trl_utils.add_fused_lm_head)


@pytest.mark.slow
def test_smollm2_one_step(tmp_path, smollm2_dir, smollm2_tokenizer):
    args = make_args(tmp_path, max_steps=1, num_generations=2, prompts_per_rollout=1, mini_batch_size=2,
                     micro_batch_size=2, max_completion_length=40, max_tokens_per_turn=16, max_turns=2)
    trainer = MultiTurnGRPOTrainer(
        model=str(smollm2_dir), args=args, train_dataset=dataset(2), environment_factory=FeedbackEnv,
        reward_funcs=[vowel_reward],
    )
    trainer.train()
    assert trainer.state.global_step == 1
    assert logged(trainer, "rollout/assistant_tokens_mean")[0] > 0


class VariableLengthEnv(FeedbackEnv):
    """Ends an episode when the sampled text says so (a hash of it), so lengths differ inside a group."""

    def step(self, action):
        return Step(observation="Invalid.", done=sum(map(ord, action.text)) % 3 == 0)


def test_balanced_micro_batches_leave_the_loss_unchanged(tmp_path, smollm2_tokenizer, tiny_model_factory):
    """Same seed, same rollouts: balanced + trimmed micro-batches give the same losses and gradients as plain
    fixed-size splitting, while computing fewer padding tokens."""
    runs = {}
    for balance in (False, True):
        args = make_args(tmp_path / str(balance), mini_batch_size=8, micro_batch_size=2, max_steps=2,
                         balance_micro_batches=balance, max_turns=3, share_prompt_prefix=False)  # padding alone
        trainer = MultiTurnGRPOTrainer(
            model=tiny_model_factory(), args=args, train_dataset=dataset(), environment_factory=VariableLengthEnv,
            reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer,
        )
        trainer.train()
        runs[balance] = trainer
    for key in ("loss/pg_loss", "grad_norm", "reward"):
        assert logged(runs[True], key) == pytest.approx(logged(runs[False], key), abs=1e-5, rel=1e-4), key
    plain, balanced = logged(runs[False], "perf/useful_token_frac"), logged(runs[True], "perf/useful_token_frac")
    assert all(b >= p for b, p in zip(balanced, plain)) and any(b > p for b, p in zip(balanced, plain)), (
        balanced, plain)
    # episodes that end with done (no EOS at their end) are not "clipped": TRL's metric follows the trajectory's flag
    clipped, truncated = logged(runs[True], "completions/clipped_ratio"), logged(runs[True], "rollout/truncated_frac")
    assert clipped == pytest.approx(truncated) and min(clipped) < 1.0, (clipped, truncated)


def test_qlora_step_with_kl_to_the_adapter_free_base(tmp_path, smollm2_tokenizer):
    """QLoRA through the trainer: a 4-bit base (bitsandbytes' CPU path, with the CPU workaround), a LoRA adapter,
    and beta > 0, whose reference policy is the base with the adapter disabled (no second copy of the weights)."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from trl_multiturn.models import prepare_qlora_for_cpu, tiny_random_model

    path = tmp_path / "base"
    tiny_random_model(smollm2_tokenizer, hidden_size=64, num_layers=2, seed=0).save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                     bnb_4bit_compute_dtype=torch.float32),
    )
    prepare_qlora_for_cpu(model)
    trainer = MultiTurnGRPOTrainer(
        model=model, args=make_args(tmp_path, max_steps=1, beta=0.05), train_dataset=dataset(),
        environment_factory=FeedbackEnv, reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    assert trainer.ref_model is None  # the reference is the base model with the adapter disabled
    lora_before = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if "lora_B" in k}
    rec = Recorder(trainer)
    trainer.train()
    assert "ref_per_token_logps" in rec.batches[0]
    kl = logged(trainer, "loss/kl")
    assert len(kl) == 1 and math.isfinite(kl[0]) and abs(kl[0]) < 1e-5  # adapter starts at zero: policy == reference
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(v, after[k]) for k, v in lora_before.items())


def test_kl_of_a_pretrained_adapter_is_taken_to_a_frozen_copy_of_it(tmp_path, smollm2_tokenizer, tiny_model_factory):
    """Training a given adapter (a warm start) with beta > 0: the reference is a frozen copy of that adapter made at
    construction (TRL's "ref" adapter), not the base model. The first rollout's KL is then 0 although the adapter is
    far from the base, and the reference stays where the adapter started while the adapter moves."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model_factory(hidden_size=32, num_layers=2, seed=0),
                           LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    trainer = MultiTurnGRPOTrainer(
        model=model, args=make_args(tmp_path, max_steps=2, beta=0.1), train_dataset=dataset(),
        environment_factory=FeedbackEnv, reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer,
    )
    assert trainer.ref_model is None and "ref" in trainer.model.peft_config
    start = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if ".default." in k}
    trainer.train()
    kl = logged(trainer, "loss/kl")
    assert len(kl) == 2 and abs(kl[0]) < 1e-6 < kl[1], kl  # 0 against the copy, then > 0 once the adapter moved
    params = dict(trainer.model.named_parameters())
    for name, value in start.items():
        torch.testing.assert_close(params[name.replace(".default.", ".ref.")], value)  # the reference did not move
    assert any(not torch.equal(v, params[k]) for k, v in start.items())


def _left_right_padded_batch(lengths, pad_id, seed=0):
    """TRL's training layout: prompts left-padded, completions right-padded. ``lengths`` = [(prompt, completion)]."""
    g = torch.Generator().manual_seed(seed)
    p_w, c_w = max(p for p, _ in lengths), max(c for _, c in lengths)
    ids = torch.full((len(lengths), p_w + c_w), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(lengths):
        ids[i, p_w - p : p_w + c] = torch.randint(10, 4000, (p + c,), generator=g)
        mask[i, p_w - p : p_w + c] = 1
    return ids, mask, c_w


def test_compact_padding_gives_trl_log_probs_with_fewer_tokens(tmp_path, smollm2_tokenizer, tiny_model_factory):
    """The compacted forward (each row's real tokens contiguous, right-padded) returns the log-probs of TRL's
    left/right-padded layout for every real completion token, and 0 elsewhere; a mask with a hole falls back to
    TRL's path exactly."""
    from trl import GRPOTrainer

    from trl_multiturn.layouts import compact_rows

    trainer = MultiTurnGRPOTrainer(
        model=tiny_model_factory(), args=make_args(tmp_path), train_dataset=dataset(), environment_factory=FeedbackEnv,
        reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer,
    )
    model = trainer.model.eval()
    lengths = [(7, 3), (2, 9), (5, 5), (1, 1), (6, 0)]
    ids, mask, c_w = _left_right_padded_batch(lengths, smollm2_tokenizer.pad_token_id)
    with torch.no_grad():
        ours, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, c_w, batch_size=2)
        theirs, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, ids, mask, c_w)
    real = mask[:, -c_w:].bool()
    assert ours.shape == theirs.shape == (len(lengths), c_w)
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=1e-5)
    assert (ours[~real] == 0).all() and ours[real].abs().min() > 0
    compact_ids, compact_mask, index, valid, is_completion = compact_rows(ids, mask, c_w)
    assert compact_ids.size(1) == max(p + c for p, c in lengths) < ids.size(1)
    assert compact_mask.sum() == mask.sum() and (compact_ids.gather(1, index)[valid] == ids[:, -c_w:][valid]).all()
    assert is_completion.sum(1).tolist() == [c for _, c in lengths]
    assert all(is_completion[i, p : p + c].all() for i, (p, c) in enumerate(lengths))

    holed = mask.clone()
    holed[1, -c_w + 2] = 0  # a hole inside a completion: not compactable, TRL's path is used
    with torch.no_grad():
        ours, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, holed, c_w)
        theirs, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, ids, holed, c_w)
    assert torch.equal(ours, theirs)


@pytest.mark.slow  # three training runs: ~8 s
def test_token_budget_micro_batches_leave_the_loss_unchanged(tmp_path, smollm2_tokenizer, tiny_model_factory):
    """max_tokens_per_micro_batch: the mini-batch is cut into the fewest micro-batches that fit the budget (unused
    accumulation slots run an empty micro-batch); losses and gradients equal fixed-size micro-batching."""
    from trl_multiturn.batching import chunk_tokens

    runs, chunks = {}, {}
    for name in (None, 120, 10**6, "120 unshared"):
        budget = 120 if name == "120 unshared" else name
        extra = {"micro_batch_size": 2} if budget is None else {"max_tokens_per_micro_batch": budget, "micro_batch_size": None}
        args = make_args(tmp_path / str(name), mini_batch_size=8, max_steps=2, max_turns=3,
                         share_prompt_prefix=name != "120 unshared", **extra)
        trainer = MultiTurnGRPOTrainer(
            model=tiny_model_factory(), args=args, train_dataset=dataset(), environment_factory=VariableLengthEnv,
            reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer,
        )
        seen = []
        original = trainer._prepare_inputs
        trainer._prepare_inputs = lambda batch: seen.append(original(batch)) or seen[-1]
        trainer.train()
        runs[name], chunks[name] = trainer, seen
    assert runs[120].args.micro_batch_size == 1 and runs[120].args.gradient_accumulation_steps == 8
    for name in (120, 10**6, "120 unshared"):
        budget, share = (120, False) if name == "120 unshared" else (name, True)
        for key in ("loss/pg_loss", "grad_norm", "reward"):
            assert logged(runs[name], key) == pytest.approx(logged(runs[None], key), abs=1e-5, rel=1e-4), key
        real = [c for c in chunks[name] if not c.get("empty_micro_batch")]
        lengths = [(c["prompt_mask"].sum(1) + c["completion_mask"].sum(1)) for c in real]
        # padded size within budget (the shared-prompt forward computes a repeated prompt once)
        assert all(len(n) == 1 or chunk_tokens(c, True, False, share)[0] <= budget for c, n in zip(real, lengths))
        if not share:
            assert all(len(n) == 1 or len(n) * int(n.max()) <= budget for n in lengths)
        assert sum(len(n) for n in lengths) == 8 * 2  # every trajectory of both steps trained exactly once
        empty = [c for c in chunks[budget] if c.get("empty_micro_batch")]
        assert all(int(c["tool_mask"].sum()) == 0 and c["prompt_ids"].size(1) + c["completion_ids"].size(1) == 2
                   for c in empty)
    # everything fits one forward with a huge budget: one real micro-batch per step, 7 empty slots
    assert logged(runs[10**6], "perf/micro_batches") == [1.0, 1.0]
    assert 1.0 < min(logged(runs[120], "perf/micro_batches"))
    # group members share their prompt's forward: fewer tokens processed for the same loss
    assert runs[120]._sharing_checked is True and runs["120 unshared"]._sharing_checked is None
    shared, unshared = (logged(runs[k], "perf/completion_token_frac") for k in (120, "120 unshared"))
    assert all(a > b for a, b in zip(shared, unshared)), (shared, unshared)


def test_compact_padding_leaves_training_unchanged(tmp_path, smollm2_tokenizer, tiny_model_factory):
    """Same seed, same rollouts: the compacted training forward gives the losses and gradient norms of TRL's layout
    (two mini-batches, so the frozen old log-probs are computed too) and computes fewer padding tokens when the
    prompts of a micro-batch differ in length."""
    runs = {}
    for compact in (False, True):
        args = make_args(tmp_path / str(compact), prompts_per_rollout=4, mini_batch_size=8, micro_batch_size=8,
                         max_steps=2, compact_padding=compact, max_turns=3)
        questions = Dataset.from_dict({"q": [f"question {i}" + " with more words" * (i % 4) for i in range(16)]})
        trainer = MultiTurnGRPOTrainer(
            model=tiny_model_factory(), args=args, train_dataset=questions, environment_factory=VariableLengthEnv,
            reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer,
        )
        trainer.train()
        runs[compact] = trainer
    for key in ("loss/pg_loss", "loss/ratio_max", "grad_norm", "reward"):
        assert logged(runs[True], key) == pytest.approx(logged(runs[False], key), abs=1e-5, rel=1e-4), key
    # completion tokens / tokens processed: compaction (and sharing the group's prompt) process fewer tokens
    plain, compact = (logged(runs[k], "perf/completion_token_frac") for k in (False, True))
    assert all(c > p for c, p in zip(compact, plain)), (compact, plain)


def test_tokens_processed_counts_the_compacted_width():
    from trl_multiturn.batching import _tokens_processed

    chunk = {"prompt_ids": torch.zeros(3, 7), "completion_ids": torch.zeros(3, 5),
             "prompt_mask": torch.tensor([[0, 0, 0, 0, 0, 1, 1], [1] * 7, [0, 0, 0, 1, 1, 1, 1]]),
             "completion_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])}
    assert _tokens_processed(chunk, compact=False) == 3 * 12
    assert _tokens_processed(chunk, compact=True) == 3 * 8  # longest row: 7 + 1 real tokens


def test_packed_sequences_give_the_unpacked_log_probs(tmp_path, smollm2_tokenizer, tiny_model_factory):
    """Several sequences packed into one row (position ids restarting at 0, no attention mask) score every real
    completion token as the row-per-sequence forward does, in fewer rows; the first-micro-batch check accepts it."""
    from trl import GRPOTrainer

    from trl_multiturn.batching import first_fit_decreasing
    from trl_multiturn.batching import _tokens_processed

    trainer = MultiTurnGRPOTrainer(
        model=tiny_model_factory(), args=make_args(tmp_path), train_dataset=dataset(), environment_factory=FeedbackEnv,
        reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer,
    )
    model = trainer.model.train()  # dropout-free tiny model: train mode is deterministic
    lengths = [(7, 9), (2, 3), (5, 5), (1, 1), (6, 0), (3, 4)]
    ids, mask, c_w = _left_right_padded_batch(lengths, smollm2_tokenizer.pad_token_id, seed=1)
    with torch.no_grad():
        ours, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, c_w)
        theirs, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, ids, mask, c_w)
    assert trainer._packing_checked is True
    real = mask[:, -c_w:].bool()
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=1e-5)
    assert first_fit_decreasing([16, 5, 10, 2, 6, 7], 16) == [[0], [2, 4], [5, 1, 3]]
    chunk = {"prompt_mask": mask[:, :-c_w], "completion_mask": mask[:, -c_w:], "prompt_ids": ids[:, :-c_w],
             "completion_ids": ids[:, -c_w:]}
    assert _tokens_processed(chunk, compact=True, pack=True) == 16 * 3 < _tokens_processed(chunk, compact=True) == 16 * 6


def test_packing_check_is_not_fooled_by_dropout(tmp_path, smollm2_tokenizer, tiny_model_factory):
    """With LoRA dropout the two forwards of the check differ by the dropout noise unless they run without it; the
    check must accept packing on such a model and leave it in train mode."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model_factory(), LoraConfig(r=8, lora_alpha=64, lora_dropout=0.5, init_lora_weights=False,
                                                            target_modules=["q_proj", "v_proj", "up_proj"]))
    trainer = MultiTurnGRPOTrainer(
        model=model, args=make_args(tmp_path, disable_dropout=False), train_dataset=dataset(),
        environment_factory=FeedbackEnv, reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer,
    )
    model = trainer.model.train()
    ids, mask, c_w = _left_right_padded_batch([(7, 9), (2, 3), (5, 5), (3, 4)], smollm2_tokenizer.pad_token_id, seed=1)
    with torch.no_grad():
        noisy = [model(input_ids=ids, attention_mask=mask).logits for _ in range(2)]
        assert (noisy[0] - noisy[1]).abs().mean() > 1e-3  # dropout is really on in train mode
        trainer._get_per_token_logps_and_entropies(model, ids, mask, c_w)
    assert trainer._packing_checked is True and model.training

    # by default (unlike TRL) the trainer turns dropout off, LoRA dropout included
    assert MultiTurnGRPOConfig(output_dir=str(tmp_path / "d"), report_to="none").disable_dropout is True
    model = get_peft_model(tiny_model_factory(), LoraConfig(r=8, lora_dropout=0.5, target_modules=["q_proj"]))
    MultiTurnGRPOTrainer(model=model, args=make_args(tmp_path), train_dataset=dataset(), environment_factory=FeedbackEnv,
                         reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer)
    assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))


def test_packing_is_turned_off_when_the_model_ignores_position_ids(tmp_path, smollm2_tokenizer, tiny_model_factory,
                                                                   caplog):
    """A model whose attention does not isolate packed sequences fails the first-micro-batch check: packing is off
    (with a warning) and the log-probs are still right."""
    from trl import GRPOTrainer

    trainer = MultiTurnGRPOTrainer(
        model=tiny_model_factory(), args=make_args(tmp_path), train_dataset=dataset(), environment_factory=FeedbackEnv,
        reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer,
    )
    model = trainer.model.train()
    inner = model.forward

    def ignore_positions(*args, position_ids=None, **kwargs):  # attention then spans the whole packed row
        return inner(*args, **kwargs)

    model.forward = ignore_positions
    lengths = [(4, 6), (3, 2), (2, 2)]
    ids, mask, c_w = _left_right_padded_batch(lengths, smollm2_tokenizer.pad_token_id, seed=2)
    with torch.no_grad(), caplog.at_level("WARNING"):
        ours, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, c_w)
        theirs, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, ids, mask, c_w)
    assert trainer._packing_checked is False and "training without packing" in caplog.text
    real = mask[:, -c_w:].bool()
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=1e-5)


def test_flash_attention_packs_a_micro_batch_into_one_row(tmp_path, smollm2_tokenizer, tiny_model_factory,
                                                          monkeypatch):
    """With a variable-length attention kernel the whole micro-batch is one row (no padding at all). The kernel is
    not available on CPU: the layout is checked with sdpa, whose packed-sequence masks isolate sequences the same
    way, and the detection on a config that names a flash kernel."""
    from types import SimpleNamespace

    from trl import GRPOTrainer

    import trl_multiturn.scoring as scoring_module

    assert scoring_module.varlen_attention(SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2")))
    assert scoring_module.varlen_attention(SimpleNamespace(module=SimpleNamespace(config=SimpleNamespace(
        _attn_implementation="kernels-community/flash-attn3"))))
    trainer = MultiTurnGRPOTrainer(
        model=tiny_model_factory(), args=make_args(tmp_path), train_dataset=dataset(), environment_factory=FeedbackEnv,
        reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer,
    )
    model = trainer.model.train()
    assert not scoring_module.varlen_attention(model)  # sdpa
    lengths = [(7, 9), (2, 3), (5, 5)]
    ids, mask, c_w = _left_right_padded_batch(lengths, smollm2_tokenizer.pad_token_id, seed=4)
    shapes = []
    hook = model.register_forward_pre_hook(lambda m, a, k: shapes.append(tuple(k["input_ids"].shape)), with_kwargs=True)
    trainer._packing_checked = True
    with torch.no_grad():
        theirs, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, ids, mask, c_w)
        packed_rows, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, c_w)
        monkeypatch.setattr(scoring_module, "varlen_attention", lambda model: True)
        one_row, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, c_w)
    hook.remove()
    real = mask[:, -c_w:].bool()
    torch.testing.assert_close(packed_rows[real], theirs[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(one_row[real], theirs[real], atol=1e-5, rtol=1e-5)
    assert shapes[-1] == (1, sum(p + c for p, c in lengths)) and shapes[-2][0] == 2, shapes


def _group_batch(groups, pad_id, seed=0):
    """TRL's layout for GRPO groups: ``groups`` = [(prompt length, [completion lengths of its members])]; members of
    a group share their prompt tokens."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for p, completions in groups:
        prompt = torch.randint(10, 4000, (p,), generator=g)
        rows += [(prompt, torch.randint(10, 4000, (c,), generator=g)) for c in completions]
    p_w, c_w = max(len(p) for p, _ in rows), max(len(c) for _, c in rows)
    ids = torch.full((len(rows), p_w + c_w), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(rows):
        ids[i, p_w - len(p) : p_w] = p
        ids[i, p_w : p_w + len(c)] = c
        mask[i, p_w - len(p) : p_w + len(c)] = 1
    return ids, mask, c_w


def _logps_and_grads(trainer, model, ids, mask, c_w, trl_path=False):
    """Per-token log-probs of the completion columns, the gradients of a weighted sum of them, and the tokens that
    went through the model outside the one-time checks."""
    from trl import GRPOTrainer

    seen = []

    def count(module, args, kwargs):
        if not trainer._in_packing_check:
            seen.append(kwargs["input_ids"].numel())

    hook = model.register_forward_pre_hook(count, with_kwargs=True)
    model.zero_grad()
    try:
        if trl_path:
            logps, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, ids, mask, c_w)
        else:
            logps, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, c_w)
    finally:
        hook.remove()
    real = mask[:, -c_w:].bool()
    (logps[real] * torch.linspace(0.5, 2.0, int(real.sum()))).sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return logps.detach(), grads, sum(seen)


@pytest.mark.parametrize("checkpointing", [None, "non-reentrant", "reentrant"])
def test_shared_prompt_forward_gives_the_log_probs_and_gradients(tmp_path, smollm2_tokenizer, tiny_model_factory,
                                                                 checkpointing):
    """share_prompt_prefix: the micro-batch as one row, each distinct prompt once followed by its rows' completions,
    attention segment by segment. The log-probs of every real completion token and the gradients of a loss on them
    equal TRL's row-per-sequence forward (also under gradient checkpointing, whose replays run during the backward
    pass); each prompt goes through the model once and no padding does."""
    trainer = MultiTurnGRPOTrainer(
        model=tiny_model_factory(), args=make_args(tmp_path, pack_sequences=False), train_dataset=dataset(),
        environment_factory=FeedbackEnv, reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer,
    )
    model = trainer.model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
        model.enable_input_require_grads()
    groups = [(9, [5, 12, 0, 3]), (4, [7, 1]), (6, [2])]  # prompts of different lengths, one unshared, one empty
    ids, mask, c_w = _group_batch(groups, smollm2_tokenizer.pad_token_id, seed=3)
    ours, g_ours, tokens = _logps_and_grads(trainer, model, ids, mask, c_w)
    theirs, g_theirs, _ = _logps_and_grads(trainer, model, ids, mask, c_w, trl_path=True)
    assert trainer._sharing_checked is True
    real = mask[:, -c_w:].bool()
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=1e-5)
    assert (ours[~real] == 0).all()
    assert len(g_ours) == len(g_theirs) == len([p for p in model.parameters() if p.requires_grad])
    for a, b in zip(g_ours, g_theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    # one row: the prompts less their last token (8 + 3 + 5), then each row's last prompt token and completion
    # (6 + 13 + 1 + 4 + 8 + 2 + 3); compact rows without sharing: 7 x 21
    assert tokens == 16 + 37 < 7 * 21


def test_shared_prompt_forward_falls_back_where_the_attention_is_not_shared(tmp_path, smollm2_tokenizer,
                                                                            tiny_model_factory, caplog):
    """A model whose attention does not run through transformers' AttentionInterface ('eager'), or whose layers do
    not pass the plan on, fails the one-time check: sharing is off with a warning, the log-probs are TRL's."""
    from trl import GRPOTrainer

    ids, mask, c_w = _group_batch([(9, [5, 12, 3]), (4, [7, 1])], smollm2_tokenizer.pad_token_id, seed=4)
    real = mask[:, -c_w:].bool()
    for breakage in ("eager", "plan dropped"):
        model = tiny_model_factory()
        if breakage == "eager":
            model.set_attn_implementation("eager")
        trainer = MultiTurnGRPOTrainer(
            model=model, args=make_args(tmp_path / breakage, pack_sequences=False), train_dataset=dataset(),
            environment_factory=FeedbackEnv, reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer,
        )
        model = trainer.model.train()
        if breakage == "plan dropped":
            inner = model.forward
            model.forward = lambda *args, shared_prompt_plan=None, **kwargs: inner(*args, **kwargs)
        caplog.clear()
        with torch.no_grad(), caplog.at_level("WARNING"):
            ours, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, c_w)
            theirs, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, ids, mask, c_w)
        assert trainer._sharing_checked is False and "training without prompt sharing" in caplog.text, breakage
        torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=1e-5)


def test_shared_budget_parts():
    """Token budget with the shared-prompt forward: a micro-batch that repeats a prompt costs each distinct prompt
    once (less its last token) plus each row's completion and last prompt token, without padding; the fewest
    micro-batches, then the fewest tokens."""
    from trl_multiturn.batching import _shared_budget_parts, _shared_cost

    keys = [(1,) * 21] * 4 + [(2,) * 11] * 4
    p = [21] * 4 + [11] * 4
    c = [30, 9, 19, 29, 35, 5, 34, 4]
    assert _shared_cost(keys, p, c, [0, 3]) == 20 + 31 + 30
    assert _shared_cost(keys, p, c, [0, 4]) == 2 * 51  # no repeated prompt: rows x longest row
    assert _shared_cost(keys, p, c, [0, 3, 4, 6]) == 20 + 10 + 31 + 30 + 36 + 35
    # each group fits (111 and 92 tokens), both together do not (203): two micro-batches, one per group
    assert _shared_budget_parts(keys, p, c, 130, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _shared_budget_parts(keys, p, c, 130, 1) is None
    assert _shared_budget_parts(keys, p, c, 203, 8) == [list(range(8))]
    # interleaved lengths: cut by length, the micro-batches would mix the prompts and pay for both
    keys = [(1,) * 41] * 4 + [(2,) * 41] * 4
    p, c = [41] * 8, [20, 18, 16, 14, 19, 17, 15, 13]
    assert _shared_budget_parts(keys, p, c, 150, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_fixed_micro_batches_keep_groups_together_for_the_shared_prompt():
    """Without a budget, the balanced dealing by length mixes groups; with share_prompt_prefix the micro-batches are
    whole groups when that computes fewer tokens (each group's prompt once, no padding)."""
    from trl_multiturn.batching import balanced_micro_batches, chunk_tokens

    ids, mask, c_w = _group_batch([(30, [20, 3, 19, 2]), (30, [21, 4, 18, 1])], pad_id=0, seed=5)
    batch = {"prompt_ids": ids[:, :-c_w], "prompt_mask": mask[:, :-c_w], "completion_ids": ids[:, -c_w:],
             "completion_mask": mask[:, -c_w:], "tool_mask": mask[:, -c_w:].clone(), "advantages": torch.zeros(8)}
    plans = {share: balanced_micro_batches(batch, 2, 2, share_prefix=share) for share in (False, True)}
    prompts = lambda chunk: {tuple(r.tolist()) for r in chunk["prompt_ids"]}  # noqa: E731
    assert all(len(prompts(c)) == 2 for c in plans[False])  # dealt by length: both groups in each
    assert all(len(prompts(c)) == 1 and len(c["prompt_ids"]) == 4 for c in plans[True])
    tokens = {share: sum(chunk_tokens(c, True, False, True)[0] for c in plan) for share, plan in plans.items()}
    assert tokens[True] == 2 * 29 + sum(c + 1 for c in [20, 3, 19, 2, 21, 4, 18, 1]) < tokens[False]


def test_rollout_max_batch_size_bounds_the_decode_batch_and_keeps_the_samples(tmp_path, smollm2_tokenizer,
                                                                               tiny_model_factory):
    """rollout_max_batch_size reaches the generator (at most that many rows decode together) and, every trajectory
    sampling from its own seeded generator, the rollout's tokens are those of the unbounded run."""

    def rollout(limit):
        trainer = MultiTurnGRPOTrainer(
            model=tiny_model_factory(), args=make_args(tmp_path, max_steps=1, rollout_max_batch_size=limit),
            train_dataset=dataset(), environment_factory=FeedbackEnv, reward_funcs=[vowel_reward],
            processing_class=smollm2_tokenizer,
        )
        generators, run = [], trainer.rollout.run

        def run_and_keep(inputs, generator, params):
            generators.append(generator)
            return run(inputs, generator, params)

        trainer.rollout.run = run_and_keep
        rec = Recorder(trainer)
        trainer.train()
        (gen,) = generators
        return [t.completion_ids for t in rec.rollouts[0]], gen

    unbounded, gen = rollout(None)
    bounded, small = rollout(2)
    assert gen.max_batch_size is None and small.max_batch_size == 2
    assert small.stats["decode_positions"] <= 2 * small.stats["decode_steps"]
    assert gen.stats["decode_positions"] > 2 * gen.stats["decode_steps"]  # 8 trajectories decode together otherwise
    assert bounded == unbounded


def test_rollout_max_batch_size_is_checked(tmp_path):
    with pytest.raises(ValueError, match="rollout_max_batch_size must be >= 1 or None; got 0"):
        make_args(tmp_path, rollout_max_batch_size=0)
    with pytest.raises(ValueError, match="rollout_max_batch_size=4 limits the Transformers generator only"):
        make_args(tmp_path, rollout_max_batch_size=4, use_vllm=True)


def test_rollout_merge_adapter_samples_the_same_policy_and_leaves_the_base_alone(tmp_path, smollm2_tokenizer,
                                                                                  tiny_model_factory):
    """rollout_merge_adapter: the rollout runs with the LoRA adapter folded into the weights (its branch off), samples
    the trajectories the unmerged adapter samples, and training sees the original base weights, bit for bit."""
    from peft import LoraConfig
    from peft.tuners.lora import LoraLayer

    def run(merge):
        trainer = MultiTurnGRPOTrainer(
            model=tiny_model_factory(), args=make_args(tmp_path, max_steps=1, rollout_merge_adapter=merge),
            train_dataset=dataset(), environment_factory=FeedbackEnv, reward_funcs=[vowel_reward],
            processing_class=smollm2_tokenizer,
            peft_config=LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
        )
        base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "base_layer" in n}
        folded, run_rollout = [], trainer.rollout.run

        def spy(inputs, generator, params):  # during the rollout: is the adapter branch off (folded in)?
            folded.append(all(m.disable_adapters for m in trainer.model.modules() if isinstance(m, LoraLayer)))
            return run_rollout(inputs, generator, params)

        trainer.rollout.run = spy
        rec = Recorder(trainer)
        trainer.train()
        after = dict(trainer.model.named_parameters())
        assert all(torch.equal(v, after[n]) for n, v in base.items())
        assert not any(m.disable_adapters for m in trainer.model.modules() if isinstance(m, LoraLayer))
        gap = logged(trainer, "rollout/sampler_logp_diff")[0]
        return folded, [t.completion_ids for t in rec.rollouts[0]], gap

    folded, merged_ids, merged_gap = run(True)
    unfolded, plain_ids, plain_gap = run(False)
    assert folded == [True] and unfolded == [False]
    assert merged_ids == plain_ids
    assert plain_gap < 1e-5 and merged_gap < 1e-4


def test_rollout_merge_adapter_is_refused_where_it_cannot_apply(tmp_path):
    with pytest.raises(ValueError, match=r"rollout_merge_adapter=True .* use_vllm=True"):
        make_args(tmp_path, rollout_merge_adapter=True, use_vllm=True)


@pytest.mark.parametrize("budget, share", [(None, False), (None, True), (200, True), (200, False)])
def test_rows_without_loss_go_into_no_micro_batch_and_the_normalizers_stay(budget, share):
    """Rows whose loss mask is all 0 (a greedy baseline's member, a dropped trajectory) are not computed: they are in
    no micro-batch, each mini-batch keeps its ``accum`` slots (empty ones where rows ran out), and the mini-batch
    normalizers are those of the plan that computes every row."""
    from trl_multiturn.batching import balanced_micro_batches, chunk_normalizers

    groups = [(30, [20, 3, 19, 2]), (25, [21, 4, 18, 1]), (28, [9, 12, 7, 5]), (31, [6, 8, 10, 11])]
    ids, mask, c_w = _group_batch(groups, pad_id=0, seed=3)
    tool_mask = mask[:, -c_w:].clone()
    no_loss = [0, 4, 8, 12, 13, 14, 15]  # each group's first member, and all of the fourth group
    tool_mask[no_loss] = 0
    batch = {"prompt_ids": ids[:, :-c_w], "prompt_mask": mask[:, :-c_w], "completion_ids": ids[:, -c_w:],
             "completion_mask": mask[:, -c_w:], "tool_mask": tool_mask, "advantages": torch.arange(16.0)}
    steps, accum = 4, 2  # two mini-batches of 8 rows; the second keeps 3 rows with loss
    plans = {skip: balanced_micro_batches(batch, steps, accum, budget, share, skip_rows_without_loss=skip)
             for skip in (False, True)}
    assert len(plans[True]) == len(plans[False]) == steps
    computed = [int(r) for c in plans[True] if not c.get("empty_micro_batch") for r in c["advantages"]]
    assert sorted(computed) == [r for r in range(16) if r not in no_loss]
    every = [int(r) for c in plans[False] if not c.get("empty_micro_batch") for r in c["advantages"]]
    assert sorted(every) == list(range(16))
    # per mini-batch, (sequences, tokens) that carry loss: rows 1-3, 5-7 (3+19+2+4+18+1) and rows 9-11 (12+7+5)
    expected = torch.tensor([[6.0, 47.0], [3.0, 24.0]], dtype=torch.float64)
    for plan in plans.values():
        torch.testing.assert_close(chunk_normalizers(plan).view(steps // accum, accum, 2).sum(1), expected)
    tool_mask[8:] = 0  # a mini-batch without a loss token: accum empty micro-batches
    plan = balanced_micro_batches(batch, steps, accum, budget, share)
    assert len(plan) == steps and all(c.get("empty_micro_batch") for c in plan[2:])
    assert not plan[0].get("empty_micro_batch")  # a budget may leave the mini-batch's second slot empty
