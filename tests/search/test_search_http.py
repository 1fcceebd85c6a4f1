"""The HTTP retriever against our server on a loopback port: same results as in process, concurrent calls merged
into one request, and retries with back-off against misbehaving loopback servers (connection refused, timeout,
HTTP 500, malformed JSON, wrong number of results). Every server binds 127.0.0.1; every wait is bounded."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trl_multiturn.search.retrievers import HTTPRetriever, RetrievalError


class CountingRetriever:
    """Wraps a retriever and records the number of queries of each call."""

    def __init__(self, inner):
        self.inner = inner
        self.corpus = inner.corpus
        self.batches: list[int] = []
        self._lock = threading.Lock()

    def retrieve(self, queries, k):
        with self._lock:
            self.batches.append(len(queries))
        return self.inner.retrieve(queries, k)


def ids(results):
    return [[d.id for d in row] for row in results]


def test_http_matches_in_process(small_bm25, server_factory):
    _, url = server_factory(small_bm25)
    client = HTTPRetriever(url, timeout_s=5, max_retries=0, batch_window_s=0)
    queries = ["Where was Zorvek Talamir born?", "capital of Varnesia"]
    remote = client.retrieve(queries, 3)
    local = small_bm25.retrieve(queries, 3)
    assert ids(remote) == ids(local)
    assert remote[0][0].title == "Zorvek Talamir" and remote[0][0].text == local[0][0].text
    assert remote[0][0].score == pytest.approx(local[0][0].score, rel=1e-6)
    assert client.stats["requests"] == 1 and client.stats["retries"] == 0


def test_url_forms_and_validation(small_bm25, server_factory):
    _, url = server_factory(small_bm25)
    for form in (url, url + "/", url + "/retrieve"):
        assert HTTPRetriever(form).url == url + "/retrieve"
    with pytest.raises(ValueError, match="http://host:port"):
        HTTPRetriever("localhost:8000")


def test_concurrent_calls_are_merged_into_one_request(small_bm25, server_factory):
    counting = CountingRetriever(small_bm25)
    _, url = server_factory(counting)
    client = HTTPRetriever(url, timeout_s=10, max_retries=0, batch_window_s=0.3)
    queries = ["Zorvek Talamir", "Mirel Talamir", "Varnesia", "Quellport", "copper wire", "Selo river"]
    ks = [1, 2, 3, 1, 2, 3]  # different k in one window: one request per distinct k
    barrier = threading.Barrier(len(queries))
    results: dict[int, list] = {}

    def call(i):
        barrier.wait(timeout=10)
        results[i] = client.retrieve([queries[i]], ks[i])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(queries))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(results) == len(queries)
    for i, q in enumerate(queries):  # every caller got its own results
        assert ids(results[i]) == ids(small_bm25.retrieve([q], ks[i]))
    # 6 calls, 3 distinct k: 3 requests when all calls land in one window (a slow thread may start a second one)
    assert len(counting.batches) < len(queries)
    assert max(counting.batches) >= 2
    assert client.stats["calls"] == len(queries)


def test_large_batches_are_split(small_bm25, server_factory):
    counting = CountingRetriever(small_bm25)
    _, url = server_factory(counting)
    client = HTTPRetriever(url, max_retries=0, batch_window_s=0, max_batch_queries=2)
    out = client.retrieve(["a", "Varnesia", "Quellport", "Talamir", "wire"], 1)
    assert len(out) == 5 and counting.batches == [2, 2, 1]


# ----- misbehaving servers -----
class Misbehaving(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, mode: str, fail_first: int = 10**9, delay_s: float = 0.0):
        self.mode, self.fail_first, self.delay_s, self.hits = mode, fail_first, delay_s, 0
        super().__init__(("127.0.0.1", 0), _BadHandler)
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"

    def stop(self):
        self.shutdown()
        self.server_close()


class _BadHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv = self.server
        srv.hits += 1
        n = len(body["queries"])
        good = {"result": [[{"document": {"id": "1", "contents": '"T"\ntext'}, "score": 1.0}] for _ in range(n)]}
        mode = srv.mode if srv.hits <= srv.fail_first else "ok"
        if mode == "timeout":
            time.sleep(srv.delay_s)
        status, payload = 200, json.dumps(good).encode()
        if mode == "500":
            status, payload = 500, b'{"error": "boom"}'
        elif mode == "400":
            status, payload = 400, b'{"error": "bad topk"}'
        elif mode == "malformed":
            payload = b"<html>not json"
        elif mode == "wrong_count":
            payload = json.dumps({"result": good["result"] + good["result"]}).encode()
        elif mode == "missing_contents":
            payload = json.dumps({"result": [[{"document": {"id": "1"}, "score": 1.0}]] * n}).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except OSError:
            pass  # the client gave up (timeout test)


@pytest.fixture
def misbehaving():
    servers = []

    def make(mode, **kw):
        s = Misbehaving(mode, **kw)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.stop()


@pytest.mark.parametrize("mode", ["500", "malformed", "wrong_count", "missing_contents"])
def test_retries_then_raises(misbehaving, mode):
    server = misbehaving(mode)
    client = HTTPRetriever(server.url, timeout_s=2, max_retries=2, backoff_s=0.05, batch_window_s=0)
    start = time.perf_counter()
    with pytest.raises(RetrievalError, match="after 3 attempts"):
        client.retrieve(["q1", "q2"], 1)
    assert server.hits == 3  # first attempt + 2 retries
    assert time.perf_counter() - start >= 0.05 + 0.10  # exponential back-off: 0.05 s, then 0.10 s
    assert client.stats == {"calls": 1, "requests": 3, "retries": 2, "failures": 1}


def test_recovers_after_transient_failures(misbehaving):
    server = misbehaving("500", fail_first=2)
    client = HTTPRetriever(server.url, timeout_s=2, max_retries=3, backoff_s=0.01, batch_window_s=0)
    out = client.retrieve(["q"], 1)
    assert out[0][0].title == "T" and out[0][0].text == "text" and server.hits == 3


def test_timeout_is_retried(misbehaving):
    server = misbehaving("timeout", fail_first=1, delay_s=3.0)
    client = HTTPRetriever(server.url, timeout_s=0.2, max_retries=1, backoff_s=0.01, batch_window_s=0)
    start = time.perf_counter()
    out = client.retrieve(["q"], 1)
    assert len(out) == 1 and server.hits == 2 and client.stats["retries"] == 1
    assert time.perf_counter() - start < 2.0  # the first attempt (3 s) was abandoned at the 0.2 s timeout


def test_client_error_is_not_retried(misbehaving):
    server = misbehaving("400")
    client = HTTPRetriever(server.url, max_retries=3, backoff_s=0.01, batch_window_s=0)
    with pytest.raises(RetrievalError, match="HTTP 400"):
        client.retrieve(["q"], 1)
    assert server.hits == 1


def test_connection_refused_is_retried_then_raises():
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = HTTPRetriever(f"http://127.0.0.1:{port}", timeout_s=1, max_retries=2, backoff_s=0.01, batch_window_s=0)
    with pytest.raises(RetrievalError, match="failed after 3 attempts"):
        client.retrieve(["q"], 1)
    assert client.stats["requests"] == 3 and client.stats["failures"] == 1


def test_failure_reaches_every_merged_caller(misbehaving):
    server = misbehaving("500")
    client = HTTPRetriever(server.url, timeout_s=2, max_retries=1, backoff_s=0.01, batch_window_s=0.2)
    errors = []
    barrier = threading.Barrier(3)

    def call():
        barrier.wait(timeout=10)
        try:
            client.retrieve(["q"], 1)
        except RetrievalError as e:
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(errors) == 3 and client.stats["failures"] == 3


def test_environments_in_threads_share_one_client(kb, kb_bm25, server_factory):
    """As in a rollout: one environment per trajectory, their steps run in a thread pool, one shared client."""
    from concurrent.futures import ThreadPoolExecutor

    from trl_multiturn.environment import Action
    from trl_multiturn.search.environment import SearchEnvironment

    counting = CountingRetriever(kb_bm25)
    _, url = server_factory(counting)
    client = HTTPRetriever(url, timeout_s=10, max_retries=1, batch_window_s=0.2)
    rows = kb.test_rows[:8]
    envs = [SearchEnvironment(client) for _ in rows]
    for env, row in zip(envs, rows):
        env.reset(row)
    with ThreadPoolExecutor(max_workers=len(rows)) as pool:
        steps = list(
            pool.map(
                lambda pair: pair[0].step(Action(kind="tool", name="search", arguments={"query": pair[1]["question"]})),
                zip(envs, rows),
            )
        )
    for step, row in zip(steps, rows):
        assert step.info["doc_ids"] == [d.id for d in kb_bm25.retrieve([row["question"]], 3)[0]]
    assert len(counting.batches) < len(rows)  # merged: fewer requests than searches
