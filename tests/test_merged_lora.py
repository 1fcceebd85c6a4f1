"""Sampling with a LoRA adapter folded into the weights (``trl_multiturn.generation.merged_lora``): the same policy
up to float rounding, the original weight tensors back bit for bit afterwards, and skipped where it cannot apply."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from trl_multiturn.generation import SamplingParams, TransformersGenerator, can_merge_lora, merged_lora

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model(factory, dtype=torch.float32, **kw):
    model = get_peft_model(factory(hidden_size=32, num_layers=2, seed=0),
                           LoraConfig(r=4, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False, **kw))
    return model.to(dtype).eval()


def base_weights(model):
    return {n: p for n, p in model.named_parameters() if "base_layer.weight" in n}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_forward_is_the_adapter_and_the_weights_come_back_bit_for_bit(tiny_model_factory, dtype):
    model = lora_model(tiny_model_factory, dtype)
    ids = torch.randint(0, 1000, (2, 9))
    with torch.no_grad():
        unmerged = model(input_ids=ids).logits.float()  # (2, 9, V)
        with model.disable_adapter():
            base_only = model(input_ids=ids).logits.float()
    before = {n: (p.data_ptr(), p.data.clone()) for n, p in base_weights(model).items()}
    lora_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    assert len(before) == 2 * len(TARGETS) and can_merge_lora(model)
    with merged_lora(model) as merged, torch.no_grad():
        assert merged
        inside = model(input_ids=ids).logits.float()
        assert all(p.data_ptr() != before[n][0] for n, p in base_weights(model).items())  # new tensors, W untouched
    tol = 1e-5 if dtype == torch.float32 else 0.1
    assert (inside - unmerged).abs().max() < tol < (base_only - unmerged).abs().max()  # the adapter, not the base
    for n, p in base_weights(model).items():
        assert p.data_ptr() == before[n][0] and torch.equal(p.data, before[n][1])  # the same memory, the same bits
    assert all(torch.equal(p, lora_before[n]) for n, p in model.named_parameters() if "lora_" in n)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits.float(), unmerged)  # the adapter is on again


def test_greedy_generation_is_the_same_merged(tiny_model_factory, smollm2_tokenizer):
    model = lora_model(tiny_model_factory)
    contexts = [smollm2_tokenizer("A question")["input_ids"], smollm2_tokenizer("Another, longer question")["input_ids"]]
    plain = TransformersGenerator(model, smollm2_tokenizer).generate(contexts, 8, SamplingParams(greedy=True))
    with merged_lora(model):
        folded = TransformersGenerator(model, smollm2_tokenizer).generate(contexts, 8, SamplingParams(greedy=True))
    assert [o.ids for o in folded] == [o.ids for o in plain]
    assert all(o.logprobs == pytest.approx(p.logprobs, abs=1e-5) for o, p in zip(folded, plain))


def test_an_error_inside_the_block_still_restores(tiny_model_factory):
    model = lora_model(tiny_model_factory)
    before = {n: p.data_ptr() for n, p in base_weights(model).items()}
    with pytest.raises(RuntimeError, match="boom"), merged_lora(model):
        raise RuntimeError("boom")
    assert all(p.data_ptr() == before[n] for n, p in base_weights(model).items())
    from peft.tuners.lora import LoraLayer

    assert not any(m.disable_adapters for m in model.modules() if isinstance(m, LoraLayer))  # the adapter is on


def test_what_is_not_merged(tiny_model_factory):
    plain = tiny_model_factory()
    dora = lora_model(tiny_model_factory, use_dora=True)
    lora = lora_model(tiny_model_factory)
    for model, enabled in ((plain, True), (dora, True), (lora, False)):
        before = {n: p.data_ptr() for n, p in model.named_parameters()}
        with merged_lora(model, enabled) as merged:
            assert not merged
            assert all(p.data_ptr() == before[n] for n, p in model.named_parameters())
    assert not can_merge_lora(plain) and not can_merge_lora(dora) and can_merge_lora(lora)
