"""The second generated knowledge base (trl_multiturn.search.music): other entity types, relations and question
wording than the default, with the same guarantees (disjoint splits, gold evidence per hop, retrievable)."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest

from trl_multiturn.search import BM25Retriever, build_offline_dataset
from trl_multiturn.search.data import QUESTION_TYPES, RELATIONS
from trl_multiturn.search.music import MUSIC_QUESTION_TYPES, MUSIC_RELATIONS, build_music_dataset
from trl_multiturn.search.rewards import normalize_answer


@pytest.fixture(scope="module")
def music():
    return build_music_dataset(num_entities=120, seed=0)


def test_nothing_shared_with_the_default_but_the_format(music):
    assert not set(MUSIC_QUESTION_TYPES) & set(QUESTION_TYPES)
    kinds = lambda rels: {k for r in rels.values() for k in (r.subject_kind, r.object_kind)}  # noqa: E731
    assert not kinds(MUSIC_RELATIONS) & kinds(RELATIONS)
    default_words = {w.format(s="X") for q in QUESTION_TYPES.values() for w in q.question}
    assert not {w.format(s="X") for q in MUSIC_QUESTION_TYPES.values() for w in q.question} & default_words
    default = build_offline_dataset(num_entities=120, seed=0)
    first_words = lambda rows: Counter(r["question"].split()[0] for r in rows)  # noqa: E731
    assert first_words(music.test_rows)["Name"] > 0 and first_words(default.test_rows)["Name"] == 0
    assert set(music.train_rows[0]) == set(default.train_rows[0])  # the same row columns: every recipe reads it


def test_deterministic_disjoint_and_balanced_enough(music):
    again = build_music_dataset(num_entities=120, seed=0)
    assert again.corpus == music.corpus and again.test_rows == music.test_rows
    assert not music.entity_names["train"] & music.entity_names["test"]
    for r in music.test_rows:
        for name in (r["subject"], r["bridge"], r["golden_answers"][0]):
            assert name is None or name in music.entity_names["test"]
    hops = Counter(r["hops"] for r in music.test_rows)
    assert set(hops) == {1, 2} and min(hops.values()) >= 0.4 * len(music.test_rows)


def test_gold_evidence_states_each_hop(music):
    docs = {d.id: d for d in music.corpus}
    for r in music.train_rows + music.test_rows:
        assert len(r["gold_doc_ids"]) == r["hops"] == len(MUSIC_QUESTION_TYPES[r["qtype"]].chain)
        first, last = docs[r["gold_doc_ids"][0]], docs[r["gold_doc_ids"][-1]]
        assert r["subject"] in first.title and r["golden_answers"][0] in last.text
        if r["hops"] == 2:
            assert r["bridge"] in first.text and r["bridge"] in last.title
            assert normalize_answer(r["golden_answers"][0]) not in normalize_answer(first.text)


def test_question_text_finds_the_first_gold_document(music):
    rows = music.test_rows
    results = BM25Retriever(music.corpus).retrieve([r["question"] for r in rows], 3)
    top3 = sum(r["gold_doc_ids"][0] in [d.id for d in res] for r, res in zip(rows, results)) / len(rows)
    assert top3 >= 0.9


def test_the_recipes_load_it(music):
    spec = importlib.util.spec_from_file_location(
        "search_agent_recipe", Path(__file__).resolve().parents[2] / "recipes" / "search_agent.py")
    recipe = importlib.util.module_from_spec(spec)
    sys.modules["search_agent_recipe"] = recipe
    spec.loader.exec_module(recipe)
    args = recipe.SearchAgentArguments(dataset="offline-music", offline_entities=120, heldout="balanced",
                                       heldout_size=40)
    corpus, train, test = recipe.load_data(args)
    assert corpus == music.corpus and Counter(r["hops"] for r in test) == {1: 20, 2: 20}
    assert {r["id"] for r in test} <= {r["id"] for r in music.test_rows}
