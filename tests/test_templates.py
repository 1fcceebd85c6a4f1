"""The chat-template check (issue 19, item 3): does the template keep turn k a token prefix of turn k+1?

Two templates, written in ``scripted.py`` (the per-turn rollout tests use them too), are the same ChatML tool
template twice: ``CHATML`` renders every assistant message as it was written; ``THINK_DROPPING`` drops the
``<think>...</think>`` block of every assistant message but the last, as thinking templates do (DeepSeek-R1, QwQ;
Qwen3 before the last user message). TRL's own ``qwen3.jinja`` is checked too, to pin what docs/trainer.md says
about it.
"""

import warnings
from pathlib import Path

import pytest
import trl

from scripted import CHATML, THINK_DROPPING, with_template
from test_trainer import FeedbackEnv, dataset, make_args

from trl_multiturn import MultiTurnGRPOTrainer
from trl_multiturn.checks import check_protocol
from trl_multiturn.models import tool_chat_template
from trl_multiturn.protocols import ChatToolProtocol, TagProtocol
from trl_multiturn.templates import check_template_prefix, probe_messages

QWEN3 = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------------- the check
def test_think_dropping_template_breaks_the_prefix_at_turn_two(smollm2_tokenizer):
    tok = with_template(smollm2_tokenizer, THINK_DROPPING)
    check = check_template_prefix(tok, ChatToolProtocol())
    assert not check.keeps_prefix and check.applies
    assert (check.turns, check.turn) == (3, 2)  # turn 1's <think> block is gone from turn 2's context
    # the difference starts inside the first assistant message, right after the prompt and its generation prompt
    prompt = ChatToolProtocol().prompt_ids(tok, probe_messages()[:2])
    assert len(prompt) <= check.position < len(prompt) + 3
    assert "I should look this up" in check.trained and "I should look this up" not in check.deployed
    assert "tool_call>" in check.deployed
    assert "assistant" in check.before  # the generation prompt both sides share
    text = check.explain()
    assert "does not keep turn 1 a prefix of turn 2" in text and f"at token {check.position}" in text
    assert f"trained on: {check.trained!r}" in text and f"deployed:   {check.deployed!r}" in text


@pytest.mark.parametrize("role", ["tool", "user"])
def test_chatml_templates_keep_the_prefix(smollm2_tokenizer, role):
    for template in (CHATML, tool_chat_template()):
        check = check_template_prefix(with_template(smollm2_tokenizer, template), ChatToolProtocol(role))
        assert check.keeps_prefix and check.turns == 3 and check.turn is None and check.position is None
        assert "keeps the prefix property" in check.explain()


@pytest.mark.parametrize("role, turn", [("tool", 3), ("user", 2)])
def test_trl_qwen3_template(smollm2_tokenizer, role, turn):
    """Qwen3 keeps non-empty <think> blocks after the last user message but drops empty ones (turn 2 of the probe
    thinks nothing), and with observations as user messages every earlier turn is before the last user message."""
    check = check_template_prefix(with_template(smollm2_tokenizer, QWEN3), ChatToolProtocol(role))
    assert not check.keeps_prefix and check.turn == turn
    assert "think>" in check.trained and "think>" not in check.deployed


def test_tag_protocol_is_not_checked(smollm2_tokenizer):
    check = check_template_prefix(with_template(smollm2_tokenizer, THINK_DROPPING), TagProtocol())
    assert check.keeps_prefix and not check.applies and check.turns == 0
    assert "not applicable to TagProtocol" in check.explain()


def test_default_protocol_is_chat_tool(smollm2_tokenizer):
    assert check_template_prefix(with_template(smollm2_tokenizer, THINK_DROPPING)).protocol == "ChatToolProtocol"


# ---------------------------------------------------------------------------------------------------- the hook
def test_template_check_settings(smollm2_tokenizer):
    tok = with_template(smollm2_tokenizer, THINK_DROPPING)
    with pytest.warns(UserWarning, match="does not keep turn 1 a prefix of turn 2") as record:
        check_protocol(ChatToolProtocol(), tok, "warn")
    message = str(record[0].message)
    assert "trains turn 2 and later on a context the deployed model will not see" in message
    assert "turn_layout='per_turn'" in message and "template_check='off'" in message
    with pytest.raises(ValueError, match="template_check='error'"):
        check_protocol(ChatToolProtocol(), tok, "error")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_protocol(ChatToolProtocol(), tok, "off")
        check_protocol(ChatToolProtocol(), with_template(smollm2_tokenizer, CHATML), "error")
        check_protocol(TagProtocol(), tok, "error")


def test_a_refused_template_names_its_prefix_break(smollm2_tokenizer):
    """ChatToolProtocol refuses TRL's qwen3.jinja (its tool-message probe renders an empty <think> block only while
    the assistant message is the last one); the error then also shows the template's first prefix break."""
    tok = with_template(smollm2_tokenizer, QWEN3)
    with pytest.raises(ValueError) as err:
        check_protocol(ChatToolProtocol(), tok, "warn")
    assert "ChatToolProtocol cannot find the observation's template tokens" in str(err.value)
    assert "does not keep turn 2 a prefix of turn 3" in str(err.value)
    with pytest.raises(ValueError) as err:
        check_protocol(ChatToolProtocol(), tok, "off")
    assert "prefix" not in str(err.value)
    # a template that cannot render tool calls at all: the protocol's own error, nothing added
    with pytest.raises(ValueError, match="drops tool calls") as err:
        check_protocol(ChatToolProtocol(), smollm2_tokenizer, "warn")
    assert "Chat template check" not in str(err.value)


# ---------------------------------------------------------------------------------------------------- the trainer
def build(tmp_path, tokenizer, model, **overrides):
    """A trainer with ChatToolProtocol on a tiny model (test_trainer's environment and config, one step)."""
    return MultiTurnGRPOTrainer(model=model, args=make_args(tmp_path, max_steps=1, **overrides),
                                train_dataset=dataset(), environment_factory=FeedbackEnv, protocol=ChatToolProtocol(),
                                processing_class=tokenizer)


def test_trainer_warns_for_a_think_dropping_template(tmp_path, smollm2_tokenizer, tiny_model_factory):
    tok = with_template(smollm2_tokenizer, THINK_DROPPING)
    with pytest.warns(UserWarning, match=r"(?s)does not keep turn 1 a prefix of turn 2.*turn_layout='per_turn'"):
        build(tmp_path, tok, tiny_model_factory())


def test_trainer_does_not_warn_for_chatml(tmp_path, smollm2_tokenizer, tiny_model_factory):
    tok = with_template(smollm2_tokenizer, CHATML)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = build(tmp_path, tok, tiny_model_factory(), template_check="error")
    assert not [w for w in record if "Chat template check" in str(w.message)]
    assert trainer.args.template_check == "error"


def test_trainer_refuses_a_think_dropping_template_with_error(tmp_path, smollm2_tokenizer, tiny_model_factory):
    tok = with_template(smollm2_tokenizer, THINK_DROPPING)
    with pytest.raises(ValueError, match="template_check='error'"):
        build(tmp_path, tok, tiny_model_factory(), template_check="error")
