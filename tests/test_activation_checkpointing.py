"""Activation checkpointing through GRPO steps (``trl_multiturn.activation_checkpointing``): the configured
``every_n_layers`` holds after the rollouts, and ``activation_checkpointing_policy="save_matmuls"`` gives the same
gradients as full checkpointing while recomputing fewer matrix products."""

import inspect
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import PreTrainedModel

from test_trainer import FeedbackEnv, dataset, make_args, vowel_reward
from trl_multiturn import MultiTurnGRPOConfig, MultiTurnGRPOTrainer
from trl_multiturn.activation_checkpointing import checkpointing_suspended

HAS_LAYER_OPTIONS = "every_n_layers" in inspect.signature(PreTrainedModel.activation_checkpointing_enable).parameters \
    if hasattr(PreTrainedModel, "activation_checkpointing_enable") else False


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


def layers(model):
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def lora(factory):
    torch.manual_seed(0)  # the adapter's random init
    model = get_peft_model(factory(hidden_size=128, num_layers=2, seed=0),
                           LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False))
    return model.train()


def gradients_and_backward_matmuls(factory, policy):
    """(LoRA gradients, aten (add)mm calls in the backward) of one loss with checkpointing as ``policy`` sets it."""
    model = lora(factory)
    args = SimpleNamespace(activation_checkpointing=policy is not None, gradient_checkpointing=policy is not None,
                           activation_checkpointing_kwargs={"use_reentrant": False}, gradient_checkpointing_kwargs=None,
                           activation_checkpointing_policy=policy or "full")
    if policy is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
        with checkpointing_suspended(model, args):  # on exit: enabled as configured, the policy's context included
            pass
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids).logits[:, -8:].log_softmax(-1).mean()
    with CountMatmuls() as counter:
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, counter.count


def test_save_matmuls_gives_the_same_gradients_and_recomputes_fewer_matmuls(tiny_model_factory):
    plain, plain_mm = gradients_and_backward_matmuls(tiny_model_factory, None)
    full, full_mm = gradients_and_backward_matmuls(tiny_model_factory, "full")
    saved, saved_mm = gradients_and_backward_matmuls(tiny_model_factory, "save_matmuls")
    assert plain.keys() == full.keys() == saved.keys() and len(plain) == 2 * 7 * 2  # A, B x 7 projections x 2 layers
    for name in plain:
        assert torch.equal(saved[name], full[name]), name  # the same values, recomputed or kept
        torch.testing.assert_close(saved[name], plain[name], rtol=0, atol=1e-6)
    # full checkpointing recomputes every projection (2 layers x 7) in the backward; save_matmuls only the adapters'
    assert full_mm >= plain_mm + 14 and saved_mm < full_mm - 7, (plain_mm, full_mm, saved_mm)


def run(tmp_path, tokenizer, factory, **overrides):
    model = factory(num_layers=4)
    args = make_args(tmp_path, max_steps=2, gradient_checkpointing=True, **overrides)
    trainer = MultiTurnGRPOTrainer(model=model, args=args, train_dataset=dataset(), environment_factory=FeedbackEnv,
                                   reward_funcs=[vowel_reward], processing_class=tokenizer)
    seen = []
    compute_loss = trainer.compute_loss

    def recording(*a, **kw):  # what the layers are set to while the loss is computed
        seen.append([(m.gradient_checkpointing, dict(getattr(m._gradient_checkpointing_func, "keywords", {})))
                     for m in layers(model)])
        return compute_loss(*a, **kw)

    trainer.compute_loss = recording
    trainer.train()
    hooks = len(model.get_input_embeddings()._forward_hooks)
    assert hooks <= 2, hooks  # TRL's own and the last enable's: toggling does not pile hooks up
    return model, seen


@pytest.mark.skipif(not HAS_LAYER_OPTIONS, reason="this transformers has no every_n_layers")
def test_every_n_layers_holds_after_the_rollouts(tmp_path, smollm2_tokenizer, tiny_model_factory):
    _, seen = run(tmp_path, smollm2_tokenizer, tiny_model_factory,
                  gradient_checkpointing_kwargs={"use_reentrant": False, "every_n_layers": 2})
    assert len(seen) == 4  # 2 steps x 2 micro-batches, each after a rollout or a buffered one
    for flags in seen:
        assert [on for on, _ in flags] == [True, False, True, False]
        assert all("every_n_layers" not in kw for _, kw in flags)  # not handed to torch's checkpoint


def test_policy_through_training_same_parameters(tmp_path, smollm2_tokenizer, tiny_model_factory):
    full, _ = run(tmp_path / "full", smollm2_tokenizer, tiny_model_factory)
    saved, seen = run(tmp_path / "saved", smollm2_tokenizer, tiny_model_factory,
                      activation_checkpointing_policy="save_matmuls")
    assert all(kw.get("context_fn") is not None for flags in seen for _, kw in flags)
    moved = 0
    for (name, a), b in zip(full.state_dict().items(), saved.state_dict().values()):
        assert torch.equal(a, b), name
    start = tiny_model_factory(num_layers=4).state_dict()
    moved = sum(not torch.equal(v, start[k]) for k, v in saved.state_dict().items())
    assert moved > 0  # the steps trained


@pytest.mark.parametrize("overrides, match", [
    ({"activation_checkpointing_policy": "save_everything"}, "use one of"),
    ({"activation_checkpointing_policy": "save_matmuls", "gradient_checkpointing": False}, "gradient_checkpointing=True"),
    ({"activation_checkpointing_policy": "save_matmuls", "gradient_checkpointing_kwargs": {"use_reentrant": True}},
     "non-reentrant"),
])
def test_policy_refused_where_it_would_be_ignored(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        MultiTurnGRPOConfig(output_dir=str(tmp_path), report_to="none", **overrides)
