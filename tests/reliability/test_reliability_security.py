"""Security of what the package runs and serves.

* The package (and the recipes) never unpickle anything, never load ``torch`` files without ``weights_only=True``,
  never ``eval`` / ``exec`` and never pass ``trust_remote_code=True`` on their own: an AST scan of every source file,
  itself tested on a snippet that has each forbidden pattern.
* The retrieval server binds to 127.0.0.1 unless told otherwise (class, helper and command line), and answers
  hostile requests that its own tests (tests/search/test_search_server.py: limits, bad JSON, wrong paths, stalled
  bodies, internal errors) do not cover with a 4xx and never a stack trace.
"""

from __future__ import annotations

import ast
import http.client
import inspect
import json
import socket
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCANNED = [REPO / "trl_multiturn", REPO / "recipes"]
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}


def unsafe_calls(source: str, filename: str = "<snippet>") -> list[str]:
    """Every unsafe deserialisation / code execution / remote-code pattern in ``source``, as ``file:line: what``."""
    found = []
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in UNSAFE_MODULES:
                    found.append(f"{where}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            found.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            owner = getattr(func.value, "id", "") if isinstance(func, ast.Attribute) else ""
            keywords = {k.arg: k.value for k in node.keywords}
            if name in ("eval", "exec") and isinstance(func, ast.Name):
                found.append(f"{where}: {name}()")
            if owner == "torch" and name == "load":
                weights_only = keywords.get("weights_only")
                if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                    found.append(f"{where}: torch.load without weights_only=True")
            if name == "load" and owner in ("np", "numpy"):
                allow = keywords.get("allow_pickle")
                if isinstance(allow, ast.Constant) and allow.value is True:
                    found.append(f"{where}: numpy.load(allow_pickle=True)")
            if owner == "yaml" and name in ("load", "unsafe_load", "full_load", "load_all"):
                found.append(f"{where}: yaml.{name} (use yaml.safe_load)")
            if name == "read_pickle":
                found.append(f"{where}: read_pickle")
            remote = keywords.get("trust_remote_code")
            if isinstance(remote, ast.Constant) and remote.value is True:
                found.append(f"{where}: trust_remote_code=True")
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if (isinstance(key, ast.Constant) and key.value == "trust_remote_code"
                        and isinstance(value, ast.Constant) and value.value is True):
                    found.append(f"{where}: {{'trust_remote_code': True}}")
    return found


def test_the_scanner_finds_every_pattern():
    snippet = '''
import pickle
from dill import loads
import torch, numpy as np, yaml
torch.load("x")
torch.load("x", weights_only=False)
np.load("x", allow_pickle=True)
yaml.load(open("x"))
eval("1")
AutoModel.from_pretrained("m", trust_remote_code=True)
kwargs = {"trust_remote_code": True}
torch.load("ok", weights_only=True)
AutoModel.from_pretrained("m", trust_remote_code=user_said_so)
'''
    found = unsafe_calls(snippet)
    assert len(found) == 9, found
    assert not any(":12:" in f or ":13:" in f for f in found)  # the two safe lines


def test_package_never_unpickles_or_trusts_remote_code():
    files = [p for root in SCANNED if root.exists() for p in root.rglob("*.py")]
    assert len(files) > 10
    found = [hit for p in files for hit in unsafe_calls(p.read_text(), str(p.relative_to(REPO)))]
    assert found == [], "\n".join(found)


# ---------------------------------------------------------------------------------------------------- the server
server_module = pytest.importorskip("trl_multiturn.search.server")


def test_server_binds_loopback_by_default(small_bm25):
    assert inspect.signature(server_module.RetrievalServer.__init__).parameters["host"].default == "127.0.0.1"
    assert inspect.signature(server_module.start_server).parameters["host"].default == "127.0.0.1"
    # the command line's --host default, read from the source's add_argument call
    tree = ast.parse(inspect.getsource(server_module.main))
    defaults = [
        {k.arg: k.value.value for k in call.keywords if isinstance(k.value, ast.Constant)}.get("default")
        for call in ast.walk(tree)
        if isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "add_argument"
        and call.args and isinstance(call.args[0], ast.Constant) and call.args[0].value == "--host"
    ]
    assert defaults == ["127.0.0.1"]
    server, url = server_module.start_server(small_bm25, port=0)
    try:
        assert server.server_address[0] == "127.0.0.1" and url.startswith("http://127.0.0.1:")
    finally:
        server.stop()


@pytest.fixture(scope="module")
def small_bm25():
    from trl_multiturn.search.retrievers import BM25Retriever, Document

    return BM25Retriever([Document("d0", "Quellport", "A harbour city."), Document("d1", "Selo", "A river.")])


@pytest.fixture(scope="module")
def served(small_bm25):
    limits = server_module.ServerLimits(request_timeout_s=3.0)
    server, _ = server_module.start_server(small_bm25, port=0, limits=limits)
    yield server.server_address[1]
    server.stop()


def exchange(port: int, data: bytes) -> str:
    """Send raw bytes, read the reply until the server closes (bounded by the socket timeout)."""
    chunks = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def post(port: int, body: bytes) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", "/retrieve", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


HOSTILE_RAW = [
    ("150_headers", b"POST /retrieve HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(150))
     + b"Content-Length: 2\r\n\r\n{}", "431"),
    ("70k_request_line", b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", "414"),
    ("70k_header", b"GET /health HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 70000 + b"\r\n\r\n", "431"),
    ("bad_http_version", b"GET /health HTTP/9.9\r\n\r\n", "505"),
    ("binary_garbage", b"\x00\x01\x02 garbage\r\n\r\n", "400"),
    ("negative_length", b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n", "400"),
    ("20_digit_length", b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999\r\n\r\n", "413"),
    ("chunked_body", b"POST /retrieve HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", "411"),
]


@pytest.mark.parametrize("data,status", [c[1:] for c in HOSTILE_RAW], ids=[c[0] for c in HOSTILE_RAW])
def test_hostile_requests_get_4xx_and_no_trace(served, data, status):
    reply = exchange(served, data)
    assert f" {status} " in reply.split("\r\n", 1)[0] or f'"status": {status}' in reply, reply[:200]
    assert "Traceback" not in reply and 'File "' not in reply


# (id, body, status, what the reply must contain): odd but valid strings are searched (one result list of topk=1
# documents); values of the wrong type are a client error that names the field
ODD_QUERIES = [
    ("nul_character", b'{"queries": ["\\u0000"], "topk": 1}', 200, '"result": [[{"id": '),
    ("lone_surrogate", b'{"queries": ["\\ud800"], "topk": 1}', 200, '"result": [[{"id": '),
    ("whitespace_only", b'{"queries": ["   "], "topk": 1}', 200, '"result": [[{"id": '),
    ("nan_topk", b'{"queries": ["a"], "topk": NaN}', 400, "'topk' must be an integer"),
    ("duplicate_keys", b'{"queries": ["a"], "queries": 5}', 400, "'queries' must be a list of strings"),  # last wins
]


@pytest.mark.parametrize("body,status,expected", [c[1:] for c in ODD_QUERIES], ids=[c[0] for c in ODD_QUERIES])
def test_odd_queries_get_a_result_or_a_named_client_error(served, body, status, expected):
    got, text = post(served, body)
    assert (got, expected in text) == (status, True), text
    assert "Traceback" not in text
    if status == 200:
        assert len(json.loads(text)["result"]) == 1 and len(json.loads(text)["result"][0]) == 1


HOSTILE_JSON = [
    ("deeply_nested", b"[" * 100000 + b"]" * 100000),
    ("5000_digit_number", b'{"queries": ["a"], "topk": ' + b"9" * 5000 + b"}"),
]


@pytest.mark.parametrize("body", [c[1] for c in HOSTILE_JSON], ids=[c[0] for c in HOSTILE_JSON])
def test_json_python_cannot_decode_is_a_client_error(served, body):
    status, text = post(served, body)
    assert status == 400 and "not valid JSON" in text, (status, text)
