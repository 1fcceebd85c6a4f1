"""Context functions (issue 19, item 4): what of the conversation the next turn sees, on hand-built histories.

A history is the rollout's per-turn record: the prompt, then per turn an assistant message (sampled text and ids) and
a tool message (the environment's text). Each policy rewrites only tool messages, returns new messages and leaves its
input as it was.
"""

import copy
from types import SimpleNamespace

import pytest

import trl_multiturn
from trl_multiturn.context import (
    OBSERVATION_PLACEHOLDER,
    context_policy,
    keep_last_observations,
    truncate_observations,
)
from trl_multiturn.environment import Action
from trl_multiturn.protocols import TRUNCATION_MARKER


def history(observations: list[str]) -> list[dict]:
    """System and user prompt, then one searching assistant turn per observation, each answered by it."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who wrote Solaris?"}]
    for k, text in enumerate(observations):
        messages.append({"role": "assistant", "content": f"<search>q{k}</search>", "ids": [100 + k, 200 + k]})
        messages.append({"role": "tool", "content": text, "action": Action(kind="tool", name="search"),
                         "name": "search"})
    return messages


def contents(messages: list[dict], role: str) -> list[str]:
    return [m["content"] for m in messages if m["role"] == role]


def test_keep_last_observations_replaces_the_older_ones_with_a_placeholder():
    messages = history(["first result", "second result", "third result"])
    before = copy.deepcopy(messages)
    seen = keep_last_observations(1)(messages)
    assert messages == before  # the input is not mutated
    assert all(a is not b for a, b in zip(seen, messages))  # new message dicts
    assert contents(seen, "tool") == [OBSERVATION_PLACEHOLDER, OBSERVATION_PLACEHOLDER, "third result"]
    assert OBSERVATION_PLACEHOLDER == "[earlier result removed]"
    # everything but the content of the older observations is kept: roles, the prompt, assistant turns and their ids,
    # the action each observation answered (the protocol renders it with it)
    assert [m["role"] for m in seen] == [m["role"] for m in messages]
    assert [m for m in seen if m["role"] != "tool"] == [m for m in messages if m["role"] != "tool"]
    searched = (Action("tool", name="search"), "search")
    assert [(m["action"], m["name"]) for m in seen if m["role"] == "tool"] == [searched] * 3


@pytest.mark.parametrize("n, kept", [(0, []), (2, ["b", "c"]), (3, ["a", "b", "c"]), (10, ["a", "b", "c"])])
def test_keep_last_observations_counts(n, kept):
    seen = keep_last_observations(n)(history(["a", "b", "c"]))
    assert contents(seen, "tool") == [OBSERVATION_PLACEHOLDER] * (3 - len(kept)) + kept


def test_keep_last_observations_without_observations_is_the_identity():
    messages = history([])
    assert keep_last_observations(0)(messages) == messages


def test_truncate_observations_cuts_all_but_the_latest(smollm2_tokenizer):
    tok = smollm2_tokenizer
    long_text = "The novel Solaris was written by Stanislaw Lem and published in 1961 in Warsaw."
    messages = history([long_text, "short", long_text])
    before = copy.deepcopy(messages)
    seen = truncate_observations(4, tok)(messages)
    assert messages == before
    first_four = tok.decode(tok(long_text, add_special_tokens=False)["input_ids"][:4])
    # an older long observation: its first 4 tokens and the visible marker; a short one (<= 4 tokens) is whole; the
    # most recent one is untouched however long it is
    assert contents(seen, "tool") == [first_four + TRUNCATION_MARKER, "short", long_text]
    assert first_four == "The novel Solaris"  # 4 tokens: "The", " novel", " Solar", "is"
    assert [m for m in seen if m["role"] != "tool"] == [m for m in messages if m["role"] != "tool"]


def test_truncate_observations_keeps_an_observation_of_exactly_max_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    text = "one two three"
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    assert contents(truncate_observations(n, tok)(history([text, "x"])), "tool") == [text, "x"]
    cut = contents(truncate_observations(n - 1, tok)(history([text, "x"])), "tool")[0]
    assert cut.endswith(TRUNCATION_MARKER) and cut != text


@pytest.mark.parametrize("n", [-1, 1.5, True, "2", None])
def test_keep_last_observations_refuses_bad_n(n):
    with pytest.raises(ValueError, match=r"keep_last_observations\(n\) must be an integer >= 0; got " + repr(n)):
        keep_last_observations(n)


@pytest.mark.parametrize("max_tokens", [0, -3, 2.0, False])
def test_truncate_observations_refuses_bad_max_tokens(smollm2_tokenizer, max_tokens):
    with pytest.raises(ValueError, match=r"truncate_observations\(max_tokens\) must be an integer >= 1; got "
                       + repr(max_tokens) + r".*keep_last_observations"):
        truncate_observations(max_tokens, smollm2_tokenizer)


def test_truncate_observations_refuses_a_missing_tokenizer():
    with pytest.raises(ValueError, match=r"needs the policy's tokenizer.*got NoneType.*truncate_observations\("):
        truncate_observations(8, None)


def test_policies_are_exported():
    assert trl_multiturn.keep_last_observations is keep_last_observations
    assert trl_multiturn.truncate_observations is truncate_observations
    assert {"keep_last_observations", "truncate_observations"} <= set(trl_multiturn.__all__)


def test_context_policy_composes_the_configured_policies(smollm2_tokenizer):
    tok = smollm2_tokenizer
    off = SimpleNamespace(keep_last_observations=None, truncate_observations=None)
    assert context_policy(off, tok) is None and context_policy(object(), tok) is None  # fields absent: off

    def shout(messages):
        return [{**m, "content": m["content"].upper()} if m["role"] == "tool" else dict(m) for m in messages]

    assert context_policy(off, tok, shout) is shout
    long_text = "The novel Solaris was written by Stanislaw Lem and published in 1961 in Warsaw."
    messages = history([long_text, long_text, long_text])
    before = copy.deepcopy(messages)
    both = SimpleNamespace(keep_last_observations=2, truncate_observations=4)
    # the user's function, then truncation of all but the latest, then the placeholder for all but the last 2
    seen = context_policy(both, tok, shout)(messages)
    assert messages == before
    cut = tok.decode(tok(long_text.upper(), add_special_tokens=False)["input_ids"][:4]) + TRUNCATION_MARKER
    assert contents(seen, "tool") == [OBSERVATION_PLACEHOLDER, cut, long_text.upper()]
    assert contents(context_policy(SimpleNamespace(keep_last_observations=0), tok)(messages), "tool") == [
        OBSERVATION_PLACEHOLDER] * 3
    with pytest.raises(ValueError, match=r"truncate_observations\(max_tokens\) must be an integer >= 1; got 0"):
        context_policy(SimpleNamespace(truncate_observations=0), tok)
