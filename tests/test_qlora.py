"""QLoRA on CPU: LoRA gradients of a 4-bit model after `generate` equal LoRA gradients on its de-quantized weights.

GRPO generates rollouts, then trains on them, in the same process. With bitsandbytes on a CPU with AVX512-BF16,
the first forward without gradients in eval mode repacks every 4-bit weight for an inference kernel without a
backward, and later LoRA gradients are silently wrong. `prepare_qlora_for_cpu` keeps the layers on the
autograd-capable path (and undoes a repacking that already happened). The reference here is the same model in
float32 whose linear weights are the de-quantized 4-bit weights, with the same LoRA initialisation: both compute
the same function, so their gradients must agree to float32 rounding.

Independent of the CPU: the repacking and its undoing are tested on every CPU (the repacking done by calling
bitsandbytes' own conversion, and the AVX512-BF16 flag set by hand); on a CPU with AVX512-BF16 two more tests run
the real trigger (an eval forward) and show the wrong gradients without the workaround; on any other CPU one test
shows that the same steps keep correct gradients there. The skip reasons in the summary say which set ran.
"""

from __future__ import annotations

import warnings

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from trl_multiturn.models import cpu_has_avx512_bf16, prepare_qlora_for_cpu

PROMPT = "<|im_start|>user\nWho wrote Hamlet?<|im_end|>\n<|im_start|>assistant\n<search>Hamlet</search>"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def load_4bit(path):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config, dtype=torch.float32, device_map="cpu")


def dequantized_copy(path, quantized):
    """The float32 model from `path` with each 4-bit layer's weight replaced by its de-quantized value."""
    from bitsandbytes.functional import dequantize_4bit
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    modules = dict(model.named_modules())
    count = 0
    for name, module in quantized.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            weight = dequantize_4bit(module.weight.data, module.weight.quant_state).to(torch.float32)
            modules[name].weight.data.copy_(weight)
            count += 1
    assert count > 0, "the quantized model has no 4-bit layers"
    return model


def with_lora(model):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the same LoRA initialisation for both models
        return get_peft_model(model, config)


def rollout_then_lora_grads(model, ids):
    """What GRPO does: generate in eval mode without gradients, then a training forward and backward."""
    model.eval()
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)
    model.train()
    model.zero_grad()
    model(ids, labels=ids).loss.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def max_relative_error(actual, expected):
    assert actual.keys() == expected.keys() and len(expected) > 0
    return max(
        ((actual[n] - expected[n]).abs().max() / expected[n].abs().max().clamp_min(1e-12)).item() for n in expected
    )


def assert_grads_equal(actual, expected):
    assert actual.keys() == expected.keys() and len(expected) > 0
    for name in expected:
        assert expected[name].abs().max() > 0, f"{name} has no gradient, the comparison would prove nothing"
        torch.testing.assert_close(
            actual[name], expected[name], rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, smollm2_tokenizer):
    from trl_multiturn.models import tiny_random_model

    path = tmp_path_factory.mktemp("tiny_base")
    # hidden 64: the 4-bit CPU layout packs output rows in blocks of 32, so every projection is at least that wide.
    tiny_random_model(smollm2_tokenizer, hidden_size=64, num_layers=2, seed=0).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_reference(tiny_checkpoint, smollm2_tokenizer):
    ids = smollm2_tokenizer(PROMPT, return_tensors="pt").input_ids
    reference = with_lora(dequantized_copy(tiny_checkpoint, load_4bit(tiny_checkpoint)))
    return ids, rollout_then_lora_grads(reference, ids)


def test_qlora_grads_after_generate_match_dequantized_lora(tiny_checkpoint, tiny_reference):
    ids, expected = tiny_reference
    model = with_lora(prepare_qlora_for_cpu(load_4bit(tiny_checkpoint)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the broken path only warns: make any such warning fail here
        actual = rollout_then_lora_grads(model, ids)
    assert_grads_equal(actual, expected)


def repack_like_an_avx512_bf16_cpu(layers) -> None:
    """What `Linear4bit.forward` does to each layer on its first eval forward on a CPU with AVX512-BF16, done here by
    calling the same bitsandbytes conversion directly, so that it happens on any CPU."""
    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    for module in layers.values():
        module.weight.data, module.weight.quant_state = _convert_weight_packed_for_cpu(
            module.weight.data, module.weight.quant_state
        )


def assert_prepare_undoes_the_repacking(model, tiny_checkpoint, ids, layers, loaded):
    """`prepare_qlora_for_cpu` on a model whose 4-bit layers were repacked restores the autograd layout, with a
    warning. The repacking rounded the block scales to bfloat16, so the gradient reference is the de-quantized copy
    of the weights as they are now."""
    from bitsandbytes.functional import dequantize_4bit

    assert all(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in layers.values())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepare_qlora_for_cpu(model)
    assert [str(w.message) for w in caught if "already been repacked" in str(w.message)] != []
    for name, module in layers.items():
        assert module.support_avx512bf16_for_cpu is False
        assert not getattr(module.weight.quant_state, "packing_format_for_cpu", False)
        now = dequantize_4bit(module.weight.data, module.weight.quant_state).float()
        # the same weights up to bfloat16 rounding of the scales (2**-8 relative), not a scrambled layout
        torch.testing.assert_close(now, loaded[name], rtol=2**-8, atol=1e-6)
    expected = rollout_then_lora_grads(with_lora(dequantized_copy(tiny_checkpoint, model)), ids)
    assert_grads_equal(rollout_then_lora_grads(with_lora(model), ids), expected)


def loaded_layers(tiny_checkpoint):
    """A fresh 4-bit model, its 4-bit layers by name, and each layer's de-quantized weight as loaded."""
    from bitsandbytes.functional import dequantize_4bit

    model = load_4bit(tiny_checkpoint)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    loaded = {n: dequantize_4bit(m.weight.data, m.weight.quant_state).float() for n, m in layers.items()}
    return model, layers, loaded


def test_prepare_undoes_a_repacking_that_already_happened(tiny_checkpoint, smollm2_tokenizer):
    """Called late, after the weights were repacked (here with bitsandbytes' own conversion, on any CPU)."""
    ids = smollm2_tokenizer(PROMPT, return_tensors="pt").input_ids
    model, layers, loaded = loaded_layers(tiny_checkpoint)
    repack_like_an_avx512_bf16_cpu(layers)
    assert_prepare_undoes_the_repacking(model, tiny_checkpoint, ids, layers, loaded)


@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="this CPU lacks AVX512-BF16: bitsandbytes never repacks here "
                    "(the repacking is tested by calling its conversion directly)")
def test_an_eval_forward_repacks_on_this_cpu_and_prepare_undoes_it(tiny_checkpoint, smollm2_tokenizer):
    """The real trigger: on this CPU an eval forward without gradients repacks every 4-bit layer by itself."""
    ids = smollm2_tokenizer(PROMPT, return_tensors="pt").input_ids
    model, layers, loaded = loaded_layers(tiny_checkpoint)
    model.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(ids)
    assert_prepare_undoes_the_repacking(model, tiny_checkpoint, ids, layers, loaded)


def test_prepare_keeps_an_avx512_bf16_cpu_from_repacking(tiny_checkpoint, smollm2_tokenizer):
    """Portable check of the switch: each layer's flag set as bitsandbytes sets it on a CPU with AVX512-BF16, then
    `prepare_qlora_for_cpu` turns it off, and an eval forward leaves the autograd layout in place."""
    ids = smollm2_tokenizer(PROMPT, return_tensors="pt").input_ids
    model, layers, _ = loaded_layers(tiny_checkpoint)
    for module in layers.values():
        module.support_avx512bf16_for_cpu = True  # what `Linear4bit.__init__` sets on such a CPU
    prepare_qlora_for_cpu(model)
    model.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model(ids)
    assert [n for n, m in layers.items() if getattr(m.weight.quant_state, "packing_format_for_cpu", False)] == []


@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="this CPU lacks AVX512-BF16, so bitsandbytes never repacks "
                    "(test_without_the_workaround_this_cpu_keeps_correct_grads runs instead)")
def test_without_the_workaround_grads_are_wrong_on_this_cpu(tiny_checkpoint, tiny_reference):
    """Shows that the tests above guard a real failure: the same steps without `prepare_qlora_for_cpu`."""
    ids, expected = tiny_reference
    model = with_lora(load_4bit(tiny_checkpoint))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        actual = rollout_then_lora_grads(model, ids)
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and all(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in layers)
    assert max_relative_error(actual, expected) > 0.05


@pytest.mark.skipif(cpu_has_avx512_bf16(), reason="this CPU has AVX512-BF16: "
                    "test_without_the_workaround_grads_are_wrong_on_this_cpu runs instead")
def test_without_the_workaround_this_cpu_keeps_correct_grads(tiny_checkpoint, tiny_reference):
    """The portable path: without AVX512-BF16 bitsandbytes never repacks, so the workaround changes nothing here."""
    ids, expected = tiny_reference
    model = with_lora(load_4bit(tiny_checkpoint))
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and not any(m.support_avx512bf16_for_cpu for m in layers)
    actual = rollout_then_lora_grads(model, ids)
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in layers)
    assert_grads_equal(actual, expected)


def test_prepare_is_a_no_op_without_4bit_layers(tiny_model_factory):
    model = tiny_model_factory()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert prepare_qlora_for_cpu(model) is model
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_smollm2_qlora_grads_after_generate_match_dequantized_lora(smollm2_dir, smollm2_tokenizer):
    ids = smollm2_tokenizer(PROMPT, return_tensors="pt").input_ids
    quantized = prepare_qlora_for_cpu(load_4bit(smollm2_dir))  # loading in 4 bits takes ~10 s: do it once
    expected = rollout_then_lora_grads(with_lora(dequantized_copy(smollm2_dir, quantized)), ids)
    actual = rollout_then_lora_grads(with_lora(quantized), ids)
    assert_grads_equal(actual, expected)


def test_memory_estimate_arithmetic(monkeypatch):
    """The GPU estimate in docs/lora_qlora.md: parameter counts against the published sizes, LoRA by hand."""
    from repo_scripts import load_script

    memory = load_script("benchmarks/memory.py", "memory_benchmark")
    assert round(memory.QWEN2_5_3B.params() / 1e9, 2) == 3.09  # Qwen2.5-3B: 3.09 B
    assert round(memory.QWEN2_5_7B.params() / 1e9, 2) == 7.62  # Qwen2.5-7B: 7.61 B (7,615,616,512)
    # LoRA r=16 on one Qwen2.5-3B layer: q (2048+2048) + k, v (2048+256) x 2 + o (2048+2048) + gate, up (2048+11008)
    # x 2 + down (11008+2048) = 51,968 per unit of rank -> x 16 x 36 layers
    assert memory.QWEN2_5_3B.lora_params(16) == 51_968 * 16 * 36
    full = memory.estimate(memory.QWEN2_5_7B, "full", seq_len=4096)
    assert full["trainable_state"] == full["params"] * 14 and full["weights"] == full["params"] * 2
    qlora = memory.estimate(memory.QWEN2_5_7B, "qlora", seq_len=4096)
    assert qlora["logits"] == 4096 * 152064 * 4 and qlora["total"] < 24 * memory.GiB
    with pytest.raises(ValueError, match="method='dora'"):
        memory.estimate(memory.QWEN2_5_3B, "dora")
