"""Shared test set-up: an offline environment, SmolLM2's tokenizer and model, and tiny random models.

Everything runs without network access. The environment variables are set when this file is imported, before
any test module imports `huggingface_hub` or `transformers` (both read them once, at import):

- `HF_HUB_OFFLINE=1`, `TRANSFORMERS_OFFLINE=1`, `HF_DATASETS_OFFLINE=1`: no call ever goes to the Hub.
- `HF_HOME`: a fresh temporary directory, so no personal token or Hub cache leaks into the tests; `HF_TOKEN`
  is removed for the same reason.
- `TRL_MULTITURN_CACHE`: the converted SmolLM2 lives in the repository's ignored `.cache/trl_multiturn` unless
  the variable is already set, so the GGUF conversion (~20 s) happens once per checkout, not once per run.
- `TRL_EXPERIMENTAL_SILENCE=1`: TRL's warnings about experimental modules stay out of the logs.

Tests that use `smollm2_model` are marked `slow` automatically; others that take more than ~5 s carry the mark
themselves, so that `pytest -m "not slow"` is a fast set to run while working (CI runs everything). The report
header says whether this CPU has AVX512-BF16, which decides which of the 4-bit tests run here.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="trl_multiturn_hf_home_")
atexit.register(shutil.rmtree, os.environ["HF_HOME"], ignore_errors=True)
for _name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
    os.environ.pop(_name, None)
os.environ.setdefault("TRL_MULTITURN_CACHE", str(REPO_ROOT / ".cache" / "trl_multiturn"))

import pytest
import torch

from trl_multiturn.models import load_smollm2, load_tokenizer_offline, smollm2_path, tiny_random_model


def pytest_report_header(config):
    """Says which CPU-dependent paths this run takes (tests/test_qlora.py tests both; the skip reasons name them)."""
    import warnings

    from trl_multiturn.models import cpu_has_avx512_bf16

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # importing bitsandbytes warns about torch.jit
        has = cpu_has_avx512_bf16()
    return (f"CPU: {'has' if has else 'lacks'} AVX512-BF16, so bitsandbytes {'repacks' if has else 'never repacks'} "
            f"4-bit weights for inference here; torch threads: {torch.get_num_threads()}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "smollm2_model" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def offline_environment():
    """Checks that the offline set-up above is in force for the whole session (it is set at import)."""
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["TRANSFORMERS_OFFLINE"] == "1"
    yield


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """Directory of the converted SmolLM2-135M-Instruct (usable as `model_name_or_path`)."""
    return smollm2_path()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's tokenizer (vocabulary 49152, pad token `<|im_end|>`). Shared: do not change it in a test."""
    tokenizer = load_tokenizer_offline()
    assert tokenizer.pad_token is not None
    return tokenizer


@pytest.fixture
def tiny_model_factory(smollm2_tokenizer):
    """`make(hidden_size=32, num_layers=2, seed=0)` -> a fresh tiny random Llama with SmolLM2's vocabulary."""

    def make(hidden_size: int = 32, num_layers: int = 2, seed: int = 0):
        return tiny_random_model(smollm2_tokenizer, hidden_size=hidden_size, num_layers=num_layers, seed=seed)

    return make


@pytest.fixture
def tiny_model_dir(tmp_path, smollm2_tokenizer, tiny_model_factory):
    """A directory holding a tiny random model and SmolLM2's tokenizer, for scripts that take --model_name_or_path."""
    path = tmp_path / "tiny"
    tiny_model_factory(hidden_size=32, num_layers=2).save_pretrained(path)
    smollm2_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smollm2_model():
    """The real SmolLM2-135M-Instruct in float32, eval mode. Shared by the session: do not train it in place;
    load a fresh copy with `load_smollm2()` (~0.5 s from the cache) for that."""
    model, _ = load_smollm2(dtype=torch.float32)
    return model.eval()
