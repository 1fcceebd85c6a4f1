"""Retrievers: a batch of queries and ``k`` in, the top-k documents of each query out.

Three implementations of one :class:`Retriever` contract:

* :class:`BM25Retriever` -- lexical BM25 (``bm25s``) built in process from a corpus; the offline default.
* :class:`DenseRetriever` -- FAISS inner-product search over sentence-transformers embeddings (optional extra:
  ``pip install trl-multiturn[dense]``).
* :class:`HTTPRetriever` -- a client for a retrieval server speaking Search-R1's ``POST /retrieve`` API (ours in
  ``trl_multiturn.search.server`` or Search-R1's own), with timeouts, retries with exponential back-off and the
  merging of concurrent calls into one request.

Departures from Search-R1: its rollout posts one request per turn from a single process with no timeout, no
retry and no error handling (a dead server crashes training). Here a failed request is retried with back-off and
finally raises :class:`RetrievalError`, which ``SearchEnvironment`` turns into an error observation; calls made
from several threads within ``batch_window_s`` are merged into one request.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .document import Document, parse_contents  # Document is re-exported: it lived here

logger = logging.getLogger(__name__)


class RetrievalError(RuntimeError):
    """Retrieval failed (after all retries, for the HTTP client). The environment reports it as an observation."""


@runtime_checkable
class Retriever(Protocol):
    """Structural type of a retriever: ``retrieve(queries, k)[i]`` holds the top ``k`` documents of ``queries[i]``,
    best first. Implementations must be safe to call from several threads."""

    def retrieve(self, queries: list[str], k: int) -> list[list[Document]]: ...


def _check_k(k: int) -> int:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}.")
    return k


def _check_queries(queries: Sequence[str]) -> list[str]:
    if isinstance(queries, str):
        raise TypeError(f"retrieve() takes a list of queries, got the single string {queries!r}; wrap it in a list.")
    queries = list(queries)
    for q in queries:
        if not isinstance(q, str):
            raise TypeError(f"every query must be a string, got {type(q).__name__}: {q!r}.")
    return queries


class _InProcessRetriever:
    """What the retrievers that search an index of ``self.corpus`` held in this process share: the checks of
    ``retrieve``'s arguments (``k`` is capped at the corpus size), the lock around the search, and the copying of
    the hits into documents with their scores. A subclass sets ``corpus`` and ``_lock`` and implements ``_search``."""

    corpus: list[Document]
    _lock: threading.Lock

    def __len__(self) -> int:
        return len(self.corpus)

    def retrieve(self, queries: list[str], k: int) -> list[list[Document]]:
        queries = _check_queries(queries)
        k = min(_check_k(k), len(self.corpus))
        if not queries:
            return []
        with self._lock:
            indices, scores = self._search(queries, k)
        return [
            [
                Document(id=self.corpus[i].id, title=self.corpus[i].title, text=self.corpus[i].text, score=float(s))
                for i, s in zip(row_idx, row_scores)
                if i >= 0  # FAISS pads a row that found fewer than k documents with -1
            ]
            for row_idx, row_scores in zip(indices, scores)
        ]

    def _search(self, queries: list[str], k: int) -> tuple[list[list[int]], list[list[float]]]:
        """``(indices, scores)``: for each query the corpus positions of its top ``k`` documents and their scores,
        best first. Called under ``self._lock``."""
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------------------------
# BM25
# ---------------------------------------------------------------------------------------------------------------
class BM25Retriever(_InProcessRetriever):
    """BM25 over ``title + text`` of each document, built in process with ``bm25s``.

    Args:
        corpus: the documents to index (see ``trl_multiturn.search.corpus.load_corpus``).
        k1, b, method: BM25 parameters passed to ``bm25s.BM25``.
        stopwords: stop-word list name or list for ``bm25s`` ("en" by default; None keeps every token).
        stemmer: optional callable stemmer (e.g. ``Stemmer.Stemmer("english").stemWords`` from PyStemmer).

    After construction ``build_time_s`` (wall seconds to tokenize and index), ``index_bytes`` (bytes held by the
    sparse score matrix) and ``vocab_size`` are set and logged at INFO level.
    """

    def __init__(
        self,
        corpus: Sequence[Document],
        *,
        k1: float = 1.5,
        b: float = 0.75,
        method: str = "lucene",
        stopwords: str | list[str] | None = "en",
        stemmer: Any = None,
    ) -> None:
        if "jax" not in sys.modules:
            # bm25s imports JAX when it is installed and runs a top-k with it at import; JAX's first use on a GPU
            # takes 75% of its memory (seen: 105 of 140 GiB on an H200, and the policy's process ran out). Retrieval
            # itself runs on numpy (below), so JAX only needs a small allocation. A value you set is kept.
            os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        import bm25s
        from bm25s.tokenization import Tokenizer

        self.corpus = list(corpus)
        if not self.corpus:
            raise ValueError("BM25Retriever needs a non-empty corpus; load one with load_corpus(path).")
        start = time.perf_counter()
        self._tokenizer = Tokenizer(lower=True, stopwords=stopwords, stemmer=stemmer)
        texts = [f"{d.title}\n{d.text}" for d in self.corpus]
        corpus_ids = self._tokenizer.tokenize(texts, return_as="ids", show_progress=False)
        self._bm25 = bm25s.BM25(k1=k1, b=b, method=method)
        self._bm25.index(corpus_ids, show_progress=False)
        self.build_time_s = time.perf_counter() - start
        self.index_bytes = int(sum(getattr(a, "nbytes", 0) for a in self._bm25.scores.values()))
        self.vocab_size = len(self._tokenizer.get_vocab_dict())
        self._lock = threading.Lock()
        logger.info(
            "BM25 index: %d documents, %d terms, built in %.2f s, %.1f MiB of scores",
            len(self.corpus),
            self.vocab_size,
            self.build_time_s,
            self.index_bytes / 2**20,
        )

    def _search(self, queries: list[str], k: int) -> tuple[list[list[int]], list[list[float]]]:
        # under the lock: the tokenizer's vocabulary lookups and bm25s' buffers are not documented thread-safe
        query_ids = self._tokenizer.tokenize(queries, update_vocab=False, return_as="ids", show_progress=False)
        # numpy top-k whether or not JAX is installed: the same documents (and tie order) on every machine
        indices, scores = self._bm25.retrieve(query_ids, k=k, show_progress=False, backend_selection="numpy")
        return indices.tolist(), scores.tolist()


# ---------------------------------------------------------------------------------------------------------------
# Dense (optional)
# ---------------------------------------------------------------------------------------------------------------
class DenseRetriever(_InProcessRetriever):
    """Exact inner-product search (FAISS ``IndexFlatIP``) over normalized sentence-transformers embeddings.

    Args:
        corpus: the documents to index.
        model_name_or_path: a sentence-transformers model name or local directory (ignored if ``encoder`` given).
        encoder: an object with ``encode(texts, batch_size=..., normalize_embeddings=..., ...) -> ndarray``.
        batch_size: encoding batch size.
        query_prefix, passage_prefix: strings prepended before encoding (e5 models want "query: "/"passage: ").
        device: device for the encoder (None lets sentence-transformers choose).

    Raises ImportError naming the extra when faiss or sentence-transformers is missing. Sets ``build_time_s``
    (encoding + indexing) and ``index_bytes`` like :class:`BM25Retriever`.
    """

    def __init__(
        self,
        corpus: Sequence[Document],
        model_name_or_path: str = "sentence-transformers/all-MiniLM-L6-v2",
        *,
        encoder: Any = None,
        batch_size: int = 64,
        query_prefix: str = "",
        passage_prefix: str = "",
        device: str | None = None,
    ) -> None:
        try:
            import faiss
        except ImportError as e:
            raise ImportError(
                "DenseRetriever needs faiss; install the dense extra: pip install 'trl-multiturn[dense]'."
            ) from e
        if encoder is None:
            try:
                from sentence_transformers import SentenceTransformer
            except ImportError as e:
                raise ImportError(
                    "DenseRetriever needs sentence-transformers; install the dense extra: "
                    "pip install 'trl-multiturn[dense]', or pass encoder=."
                ) from e
            encoder = SentenceTransformer(model_name_or_path, device=device)
        self.corpus = list(corpus)
        if not self.corpus:
            raise ValueError("DenseRetriever needs a non-empty corpus; load one with load_corpus(path).")
        self.encoder = encoder
        self.batch_size = batch_size
        self.query_prefix = query_prefix
        self.passage_prefix = passage_prefix
        start = time.perf_counter()
        emb = self._encode([f"{passage_prefix}{d.title}\n{d.text}" for d in self.corpus])
        self.index = faiss.IndexFlatIP(emb.shape[1])
        self.index.add(emb)
        self.build_time_s = time.perf_counter() - start
        self.index_bytes = int(emb.nbytes)
        self._lock = threading.Lock()
        logger.info(
            "Dense index: %d documents, dim %d, built in %.2f s, %.1f MiB",
            len(self.corpus),
            emb.shape[1],
            self.build_time_s,
            self.index_bytes / 2**20,
        )

    def _encode(self, texts: list[str]):
        import numpy as np

        emb = self.encoder.encode(
            texts, batch_size=self.batch_size, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
        )
        return np.ascontiguousarray(emb, dtype="float32")

    def _search(self, queries: list[str], k: int) -> tuple[list[list[int]], list[list[float]]]:
        scores, indices = self.index.search(self._encode([f"{self.query_prefix}{x}" for x in queries]), k)
        return indices.tolist(), scores.tolist()


# ---------------------------------------------------------------------------------------------------------------
# HTTP client for Search-R1's retrieval API
# ---------------------------------------------------------------------------------------------------------------
class _TransientError(Exception):
    """A failure worth retrying (connection, timeout, 5xx/429, malformed or mismatched response)."""


@dataclass
class _Pending:
    queries: list[str]
    k: int
    future: Future


def document_from_api(item: Any) -> Document:
    """Parse one result entry of the ``/retrieve`` API into a :class:`Document`.

    Accepts ``{"document": {"id", "contents"}, "score"}`` (``return_scores=true``) and a bare document dict;
    documents with ``title``/``text`` fields instead of ``contents`` are accepted too.
    """
    if not isinstance(item, dict):
        raise ValueError(f"expected a JSON object per result, got {type(item).__name__}: {str(item)[:80]!r}")
    score = 0.0
    doc = item
    if "document" in item:
        doc = item["document"]
        score = item.get("score", 0.0)
        if not isinstance(doc, dict):
            raise ValueError(f"'document' must be a JSON object, got {type(doc).__name__}")
    if "contents" in doc:
        title, text = parse_contents(str(doc["contents"]))
    elif "text" in doc:
        title, text = str(doc.get("title", "")), str(doc["text"])
    else:
        raise ValueError(f"document has neither 'contents' nor 'text': keys {sorted(doc)}")
    if not isinstance(score, (int, float)) or isinstance(score, bool):
        raise ValueError(f"'score' must be a number, got {score!r}")
    return Document(id=str(doc.get("id", "")), title=title, text=text, score=float(score))


class HTTPRetriever:
    """Client for a retrieval server speaking Search-R1's API.

    Request ``POST {url}`` with ``{"queries": [...], "topk": k, "return_scores": true}``; response
    ``{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}`` with one list per query.

    Args:
        url: the server, e.g. ``http://127.0.0.1:8000`` (``/retrieve`` is appended) or the full endpoint URL.
        timeout_s: socket timeout of one attempt.
        max_retries: retries after the first attempt (0 = try once). Retried: connection errors, timeouts,
            HTTP 5xx and 429, a body that is not the expected JSON, a wrong number of result lists.
            Other HTTP 4xx mean the request itself is wrong and raise at once.
        backoff_s: sleep before retry ``i`` (0-based) is ``min(backoff_s * 2**i, max_backoff_s)``.
        max_backoff_s: cap of one back-off sleep.
        batch_window_s: calls from several threads arriving within this window are merged into one request
            (0 disables merging: each call is its own request).
        max_batch_queries: the most queries one request carries; a larger merged batch is split.
        use_env_proxy: route requests through the ``http_proxy``/``https_proxy`` of the environment. Off by
            default: a retrieval server sits on the cluster network, and a proxy meant for the internet would
            intercept (or refuse) requests to it.

    ``stats`` counts ``requests`` (HTTP attempts), ``retries``, ``failures`` (calls that raised) and ``calls``.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        batch_window_s: float = 0.01,
        max_batch_queries: int = 256,
        use_env_proxy: bool = False,
    ) -> None:
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"HTTPRetriever url must look like http://host:port[/retrieve], got {url!r}.")
        if parsed.path in ("", "/"):
            url = url.rstrip("/") + "/retrieve"
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}.")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}.")
        if max_batch_queries < 1:
            raise ValueError(f"max_batch_queries must be >= 1, got {max_batch_queries}.")
        self.url = url
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.batch_window_s = float(batch_window_s)
        self.max_batch_queries = int(max_batch_queries)
        self.stats = {"calls": 0, "requests": 0, "retries": 0, "failures": 0}
        self._lock = threading.Lock()
        self._queue: list[_Pending] = []
        self._leader_waiting = False
        handlers = [] if use_env_proxy else [urllib.request.ProxyHandler({})]
        self._opener = urllib.request.build_opener(*handlers)

    # ----- public -----
    def retrieve(self, queries: list[str], k: int) -> list[list[Document]]:
        queries = _check_queries(queries)
        _check_k(k)
        with self._lock:
            self.stats["calls"] += 1
        if not queries:
            return []
        try:
            return self._retrieve(queries, k)
        except RetrievalError:
            with self._lock:
                self.stats["failures"] += 1
            raise

    # ----- internals -----
    def _retrieve(self, queries: list[str], k: int) -> list[list[Document]]:
        if self.batch_window_s <= 0:
            return self._request_chunked(queries, k)
        # Leader/follower merging: the first caller of a window sleeps for the window, then sends everything that
        # arrived meanwhile; later callers just wait on their future. No background thread outlives a call.
        pending = _Pending(queries, k, Future())
        with self._lock:
            self._queue.append(pending)
            leader = not self._leader_waiting
            if leader:
                self._leader_waiting = True
        if leader:
            time.sleep(self.batch_window_s)
            with self._lock:
                batch, self._queue = self._queue, []
                self._leader_waiting = False
            self._dispatch(batch)
        return pending.future.result()

    def _dispatch(self, batch: list[_Pending]) -> None:
        """Send the merged batch (one request per distinct k, split at ``max_batch_queries``); resolve futures."""
        by_k: dict[int, list[_Pending]] = {}
        for p in batch:
            by_k.setdefault(p.k, []).append(p)
        for k, group in by_k.items():
            try:
                flat = [q for p in group for q in p.queries]
                results = self._request_chunked(flat, k)
            except RetrievalError as e:
                for p in group:
                    p.future.set_exception(e)
                continue
            except Exception as e:  # noqa: BLE001 -- never leave a follower waiting forever on an unexpected error
                err = RetrievalError(f"retrieval from {self.url} failed unexpectedly: {type(e).__name__}: {e}")
                for p in group:
                    p.future.set_exception(err)
                continue
            pos = 0
            for p in group:
                p.future.set_result(results[pos : pos + len(p.queries)])
                pos += len(p.queries)

    def _request_chunked(self, queries: list[str], k: int) -> list[list[Document]]:
        out: list[list[Document]] = []
        for i in range(0, len(queries), self.max_batch_queries):
            out.extend(self._request_with_retries(queries[i : i + self.max_batch_queries], k))
        return out

    def _request_with_retries(self, queries: list[str], k: int) -> list[list[Document]]:
        last: Exception | None = None
        for attempt in range(self.max_retries + 1):
            if attempt > 0:
                with self._lock:
                    self.stats["retries"] += 1
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))
            try:
                return self._request_once(queries, k)
            except _TransientError as e:
                last = e
                logger.warning(
                    "retrieval attempt %d/%d to %s failed: %s", attempt + 1, self.max_retries + 1, self.url, e
                )
        raise RetrievalError(
            f"retrieval from {self.url} failed after {self.max_retries + 1} attempts: {last}. "
            "Check that the server is running (python -m trl_multiturn.search.server), or raise max_retries/timeout_s."
        )

    def _request_once(self, queries: list[str], k: int) -> list[list[Document]]:
        body = json.dumps({"queries": queries, "topk": k, "return_scores": True}).encode("utf-8")
        req = urllib.request.Request(self.url, data=body, method="POST", headers={"Content-Type": "application/json"})
        with self._lock:
            self.stats["requests"] += 1
        try:
            with self._opener.open(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read(500).decode("utf-8", "replace") if e.fp is not None else ""
            e.close()
            if e.code >= 500 or e.code == 429:
                raise _TransientError(f"HTTP {e.code}: {detail}") from e
            raise RetrievalError(
                f"retrieval server {self.url} rejected the request with HTTP {e.code}: {detail}"
            ) from e
        except (OSError, http.client.HTTPException) as e:  # URLError, refused, reset, timeout, truncated body
            raise _TransientError(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from e
        try:
            payload = json.loads(raw)
            result = payload["result"]
            if not isinstance(result, list):
                raise ValueError(f"'result' must be a list, got {type(result).__name__}")
            if len(result) != len(queries):
                raise ValueError(f"got {len(result)} result lists for {len(queries)} queries")
            return [[document_from_api(item) for item in row] for row in result]
        except (ValueError, KeyError, TypeError) as e:
            raise _TransientError(f"malformed response ({type(e).__name__}: {e}); body starts {raw[:120]!r}") from e
