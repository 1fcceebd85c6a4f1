"""What the first optimizer step of a one-step GRPO run would have been under another update rule.

After one AdamW step (no weight decay), the optimizer state of a checkpoint holds the step's gradient exactly:
``exp_avg = (1 - beta1) * g`` and ``exp_avg_sq = (1 - beta2) * g**2``, and the step itself was
``-lr * g / (|g| + eps)``, i.e. ``-lr * sign(g)`` wherever ``|g| >> eps``: a sign step that moves every LoRA
parameter by the learning rate whatever its gradient. This script reads that gradient back (checking the adapter's
change against it), reports how the two seeds' gradients and the sign steps relate, and writes adapters for

- ``sgd``: the warm start minus ``lr_sgd * g``, the step that ``optim: sgd`` (torch.optim.SGD, no momentum) with
  ``learning_rate: lr_sgd`` takes on the same on-policy batch: the rollout of a seed from the same warm start is
  the same, so the gradient is too (the run's ``max_grad_norm`` did not clip it: its logged grad_norm is checked);
- ``scaled``: the warm start plus ``factor`` times the Adam step (Adam at ``factor * lr``).

    python docs/scripts/one_step_update_rules.py --warm_start outputs/warm_start/sft_adapter \\
        --checkpoint outputs/lp/step64_seed0/checkpoint-1 --checkpoint outputs/lp/step64_seed1/checkpoint-1 \\
        --rule sgd --lr 1.65 --out_dir outputs/lp/rules --stats_json docs/results/learning_proof/step64_update_rules.json
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_MODULE_ORDER = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model_order(keys: list[str]) -> list[str]:
    """The LoRA tensors in the order of ``model.parameters()`` (the optimizer's order) for a Llama-style model:
    layer by layer, attention projections then MLP projections, ``lora_A`` before ``lora_B``."""

    def key(name: str):
        layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
        module = next(i for i, m in enumerate(_MODULE_ORDER) if f".{m}." in name)
        return layer, module, 0 if "lora_A" in name else 1

    return sorted(keys, key=key)


def read_step(warm: dict, checkpoint: Path) -> dict:
    """The gradient of a checkpoint's one Adam step, per adapter tensor, checked against the adapter's change."""
    opt = torch.load(checkpoint / "optimizer.pt", map_location="cpu", weights_only=False)
    group = opt["param_groups"][0]
    beta1, beta2 = group["betas"]
    if group.get("weight_decay", 0.0) != 0.0:
        raise ValueError(f"{checkpoint}: weight_decay={group['weight_decay']}; the gradient read-back assumes 0.")
    state = opt["state"]
    if any(float(s["step"]) != 1.0 for s in state.values()):
        raise ValueError(f"{checkpoint}: the optimizer took more than one step; the gradient is not recoverable.")
    after = load_file(str(checkpoint / "adapter_model.safetensors"))
    names = _model_order(list(warm))
    if len(names) != len(state):
        raise ValueError(f"{checkpoint}: {len(state)} optimizer tensors for {len(names)} adapter tensors.")
    grads, worst = {}, 0.0
    for i, name in enumerate(names):
        g = state[i]["exp_avg"].double() / (1 - beta1)
        adam = -group["lr"] * g / ((state[i]["exp_avg_sq"].double() / (1 - beta2)).sqrt() + group["eps"])
        delta = after[name].double() - warm[name].double()
        if g.shape != delta.shape:
            raise ValueError(f"{checkpoint}: {name} has shape {tuple(delta.shape)}, its optimizer state {tuple(g.shape)}.")
        worst = max(worst, (adam - delta).abs().max().item())
        grads[name] = g
    if worst > 1e-2 * group["lr"]:  # float32 rounding of the weights is far below 1% of a step
        raise ValueError(f"{checkpoint}: the adapter's change is not the Adam step of its optimizer state "
                         f"(largest difference {worst:.2e}); is this the first step from this warm start?")
    state_json = json.loads((checkpoint / "trainer_state.json").read_text())
    grad_norm = next(h["grad_norm"] for h in state_json["log_history"] if "grad_norm" in h)
    return {"grad": grads, "lr": group["lr"], "logged_grad_norm": grad_norm, "check_max_abs_diff": worst}


def _flat(t: dict) -> torch.Tensor:
    return torch.cat([t[k].flatten() for k in sorted(t)])


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--warm_start", required=True, help="The adapter the one-step runs started from.")
    p.add_argument("--checkpoint", action="append", required=True, help="A one-step run's checkpoint-1 (repeat).")
    p.add_argument("--rule", choices=["sgd", "scaled"], default="sgd")
    p.add_argument("--lr", type=float, default=1.65, help="--rule sgd: the SGD learning rate.")
    p.add_argument("--factor", type=float, default=0.5, help="--rule scaled: the fraction of the Adam step.")
    p.add_argument("--out_dir", required=True, help="Adapters are written to <out_dir>/<rule>_<checkpoint run>.")
    p.add_argument("--stats_json", help="Write the gradient statistics here.")
    args = p.parse_args(argv)

    warm_dir = Path(args.warm_start)
    warm = {k: v.double() for k, v in load_file(str(warm_dir / "adapter_model.safetensors")).items()}
    steps = {Path(c).parent.name: read_step(warm, Path(c)) for c in args.checkpoint}
    stats = {"warm_start": str(warm_dir), "rule": args.rule, "runs": {}}
    flats = {}
    for run, step in steps.items():
        g = _flat(step["grad"])
        flats[run] = g
        norm = float(g.norm())
        if abs(norm - step["logged_grad_norm"]) > 1e-3 * norm:
            raise ValueError(f"{run}: gradient norm {norm:.6f} from the optimizer state, {step['logged_grad_norm']:.6f} "
                             "logged: the gradient was clipped or rescaled; the SGD equivalent would differ.")
        sign = torch.sign(g)
        stats["runs"][run] = {
            "grad_norm": norm, "logged_grad_norm": step["logged_grad_norm"], "adam_lr": step["lr"],
            "adam_step_norm": float(step["lr"] * sign.norm()), "cos_sign_step_gradient": _cos(sign, g),
            "fraction_moved_by_lr": float((g.abs() > 1e-7).double().mean()),
            "check_max_abs_diff": step["check_max_abs_diff"], "num_parameters": g.numel(),
        }
        if args.rule == "sgd":
            stats["runs"][run]["sgd_step_norm"] = args.lr * norm
        out = Path(args.out_dir) / f"{args.rule}_{run}"
        out.mkdir(parents=True, exist_ok=True)
        if args.rule == "sgd":
            new = {k: (warm[k] - args.lr * step["grad"][k]).float() for k in warm}
        else:
            after = load_file(str(Path(args.checkpoint[list(steps).index(run)]) / "adapter_model.safetensors"))
            new = {k: (warm[k] + args.factor * (after[k].double() - warm[k])).float() for k in warm}
        save_file({k: v.contiguous() for k, v in new.items()}, str(out / "adapter_model.safetensors"))
        for f in warm_dir.iterdir():
            if f.name != "adapter_model.safetensors" and f.is_file():
                shutil.copy(f, out / f.name)
    runs = list(flats)
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            stats[f"cos_gradient_{a}_{b}"] = _cos(flats[a], flats[b])
            stats[f"cos_sign_step_{a}_gradient_{b}"] = _cos(torch.sign(flats[a]), flats[b])
            stats[f"cos_sign_step_{b}_gradient_{a}"] = _cos(torch.sign(flats[b]), flats[a])
    print(json.dumps(stats, indent=2))
    if args.stats_json:
        Path(args.stats_json).write_text(json.dumps(stats, indent=2))
    return stats


if __name__ == "__main__":
    main()
