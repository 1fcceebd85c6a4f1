"""QA rewards: Search-R1 / SQuAD normalization cases, exact and substring match, F1, answer extraction, the format
check, and the TRL reward-function signatures (string and conversational completions)."""

from __future__ import annotations

import pytest

from trl_multiturn.search.rewards import (
    check_format,
    exact_match,
    exact_match_reward,
    extract_answer,
    f1,
    f1_reward,
    format_reward,
    normalize_answer,
    substring_match,
    substring_match_reward,
)


@pytest.mark.parametrize(
    "raw,normalized",
    [
        ("The Eiffel Tower", "eiffel tower"),  # article dropped, lower-cased
        ("  an   apple,  a pie! ", "apple pie"),  # articles, punctuation, white space
        ("U.S.A.", "usa"),  # punctuation removed, not replaced by spaces
        ("Theatre of the Absurd", "theatre of absurd"),  # 'the' only as a whole word
        ("Anatomy", "anatomy"),  # 'an' inside a word stays
        ("A", ""),
        ("rock'n'roll", "rocknroll"),
        ("Tab\tand\nnewline", "tab and newline"),
    ],
)
def test_normalize_answer(raw, normalized):
    assert normalize_answer(raw) == normalized


def test_exact_and_substring_match():
    assert exact_match("the Beijing.", ["beijing"]) == 1.0
    assert exact_match("Beijing", "Beijing") == 1.0  # a single string gold
    assert exact_match("Beijing China", ["Beijing"]) == 0.0
    assert exact_match("Paris", ["Beijing", "paris"]) == 1.0  # any gold counts
    assert exact_match(None, ["Beijing"]) == 0.0
    assert substring_match("It is Beijing, China", ["beijing"]) == 1.0
    assert substring_match("Bei", ["Beijing"]) == 0.0
    assert substring_match("anything", ["the"]) == 0.0  # a gold that normalizes to nothing never matches


def test_f1():
    assert f1("Zorvek Talamir", ["Zorvek Talamir"]) == 1.0
    # pred {zorvek, talamir, jr}, gold {zorvek, talamir}: P = 2/3, R = 1, F1 = 2 * (2/3) / (5/3) = 0.8
    assert f1("Zorvek Talamir Jr", ["Zorvek Talamir"]) == pytest.approx(0.8)
    assert f1("Quellport", ["Brindhaven", "quellport"]) == 1.0  # best over golds
    assert f1("nothing shared", ["Quellport"]) == 0.0
    assert f1(None, ["x"]) == 0.0


def test_extract_answer_takes_the_last():
    assert extract_answer("<answer> first </answer> ... <answer>\n Last one \n</answer>") == "Last one"
    assert extract_answer("no answer here") is None
    assert extract_answer("<answer>unclosed") is None
    assert extract_answer(None) is None


VALID = [
    "<think>I know it.</think><answer>Paris</answer>",
    '<think>a</think>\n<search>q</search>\n\n<information>Doc 1(Title: "x") y</information>\n\n'
    "<think>b</think>\n<search>q2</search><information>z</information><think>c</think>\n<answer>Paris</answer>\n",
]
INVALID = [
    ("Paris", "text outside the tags"),
    ("", "does not end with an answer"),
    ("<answer>Paris</answer>", "unexpected tag <answer>"),  # think is required before an action
    ("<think>a</think><answer>x</answer><answer>y</answer>", "unexpected tag <answer> in state end"),
    ("<think>a</think>stray<answer>x</answer>", "text outside the tags"),
    ("<think>a</think><search>q</search><think>b</think><answer>x</answer>", "unexpected tag <think>"),
    ("<think>a<search>q</search></think><answer>x</answer>", "unexpected tag <search> in state in_think"),
    ("<think>a</think><search>q</search><information>i</information>", "does not end with an answer"),
]


def test_check_format():
    for text in VALID:
        assert check_format(text) == (True, "ok"), text
    for text, why in INVALID:
        ok, reason = check_format(text)
        assert not ok and why in reason, (text, reason)
    assert check_format("<search>q</search><information>i</information><answer>x</answer>", require_think=False)[0]


def test_trl_reward_functions_with_strings():
    completions = [VALID[1], "<think>x</think><answer>London</answer>", "no tags at all"]
    golds = [["paris"], ["Paris"], ["Paris"]]
    kwargs = dict(prompts=["p"] * 3, completion_ids=[[1]] * 3, golden_answers=golds, hops=[1, 2, 1])
    assert exact_match_reward(completions=completions, **kwargs) == [1.0, 0.0, 0.0]
    assert substring_match_reward(completions=completions, **kwargs) == [1.0, 0.0, 0.0]
    assert f1_reward(completions=completions, **kwargs) == [1.0, 0.0, 0.0]
    assert format_reward(completions=completions, **kwargs) == [1.0, 1.0, 0.0]


def test_trl_reward_functions_with_messages():
    conversational = [
        [
            {"role": "assistant", "content": "<think>a</think><search>q</search>"},
            {"role": "tool", "content": 'Doc 1(Title: "x") Paris is the capital.'},
            {"role": "assistant", "content": [{"type": "text", "text": "<think>b</think><answer>Paris</answer>"}]},
        ],
        [{"role": "assistant", "content": "<answer>Rome</answer>"}],
    ]
    golds = [["Paris"], ["Paris"]]
    assert exact_match_reward(conversational, golden_answers=golds) == [1.0, 0.0]
    assert format_reward(conversational) == [1.0, 0.0]


def test_reward_errors_name_the_column():
    with pytest.raises(ValueError, match="golden_answers"):
        exact_match_reward(["<answer>x</answer>"])
    with pytest.raises(ValueError, match="1 completions but 2 golden_answers"):
        exact_match_reward(["<answer>x</answer>"], golden_answers=[["x"], ["y"]])
