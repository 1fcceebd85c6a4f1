"""Tests for `trl_multiturn.hub`: the model card, the saved files, reloading, and pushing over real HTTP.

The push tests run `push_to_hub` against a small stand-in for the Hub API on a loopback port (`HF_ENDPOINT`). It
answers the four endpoints that `create_repo` and `create_commit` call: `POST /api/repos/create`,
`POST /api/validate-yaml`, `POST /api/models/{repo}/preupload/{rev}` and `POST /api/models/{repo}/commit/{rev}`
(NDJSON, one line per file with its base64 content; the stand-in asks for every file inline, which the real Hub
does for small files). It can be told to refuse a given endpoint with a status code.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
import yaml

from trl_multiturn.hub import HubPushError, ModelCardInfo, merge_and_save, push_to_hub, save_adapter

TOKEN = "hf_standin_write_token"
TEXT = "<|im_start|>user\nWho wrote Hamlet?<|im_end|>\n<|im_start|>assistant\n<search>Hamlet author</search>"


# ---------------------------------------------------------------------------------------------------------------
# A trained-looking adapter on a tiny model
# ---------------------------------------------------------------------------------------------------------------


def lora_model(tiny_model_factory):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(tiny_model_factory(), config).eval()


def token_logprobs(model, ids):
    with torch.no_grad():
        logits = model(ids).logits[:, :-1]  # (1, T-1, V)
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (1, T-1)


@pytest.fixture
def plot_png(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([0, 1, 2], [0.1, 0.3, 0.5], label="reward")
    ax.legend()
    path = tmp_path / "training_curves.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def card_info(base_model="HuggingFaceTB/SmolLM2-135M-Instruct", plot=None, **extra):
    return ModelCardInfo(
        base_model=base_model,
        repo_id=extra.pop("repo_id", "me/agent"),
        environment="SearchEnvironment: BM25 over a Wikipedia sample, up to 4 turns",
        dataset="NQ + HotpotQA (Search-R1 mix), 512 questions",
        datasets=["PeterJinGo/nq_hotpotqa_train"],
        config={"learning_rate": 1e-6, "num_generations": 5, "max_turns": 4, "hub_token": "hf_secret"},
        evaluation={"base model": {"exact_match": 0.12, "reward": 0.15}, "after GRPO": {"exact_match": 0.31}},
        plot=plot,
        **extra,
    )


@pytest.fixture
def saved_adapter(tmp_path, tiny_model_factory, smollm2_tokenizer, plot_png):
    model = lora_model(tiny_model_factory)
    out = save_adapter(model, smollm2_tokenizer, tmp_path / "adapter", card=card_info(plot=plot_png))
    return model, out


# ---------------------------------------------------------------------------------------------------------------
# Card, files, reload
# ---------------------------------------------------------------------------------------------------------------


def test_model_card_metadata_and_content(saved_adapter):
    from huggingface_hub import ModelCard

    _, out = saved_adapter
    card = ModelCard.load(out / "README.md")
    meta = card.data.to_dict()
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert meta["library_name"] == "peft" and meta["pipeline_tag"] == "text-generation"
    assert {"trl", "grpo", "multi-turn", "trl-multiturn"} <= set(meta["tags"])
    assert meta["datasets"] == ["PeterJinGo/nq_hotpotqa_train"]

    text = card.text
    assert "SearchEnvironment: BM25 over a Wikipedia sample, up to 4 turns" in text
    assert "NQ + HotpotQA (Search-R1 mix), 512 questions" in text
    assert "| stage | exact_match | reward |" in text
    assert "| base model | 0.12 | 0.15 |" in text and "| after GRPO | 0.31 | - |" in text
    assert "![Reward and exact match during training](training_curves.png)" in text
    config = yaml.safe_load(re.search(r"```yaml\n(.*?)```", text, re.DOTALL).group(1))
    assert config["num_generations"] == 5 and config["hub_token"] == "<redacted>"
    assert 'PeftModel.from_pretrained(base, "me/agent")' in text
    assert "hf_secret" not in (out / "README.md").read_text()
    from importlib.metadata import version

    versions = text.split("## Framework versions", 1)[1]  # as TRL's cards list them: the installed versions
    for name, dist in (("TRL", "trl"), ("Transformers", "transformers"), ("PEFT", "peft"), ("PyTorch", "torch")):
        assert f"- {name}: {version(dist)}\n" in versions


def test_saved_files(saved_adapter, plot_png):
    _, out = saved_adapter
    names = {p.name for p in out.iterdir()}
    assert {
        "adapter_config.json",
        "adapter_model.safetensors",
        "README.md",
        "tokenizer.json",
        "training_curves.png",
    } <= names
    assert not any(name.startswith("model") for name in names)  # the adapter only, not the base weights
    assert (out / "training_curves.png").read_bytes() == plot_png.read_bytes()
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]


def test_reload_gives_the_same_logprobs(saved_adapter, tiny_model_factory, smollm2_tokenizer):
    from peft import PeftModel

    model, out = saved_adapter
    ids = smollm2_tokenizer(TEXT, return_tensors="pt").input_ids
    before = token_logprobs(model, ids)
    base_only = token_logprobs(tiny_model_factory(), ids)
    assert (before - base_only).abs().max() > 1e-3  # the adapter changes the model, so the check below means something
    reloaded = PeftModel.from_pretrained(tiny_model_factory(), out).eval()
    torch.testing.assert_close(token_logprobs(reloaded, ids), before, rtol=0, atol=1e-6)


def test_card_snippet_runs(tmp_path, tiny_model_factory, smollm2_tokenizer):
    """The loading snippet in the card is real code: run it against a local base and adapter."""
    base_dir = tmp_path / "base"
    tiny_model_factory().save_pretrained(base_dir)
    out = save_adapter(
        lora_model(tiny_model_factory),
        smollm2_tokenizer,
        tmp_path / "adapter",
        card=card_info(str(base_dir), repo_id=None),
    )
    code = re.search(r"```python\n(.*?)```", (out / "README.md").read_text(), re.DOTALL).group(1)
    assert f'PeftModel.from_pretrained(base, "{out}")' in code
    code = code.replace("max_new_tokens=128", "max_new_tokens=4")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "model_card_snippet", "exec"), {})
    assert printed.getvalue().endswith("\n")  # the snippet ran to its final print (a random model's text may be empty)


def test_offline_smollm2_base_is_recorded_by_its_hub_id(tmp_path, tiny_model_factory, smollm2_tokenizer, smollm2_dir):
    out = save_adapter(
        lora_model(tiny_model_factory), smollm2_tokenizer, tmp_path / "a", card={"base_model": str(smollm2_dir)}
    )
    text = (out / "README.md").read_text()
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in text and "smollm2_path()" in text


def test_bad_inputs_name_the_problem(tmp_path, tiny_model_factory, smollm2_tokenizer):
    with pytest.raises(TypeError, match="needs a peft.PeftModel, got LlamaForCausalLM"):
        save_adapter(tiny_model_factory(), smollm2_tokenizer, tmp_path / "x", card={"base_model": "b"})
    with pytest.raises(TypeError, match=r"Unknown model card field\(s\) \['basemodel'\]"):
        save_adapter(lora_model(tiny_model_factory), smollm2_tokenizer, tmp_path / "x", card={"basemodel": "b"})
    not_png = tmp_path / "plot.png"
    not_png.write_text("hello")
    with pytest.raises(ValueError, match="is not a PNG file"):
        save_adapter(lora_model(tiny_model_factory), smollm2_tokenizer, tmp_path / "y", card=card_info(plot=not_png))


def test_merge_and_save_matches_the_adapter(tmp_path, tiny_model_factory, smollm2_tokenizer):
    from transformers import AutoModelForCausalLM

    model = lora_model(tiny_model_factory)
    ids = smollm2_tokenizer(TEXT, return_tensors="pt").input_ids
    expected = token_logprobs(model, ids)
    out = merge_and_save(model, smollm2_tokenizer, tmp_path / "merged", card=card_info())
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(token_logprobs(merged, ids), expected, rtol=0, atol=1e-5)
    assert "library_name: transformers" in (out / "README.md").read_text()
    assert not (out / "adapter_config.json").exists()


# ---------------------------------------------------------------------------------------------------------------
# A stand-in for the Hub API
# ---------------------------------------------------------------------------------------------------------------


class HubStandIn:
    """Records repositories, commits and files; `refuse[endpoint] = status` makes that endpoint fail."""

    def __init__(self):
        self.repos: dict[str, dict] = {}
        self.requests: list[tuple[str, str]] = []
        self.refuse: dict[str, int] = {}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep the test output quiet
                pass

            def _send(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if status >= 400:
                    self.send_header("X-Error-Message", body.get("error", ""))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                hub.requests.append(("GET", self.path))
                match = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/.*)?", self.path.split("?")[0])
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._send(401, {"error": "Invalid credentials in Authorization header"})
                if match and match.group(1) in hub.repos and "repo_info" not in hub.refuse:
                    return self._send(200, {"id": match.group(1), "sha": "0" * 40, "private": False})
                self._send(hub.refuse.get("repo_info", 404), {"error": "Repository not found"})

            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                body = self.rfile.read(length)
                path = self.path.split("?")[0]
                hub.requests.append(("POST", path))
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._send(401, {"error": "Invalid credentials in Authorization header"})
                if path == "/api/repos/create":
                    return self._create(json.loads(body))
                if path == "/api/validate-yaml":
                    return self._send(200, {"errors": [], "warnings": []})
                match = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(preupload|commit)/([^/]+)", path)
                if not match:
                    return self._send(404, {"error": f"no such endpoint {path}"})
                repo_id, action, revision = match.groups()
                if action in hub.refuse:
                    return self._send(hub.refuse[action], {"error": f"{action} refused"})
                if repo_id not in hub.repos:
                    return self._send(404, {"error": "Repository not found"})
                if action == "preupload":
                    files = json.loads(body)["files"]
                    modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
                    return self._send(200, {"files": modes})
                return self._commit(repo_id, revision, body)

            def _create(self, payload):
                if "create" in hub.refuse:
                    return self._send(hub.refuse["create"], {"error": "create refused"})
                repo_id = f"{payload['organization']}/{payload['name']}"
                if repo_id in hub.repos:
                    # The Hub's 409 carries the url too; create_repo(exist_ok=True) reads it.
                    return self._send(
                        409, {"error": "You already created this model repo", "url": f"{hub.url}/{repo_id}"}
                    )
                hub.repos[repo_id] = {"visibility": payload.get("visibility"), "files": {}, "commits": []}
                self._send(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id})

            def _commit(self, repo_id, revision, body):
                assert self.headers.get("Content-Type") == "application/x-ndjson"
                lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
                header = lines[0]
                assert header["key"] == "header"
                repo = hub.repos[repo_id]
                added = {}
                for line in lines[1:]:
                    assert line["key"] == "file" and line["value"]["encoding"] == "base64", line
                    added[line["value"]["path"]] = base64.b64decode(line["value"]["content"])
                repo["files"].update(added)
                oid = f"{len(repo['commits']) + 1:040x}"
                repo["commits"].append(
                    {"summary": header["value"]["summary"], "revision": revision, "files": sorted(added)}
                )
                self._send(200, {"commitUrl": f"{hub.url}/{repo_id}/commit/{oid}", "commitOid": oid})

        return Handler

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub(monkeypatch):
    from huggingface_hub import constants

    with HubStandIn() as standin:
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # conftest turns it on for the whole session
        monkeypatch.setenv("HF_ENDPOINT", standin.url)
        yield standin


def local_files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}


def test_push_sends_every_file_in_one_commit(hub, saved_adapter):
    _, out = saved_adapter
    url = push_to_hub(out, "me/agent", private=True, token=TOKEN, commit_message="GRPO search agent, step 300")
    repo = hub.repos["me/agent"]
    assert repo["visibility"] == "private"
    assert len(repo["commits"]) == 1 and repo["commits"][0]["summary"] == "GRPO search agent, step 300"
    assert repo["files"] == local_files(out)  # every file arrived, byte for byte
    assert {"README.md", "adapter_model.safetensors", "adapter_config.json", "training_curves.png"} <= set(
        repo["files"]
    )
    assert url == f"{hub.url}/me/agent/commit/{1:040x}"
    assert [p for m, p in hub.requests if "/commit/" in p] == ["/api/models/me/agent/commit/main"]

    push_to_hub(out, "me/agent", token=TOKEN)  # the repository exists now: a second commit, no error
    assert len(repo["commits"]) == 2 and repo["visibility"] == "private"


@pytest.mark.parametrize(
    ("endpoint", "status", "reason"),
    [
        ("create", 401, "the token was refused"),
        ("create", 500, "the server answered 500"),
        ("commit", 403, "no permission to write"),
    ],
)
def test_refused_push_keeps_the_local_copy(hub, saved_adapter, endpoint, status, reason):
    _, out = saved_adapter
    before = local_files(out)
    hub.refuse[endpoint] = status
    if endpoint == "create" and status in (401, 403):
        hub.refuse["repo_info"] = status  # create_repo(exist_ok=True) then asks whether the repo exists
    with pytest.raises(HubPushError, match=reason) as caught:
        push_to_hub(out, "me/agent", token=TOKEN)
    message = str(caught.value)
    assert f"The local copy is kept at {out}" in message and "'me/agent'" in message
    assert caught.value.output_dir == out
    assert local_files(out) == before
    assert all(not repo["files"] for repo in hub.repos.values())


def test_wrong_token_is_refused_by_the_server(hub, saved_adapter):
    _, out = saved_adapter
    with pytest.raises(HubPushError, match="the token was refused"):
        push_to_hub(out, "me/agent", token="hf_wrong")
    assert hub.repos == {}


def test_no_token_fails_before_any_request(hub, saved_adapter, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    _, out = saved_adapter
    with pytest.raises(HubPushError, match="no Hugging Face token. Log in with `hf auth login`"):
        push_to_hub(out, "me/agent")
    assert hub.requests == []


def test_no_network_keeps_the_local_copy(saved_adapter, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with socket.socket() as probe:  # a loopback port with nothing listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    _, out = saved_adapter
    with pytest.raises(HubPushError, match="is the network reachable") as caught:
        push_to_hub(out, "me/agent", token=TOKEN, endpoint=f"http://127.0.0.1:{port}")
    assert "The local copy is kept at" in str(caught.value) and (out / "adapter_model.safetensors").is_file()


def test_offline_mode_is_named(saved_adapter):
    _, out = saved_adapter
    with pytest.raises(HubPushError, match="HF_HUB_OFFLINE=1"):
        push_to_hub(out, "me/agent", token=TOKEN)


def test_repo_id_without_namespace_is_named(saved_adapter):
    _, out = saved_adapter
    with pytest.raises(ValueError, match="repo_id='agent' needs a namespace"):
        push_to_hub(out, "agent", token=TOKEN)
