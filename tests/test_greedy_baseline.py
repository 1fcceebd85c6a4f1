"""``greedy_baseline``: each group's first rollout decoded greedily, not trained, its reward the baseline of the
others (ReMax / self-critical sequence training). The advantages by hand, the generator's per-row greedy decoding
(both generation paths), the rollout's flags, the trainer end to end, and the settings it refuses."""

import copy
import math

import pytest
import torch

from scripted import Recorder, logged
from test_trainer import FeedbackEnv, dataset, make_args, vowel_reward

from trl_multiturn import MultiTurnGRPOTrainer
from trl_multiturn.advantages import greedy_baseline_advantages, greedy_rows, rollout_advantages
from trl_multiturn.generation import SamplingParams, TransformersGenerator
from trl_multiturn.protocols import TagProtocol
from trl_multiturn.rollout import MultiTurnRollout, RolloutConfig

EPS = 1e-6


def test_advantages_against_the_greedy_member_by_hand():
    # group 0: greedy fails, every sample succeeds (no variance among the samples: plain GRPO gives 0 here)
    # group 1: all equal -> 0;  group 2: greedy succeeds, two of three samples fail
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    a = greedy_baseline_advantages(rewards, 4, eps=EPS)
    std0 = 0.5  # unbiased std of [0, 1, 1, 1]
    std2 = math.sqrt(1 / 3)  # unbiased std of [1, 0, 1, 0]
    expected = [0.0, 1 / (std0 + EPS), 1 / (std0 + EPS), 1 / (std0 + EPS), 0, 0, 0, 0,
                0.0, -1 / (std2 + EPS), 0.0, -1 / (std2 + EPS)]
    torch.testing.assert_close(a, torch.tensor(expected), rtol=1e-6, atol=1e-7)
    none = greedy_baseline_advantages(rewards, 4, scale="none")
    torch.testing.assert_close(none, torch.tensor([0.0, 1, 1, 1, 0, 0, 0, 0, 0, -1, 0, -1]))
    batch = greedy_baseline_advantages(rewards, 4, scale="batch", eps=EPS)
    torch.testing.assert_close(batch, none / (rewards.std() + EPS))
    # ReMax exactly: G = 2, no scale -> r_sample - r_greedy
    torch.testing.assert_close(greedy_baseline_advantages(torch.tensor([0.2, 0.7, 0.9, 0.4]), 2, scale="none"),
                               torch.tensor([0.0, 0.5, 0.0, -0.5]))


def test_a_dropped_greedy_member_falls_back_to_grpo_and_dropped_samples_leave_the_std():
    rewards = torch.tensor([float("nan"), 1.0, 0.0, 0.0, 0.0, 1.0, float("nan"), 1.0])
    keep = torch.isfinite(rewards)
    a = greedy_baseline_advantages(rewards, 4, eps=EPS, keep=keep)
    s = torch.tensor([1.0, 0.0, 0.0])  # group 0's samples: GRPO among them
    torch.testing.assert_close(a[:4], torch.cat([torch.zeros(1), (s - s.mean()) / (s.std() + EPS)]))
    kept = torch.tensor([0.0, 1.0, 1.0])  # group 1: greedy 0, samples 1 and 1 (the NaN one left out)
    torch.testing.assert_close(a[4:], torch.tensor([0.0, 1.0, 0.0, 1.0]) / (kept.std() + EPS))
    # the same through the trainer's entry point: the failed environment is what drops the member
    rpf = torch.tensor([[0.0], [1.0], [0.0], [0.0], [0.0], [1.0], [1.0], [1.0]])
    failed = torch.tensor([True, False, False, False, False, False, True, False])
    out = rollout_advantages(rpf, torch.ones(1), failed, 4, greedy_baseline=True, eps=EPS)
    torch.testing.assert_close(out.advantages, a)


def test_greedy_baseline_refuses_what_it_cannot_score():
    with pytest.raises(ValueError, match="no sampled member"):
        greedy_baseline_advantages(torch.tensor([1.0, 0.0]), 1)
    with pytest.raises(ValueError, match="turn_advantage='trajectory' only"):
        rollout_advantages(torch.zeros(4, 1), torch.ones(1), torch.zeros(4, dtype=torch.bool), 2, mode="mt-grpo",
                           turn_rewards=[[0.0]] * 4, turn_ids=torch.zeros(4, 1, dtype=torch.long),
                           action_mask=torch.ones(4, 1), greedy_baseline=True)


def test_greedy_rows_follow_the_global_layout():
    assert greedy_rows(6, 0, 3) == [True, False, False, True, False, False]
    assert greedy_rows(4, 2, 4) == [False, False, True, False]  # a rank whose rows start mid-group


def _tokens(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("kv_reuse", [True, False])
def test_a_greedy_session_takes_the_argmax_and_leaves_the_sampled_rows_alone(smollm2_tokenizer, tiny_model_factory,
                                                                            kv_reuse):
    tok, model = smollm2_tokenizer, tiny_model_factory().eval()
    contexts = [_tokens(tok, t) for t in ("Question one", "A second, longer question", "Third")]
    params = SamplingParams(temperature=0.7)

    def run(greedy_flags):
        gen = TransformersGenerator(model, tok, generator=torch.Generator().manual_seed(3), kv_reuse=kv_reuse)
        sessions = [gen.new_session() for _ in contexts]
        for s, g in zip(sessions, greedy_flags):
            s.greedy = g
        if not kv_reuse:  # the reference path samples each batch from one stream: compare per row alone
            return [gen.generate([c], 8, params, sessions=[s])[0] for c, s in zip(contexts, sessions)]
        return gen.generate(contexts, 8, params, sessions=sessions)

    mixed, sampled = run([True, False, False]), run([False, False, False])
    greedy = TransformersGenerator(model, tok).generate(contexts, 8, SamplingParams(greedy=True))
    assert mixed[0].ids == greedy[0].ids and mixed[0].ids != sampled[0].ids
    if kv_reuse:  # every row samples from its own stream: the other rows do not notice
        assert [o.ids for o in mixed[1:]] == [o.ids for o in sampled[1:]]
    # the greedy row's log-probs are those of the distribution the trainer scores: log_softmax(logits / T)
    with torch.no_grad():
        full = torch.tensor([contexts[0] + mixed[0].ids])
        logits = model(full).logits[0, len(contexts[0]) - 1 : -1].float()  # (n, V)
    expected = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, torch.tensor(mixed[0].ids).unsqueeze(-1))
    assert mixed[0].logprobs == pytest.approx(expected.squeeze(-1).tolist(), abs=1e-4)


class _NoSessions:
    """A backend that samples every row alike (as vLLM's does here)."""

    def generate(self, contexts, max_new_tokens, params):
        raise AssertionError("not reached")


def test_rollout_marks_greedy_rows_and_refuses_a_backend_without_sessions(smollm2_tokenizer, tiny_model_factory):
    tok, model = smollm2_tokenizer, tiny_model_factory().eval()
    rollout = MultiTurnRollout(FeedbackEnv, TagProtocol(), tok, RolloutConfig(max_turns=2, max_completion_length=40,
                                                                              max_tokens_per_turn=8))
    examples = [{"q": "a"}, {"q": "a"}]
    trajs = rollout.run(examples, TransformersGenerator(model, tok), SamplingParams(temperature=0.7),
                        greedy=[True, False])
    assert trajs[0].info.get("greedy") is True and "greedy" not in trajs[1].info
    alone = rollout.run(examples[:1], TransformersGenerator(model, tok), SamplingParams(greedy=True))
    assert trajs[0].completion_ids == alone[0].completion_ids  # the whole multi-turn trajectory, greedily
    with pytest.raises(ValueError, match="per-trajectory sessions"):
        rollout.run(examples, _NoSessions(), SamplingParams(), greedy=[True, False])
    with pytest.raises(ValueError, match="2 flags for 1 examples"):
        rollout.run(examples[:1], TransformersGenerator(model, tok), SamplingParams(), greedy=[True, False])


def test_trainer_decodes_one_greedy_member_per_group_and_trains_only_the_samples(tmp_path, smollm2_tokenizer,
                                                                                tiny_model_factory):
    model = tiny_model_factory()
    start = copy.deepcopy(model).eval()
    trainer = MultiTurnGRPOTrainer(
        model=model, args=make_args(tmp_path, max_steps=1, greedy_baseline=True, temperature=0.7),
        train_dataset=dataset(), environment_factory=FeedbackEnv, reward_funcs=[vowel_reward],
        processing_class=smollm2_tokenizer,
    )
    rec = Recorder(trainer)
    trainer.train()
    trajs, batch = rec.rollouts[0], rec.batches[0]
    assert [bool(t.info.get("greedy")) for t in trajs] == [True, False, False, False] * 2
    greedy_runs = trainer.rollout.run(list(trainer.train_dataset), TransformersGenerator(start, smollm2_tokenizer),
                                      SamplingParams(greedy=True))
    by_prompt = {tuple(t.prompt_ids): t.completion_ids for t in greedy_runs}
    for g in (0, 4):  # the greedy member is the start policy's greedy trajectory for its prompt
        assert trajs[g].completion_ids == by_prompt[tuple(trajs[g].prompt_ids)]
    # no loss on the greedy rows; the samples' advantages are measured against the greedy reward
    assert batch["tool_mask"][[0, 4]].sum() == 0 and batch["tool_mask"][[1, 2, 3, 5, 6, 7]].sum() > 0
    rewards = torch.tensor([t.reward for t in trajs])
    torch.testing.assert_close(batch["advantages"].cpu(), greedy_baseline_advantages(rewards, 4))
    assert batch["advantages"][[0, 4]].abs().sum() == 0 and batch["advantages"].abs().sum() > 0
    greedy = logged(trainer, "rollout/greedy_reward")
    assert greedy == pytest.approx([float(rewards[[0, 4]].mean())], abs=1e-6)
    assert logged(trainer, "rollout/sampled_reward") == pytest.approx(
        [float(rewards[[1, 2, 3, 5, 6, 7]].mean())], abs=1e-6)
    assert all(g > 0 for g in logged(trainer, "grad_norm"))


def test_greedy_rows_are_not_computed_in_training_and_the_step_is_unchanged(tmp_path, smollm2_tokenizer,
                                                                            tiny_model_factory, monkeypatch):
    """The greedy members carry no loss, so the training micro-batches leave them out (1/G of the training forward
    and backward saved): the same seed gives the same losses and gradient norms as computing them."""
    import functools

    import trl_multiturn.trainer as trainer_module

    runs = {}
    for skip in (True, False):
        with monkeypatch.context() as m:
            m.setattr(trainer_module, "balanced_micro_batches", functools.partial(
                trainer_module.balanced_micro_batches, skip_rows_without_loss=skip))
            trainer = MultiTurnGRPOTrainer(
                model=tiny_model_factory(), args=make_args(tmp_path / str(skip), greedy_baseline=True, temperature=0.7),
                train_dataset=dataset(), environment_factory=FeedbackEnv, reward_funcs=[vowel_reward],
                processing_class=smollm2_tokenizer,
            )
            trainer.train()
        rows = sum(len(c["prompt_ids"]) for c in trainer._buffered_inputs if not c.get("empty_micro_batch"))
        runs[skip] = (trainer, rows)
    assert runs[True][1] == 6 and runs[False][1] == 8  # two groups of 4: the two greedy rows are not computed
    for key in ("loss/pg_loss", "grad_norm", "reward", "rollout/greedy_reward"):
        assert logged(runs[True][0], key) == pytest.approx(logged(runs[False][0], key), abs=1e-6, rel=1e-5), key
    assert len(logged(runs[True][0], "grad_norm")) == 2


@pytest.mark.parametrize("overrides, match", [
    ({"num_generations": 1, "prompts_per_rollout": 2, "mini_batch_size": 2, "micro_batch_size": 2},
     "num_generations=1 leaves no sampled rollout"),
    ({"turn_advantage": "mt-grpo"}, "turn_advantage='mt-grpo'"),
    ({"turn_layout": "per_turn"}, "turn_layout='per_turn'"),
    ({"use_vllm": True}, "use_vllm=True"),
])
def test_config_refuses_greedy_baseline_where_it_cannot_be_honoured(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        make_args(tmp_path, greedy_baseline=True, **overrides)
