"""``SearchEnvironment`` driven by a scripted policy: search -> information -> answer, invalid actions, the search
budget, retrieval errors, and the rule that no prompt or feedback text contains a parsable action."""

from __future__ import annotations

import re

import pytest

from trl_multiturn.environment import Action, Environment, Step
from trl_multiturn.search import environment as env_module
from trl_multiturn.search.environment import (
    SEARCH_R1_ORIGINAL_TEMPLATE,
    SEARCH_R1_TEMPLATE,
    SearchEnvironment,
    render_documents,
)
from trl_multiturn.search.retrievers import RetrievalError

# Any complete action a tag protocol would act on: an opening tag, content, and the matching closing tag.
PARSABLE = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)

ROW = {
    "id": "q1",
    "question": "In which city was Zorvek Talamir born",
    "golden_answers": ["Quellport"],
    "gold_doc_ids": ["d2"],
}


def search(q):
    return Action(kind="tool", name="search", arguments={"query": q}, text=f"<search>{q}</search>")


def feedback_texts():
    return [v for k, v in vars(env_module).items() if k.endswith("_FEEDBACK")]


def test_prompt_has_the_question_and_no_parsable_action(small_bm25):
    env = SearchEnvironment(small_bm25)
    assert isinstance(env, Environment)
    prompt = env.reset(ROW)
    assert prompt.endswith("Question: In which city was Zorvek Talamir born?\n")  # '?' appended, as Search-R1 does
    assert PARSABLE.search(prompt) is None
    assert PARSABLE.search(SEARCH_R1_TEMPLATE) is None
    assert PARSABLE.search(SEARCH_R1_ORIGINAL_TEMPLATE) is not None  # why the original is not the default
    custom = SearchEnvironment(small_bm25, prompt_template="Q: {question}")
    assert custom.reset(ROW) == "Q: In which city was Zorvek Talamir born?"


def test_search_then_answer(small_bm25):
    env = SearchEnvironment(small_bm25, topk=2)
    env.reset(ROW)
    step = env.step(search("Zorvek Talamir born"))
    assert isinstance(step, Step) and not step.done
    expected_docs = small_bm25.retrieve(["Zorvek Talamir born"], 2)[0]
    assert step.observation == render_documents(expected_docs)
    assert step.observation.startswith('Doc 1(Title: "Zorvek Talamir") Zorvek Talamir is a botanist')
    assert "\nDoc 2(Title: " in step.observation
    assert step.info["action"] == "search" and step.info["doc_ids"] == [d.id for d in expected_docs]
    assert step.info["retrieval_hit"] is True and step.info["gold_doc_hit"] is True
    assert step.info["num_searches"] == 1 and step.reward == 0.0  # the hit reward is off by default
    final = env.step(Action(kind="answer", content=" quellport. ", text="<answer> quellport. </answer>"))
    assert final.done and final.observation is None
    assert final.info["answer"] == "quellport." and final.info["exact_match"] == 1.0 and final.info["f1"] == 1.0
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step(search("again"))


def test_wrong_answer_and_miss(small_bm25):
    env = SearchEnvironment(small_bm25, topk=1)
    env.reset(ROW)
    step = env.step(search("copper wire"))
    assert step.info["retrieval_hit"] is False and step.info["gold_doc_hit"] is False
    assert env.step(Action(kind="answer", content="Brindhaven")).info["exact_match"] == 0.0


def test_invalid_actions_get_feedback_without_a_parsable_action(small_bm25):
    env = SearchEnvironment(small_bm25)
    env.reset(ROW)
    for action in (
        Action(kind="invalid", text="I think the answer is Quellport", error="no complete action tag"),
        Action(kind="tool", name="calculator", arguments={"expr": "1+1"}),
        search("   "),
    ):
        step = env.step(action)
        assert not step.done and step.info["action"] == "invalid"
        assert PARSABLE.search(step.observation) is None
        assert "search tags" in step.observation  # says the format in words
    assert step.info["num_invalid"] == 3 and step.info["num_searches"] == 0
    for text in feedback_texts():
        assert PARSABLE.search(text) is None, text


def test_feedback_does_not_parse_as_an_action_with_the_tag_protocol(small_bm25):
    protocols = pytest.importorskip("trl_multiturn.protocols")
    protocol = protocols.TagProtocol()
    env = SearchEnvironment(small_bm25)
    for text in [env.reset(ROW), *feedback_texts()]:
        assert protocol.parse(text).kind == "invalid", text


def test_search_budget(small_bm25):
    env = SearchEnvironment(small_bm25, max_searches=2)
    env.reset(ROW)
    assert env.step(search("Varnesia")).info["action"] == "search"
    assert env.step(search("Quellport")).info["action"] == "search"
    step = env.step(search("Talamir"))
    assert step.info["action"] == "search_limit" and not step.done
    assert "search budget is spent" in step.observation and PARSABLE.search(step.observation) is None
    assert step.info["num_searches"] == 2 and step.info["num_search_limit"] == 1
    assert env.step(Action(kind="answer", content="Quellport")).info["exact_match"] == 1.0


def test_retrieval_error_becomes_an_observation():
    class Down:
        calls = 0

        def retrieve(self, queries, k):
            self.calls += 1
            raise RetrievalError("retrieval from http://127.0.0.1:9/retrieve failed after 3 attempts")

    env = SearchEnvironment(Down())
    env.reset(ROW)
    step = env.step(search("Zorvek"))
    assert not step.done and step.info["action"] == "retrieval_error"
    assert "search engine failed" in step.observation and step.info["num_retrieval_errors"] == 1
    assert step.info["num_searches"] == 0  # a failed search does not use the budget


def test_retrieval_hit_reward_is_paid_once(small_bm25):
    env = SearchEnvironment(small_bm25, topk=1, retrieval_hit_reward=0.2)
    env.reset(ROW)
    assert env.step(search("copper wire")).reward == 0.0
    assert env.step(search("Zorvek Talamir")).reward == 0.2
    assert env.step(search("Zorvek Talamir botanist")).reward == 0.0  # no reward for finding it again
    assert env.step(search("x")).info["num_retrieval_hits"] == 2


def test_redundant_search_reward_charges_every_search_after_the_answer_was_retrieved(small_bm25):
    env = SearchEnvironment(small_bm25, topk=1, retrieval_hit_reward=0.2, redundant_search_reward=-1.0)
    env.reset(ROW)
    first = env.step(search("copper wire"))  # no answer in it: not redundant, no credit
    assert first.reward == 0.0 and first.info["redundant_search"] is False
    hit = env.step(search("Zorvek Talamir"))
    assert hit.reward == 0.2 and hit.info["redundant_search"] is False
    for query in ("copper wire", "Zorvek Talamir"):  # after the hit, any search costs, whatever it finds
        step = env.step(search(query))
        assert step.reward == -1.0 and step.info["redundant_search"] is True
    env.reset(ROW)  # a new episode starts without the cost
    assert env.step(search("Zorvek Talamir")).reward == 0.2
    capped = SearchEnvironment(small_bm25, topk=1, max_searches=1, redundant_search_reward=-1.0)
    capped.reset(ROW)
    capped.step(search("Zorvek Talamir"))
    refused = capped.step(search("Zorvek Talamir"))  # refused by the budget: not retrieved, not charged
    assert refused.info["action"] == "search_limit" and refused.reward == 0.0
    with pytest.raises(ValueError, match="redundant_search_reward must be a finite number; got nan"):
        SearchEnvironment(small_bm25, redundant_search_reward=float("nan"))


def test_repeated_query_reward_charges_a_query_the_episode_already_searched(small_bm25):
    env = SearchEnvironment(small_bm25, topk=1, retrieval_hit_reward=0.2, repeated_query_reward=-1.0)
    env.reset(ROW)
    first = env.step(search("copper wire"))
    assert first.reward == 0.0 and first.info["repeated_query"] is False
    other = env.step(search("copper  wire alloy"))  # a different query is not a repeat
    assert other.reward == 0.0 and other.info["repeated_query"] is False
    again = env.step(search("  Copper WIRE "))  # case and spacing ignored
    assert again.reward == -1.0 and again.info["repeated_query"] is True
    assert again.observation == first.observation  # retrieved as usual: the same documents come back
    env.reset(ROW)  # a new episode remembers nothing
    assert env.step(search("copper wire")).info["repeated_query"] is False
    both = SearchEnvironment(small_bm25, topk=1, retrieval_hit_reward=0.2, redundant_search_reward=-0.5,
                             repeated_query_reward=-1.0)
    both.reset(ROW)
    assert both.step(search("Zorvek Talamir")).reward == 0.2
    assert both.step(search("zorvek talamir")).reward == -1.5  # after a hit and a repeat: both costs
    assert both.step(search("Zorvek Talamir botanist")).reward == -0.5  # after a hit only
    capped = SearchEnvironment(small_bm25, topk=1, max_searches=1, repeated_query_reward=-1.0)
    capped.reset(ROW)
    capped.step(search("copper wire"))
    refused = capped.step(search("copper wire"))  # refused by the budget: not retrieved, not charged
    assert refused.info["action"] == "search_limit" and refused.reward == 0.0
    with pytest.raises(ValueError, match="repeated_query_reward must be a finite number; got inf"):
        SearchEnvironment(small_bm25, repeated_query_reward=float("inf"))


def test_reset_checks_columns_and_starts_fresh(small_bm25):
    env = SearchEnvironment(small_bm25)
    assert env.required_columns == ("question", "golden_answers")
    with pytest.raises(KeyError, match="golden_answers"):
        env.reset({"question": "q"})
    env.reset(ROW)
    env.step(search("Varnesia"))
    env.reset({"question": "q?", "golden_answers": "Quellport"})  # a string answer is accepted
    assert env.num_searches == 0 and env.golden_answers == ["Quellport"] and not env.gold_doc_ids
    with pytest.raises(ValueError, match="must contain '{question}'"):
        SearchEnvironment(small_bm25, prompt_template="no placeholder")
