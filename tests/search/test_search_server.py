"""Our retrieval server: Search-R1's response shape, limits, and bad requests answered with 4xx JSON errors that
never carry a stack trace."""

from __future__ import annotations

import dataclasses
import http.client
import json
import queue
import re
import socket
import subprocess
import sys
import threading
import urllib.parse

import pytest

from trl_multiturn.search.server import RetrievalServer, ServerLimits

LIMITS = ServerLimits(max_body_bytes=4096, max_queries=4, max_topk=5, max_query_chars=50, request_timeout_s=2.0)


def request(url, method, path, body=None, headers=None):
    """One raw HTTP exchange; returns (status, parsed JSON or raw text)."""
    parsed = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=5)
    try:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn.request(method, path, body=data, headers=headers or {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read().decode()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(raw)
    except json.JSONDecodeError:
        return resp.status, raw


def raw_exchange(url, data: bytes) -> str:
    """Send raw bytes and read until the server closes; a server that never answers fails on the socket timeout."""
    port = urllib.parse.urlparse(url).port
    chunks = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        while chunk := s.recv(4096):
            chunks.append(chunk)
    return b"".join(chunks).decode()


def test_response_shape_matches_search_r1(small_bm25, server_factory):
    server, url = server_factory(small_bm25, LIMITS)
    assert url.startswith("http://127.0.0.1:")
    status, body = request(url, "POST", "/retrieve", {"queries": ["Zorvek Talamir"], "topk": 2, "return_scores": True})
    assert status == 200
    (row,) = body["result"]
    assert len(row) == 2
    assert set(row[0]) == {"document", "score"} and set(row[0]["document"]) == {"id", "contents"}
    assert row[0]["document"]["contents"].startswith('"Zorvek Talamir"\n')
    status, body = request(url, "POST", "/retrieve", {"queries": ["Zorvek Talamir"], "topk": 1})
    assert status == 200 and set(body["result"][0][0]) == {"id", "contents"}  # without scores: bare documents
    status, body = request(url, "GET", "/health")
    assert status == 200 and body == {"status": "ok", "documents": 6}


BAD = [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    ({"topk": 3}, 400, "'queries' must be a list of strings"),
    ({"queries": "one string"}, 400, "'queries' must be a list of strings"),
    ({"queries": [1, 2]}, 400, "'queries' must be a list of strings"),
    ({"queries": ["a"] * 5}, 400, "5 queries in one request; the limit is 4"),
    ({"queries": ["x" * 51]}, 400, "51 characters; the limit is 50"),
    ({"queries": ["a"], "topk": 0}, 400, "'topk' must be an integer in [1, 5]"),
    ({"queries": ["a"], "topk": 6}, 400, "'topk' must be an integer in [1, 5]"),
    ({"queries": ["a"], "topk": "3"}, 400, "'topk'"),
    ({"queries": ["a"], "return_scores": "yes"}, 400, "'return_scores'"),
    ({"queries": ["a" * 40] * 4, "pad": "z" * 5000}, 413, "the limit is 4096"),
]


@pytest.mark.parametrize("body,status,message", BAD, ids=[m for _, _, m in BAD])
def test_bad_requests_get_4xx_json(small_bm25, server_factory, body, status, message):
    _, url = server_factory(small_bm25, LIMITS)
    got_status, got = request(url, "POST", "/retrieve", body)
    assert got_status == status
    assert isinstance(got, dict) and message in got["error"] and got["status"] == status
    assert "Traceback" not in json.dumps(got)


def test_wrong_paths_methods_and_headers(small_bm25, server_factory):
    _, url = server_factory(small_bm25, LIMITS)
    assert request(url, "POST", "/search", {"queries": ["a"]})[0] == 404
    assert request(url, "GET", "/nowhere")[0] == 404
    assert request(url, "GET", "/retrieve")[0] == 405
    status, body = request(url, "PUT", "/retrieve", {"queries": ["a"]})
    assert status == 501 and isinstance(body, dict) and "error" in body
    status, body = request(url, "POST", "/retrieve", b"")  # Content-Length: 0
    assert status == 400 and "not valid JSON" in body["error"]
    reply = raw_exchange(url, b"POST /retrieve HTTP/1.1\r\nHost: x\r\n\r\n")  # no Content-Length at all
    assert reply.startswith("HTTP/1.1 411") and "Content-Length header is required" in reply


def test_stalled_body_times_out_with_408(small_bm25, server_factory):
    _, url = server_factory(small_bm25, dataclasses.replace(LIMITS, request_timeout_s=0.5))
    # the client waits up to 10 s: only the server's own 0.5 s body timeout can produce this reply
    reply = raw_exchange(url, b'POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"q')
    assert reply.startswith("HTTP/1.1 408") and "did not arrive" in reply
    assert "Traceback" not in reply


def test_internal_error_is_a_plain_500(server_factory):
    class Broken:
        corpus = []

        def retrieve(self, queries, k):
            raise ZeroDivisionError("secret internal detail")

    _, url = server_factory(Broken(), LIMITS)
    status, body = request(url, "POST", "/retrieve", {"queries": ["a"], "topk": 1})
    assert status == 500 and body["error"].startswith("internal error")
    assert "secret" not in json.dumps(body) and "Traceback" not in json.dumps(body)


def test_server_context_manager_binds_loopback_and_stops(small_bm25):
    with RetrievalServer(small_bm25, port=0) as server:
        assert server.server_address[0] == "127.0.0.1"
        assert request(server.url, "GET", "/health")[0] == 200
    assert server.socket.fileno() == -1  # stopped: its listening socket is closed


@pytest.mark.slow
def test_command_line_serves_a_corpus(tmp_path):
    from trl_multiturn.search.corpus import write_corpus_jsonl
    from trl_multiturn.search.retrievers import Document

    corpus = write_corpus_jsonl(
        [Document("1", "Quellport", "A harbour city."), Document("2", "Selo", "A river.")], tmp_path / "c.jsonl"
    )
    # --port 0: the server binds a free port itself and logs its URL, which is read back here (no port is chosen
    # by the test, closed, and hoped to be still free)
    proc = subprocess.Popen(
        [sys.executable, "-m", "trl_multiturn.search.server", "--corpus", str(corpus), "--port", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr] + [lines.put(None)], daemon=True).start()
    try:
        seen = []
        while (line := lines.get(timeout=60)) is not None:
            seen.append(line)
            if match := re.search(r"serving 2 documents on (http://127\.0\.0\.1:\d+)/retrieve", line):
                break
        assert line is not None, f"the server exited before serving: {''.join(seen)[-2000:]}"
        url = match.group(1)
        assert not url.endswith(":0")
        status, body = request(url, "POST", "/retrieve", {"queries": ["harbour"], "topk": 1})
        assert status == 200 and body["result"][0][0]["id"] == "1"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
