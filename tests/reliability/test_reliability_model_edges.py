"""Model-side edge cases: what the policy writes, how long the prompt is, and what the tokenizer lacks.

* a policy whose every completion is empty (EOS first), which also makes every reward in a group equal: advantages
  are exactly 0 and nothing is NaN, through ``trainer.train()``; the tokenizer of that run has neither a pad token
  nor a chat template (``TagProtocol(use_chat_template=False)`` gives the prompt as plain text);
* a completion that runs into ``max_completion_length`` inside an open tag: the trajectory is truncated, the cut
  action is never executed, its tokens keep mask 1;
* a prompt longer than the model's context: an error that names the example (or, with ``on_long_prompt="skip"``,
  the example is dropped and counted);
* tokenizers the trainer cannot work with are rejected at construction, with the fix in the message.
"""

from __future__ import annotations

import math

import pytest
import torch

from trl_multiturn import MultiTurnGRPOTrainer
from trl_multiturn.environment import Step
from trl_multiturn.generation import SamplingParams, TransformersGenerator
from trl_multiturn.models import load_tokenizer_offline, tiny_random_model
from trl_multiturn.protocols import TagProtocol
from trl_multiturn.rollout import MultiTurnRollout, RolloutConfig

from reliability_helpers import FaultEnv, Recorder, fault_dataset, logged, tiny_args, vowel_reward
from scripted import ScriptedLM


def eos_first(model, eos_token_id: int):
    """Make ``model`` put (almost) all probability on EOS at every position: every completion is empty."""
    bias = torch.zeros(model.config.vocab_size)
    bias[eos_token_id] = 50.0
    model.lm_head.register_forward_hook(lambda module, inputs, logits: logits + bias.to(logits.dtype))
    return model


@pytest.fixture(scope="module")
def bare_tokenizer():
    """SmolLM2's tokenizer without a pad token and without a chat template (a fresh copy: the shared one is kept)."""
    tok = load_tokenizer_offline()
    tok.pad_token = None
    tok.chat_template = None
    assert tok.pad_token is None and tok.eos_token is not None
    return tok


@pytest.fixture(scope="module")
def empty_completion_run(tmp_path_factory, bare_tokenizer):
    tok = bare_tokenizer
    model = eos_first(tiny_random_model(load_tokenizer_offline()), tok.eos_token_id)
    trainer = MultiTurnGRPOTrainer(
        model=model, args=tiny_args(tmp_path_factory.mktemp("empty")), train_dataset=fault_dataset(["ok"] * 4),
        environment_factory=FaultEnv, reward_funcs=[vowel_reward], processing_class=tok,
        protocol=TagProtocol(use_chat_template=False),
    )
    recorder = Recorder(trainer)
    trainer.train()
    return trainer, recorder


def test_empty_completions_train_with_zero_advantage_and_no_nan(empty_completion_run, bare_tokenizer):
    trainer, recorder = empty_completion_run
    eos = bare_tokenizer.eos_token_id
    assert trainer.state.global_step == 1
    (rollout,), (batch,) = recorder.rollouts, recorder.batches
    for t in rollout:
        # every turn is just the EOS the policy sampled (mask 1), answered by the invalid-action feedback
        sampled = [i for i, m in zip(t.completion_ids, t.action_mask) if m == 1]
        assert sampled == [eos] * t.num_turns and t.info["actions"] == ["invalid"] * t.num_turns
    # the reward sees the same text in every trajectory (only feedback), so every group's rewards are equal
    assert len({t.reward for t in rollout}) == 1
    # all rewards of each group are equal: the advantage is exactly 0 (no 0/0), the loss and gradient are finite
    assert torch.equal(batch["advantages"], torch.zeros_like(batch["advantages"]))
    assert logged(trainer, "rollout/zero_std_group_frac") == [1.0]
    assert logged(trainer, "loss/pg_loss") == [0.0]
    assert all(math.isfinite(g) for g in logged(trainer, "grad_norm"))


def test_tokenizer_without_pad_token_or_chat_template_trains(empty_completion_run, bare_tokenizer):
    _, recorder = empty_completion_run
    assert bare_tokenizer.pad_token == bare_tokenizer.eos_token  # filled in at construction, with a warning
    prompt = bare_tokenizer.decode(recorder.rollouts[0][0].prompt_ids, skip_special_tokens=True)
    assert prompt.startswith("Question ok:") and "<|im_start|>" not in prompt  # plain text, no template


def test_tokenizer_without_pad_and_eos_is_rejected(tmp_path, bare_tokenizer):
    tok = load_tokenizer_offline()
    tok.pad_token = None
    tok.eos_token = None
    with pytest.raises(ValueError, match=r"neither a pad token nor an EOS token; set tokenizer.pad_token"):
        MultiTurnGRPOTrainer(
            model=tiny_random_model(bare_tokenizer), args=tiny_args(tmp_path), train_dataset=fault_dataset(["ok"] * 2),
            environment_factory=FaultEnv, processing_class=tok,
        )


def test_tokenizer_without_chat_template_is_rejected_at_construction(tmp_path, bare_tokenizer):
    # Without the check, every reset fails at run time and every trajectory is dropped: training learns nothing.
    with pytest.raises(ValueError, match=r"has none.*use_chat_template=False"):
        MultiTurnGRPOTrainer(
            model=tiny_random_model(bare_tokenizer), args=tiny_args(tmp_path), train_dataset=fault_dataset(["ok"] * 2),
            environment_factory=FaultEnv, processing_class=bare_tokenizer,
        )


# ---------------------------------------------------------------------------------------------------- cut inside a tag
class RecordingEnv:
    """Records every action it is asked to execute."""

    def __init__(self):
        self.actions = []

    def reset(self, example):
        return "Question: where?"

    def step(self, action):
        self.actions.append(action)
        return Step(observation="noted")


def test_completion_cut_inside_a_tag_is_truncated_and_not_executed(smollm2_tokenizer):
    tok = smollm2_tokenizer
    first = tok("<search>capital</search>", add_special_tokens=False)["input_ids"]
    second = tok("<search>" + "a very long query that never closes " * 10, add_special_tokens=False)["input_ids"]
    lm = ScriptedLM([first, second], len(tok), tok.eos_token_id)
    envs = []

    def factory():
        envs.append(RecordingEnv())
        return envs[-1]

    budget = 40
    rollout = MultiTurnRollout(factory, TagProtocol(), tok, RolloutConfig(max_turns=4, max_completion_length=budget))
    (t,) = rollout.run([{}], TransformersGenerator(lm, tok), SamplingParams())
    t.validate()
    assert t.truncated and t.info["stop_reason"] == "max_tokens"
    assert len(t.completion_ids) == budget  # the budget counts actions and observations together
    assert t.info["actions"] == ["tool", "invalid"]  # the cut turn has no closing tag
    (env,) = envs
    assert [a.arguments for a in env.actions] == [{"query": "capital"}]  # only the complete action ran
    cut = t.completion_ids[-(t.turn_ids.count(1)) :]
    assert tok.decode(cut).startswith("<search>a very long query") and set(t.action_mask[-len(cut) :]) == {1}


# ---------------------------------------------------------------------------------------------------- long prompts
def short_context_model(tokenizer, context: int):
    model = tiny_random_model(tokenizer)
    model.config.max_position_embeddings = context  # what the trainer reads as the model's context
    return model


def long_prompt_trainer(path, tokenizer, **overrides):
    return MultiTurnGRPOTrainer(
        model=short_context_model(tokenizer, 120), args=tiny_args(path, **overrides),
        train_dataset=fault_dataset(["ok", "long_prompt"]), environment_factory=FaultEnv,
        reward_funcs=[vowel_reward], processing_class=tokenizer,
    )


def test_prompt_longer_than_the_context_is_a_clear_error(tmp_path, smollm2_tokenizer):
    trainer = long_prompt_trainer(tmp_path, smollm2_tokenizer)
    with pytest.raises(ValueError, match=r"Example \d+.*the prompt is \d+ tokens, not shorter than the model context "
                                         r"max_context_length=120\. Shorten the prompt"):
        trainer.train()


def test_long_prompt_error_names_the_example_and_the_switch(tmp_path, smollm2_tokenizer):
    trainer = long_prompt_trainer(tmp_path, smollm2_tokenizer)
    with pytest.raises(ValueError, match=r"\{'mode': 'long_prompt'\}.*on_long_prompt='skip'"):
        trainer.train()


@pytest.mark.slow  # ~7 s
def test_long_prompt_can_be_skipped_with_a_count(tmp_path, smollm2_tokenizer):
    trainer = long_prompt_trainer(tmp_path, smollm2_tokenizer, on_long_prompt="skip")
    recorder = Recorder(trainer)
    trainer.train()
    assert trainer.state.global_step == 1
    (rollout,), (batch,) = recorder.rollouts, recorder.batches
    skipped = [row for row, t in enumerate(rollout) if t.info.get("skipped") == "prompt_too_long"]
    assert len(skipped) == 2  # the long prompt's whole group
    loss_mask = batch["tool_mask"] * batch["completion_mask"]
    assert all(int(loss_mask[row].sum()) == 0 for row in skipped)
    assert logged(trainer, "rollout/skipped_prompts") == [2.0]
    assert logged(trainer, "env/failed_frac") == [0.0]  # not an environment failure
    assert logged(trainer, "rollout/dropped_frac") == [0.5]
