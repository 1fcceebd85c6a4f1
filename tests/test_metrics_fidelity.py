"""Metrics that say what was trained: the eval loss, the completions table's advantages, the skipped update of a
rollout without a loss token, and the sampler-vs-learner log-prob gap; and the refused vLLM sampling combination."""

import math

import pytest
import torch

from scripted import Recorder, SnapshotAfterFirstStep, logged
from test_trainer import FeedbackEnv, SometimesFailingEnv, dataset, make_args, vowel_reward
from trl_multiturn import MultiTurnGRPOTrainer
from trl_multiturn.environment import Step
from trl_multiturn.loss import loss_normalizers, policy_loss, sampler_learner_gap


def make_trainer(tmp_path, tokenizer, model, env=FeedbackEnv, **overrides):
    return MultiTurnGRPOTrainer(
        model=model, args=make_args(tmp_path, **overrides), train_dataset=dataset(), eval_dataset=dataset(4),
        environment_factory=env, reward_funcs=[vowel_reward], processing_class=tokenizer,
    )


# ---------------------------------------------------------------------------------------------------------------
# sampler vs learner
# ---------------------------------------------------------------------------------------------------------------
def test_sampler_learner_gap_hand_computed():
    q = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, -3.0, 0.0]])  # sampler; NaN = unknown
    p = torch.tensor([[-1.5, -2.0, -1.0], [-0.5, -1.0, -9.0]])  # learner
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    gap_abs, gap_kl, n = sampler_learner_gap(q, p, mask)
    # tokens (0,0) d = -0.5, (0,1) d = 0, (1,0) d = 0; (0,2) has no sampler log-prob, the rest are mask 0
    assert int(n) == 3
    assert float(gap_abs) == pytest.approx(0.5, abs=1e-7)
    assert float(gap_kl) == pytest.approx(math.exp(-0.5) - 1 + 0.5, abs=1e-7)
    with pytest.raises(ValueError, match="same"):
        sampler_learner_gap(q, p[:, :2], mask)


def test_sampler_learner_gap_is_logged_for_the_transformers_generator(tmp_path, smollm2_tokenizer,
                                                                     tiny_model_factory):
    # two mini-batches: pi_old is its own pass; the gap compares it with the generator's log-probs
    trainer = make_trainer(tmp_path, smollm2_tokenizer, tiny_model_factory(), mini_batch_size=4, micro_batch_size=2,
                           max_steps=2, bf16=False)
    trainer.train()
    diff, kl = logged(trainer, "rollout/sampler_logp_diff"), logged(trainer, "rollout/sampler_kl")
    assert len(diff) == len(kl) == 2
    # the generator (KV cache, one token at a time) and the learner (one forward) agree up to fp32 error
    assert all(0 <= x < 1e-4 for x in diff), diff
    assert all(0 <= x < 1e-6 for x in kl), kl
    # recomputed from the first mini-batch: the generator's log-probs against pi_old, over the loss tokens
    chunks = trainer._buffered_inputs[:2]
    sums = [sampler_learner_gap(c["sampling_per_token_logps"], c["old_per_token_logps"],
                                c["completion_mask"] * c["tool_mask"]) for c in chunks]
    tokens = sum(float(s[2]) for s in sums)
    assert diff[0] == pytest.approx(sum(float(s[0]) for s in sums) / tokens, rel=1e-6, abs=1e-12)


def test_vllm_with_filtered_sampling_is_refused(tmp_path, smollm2_tokenizer, tiny_model_factory):
    for top_p, top_k in ((0.9, 0), (1.0, 20)):
        args = make_args(tmp_path, use_vllm=True, top_p=top_p, top_k=top_k)
        with pytest.raises(ValueError, match=f"top_p={top_p} and top_k={top_k}.*vllm_importance_sampling_correction"):
            MultiTurnGRPOTrainer(model=tiny_model_factory(), args=args, train_dataset=dataset(),
                                 environment_factory=FeedbackEnv, reward_funcs=[vowel_reward],
                                 processing_class=smollm2_tokenizer)


# ---------------------------------------------------------------------------------------------------------------
# eval loss
# ---------------------------------------------------------------------------------------------------------------
def test_eval_loss_is_not_scaled_by_the_process_count(tmp_path, smollm2_tokenizer, tiny_model_factory, monkeypatch):
    trainer = make_trainer(tmp_path, smollm2_tokenizer, tiny_model_factory(), max_steps=1, bf16=False)
    rec = Recorder(trainer)
    trainer.train()
    batch = {k: v[:2] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in rec.batches[0].items()}
    batch.pop("old_per_token_logps", None)  # eval: on-policy, ratio 1
    mask = batch["completion_mask"] * batch["tool_mask"]
    # two rows of a group: their advantages do not cancel, so the loss is not 0
    expected, _ = policy_loss(torch.zeros_like(mask, dtype=torch.float32), torch.zeros_like(mask, dtype=torch.float32),
                              batch["advantages"], mask, aggregation=trainer.args.loss_aggregation)
    assert abs(float(expected)) > 1e-4 and loss_normalizers(mask)[0] == 2
    trainer.model.eval()
    # as on rank 0 of 2: the eval loss uses this process's normalizers, so it must not be multiplied by 2
    monkeypatch.setattr(type(trainer.accelerator), "num_processes", property(lambda self: 2))
    assert trainer.accelerator.num_processes == 2
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# completions table
# ---------------------------------------------------------------------------------------------------------------
def test_completions_table_logs_the_advantages_trained_on(tmp_path, smollm2_tokenizer, tiny_model_factory):
    SometimesFailingEnv.created = 0
    trainer = make_trainer(tmp_path, smollm2_tokenizer, tiny_model_factory(), env=SometimesFailingEnv, max_steps=1)
    rec = Recorder(trainer)
    trainer.train()
    (trajs,), (batch,) = rec.rollouts, rec.batches
    assert any(t.info.get("failed") for t in trajs)
    loss_tokens = (batch["completion_mask"] * batch["tool_mask"]).sum(1)
    trained = torch.where(loss_tokens > 0, batch["advantages"], torch.zeros_like(batch["advantages"]))
    assert list(trainer._logs["advantages"]) == pytest.approx(trained.tolist(), abs=0)


# ---------------------------------------------------------------------------------------------------------------
# skipped update
# ---------------------------------------------------------------------------------------------------------------
class EndsThenRunsLong(FeedbackEnv):
    """The first rollout's episodes end at their first action; later ones get long feedback until the completion
    budget cuts them (truncated)."""

    resets = 0

    def reset(self, example):
        EndsThenRunsLong.resets += 1
        self.short = EndsThenRunsLong.resets <= 8
        return super().reset(example)

    def step(self, action):
        if self.short:
            return Step(observation=None, done=True)
        return Step(observation="Invalid. " * 30)


def test_a_rollout_masked_by_truncation_skips_the_update(tmp_path, smollm2_tokenizer, tiny_model_factory):
    EndsThenRunsLong.resets = 0
    model = tiny_model_factory()
    trainer = make_trainer(tmp_path, smollm2_tokenizer, model, env=EndsThenRunsLong, max_steps=2,
                           mask_truncated_completions=True)
    EndsThenRunsLong.resets = 0  # the probe made at construction does not count
    snap = SnapshotAfterFirstStep(model)
    trainer.add_callback(snap)
    rec = Recorder(trainer)
    trainer.train()
    first, second = rec.rollouts
    assert not any(t.truncated for t in first) and all(t.truncated for t in second)
    assert logged(trainer, "rollout/skipped_update") == [0.0, 1.0]
    # Adam's moments from step 1 would move the parameters even with a zero gradient; the update is skipped
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in snap.state.items())
