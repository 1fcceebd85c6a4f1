"""The generated knowledge base (determinism, split disjointness, gold evidence, retrieval difficulty) and FlashRAG
QA loading from local files, directories and ``datasets`` objects."""

from __future__ import annotations

import json
from collections import Counter

import datasets
import pytest

from trl_multiturn.search.corpus import load_corpus
from trl_multiturn.search.data import QUESTION_TYPES, build_offline_dataset, load_qa_dataset
from trl_multiturn.search.rewards import normalize_answer


def test_deterministic_from_the_seed(kb):
    again = build_offline_dataset(num_entities=80, seed=0)
    assert again.corpus == kb.corpus and again.train_rows == kb.train_rows and again.test_rows == kb.test_rows
    other = build_offline_dataset(num_entities=80, seed=1)
    assert other.train_rows[0]["question"] != kb.train_rows[0]["question"]


def test_sizes_and_columns(kb):
    # 80 people -> 64 train / 16 test; per world: people x 4 questions + cities + 2 x companies + countries
    assert len(kb.train_rows) == 64 * 4 + 16 + 2 * 16 + 4
    assert len(kb.test_rows) == 16 * 4 + 4 + 2 * 4 + 2
    assert set(kb.train.column_names) == {
        "id",
        "question",
        "golden_answers",
        "hops",
        "qtype",
        "subject",
        "bridge",
        "gold_doc_ids",
    }
    hops = Counter(r["hops"] for r in kb.train_rows + kb.test_rows)
    assert set(hops) == {1, 2} and min(hops.values()) > 100
    assert len({r["id"] for r in kb.train_rows + kb.test_rows}) == len(kb.train_rows) + len(kb.test_rows)
    bigger = build_offline_dataset(num_entities=200, seed=0)
    assert len(bigger.corpus) > len(kb.corpus) and len(bigger.test_rows) > len(kb.test_rows)


def test_no_entity_is_shared_between_splits(kb):
    train_names, test_names = kb.entity_names["train"], kb.entity_names["test"]
    assert not train_names & test_names
    for rows, own, other in ((kb.train_rows, train_names, test_names), (kb.test_rows, test_names, train_names)):
        for r in rows:
            for name in (r["subject"], r["bridge"], r["golden_answers"][0]):
                if name is not None:
                    assert name in own and name not in other
    test_answers = {normalize_answer(r["golden_answers"][0]) for r in kb.test_rows}
    train_text = normalize_answer(" ".join(r["question"] + " " + r["golden_answers"][0] for r in kb.train_rows))
    assert not any(a in train_text for a in test_answers)  # no test answer is even mentioned in training data


def test_gold_evidence_states_each_hop(kb):
    docs = {d.id: d for d in kb.corpus}
    for r in kb.train_rows + kb.test_rows:
        assert len(r["gold_doc_ids"]) == r["hops"] == len(QUESTION_TYPES[r["qtype"]].chain)
        first, last = docs[r["gold_doc_ids"][0]], docs[r["gold_doc_ids"][-1]]
        assert r["subject"] in first.title
        if r["hops"] == 2:
            assert r["bridge"] in first.text and r["bridge"] in last.title
            assert r["golden_answers"][0] not in first.text  # the first document alone cannot answer
        assert r["golden_answers"][0] in last.text


def test_documents_hold_distractors(kb):
    person_bios = [d for d in kb.corpus if "was born in" in d.text]
    assert all(d.text.count(".") >= 2 for d in person_bios)  # several sentences, several facts per document
    family = Counter(d.title.split()[1] for d in person_bios)
    assert max(family.values()) >= 2  # namesakes share a family name


def test_question_text_finds_the_first_gold_document_in_top3(kb, kb_bm25):
    rows = kb.train_rows + kb.test_rows
    results = kb_bm25.retrieve([r["question"] for r in rows], 3)
    top3 = sum(r["gold_doc_ids"][0] in [d.id for d in res] for r, res in zip(rows, results)) / len(rows)
    top1 = sum(r["gold_doc_ids"][0] == res[0].id for r, res in zip(rows, results)) / len(rows)
    assert top3 >= 0.95
    assert top1 < 0.95  # not trivial: for some question types a namesake or the other document of the person wins


def test_write_and_reload(kb, tmp_path):
    paths = kb.write(tmp_path)
    assert load_corpus(paths["corpus"]) == kb.corpus
    test = load_qa_dataset(str(paths["test"]))
    assert test["question"] == [r["question"] for r in kb.test_rows]
    assert test["gold_doc_ids"][0] == kb.test_rows[0]["gold_doc_ids"]


def test_argument_errors():
    with pytest.raises(ValueError, match="num_entities must be at least 10"):
        build_offline_dataset(num_entities=3)
    with pytest.raises(ValueError, match="unknown question_types"):
        build_offline_dataset(num_entities=20, question_types=["birth_city", "shoe_size"])
    only = build_offline_dataset(num_entities=20, question_types=["birth_country"])
    assert {r["qtype"] for r in only.train_rows} == {"birth_country"}


# ----- FlashRAG-format QA data -----
FLASHRAG = [
    {"id": "q0", "question": " who wrote hamlet ", "golden_answers": ["Shakespeare", "William Shakespeare"]},
    {"id": "q1", "question": "capital of france?", "golden_answers": "Paris"},  # a string answer
]


def test_load_qa_from_files_and_objects(tmp_path):
    path = tmp_path / "nq.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in FLASHRAG))
    for source in (str(path), FLASHRAG):
        ds = load_qa_dataset(source)
        assert ds["question"] == ["who wrote hamlet", "capital of france?"]
        assert ds["golden_answers"] == [["Shakespeare", "William Shakespeare"], ["Paris"]]
    rows = [{"question": "q", "answer": "A"}, {"question": "r", "answer": "B"}]
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "hub_like.parquet"))
    (tmp_path / "hub_dir").mkdir()
    ds.to_parquet(str(tmp_path / "hub_dir" / "train-00000.parquet"))
    for source in (ds, str(tmp_path / "hub_like.parquet"), str(tmp_path / "hub_dir")):  # hub_dir: load_dataset(name)
        out = load_qa_dataset(source, answer_column="answer", limit=1)
        assert out.column_names == ["question", "golden_answers"] and out["golden_answers"] == [["A"]]


def test_load_qa_errors_name_the_columns():
    with pytest.raises(ValueError, match="needs a 'question' column"):
        load_qa_dataset(datasets.Dataset.from_list([{"query": "x", "golden_answers": ["y"]}]))
    with pytest.raises(ValueError, match="pass answer_column="):
        load_qa_dataset(datasets.Dataset.from_list([{"question": "x", "answer": "y"}]))
    with pytest.raises(ValueError, match="pass answer_column="):
        load_qa_dataset([{"question": "x", "answer": "y"}])
