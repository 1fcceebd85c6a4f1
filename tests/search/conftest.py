"""Fixtures of the search tests: a small hand-written corpus, a small generated knowledge base and their BM25
indexes (built once per session), and loopback servers that are always stopped."""

from __future__ import annotations

import pytest

from trl_multiturn.search.data import build_offline_dataset
from trl_multiturn.search.retrievers import BM25Retriever, Document
from trl_multiturn.search.server import start_server


@pytest.fixture(scope="session")
def small_corpus() -> list[Document]:
    return [
        Document("d0", "Quellport", "Quellport is a harbour city in Varnesia, known for glass lenses."),
        Document("d1", "Varnesia", "Varnesia is a country whose capital is Brindhaven."),
        Document("d2", "Zorvek Talamir", "Zorvek Talamir is a botanist who was born in Quellport."),
        Document("d3", "Mirel Talamir", "Mirel Talamir is a chemist who was born in Brindhaven."),
        Document("d4", "Orvik Industries", "Orvik Industries makes copper wire and is headquartered in Brindhaven."),
        Document("d5", "Brindhaven", "Brindhaven lies on the Selo river and is the capital of Varnesia."),
    ]


@pytest.fixture(scope="session")
def small_bm25(small_corpus) -> BM25Retriever:
    return BM25Retriever(small_corpus)


@pytest.fixture(scope="session")
def kb():
    """A generated knowledge base: 80 people (~200 documents, ~300 train and ~80 test questions)."""
    return build_offline_dataset(num_entities=80, seed=0)


@pytest.fixture(scope="session")
def kb_bm25(kb) -> BM25Retriever:
    return BM25Retriever(kb.corpus)


@pytest.fixture
def server_factory():
    """``make(retriever, **limits) -> (server, url)`` on 127.0.0.1 and a free port; every server is stopped."""
    servers = []

    def make(retriever, limits=None):
        server, url = start_server(retriever, host="127.0.0.1", port=0, limits=limits)
        servers.append(server)
        return server, url

    yield make
    for server in servers:
        server.stop()
