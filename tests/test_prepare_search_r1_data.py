"""recipes/prepare_search_r1_data.py offline: small stand-in files in the formats of wiki-18, FlashRAG and the e5 index
parts, laid out as a mirror of the Hub repositories; resuming an interrupted copy; errors that name the file."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

import repo_scripts

CORPUS = [
    {"id": "0", "contents": '"Aaron Burr"\nAaron Burr was the third vice president of the United States.'},
    {"id": "1", "contents": '"Paris"\nParis is the capital and largest city of France.'},
    {"id": "2", "contents": '"Mount Everest"\nMount Everest is the highest mountain above sea level.'},
]
NQ = [{"id": "test_0", "question": "what is the capital of france", "golden_answers": ["Paris"]}]
HOTPOT = [{"id": "dev_0", "question": "who was vice president after jefferson", "golden_answers": ["Aaron Burr"]}]


def load_script():
    return repo_scripts.load_script("recipes/prepare_search_r1_data.py")


def _jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


@pytest.fixture
def mirror(tmp_path) -> Path:
    """A local copy of the three Hub repositories, with the real file names."""
    root = tmp_path / "mirror"
    files = {
        "PeterJinGo/wiki-18-corpus/wiki-18.jsonl.gz": gzip.compress(_jsonl(CORPUS)),
        "RUC-NLPIR/FlashRAG_datasets/nq/train.jsonl": _jsonl(NQ * 3),
        "RUC-NLPIR/FlashRAG_datasets/nq/test.jsonl": _jsonl(NQ),
        "RUC-NLPIR/FlashRAG_datasets/hotpotqa/train.jsonl": _jsonl(HOTPOT * 2),
        "RUC-NLPIR/FlashRAG_datasets/hotpotqa/dev.jsonl": _jsonl(HOTPOT),
        "PeterJinGo/wiki-18-e5-index/part_aa": bytes(range(256)) * 40,
        "PeterJinGo/wiki-18-e5-index/part_ab": bytes(range(100)),
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def test_prepares_corpus_qa_and_e5_from_a_mirror(tmp_path, mirror, capsys):
    from trl_multiturn.search import BM25Retriever, load_corpus, load_qa_dataset

    out = tmp_path / "data"
    report = load_script().main(["--out_dir", str(out), "--mirror", str(mirror), "--e5", "--bm25"])
    printed = capsys.readouterr().out
    assert report["corpus"]["rows"] == 3 and report["nq/train"]["rows"] == 3 and report["hotpotqa/dev"]["rows"] == 1
    assert "3 passages indexed" in printed and "MiB" in printed and "done in" in printed
    # what the recipe and the server read
    docs = load_corpus(str(out / "wiki-18.jsonl"))
    assert [d.title for d in docs] == ["Aaron Burr", "Paris", "Mount Everest"]
    assert BM25Retriever(docs).retrieve(["capital of France"], k=1)[0][0].title == "Paris"
    assert load_qa_dataset(str(out / "nq" / "test.jsonl"))[0]["golden_answers"] == ["Paris"]
    index = (out / "e5_Flat.index").read_bytes()  # the parts joined in order, then removed
    assert index == bytes(range(256)) * 40 + bytes(range(100)) and not (out / "part_aa").exists()
    assert not (out / "wiki-18.jsonl.gz").exists()  # unpacked, then removed (--keep_gz keeps it)
    assert json.loads((out / "prepare_report.json").read_text())["e5"]["bytes"] == len(index)
    # a second run keeps every file and fetches nothing
    load_script().main(["--out_dir", str(out), "--mirror", str(mirror / "nowhere"), "--e5"])
    assert capsys.readouterr().out.count("already there") == 4  # the four QA files; corpus and index are kept too


def test_an_interrupted_copy_resumes(tmp_path, mirror, capsys):
    script = load_script()
    out = tmp_path / "data"
    whole = (mirror / "RUC-NLPIR/FlashRAG_datasets/nq/train.jsonl").read_bytes()
    (out / "nq").mkdir(parents=True)
    (out / "nq" / "train.jsonl.part").write_bytes(whole[:20])  # what an interrupted run left
    path = script.fetch("RUC-NLPIR/FlashRAG_datasets", "nq/train.jsonl", out, mirror)
    assert "resuming nq/train.jsonl at" in capsys.readouterr().out
    assert path.read_bytes() == whole and not (out / "nq" / "train.jsonl.part").exists()


def test_bad_input_names_the_file_and_the_fix(tmp_path, mirror):
    script = load_script()
    out = tmp_path / "data"
    with pytest.raises(FileNotFoundError, match=r"nowhere/PeterJinGo/wiki-18-corpus/wiki-18.jsonl.gz does not exist"):
        script.main(["--out_dir", str(out), "--mirror", str(tmp_path / "nowhere")])
    bad = mirror / "RUC-NLPIR/FlashRAG_datasets/nq/test.jsonl"
    bad.write_text(json.dumps(NQ[0]) + "\n" + json.dumps({"question": "no answers"}) + "\n")
    with pytest.raises(ValueError, match=r"nq/test.jsonl:2 has keys \['question'\]; a qa row needs 'question' and "
                                         r"'golden_answers'"):
        script.main(["--out_dir", str(out), "--mirror", str(mirror)])
    with pytest.raises(ValueError, match="not valid JSON"):
        (tmp_path / "broken.jsonl").write_text('{"contents": "x"\n')
        script.check_jsonl(tmp_path / "broken.jsonl", "corpus")


def test_an_unreachable_hub_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # conftest sets it too: no request leaves the machine
    with pytest.raises(RuntimeError, match=r"could not download wiki-18.jsonl.gz from the Hub dataset "
                                           r"PeterJinGo/wiki-18-corpus .*--mirror DIR"):
        load_script().main(["--out_dir", str(tmp_path / "data")])
