"""The HTTP retriever against our server on a loopback port: same results as in process, concurrent calls merged
into one request, and retries with back-off against misbehaving loopback servers (connection refused, timeout,
HTTP 500 and 429, malformed JSON, wrong number of results). Every server binds 127.0.0.1; every wait is bounded.

No assertion reads a clock: the client's sleeps (the batch window and the back-off) go through :class:`Sleeps`,
which records them and holds a batch window open until the test's callers have all joined it, so merging is an
order of events rather than a race between threads and a timer."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trl_multiturn.search import retrievers
from trl_multiturn.search.retrievers import HTTPRetriever, RetrievalError

BOUND_S = 20.0  # every wait below is bounded by this


class Sleeps:
    """Stands in for the ``time`` module of the retrievers: records every sleep of the client without sleeping, and
    holds a batch window (a sleep of ``client.batch_window_s``) open until ``callers`` calls have joined it."""

    perf_counter = staticmethod(time.perf_counter)

    def __init__(self):
        self.calls: list[float] = []
        self.client: HTTPRetriever | None = None
        self.callers = 0

    def hold_windows(self, client: HTTPRetriever, callers: int) -> None:
        self.client, self.callers = client, callers

    def waiting(self) -> int:
        with self.client._lock:
            return len(self.client._queue)

    def sleep(self, seconds: float) -> None:
        self.calls.append(seconds)
        if self.client is not None and seconds == self.client.batch_window_s:
            deadline = time.monotonic() + BOUND_S
            while self.waiting() < self.callers:
                if time.monotonic() > deadline:
                    raise AssertionError(f"only {self.waiting()} of {self.callers} calls joined the batch window")
                time.sleep(0.001)


@pytest.fixture
def sleeps(monkeypatch):
    recorder = Sleeps()
    monkeypatch.setattr(retrievers, "time", recorder)
    return recorder


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


def test_concurrent_calls_are_merged_into_one_request(small_bm25, server_factory, sleeps):
    counting = CountingRetriever(small_bm25)
    _, url = server_factory(counting)
    client = HTTPRetriever(url, timeout_s=10, max_retries=0, batch_window_s=0.3)
    queries = ["Zorvek Talamir", "Mirel Talamir", "Varnesia", "Quellport", "copper wire", "Selo river"]
    ks = [1, 2, 3, 1, 2, 3]  # different k in one window: one request per distinct k
    sleeps.hold_windows(client, len(queries))  # the first caller's window closes once all six have joined it
    results: dict[int, list] = {}

    def call(i):
        results[i] = client.retrieve([queries[i]], ks[i])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(queries))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(results) == len(queries)
    for i, q in enumerate(queries):  # every caller got its own results
        assert ids(results[i]) == ids(small_bm25.retrieve([q], ks[i]))
    # 6 calls in one window, 3 distinct k: one request per k, each carrying the two queries of that k
    assert counting.batches == [2, 2, 2]
    assert sleeps.calls == [0.3]  # one window, opened by the first caller
    assert client.stats == {"calls": 6, "requests": 3, "retries": 0, "failures": 0}


def test_large_batches_are_split(small_bm25, server_factory):
    counting = CountingRetriever(small_bm25)
    _, url = server_factory(counting)
    client = HTTPRetriever(url, max_retries=0, batch_window_s=0, max_batch_queries=2)
    out = client.retrieve(["a", "Varnesia", "Quellport", "Talamir", "wire"], 1)
    assert len(out) == 5 and counting.batches == [2, 2, 1]


# ----- misbehaving servers -----
class Misbehaving(ThreadingHTTPServer):
    """Answers as ``mode`` says for the first ``fail_first`` requests, then correctly. In mode "timeout" a request
    is held unanswered until ``stop()`` (``held`` counts the requests held right now)."""

    daemon_threads = True

    def __init__(self, mode: str, fail_first: int = 10**9):
        self.mode, self.fail_first, self.hits, self.held = mode, fail_first, 0, 0
        self.release = threading.Event()
        super().__init__(("127.0.0.1", 0), _BadHandler)
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"

    def stop(self):
        self.release.set()
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
            srv.held += 1
            srv.release.wait(BOUND_S)
            srv.held -= 1
        status, payload = 200, json.dumps(good).encode()
        if mode == "500":
            status, payload = 500, b'{"error": "boom"}'
        elif mode == "429":
            status, payload = 429, b'{"error": "too many requests"}'
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


@pytest.mark.parametrize("mode", ["500", "429", "malformed", "wrong_count", "missing_contents"])
def test_retries_then_raises(misbehaving, mode, sleeps):
    server = misbehaving(mode)
    client = HTTPRetriever(server.url, timeout_s=2, max_retries=2, backoff_s=0.05, batch_window_s=0)
    with pytest.raises(RetrievalError, match="after 3 attempts"):
        client.retrieve(["q1", "q2"], 1)
    assert server.hits == 3  # first attempt + 2 retries
    assert sleeps.calls == [0.05, 0.10]  # exponential back-off before each retry
    assert client.stats == {"calls": 1, "requests": 3, "retries": 2, "failures": 1}


def test_backoff_is_capped(misbehaving, sleeps):
    server = misbehaving("500")
    client = HTTPRetriever(server.url, max_retries=4, backoff_s=0.5, max_backoff_s=1.5, batch_window_s=0)
    with pytest.raises(RetrievalError, match="after 5 attempts"):
        client.retrieve(["q"], 1)
    assert sleeps.calls == [0.5, 1.0, 1.5, 1.5] and server.hits == 5


def test_rate_limited_request_is_retried_then_succeeds(misbehaving, sleeps):
    """HTTP 429 (the server asks to slow down) is retried after the back-off, unlike the other 4xx."""
    server = misbehaving("429", fail_first=2)
    client = HTTPRetriever(server.url, timeout_s=2, max_retries=3, backoff_s=0.25, batch_window_s=0)
    out = client.retrieve(["q"], 1)
    assert out[0][0].title == "T" and server.hits == 3
    assert sleeps.calls == [0.25, 0.5] and client.stats["retries"] == 2 and client.stats["failures"] == 0


def test_recovers_after_transient_failures(misbehaving):
    server = misbehaving("500", fail_first=2)
    client = HTTPRetriever(server.url, timeout_s=2, max_retries=3, backoff_s=0.01, batch_window_s=0)
    out = client.retrieve(["q"], 1)
    assert out[0][0].title == "T" and out[0][0].text == "text" and server.hits == 3


def test_timeout_is_retried(misbehaving):
    server = misbehaving("timeout", fail_first=1)  # the first request is held unanswered until the test ends
    client = HTTPRetriever(server.url, timeout_s=1.0, max_retries=1, backoff_s=0.01, batch_window_s=0)
    out = client.retrieve(["q"], 1)
    assert len(out) == 1 and server.hits == 2 and client.stats["retries"] == 1
    assert server.held == 1  # the answer came from the retry while the first request was still unanswered


def test_client_error_is_not_retried(misbehaving):
    server = misbehaving("400")
    client = HTTPRetriever(server.url, max_retries=3, backoff_s=0.01, batch_window_s=0)
    with pytest.raises(RetrievalError, match="HTTP 400"):
        client.retrieve(["q"], 1)
    assert server.hits == 1


def test_connection_refused_is_retried_then_raises():
    with socket.socket() as s:  # held for the whole test: bound, never listening, so every connection is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        client = HTTPRetriever(f"http://127.0.0.1:{port}", timeout_s=1, max_retries=2, backoff_s=0.01, batch_window_s=0)
        with pytest.raises(RetrievalError, match="failed after 3 attempts.*(Connection refused|Errno 111)"):
            client.retrieve(["q"], 1)
    assert client.stats["requests"] == 3 and client.stats["failures"] == 1


def test_failure_reaches_every_merged_caller(misbehaving, sleeps):
    server = misbehaving("500")
    client = HTTPRetriever(server.url, timeout_s=2, max_retries=1, backoff_s=0.01, batch_window_s=0.2)
    sleeps.hold_windows(client, 3)
    errors = []

    def call():
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
    assert server.hits == 2  # one merged request and its retry, not one per caller


def test_environments_in_threads_share_one_client(kb, kb_bm25, server_factory, sleeps):
    """As in a rollout: one environment per trajectory, their steps run in a thread pool, one shared client."""
    from concurrent.futures import ThreadPoolExecutor

    from trl_multiturn.environment import Action
    from trl_multiturn.search.environment import SearchEnvironment

    counting = CountingRetriever(kb_bm25)
    _, url = server_factory(counting)
    client = HTTPRetriever(url, timeout_s=10, max_retries=1, batch_window_s=0.2)
    rows = kb.test_rows[:8]
    sleeps.hold_windows(client, len(rows))
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
    assert counting.batches == [len(rows)]  # merged: one request for all the searches
