"""``expert_loss_coef``: the teacher-forced NLL of expert trajectories added to the GRPO loss (PPO-ptx). The draw of
examples (passes, resume, ranks), the NLL against transformers' own loss, the scaling per micro-batch, the trainer end
to end, and the settings it refuses."""

import pytest
import torch

from scripted import logged
from test_trainer import FeedbackEnv, dataset, make_args, vowel_reward

from trl_multiturn import MultiTurnGRPOTrainer
from trl_multiturn.expert_loss import ExpertLoss, expert_loss_for


def _rows(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = 6 + 3 * i
        ids = torch.randint(10, 4000, (length,), generator=g).tolist()
        mask = [0] * 3 + [1] * (length - 5) + [0, 1]  # prompt, actions, an observation token, an action token
        rows.append({"input_ids": ids, "assistant_masks": mask})
    return rows


def test_examples_are_drawn_in_passes_and_a_resumed_run_draws_the_same():
    loss = ExpertLoss(_rows(5), coef=1.0, micro_batch_size=2, accum=3, seed=7, pad_token_id=0)
    drawn = [i for step in range(5) for micro in range(3) for i in loss.indices(step, micro)]  # 30 draws, 6 passes
    for p in range(6):
        assert sorted(drawn[5 * p : 5 * p + 5]) == list(range(5))  # every pass sees every example once
    assert drawn[:5] != drawn[5:10]  # each pass its own permutation
    resumed = ExpertLoss(_rows(5), coef=1.0, micro_batch_size=2, accum=3, seed=7, pad_token_id=0)
    assert [resumed.indices(3, m) for m in range(3)] == [loss.indices(3, m) for m in range(3)]
    ranks = [ExpertLoss(_rows(5), 1.0, 1, 3, 7, 0, rank=r, world=2) for r in (0, 1)]
    for step in range(3):
        for micro in range(3):  # two ranks draw consecutive, different examples within a pass
            a, b = (r.indices(step, micro)[0] for r in ranks)
            k = (step * 3 + micro) * 2
            if k // 5 == (k + 1) // 5:
                assert a != b


def test_nll_is_transformers_token_mean_loss_and_the_call_scales_it(tiny_model_factory):
    model = tiny_model_factory()
    rows = _rows(4)
    loss = ExpertLoss(rows, coef=0.5, micro_batch_size=3, accum=4, seed=0, pad_token_id=0)
    index = loss.indices(0, 0)
    ids, attention, mask = loss.batch(index, "cpu")
    labels = ids.masked_fill(mask == 0, -100)  # padding has mask 0 too
    reference = model(input_ids=ids, attention_mask=attention, labels=labels).loss
    nll = loss.nll(model, index, "cpu")
    torch.testing.assert_close(nll, reference, rtol=1e-5, atol=1e-6)
    metrics = {}
    term = loss(model, step=0, metrics=metrics)
    torch.testing.assert_close(term, 0.5 * reference / 4, rtol=1e-5, atol=1e-6)
    term.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    loss(model, step=0, metrics=metrics)  # the second micro-batch of step 0, then step 1 starts again at micro 0
    loss(model, step=1, metrics=metrics)
    assert loss._micro == 1 and len(metrics["loss/expert_nll"]) == 3
    assert metrics["loss/expert_nll"][0] == pytest.approx(float(reference.detach()), rel=1e-5)


def test_trainer_adds_the_expert_loss_to_the_grpo_loss(tmp_path, smollm2_tokenizer, tiny_model_factory):
    """Same seed, same rollout: the logged loss grows by c times the mean expert NLL of the step's micro-batches, the
    policy loss is unchanged, and the gradient differs."""
    runs = {}
    for coef in (0.0, 0.5):
        trainer = MultiTurnGRPOTrainer(
            model=tiny_model_factory(), args=make_args(tmp_path / str(coef), max_steps=1, expert_loss_coef=coef),
            train_dataset=dataset(), environment_factory=FeedbackEnv, reward_funcs=[vowel_reward],
            processing_class=smollm2_tokenizer, expert_dataset=_rows(6) if coef else None,
        )
        trainer.train()
        runs[coef] = trainer
    nll = logged(runs[0.5], "loss/expert_nll")
    assert len(nll) == 1 and nll[0] > 0
    assert logged(runs[0.5], "loss/pg_loss") == pytest.approx(logged(runs[0.0], "loss/pg_loss"), abs=1e-6)
    assert logged(runs[0.5], "loss")[0] == pytest.approx(logged(runs[0.0], "loss")[0] + 0.5 * nll[0], rel=1e-4)
    assert logged(runs[0.5], "grad_norm")[0] != pytest.approx(logged(runs[0.0], "grad_norm")[0], rel=1e-3)


def test_refusals(tmp_path, smollm2_tokenizer, tiny_model_factory):
    with pytest.raises(ValueError, match="expert_loss_coef must be >= 0"):
        make_args(tmp_path, expert_loss_coef=-0.1)
    with pytest.raises(ValueError, match="expert_micro_batch_size must be >= 1"):
        make_args(tmp_path, expert_micro_batch_size=0)
    kwargs = dict(train_dataset=dataset(), environment_factory=FeedbackEnv, reward_funcs=[vowel_reward],
                  processing_class=smollm2_tokenizer)
    with pytest.raises(ValueError, match="needs expert trajectories: pass expert_dataset="):
        MultiTurnGRPOTrainer(model=tiny_model_factory(), args=make_args(tmp_path, expert_loss_coef=0.1), **kwargs)
    with pytest.raises(ValueError, match="expert_loss_coef=0 would ignore it"):
        MultiTurnGRPOTrainer(model=tiny_model_factory(), args=make_args(tmp_path), expert_dataset=_rows(2), **kwargs)
    with pytest.raises(ValueError, match="row 0 has 6 input_ids and 5 assistant_masks"):
        ExpertLoss([{"input_ids": [1] * 6, "assistant_masks": [0, 1, 1, 1, 1]}], 1.0, 1, 1, 0, 0)
    with pytest.raises(ValueError, match="is empty"):
        ExpertLoss([], 1.0, 1, 1, 0, 0)


@pytest.mark.parametrize("kind", ["DEEPSPEED", "FSDP"])
def test_deepspeed_and_fsdp_are_refused(tmp_path, kind):
    """DDP is checked on two ranks (tests/test_multiprocess.py); the sharded backends are refused, not run unchecked."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    trainer = SimpleNamespace(args=make_args(tmp_path, expert_loss_coef=0.1),
                              accelerator=SimpleNamespace(distributed_type=DistributedType[kind], num_processes=2))
    with pytest.raises(ValueError, match=f"under {kind} its second forward"):
        expert_loss_for(trainer, _rows(2))
