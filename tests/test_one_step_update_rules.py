"""docs/scripts/one_step_update_rules.py reads a one-step run's gradient back from its AdamW state: on a real PEFT
LoRA model (parameters in the order the optimizer sees them), the SGD adapter it writes is the warm start minus
``lr * grad``, which is what ``torch.optim.SGD`` does with the same gradient, and a checkpoint whose adapter is not
that optimizer state's step is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from repo_scripts import load_script

REPO = Path(__file__).resolve().parents[1]
rules = load_script("docs/scripts/one_step_update_rules.py")

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora_model(seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=2, lora_alpha=4, target_modules=MODULES,
                                                                lora_dropout=0.0, init_lora_weights=False))
    return model


def _adapter(model) -> dict[str, torch.Tensor]:  # the names PEFT saves: without the adapter name
    return {n.replace(".default", ""): p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _grad(model) -> dict[str, torch.Tensor]:
    model.zero_grad()
    ids = torch.randint(0, 40, (3, 10), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    return {n.replace(".default", ""): p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _one_adam_step(tmp_path: Path, lr: float = 5e-3) -> tuple[Path, Path, dict, dict]:
    model = _lora_model()
    warm = _adapter(model)
    warm_dir = tmp_path / "warm"
    warm_dir.mkdir()
    save_file(warm, str(warm_dir / "adapter_model.safetensors"))
    (warm_dir / "adapter_config.json").write_text("{}")
    grads = _grad(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    opt.step()
    ckpt = tmp_path / "run" / "checkpoint-1"
    ckpt.mkdir(parents=True)
    torch.save(opt.state_dict(), ckpt / "optimizer.pt")
    save_file(_adapter(model), str(ckpt / "adapter_model.safetensors"))
    norm = torch.cat([g.flatten() for g in grads.values()]).norm().item()
    (ckpt / "trainer_state.json").write_text(json.dumps({"log_history": [{"grad_norm": norm, "loss": 0.0}]}))
    return warm_dir, ckpt, warm, grads


def test_the_sgd_adapter_is_the_sgd_step_on_the_recovered_gradient(tmp_path):
    warm_dir, ckpt, warm, grads = _one_adam_step(tmp_path)
    # the names in the optimizer's order are the ones the script assumes
    names = [n.replace(".default", "") for n, p in _lora_model().named_parameters() if p.requires_grad]
    assert rules._model_order(list(warm)) == names
    stats = rules.main(["--warm_start", str(warm_dir), "--checkpoint", str(ckpt), "--rule", "sgd", "--lr", "0.3",
                        "--out_dir", str(tmp_path / "out")])
    new = load_file(str(tmp_path / "out" / "sgd_run" / "adapter_model.safetensors"))
    # what torch.optim.SGD does with the same gradient
    params = {k: v.clone().requires_grad_(True) for k, v in warm.items()}
    sgd = torch.optim.SGD(list(params.values()), lr=0.3)
    for k, p in params.items():
        p.grad = grads[k]
    sgd.step()
    for k in warm:
        torch.testing.assert_close(new[k], params[k].detach(), rtol=0, atol=1e-6)
    assert (tmp_path / "out" / "sgd_run" / "adapter_config.json").exists()
    run = stats["runs"]["run"]
    assert run["grad_norm"] == pytest.approx(run["logged_grad_norm"], rel=1e-5)
    assert 0.0 < run["cos_sign_step_gradient"] < 1.0


def test_the_scaled_adapter_is_a_fraction_of_the_adam_step(tmp_path):
    warm_dir, ckpt, warm, _ = _one_adam_step(tmp_path)
    rules.main(["--warm_start", str(warm_dir), "--checkpoint", str(ckpt), "--rule", "scaled", "--factor", "0.25",
                "--out_dir", str(tmp_path / "out")])
    new = load_file(str(tmp_path / "out" / "scaled_run" / "adapter_model.safetensors"))
    after = load_file(str(ckpt / "adapter_model.safetensors"))
    for k in warm:
        torch.testing.assert_close(new[k], warm[k] + 0.25 * (after[k] - warm[k]), rtol=0, atol=1e-7)


def test_a_checkpoint_that_is_not_one_adam_step_from_the_warm_start_is_refused(tmp_path):
    warm_dir, ckpt, warm, _ = _one_adam_step(tmp_path)
    moved = {k: v + 1e-3 for k, v in load_file(str(ckpt / "adapter_model.safetensors")).items()}
    save_file(moved, str(ckpt / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="is not the Adam step of its optimizer state"):
        rules.main(["--warm_start", str(warm_dir), "--checkpoint", str(ckpt), "--out_dir", str(tmp_path / "out")])


def test_a_clipped_gradient_is_refused(tmp_path):
    warm_dir, ckpt, _, _ = _one_adam_step(tmp_path)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["log_history"][0]["grad_norm"] *= 3  # the run logged the norm before clipping it to a third
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match="clipped or rescaled"):
        rules.main(["--warm_start", str(warm_dir), "--checkpoint", str(ckpt), "--out_dir", str(tmp_path / "out")])
