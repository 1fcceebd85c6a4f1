"""Bad configuration is an error at construction that names the field, the value and a valid alternative.

Each case builds the real object (``MultiTurnGRPOConfig``, a protocol, ``MultiTurnGRPOTrainer``) with one bad value
and asserts on the message: every listed fragment must appear in it. Nothing trains here.
"""

from __future__ import annotations

import math

import pytest
from datasets import Dataset

from trl_multiturn import MultiTurnGRPOConfig, MultiTurnGRPOTrainer
from trl_multiturn.models import tiny_random_model
from trl_multiturn.protocols import ChatToolProtocol, TagProtocol
from trl_multiturn.rollout import MultiTurnRollout, RolloutConfig

from reliability_helpers import FaultEnv, fault_dataset, tiny_args, vowel_reward

PLAN = dict(num_generations=4, prompts_per_rollout=2, mini_batch_size=8, micro_batch_size=4)

# (id, overrides of a valid configuration, fragments the error must contain: field=value, and the fix)
INVALID_CONFIG = [
    ("plan_incomplete", dict(micro_batch_size=None),
     ["prompts_per_rollout=2", "mini_batch_size=8", "not micro_batch_size", "Set the missing ones"]),
    ("plan_one_generation", dict(num_generations=1), ["num_generations=1", "Set num_generations >= 2"]),
    ("plan_mini_above_rollout", dict(mini_batch_size=16),
     ["mini_batch_size=16", "2 x num_generations=4 = 8", "Use mini_batch_size <= 8"]),
    ("plan_rollout_not_divisible", dict(mini_batch_size=6),
     ["mini_batch_size=6", "not divisible", "valid mini_batch_size values", "[4, 8]"]),
    ("plan_micro_above_mini", dict(mini_batch_size=4, micro_batch_size=8),
     ["micro_batch_size=8", "exceeds mini_batch_size=4", "Lower micro_batch_size to 4"]),
    ("plan_mini_not_divisible_by_micro", dict(micro_batch_size=3),
     ["micro_batch_size=3", "Valid micro_batch_size values: [1, 2, 4, 8]"]),
    ("plan_not_positive", dict(micro_batch_size=0), ["micro_batch_size=0", "must be a positive int"]),
    ("turn_advantage", dict(turn_advantage="gae"), ["turn_advantage='gae'", "'trajectory'", "'mt-grpo'"]),
    ("max_turns", dict(max_turns=0), ["max_turns", "got 0", "max_turns=1"]),
    ("max_completion_length", dict(max_completion_length=0), ["max_completion_length", "got 0", "positive"]),
]


# fields the config adds: each bad value would break training later (or silently do something else)
VALIDATED_FIELDS = [
    ("loss_aggregation", dict(loss_aggregation="mean"), ["loss_aggregation='mean'", "'seq-mean-token-mean'"]),
    ("ppo_epochs", dict(ppo_epochs=0), ["ppo_epochs=0", "int >= 1"]),
    ("max_tokens_per_turn", dict(max_tokens_per_turn=0), ["max_tokens_per_turn=0", "None (no cap)"]),
    ("max_observation_tokens", dict(max_observation_tokens=0), ["max_observation_tokens=0", "e.g. 512"]),
    ("env_timeout", dict(env_timeout=0.0), ["env_timeout=0.0", "seconds > 0"]),
    ("turn_advantage_gamma", dict(turn_advantage_gamma=1.5), ["turn_advantage_gamma=1.5", "[0, 1]"]),
    ("turn_advantage_weight", dict(turn_advantage_weight=math.nan), ["turn_advantage_weight=nan", "finite"]),
    ("advantage_eps", dict(advantage_eps=-1.0), ["advantage_eps=-1.0", ">= 0"]),
    ("scale_rewards", dict(scale_rewards="bogus"), ["scale_rewards='bogus'", "'group', 'batch' or 'none'"]),
]


def config(tmp_path, **overrides):
    kw = dict(output_dir=str(tmp_path), report_to="none", max_completion_length=32, **PLAN)
    kw.update(overrides)
    return MultiTurnGRPOConfig(**{k: v for k, v in kw.items() if v is not None})


@pytest.mark.parametrize("overrides,fragments", [c[1:] for c in INVALID_CONFIG], ids=[c[0] for c in INVALID_CONFIG])
def test_invalid_config_names_field_value_and_fix(tmp_path, overrides, fragments):
    with pytest.raises(ValueError) as info:
        config(tmp_path, **overrides)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


@pytest.mark.parametrize("overrides,fragments", [c[1:] for c in VALIDATED_FIELDS], ids=[c[0] for c in VALIDATED_FIELDS])
def test_bad_values_of_added_fields_are_rejected(tmp_path, overrides, fragments):
    with pytest.raises(ValueError) as info:
        config(tmp_path, **overrides)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_unknown_loss_aggregation_lists_the_valid_modes(tmp_path):
    with pytest.raises(ValueError, match=r"'mean' is not (valid|supported); choose one of.*'seq-mean-token-mean'"):
        config(tmp_path, loss_aggregation="mean")


def test_split_groups_warn_with_the_valid_mini_batch_sizes(tmp_path):
    with pytest.warns(UserWarning, match=r"mini_batch_size=2 is not a multiple of num_generations=4.*\[4, 8\]"):
        config(tmp_path, mini_batch_size=2, micro_batch_size=2)


def test_rollout_rejects_max_turns_below_one(smollm2_tokenizer):
    with pytest.raises(ValueError, match=r"max_turns must be >= 1; got 0. Set max_turns=1"):
        MultiTurnRollout(FaultEnv, TagProtocol(), smollm2_tokenizer, RolloutConfig(max_turns=0))


PROTOCOLS = [
    ("no_tags", lambda: TagProtocol(tool_tags=(), answer_tag=""), ["at least one tool tag or an answer tag"]),
    ("bad_tag", lambda: TagProtocol(tool_tags=("web search",)), ["'web search'", "not a valid tag name", "letters"]),
    ("template", lambda: TagProtocol(observation_template="<information></information>"),
     ["observation_template", "must contain '{text}'"]),
    ("role", lambda: ChatToolProtocol(observation_role="system"),
     ["observation_role must be 'tool' or 'user'", "'system'"]),
]


@pytest.mark.parametrize("make,fragments", [c[1:] for c in PROTOCOLS], ids=[c[0] for c in PROTOCOLS])
def test_invalid_protocol_names_field_value_and_fix(make, fragments):
    with pytest.raises(ValueError) as info:
        make()
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


# ---------------------------------------------------------------------------------------------------- trainer
class NoStopStrings(TagProtocol):
    """A tag protocol whose stop strings were emptied: a turn could never end at an action."""

    def __init__(self):
        super().__init__()
        self.stop_strings = ()


def build(tmp_path, tokenizer, **kwargs):
    kw = dict(
        model=tiny_random_model(tokenizer), args=tiny_args(tmp_path), train_dataset=fault_dataset(["ok"] * 2),
        environment_factory=FaultEnv, processing_class=tokenizer,
    )
    kw.update(kwargs)
    return MultiTurnGRPOTrainer(**kw)


TRAINER_CASES = [
    ("protocol_without_stop_strings", dict(protocol=NoStopStrings()),
     ["NoStopStrings has no stop strings", "at least one tool tag or an answer tag"]),
    ("missing_train_column", dict(train_dataset=Dataset.from_dict({"question": ["a", "b"]})),
     ["train_dataset lacks the column(s) ['mode']", "FaultEnv", "it has ['question']", "rename_column"]),
    ("missing_eval_column", dict(eval_dataset=Dataset.from_dict({"q": ["a"]})),
     ["eval_dataset lacks the column(s) ['mode']", "it has ['q']"]),
    ("reward_weights", dict(reward_funcs=[vowel_reward], args="weights"),
     ["reward_weights has 2 entries but 1 reward_funcs", "one weight per reward function"]),
    ("no_environment", dict(environment_factory=None), ["needs environment_factory", "trl.GRPOTrainer"]),
    ("not_an_environment", dict(environment_factory=lambda: object()),
     ["returned object, which has no reset()", "reset(example) and step(action)"]),
]


@pytest.mark.parametrize("kwargs,fragments", [c[1:] for c in TRAINER_CASES], ids=[c[0] for c in TRAINER_CASES])
def test_invalid_trainer_input_is_rejected_at_construction(tmp_path, smollm2_tokenizer, kwargs, fragments):
    if kwargs.get("args") == "weights":
        kwargs = dict(kwargs, args=tiny_args(tmp_path, reward_weights=[1.0, 2.0]))
    with pytest.raises((ValueError, TypeError)) as info:
        build(tmp_path, smollm2_tokenizer, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_args_of_the_wrong_type_name_the_conversion(tmp_path, smollm2_tokenizer):
    from trl import GRPOConfig

    with pytest.raises(TypeError, match=r"args must be a MultiTurnGRPOConfig, got GRPOConfig.*keyword arguments you gave GRPOConfig"):
        build(tmp_path, smollm2_tokenizer, args=GRPOConfig(output_dir=str(tmp_path), report_to="none", bf16=False))
