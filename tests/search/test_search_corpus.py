"""Corpus loading: Search-R1 JSONL, ``datasets`` objects, saved directories and data files; title/text parsing."""

from __future__ import annotations

import json

import datasets
import pytest

from trl_multiturn.search.corpus import load_corpus, parse_contents, write_corpus_jsonl
from trl_multiturn.search.retrievers import Document

ROWS = [
    {"id": "0", "contents": '"Quellport"\nQuellport is a harbour city.\nIt has two piers.'},
    {"id": "1", "contents": '"Selo"\nSelo is a river.'},
    {"id": 2, "contents": "no title line here"},
]


def test_parse_contents():
    assert parse_contents('"Quellport"\nA city.') == ("Quellport", "A city.")
    assert parse_contents('"A "quoted" title"\nBody\nmore') == ('A "quoted" title', "Body\nmore")
    assert parse_contents("Plain title\nBody") == ("Plain title", "Body")
    assert parse_contents("just text") == ("", "just text")


def test_load_jsonl(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    docs = load_corpus(path)
    assert docs[0] == Document("0", "Quellport", "Quellport is a harbour city.\nIt has two piers.")
    assert docs[2].id == "2" and docs[2].title == "" and docs[2].text == "no title line here"
    assert len(load_corpus(str(path), limit=2)) == 2


def test_jsonl_errors_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n{broken\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2 is not valid JSON"):
        load_corpus(path)
    path.write_text(json.dumps({"id": "1", "body": "x"}) + "\n")
    with pytest.raises(ValueError, match="neither 'contents' nor 'text'"):
        load_corpus(path)


def test_write_then_read_roundtrip(tmp_path):
    docs = [Document("a", "T1", "text one"), Document("b", "T2", "text two")]
    assert load_corpus(write_corpus_jsonl(docs, tmp_path / "out" / "c.jsonl")) == docs


def test_load_from_datasets_objects_dirs_and_files(tmp_path):
    ds = datasets.Dataset.from_list([{"id": str(r["id"]), "contents": r["contents"]} for r in ROWS])
    expected = [d.title for d in load_corpus(ds)]
    assert expected == ["Quellport", "Selo", ""]
    ds.save_to_disk(str(tmp_path / "saved"))
    assert [d.title for d in load_corpus(tmp_path / "saved")] == expected
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "saved_dict"))
    assert [d.title for d in load_corpus(str(tmp_path / "saved_dict"))] == expected
    ds.to_parquet(str(tmp_path / "corpus.parquet"))
    assert [d.id for d in load_corpus(str(tmp_path / "corpus.parquet"))] == ["0", "1", "2"]
    (tmp_path / "hub_like").mkdir()  # a directory of data files goes through datasets.load_dataset(name)
    ds.to_parquet(str(tmp_path / "hub_like" / "train.parquet"))
    assert [d.title for d in load_corpus(str(tmp_path / "hub_like"))] == expected


def test_title_text_columns_and_errors():
    rows = [{"id": "x", "title": "Selo", "text": "A river."}]
    assert load_corpus(datasets.Dataset.from_list(rows)) == [Document("x", "Selo", "A river.")]
    with pytest.raises(ValueError, match="needs 'contents'"):
        load_corpus(datasets.Dataset.from_list([{"id": "x", "body": "y"}]))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_corpus("./no/such/corpus.parquet")
