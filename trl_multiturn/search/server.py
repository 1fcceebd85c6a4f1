"""A retrieval server speaking Search-R1's ``/retrieve`` API over any of our retrievers.

    python -m trl_multiturn.search.server --corpus corpus.jsonl --retriever bm25 [--host 127.0.0.1 --port 8000]
    python -m trl_multiturn.search.server --corpus offline --retriever bm25     # the generated offline KB

``POST /retrieve`` with ``{"queries": [...], "topk": k, "return_scores": true}`` answers
``{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}`` (without scores: lists of documents).
``GET /health`` answers ``{"status": "ok", "documents": N}``.

Departures from Search-R1's server (FastAPI + uvicorn, no limits): the standard library's ``ThreadingHTTPServer``,
bound to 127.0.0.1 unless ``--host`` says otherwise; limits on body size, queries per request, ``topk`` and query
length; every bad request gets a 4xx JSON error naming the problem, and internal errors a 500 JSON error without a
stack trace (the trace goes to the server's log). :func:`start_server` runs it in process on a free port (tests,
single-node runs); ``RetrievalServer.stop()`` shuts it down.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .retrievers import Retriever

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerLimits:
    """Request limits. Requests past them get HTTP 413 (body) or 400 (the rest), with the limit in the message;
    a body that does not arrive within ``request_timeout_s`` gets 408."""

    max_body_bytes: int = 1 << 20
    max_queries: int = 512
    max_topk: int = 100
    max_query_chars: int = 2048
    request_timeout_s: float = 30.0


class _RequestError(Exception):
    def __init__(self, status: HTTPStatus, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class RetrievalServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` serving one retriever. ``url`` is its base URL; ``start()`` serves in a daemon
    thread; ``stop()`` shuts down and closes the socket. Usable as a context manager."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self, retriever: Retriever, host: str = "127.0.0.1", port: int = 8000, limits: ServerLimits | None = None
    ):
        self.retriever = retriever
        self.limits = limits or ServerLimits()
        self._thread: threading.Thread | None = None
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> RetrievalServer:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self.serve_forever,
                kwargs={"poll_interval": 0.05},
                daemon=True,
                name=f"retrieval-server-{self.server_address[1]}",
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self.server_close()

    def __enter__(self) -> RetrievalServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def handle_error(self, request: Any, client_address: Any) -> None:  # keep tracebacks out of stderr noise
        logger.exception("retrieval server: error while handling a request from %s", client_address)


def start_server(
    retriever: Retriever, host: str = "127.0.0.1", port: int = 0, limits: ServerLimits | None = None
) -> tuple[RetrievalServer, str]:
    """Start a server in a background thread; ``port=0`` picks a free port. Returns ``(server, url)``; call
    ``server.stop()`` when done."""
    server = RetrievalServer(retriever, host, port, limits).start()
    return server, server.url


def _validate(payload: Any, limits: ServerLimits) -> tuple[list[str], int, bool]:
    if not isinstance(payload, dict):
        raise _RequestError(HTTPStatus.BAD_REQUEST, f"the body must be a JSON object, got {type(payload).__name__}")
    queries = payload.get("queries")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise _RequestError(HTTPStatus.BAD_REQUEST, "'queries' must be a list of strings")
    if len(queries) > limits.max_queries:
        raise _RequestError(
            HTTPStatus.BAD_REQUEST, f"{len(queries)} queries in one request; the limit is {limits.max_queries}"
        )
    for i, q in enumerate(queries):
        if len(q) > limits.max_query_chars:
            raise _RequestError(
                HTTPStatus.BAD_REQUEST, f"query {i} has {len(q)} characters; the limit is {limits.max_query_chars}"
            )
    topk = payload.get("topk", 3)
    if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= limits.max_topk:
        raise _RequestError(
            HTTPStatus.BAD_REQUEST, f"'topk' must be an integer in [1, {limits.max_topk}], got {topk!r}"
        )
    return_scores = payload.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise _RequestError(HTTPStatus.BAD_REQUEST, f"'return_scores' must be true or false, got {return_scores!r}")
    return queries, topk, return_scores


class _Handler(BaseHTTPRequestHandler):
    server: RetrievalServer
    protocol_version = "HTTP/1.1"
    server_version = "trl-multiturn-retrieval"

    def setup(self) -> None:
        self.timeout = self.server.limits.request_timeout_s  # a client that stalls cannot hold a thread forever
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s - %s", self.address_string(), format % args)

    def _send_json(self, status: HTTPStatus, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status >= 400:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: HTTPStatus, message: str) -> None:
        self._send_json(status, {"error": message, "status": int(status)})

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # http.server calls this for malformed request lines and unsupported methods: answer in JSON too.
        self._error(HTTPStatus(code), message or HTTPStatus(code).phrase)

    def do_GET(self) -> None:
        if self.path.split("?")[0] == "/health":
            self._send_json(
                HTTPStatus.OK, {"status": "ok", "documents": len(getattr(self.server.retriever, "corpus", ()))}
            )
        elif self.path.split("?")[0] == "/retrieve":
            self._error(HTTPStatus.METHOD_NOT_ALLOWED, "use POST /retrieve with a JSON body")
        else:
            self._error(HTTPStatus.NOT_FOUND, f"no endpoint {self.path!r}; use POST /retrieve or GET /health")

    def do_POST(self) -> None:
        try:
            if self.path.split("?")[0] != "/retrieve":
                raise _RequestError(HTTPStatus.NOT_FOUND, f"no endpoint {self.path!r}; use POST /retrieve")
            payload = self._read_json()
            queries, topk, return_scores = _validate(payload, self.server.limits)
            results = self.server.retriever.retrieve(queries, topk) if queries else []
        except _RequestError as e:
            self._error(e.status, e.message)
            return
        except Exception:  # noqa: BLE001 -- the server boundary: log the trace, answer a plain 500
            logger.exception("retrieval server: internal error")
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error in the retriever; see the server log")
            return
        if return_scores:
            out = [
                [{"document": {"id": d.id, "contents": d.contents}, "score": d.score} for d in row] for row in results
            ]
        else:
            out = [[{"id": d.id, "contents": d.contents} for d in row] for row in results]
        self._send_json(HTTPStatus.OK, {"result": out})

    def _read_json(self) -> Any:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise _RequestError(HTTPStatus.LENGTH_REQUIRED, "chunked bodies are not accepted; send Content-Length")
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            raise _RequestError(HTTPStatus.LENGTH_REQUIRED, "a Content-Length header is required")
        try:
            length = int(length_header)
        except ValueError:
            raise _RequestError(HTTPStatus.BAD_REQUEST, f"bad Content-Length {length_header!r}") from None
        if length < 0:
            raise _RequestError(HTTPStatus.BAD_REQUEST, f"bad Content-Length {length_header!r}")
        if length > self.server.limits.max_body_bytes:
            raise _RequestError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"the body has {length} bytes; the limit is {self.server.limits.max_body_bytes}",
            )
        try:
            raw = self.rfile.read(length)
        except TimeoutError:
            raise _RequestError(
                HTTPStatus.REQUEST_TIMEOUT, f"the body did not arrive ({length} bytes announced)"
            ) from None
        if len(raw) < length:
            raise _RequestError(HTTPStatus.BAD_REQUEST, f"the body has {len(raw)} bytes, {length} were announced")
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as e:  # bad JSON, bad UTF-8, nesting or numbers Python cannot decode
            raise _RequestError(HTTPStatus.BAD_REQUEST, f"the body is not valid JSON: {e}") from None


# ---------------------------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------------------------
def build_retriever(kind: str, corpus: Any, **kwargs: Any) -> Retriever:
    """Build a retriever by name ("bm25" or "dense") over a loaded corpus."""
    from .retrievers import BM25Retriever, DenseRetriever

    if kind == "bm25":
        return BM25Retriever(corpus)
    if kind == "dense":
        return DenseRetriever(corpus, **kwargs)
    raise ValueError(f"unknown retriever {kind!r}; choose 'bm25' or 'dense'.")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve Search-R1's /retrieve API over a corpus.")
    parser.add_argument(
        "--corpus",
        required=True,
        help="Search-R1 JSONL corpus, a datasets path or Hub name, or 'offline' for the generated KB",
    )
    parser.add_argument("--retriever", default="bm25", choices=["bm25", "dense"])
    parser.add_argument(
        "--encoder",
        default="sentence-transformers/all-MiniLM-L6-v2",
        help="sentence-transformers model (dense retriever only)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address; 0.0.0.0 exposes the server to the network")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--offline-entities", type=int, default=500, help="KB size with --corpus offline")
    parser.add_argument("--offline-seed", type=int, default=0, help="KB seed with --corpus offline")
    parser.add_argument("--max-queries", type=int, default=ServerLimits.max_queries)
    parser.add_argument("--max-topk", type=int, default=ServerLimits.max_topk)
    parser.add_argument("--max-query-chars", type=int, default=ServerLimits.max_query_chars)
    parser.add_argument("--max-body-bytes", type=int, default=ServerLimits.max_body_bytes)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    if args.corpus == "offline":
        from .data import build_offline_dataset

        corpus = build_offline_dataset(args.offline_entities, seed=args.offline_seed).corpus
    else:
        from .corpus import load_corpus

        corpus = load_corpus(args.corpus)
    kwargs = {"model_name_or_path": args.encoder} if args.retriever == "dense" else {}
    retriever = build_retriever(args.retriever, corpus, **kwargs)
    limits = ServerLimits(
        max_body_bytes=args.max_body_bytes,
        max_queries=args.max_queries,
        max_topk=args.max_topk,
        max_query_chars=args.max_query_chars,
    )
    server = RetrievalServer(retriever, args.host, args.port, limits)
    logger.info("serving %d documents on %s/retrieve (Ctrl-C to stop)", len(corpus), server.url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        logger.info("stopping")
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
