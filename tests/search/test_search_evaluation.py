"""``evaluate_search_agent``: the per-question records and the summary that every published score comes from.

A scripted policy answers four questions in four different ways through the real rollout loop and the real
``SearchEnvironment`` (one document per search, a budget of one search): right after a search and a search past the
budget, wrong at once, right only as a substring after an invalid turn, and never. Each record field and each mean of
the summary is checked against the values worked out by hand below.
"""

from __future__ import annotations

import pytest

from scripted import ScriptedLM

from trl_multiturn.protocols import TagProtocol
from trl_multiturn.search.environment import SearchEnvironment
from trl_multiturn.search.evaluation import evaluate_search_agent, summarize

ROWS = [
    {"id": "q1", "question": "In which city was Zorvek Talamir born", "golden_answers": ["Quellport"], "hops": 1},
    {"id": "q2", "question": "What is the capital of Varnesia", "golden_answers": ["Brindhaven"], "hops": 2},
    {"id": "q3", "question": "Which river flows through the capital", "golden_answers": ["Brindhaven"], "hops": 2},
    {"id": "q4", "question": "Who founded Orvik Industries", "golden_answers": ["Mirel Talamir"], "hops": 1},
]
SCRIPTS = {
    "Zorvek": ["<search>Zorvek Talamir born</search>", "<search>Zorvek Talamir</search>", "<answer>Quellport</answer>"],
    "Varnesia": ["<answer>Quellport city</answer>"],
    "river": ["I do not know.", "<search>Varnesia capital</search>", "<answer>the city of Brindhaven</answer>"],
    "Orvik": ["no idea"],
}

# per question: (exact_match, substring_match, f1, searches, invalid_rate, answered, turns, answer, stop_reason)
EXPECTED = {
    # the second search is past the budget: an action, but the environment's own count stays 1
    "q1": (1.0, 1.0, 1.0, 1, 0.0, 1.0, 3, "Quellport", "answer"),
    "q2": (0.0, 0.0, 0.0, 0, 0.0, 1.0, 1, "Quellport city", "answer"),
    # "city of brindhaven" vs "brindhaven" (articles dropped): precision 1/3, recall 1 -> F1 0.5
    "q3": (0.0, 1.0, 0.5, 1, 1 / 3, 1.0, 3, "the city of Brindhaven", "answer"),
    "q4": (0.0, 0.0, 0.0, 0, 1.0, 0.0, 3, None, "max_turns"),
}
FIELDS = ("exact_match", "substring_match", "f1", "searches", "invalid_rate", "answered", "turns", "answer",
          "stop_reason")


@pytest.fixture(scope="module")
def evaluation(small_bm25, smollm2_tokenizer):
    tok = smollm2_tokenizer
    scripts = {key: [tok(t, add_special_tokens=False)["input_ids"] for t in turns] for key, turns in SCRIPTS.items()}

    def script_for(context_ids):
        question = tok.decode(context_ids).split("Question:")[1].split("\n")[0]  # the prompt's question line
        (key,) = [k for k in scripts if k in question]
        return scripts[key]

    policy = ScriptedLM(script_for, len(tok), tok.eos_token_id)
    out = evaluate_search_agent(
        policy, tok, ROWS, lambda: SearchEnvironment(small_bm25, topk=1, max_searches=1), protocol=TagProtocol(),
        max_turns=3, max_completion_length=512, max_tokens_per_turn=32, batch_size=3, progress=False,
    )
    return out


def test_each_question_gets_its_record(evaluation):
    records = evaluation["records"]
    assert [(r["id"], r["question"], r["hops"]) for r in records] == [(r["id"], r["question"], r["hops"]) for r in ROWS]
    for record in records:
        expected = dict(zip(FIELDS, EXPECTED[record["id"]]))
        assert {f: record[f] for f in FIELDS} == pytest.approx(expected), record["id"]


def test_summary_is_the_mean_per_hop_count_and_overall(evaluation):
    summary = evaluation["summary"]
    assert summary == summarize(evaluation["records"])
    assert list(summary) == ["all", "hops_1", "hops_2"]
    expected = {
        #          n  EM    substring f1     searches invalid answered turns
        "all": (4, 0.25, 0.5, 0.375, 0.5, 1 / 3, 0.75, 2.5),
        "hops_1": (2, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 3.0),  # q1, q4
        "hops_2": (2, 0.0, 0.5, 0.25, 0.5, 1 / 6, 1.0, 2.0),  # q2, q3
    }
    keys = ("n", "exact_match", "substring_match", "f1", "searches", "invalid_rate", "answered", "turns")
    for name, values in expected.items():
        assert {k: summary[name][k] for k in keys} == pytest.approx(dict(zip(keys, values))), name


def test_records_without_hops_count_only_overall():
    records = [dict(zip(FIELDS, EXPECTED["q1"]), id="x", hops=0), dict(zip(FIELDS, EXPECTED["q2"]), id="y", hops=2)]
    summary = summarize(records)
    assert list(summary) == ["all", "hops_2"] and summary["all"]["n"] == 2 and summary["hops_2"]["n"] == 1
    assert summary["all"]["exact_match"] == 0.5 and summary["hops_2"]["exact_match"] == 0.0


def test_a_search_after_the_answer_was_retrieved_is_counted_as_redundant(small_bm25, smollm2_tokenizer):
    """q1 with a budget of two searches: its first search already returns Quellport, so the second is redundant."""
    tok = smollm2_tokenizer
    script = [tok(t, add_special_tokens=False)["input_ids"] for t in SCRIPTS["Zorvek"]]
    policy = ScriptedLM(lambda context_ids: script, len(tok), tok.eos_token_id)
    out = evaluate_search_agent(
        policy, tok, ROWS[:1], lambda: SearchEnvironment(small_bm25, topk=1, max_searches=2), protocol=TagProtocol(),
        max_turns=3, max_completion_length=512, max_tokens_per_turn=32, batch_size=1, progress=False,
    )
    (record,) = out["records"]
    assert (record["searches"], record["redundant_searches"], record["exact_match"]) == (2, 1, 1.0)
    assert out["summary"]["all"]["redundant_searches"] == 1.0
