"""Peak memory of one training step: full fine-tuning, LoRA and QLoRA; measured on CPU, estimated for GPUs.

    python benchmarks/memory.py measure     # SmolLM2-135M-Instruct on CPU, one fresh process per method (a few minutes)
    python benchmarks/memory.py estimate    # Qwen2.5-3B / 7B on one GPU, computed from the architecture

`measure` runs each method in its own process and reads the kernel's resident-set high-water mark (`VmHWM`, reset
through `/proc/self/clear_refs` just before the step), so the numbers include everything the step touches:
weights, gradients, AdamW state, activations (with gradient checkpointing) and the logits. It reports memory
relative to the process before the model was loaded.

`estimate` adds up, per GPU, for per_device_train_batch_size=1 at `--seq-len` tokens in bf16:
- weights: bf16, or NF4 (4 bits + one fp32 scale per 64 weights) with bf16 embeddings and head for QLoRA;
- trainable state: full: bf16 grads + fp32 master weights + two fp32 AdamW moments = 14 bytes per parameter on top
  of the bf16 weights; LoRA: fp32 adapter, grads and moments = 16 bytes per adapter parameter; QLoRA: the same in
  bf16, as TRL casts the adapters of a quantized model, = 8 bytes;
- activations: with gradient checkpointing, one hidden state per layer, plus the tensors one layer keeps for its
  backward while it is recomputed (SDPA/flash attention, no L^2 term);
- logits and their gradient (bf16), the rollout KV cache for `--num-generations` sequences, and a fixed
  CUDA/runtime overhead.
The reference model for the KL term costs nothing extra with an adapter (the adapter is disabled for it); for full
fine-tuning with `beta > 0` add one more bf16 copy of the weights. vLLM's own memory is not included.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass

GiB = 1024**3
MiB = 1024**2


# ---------------------------------------------------------------------------------------------------------------
# Estimate for GPUs
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arch:
    """The numbers of a Llama/Qwen2-style decoder that memory depends on (from the model's config.json)."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    qkv_bias: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of the seven projections of one layer: q, k, v, o, gate, up, down."""
        h, i, kv = self.hidden, self.intermediate, self.kv_dim
        return [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]

    def linear_params(self) -> int:
        per_layer = sum(a * b for a, b in self.linear_shapes()) + (self.hidden + 2 * self.kv_dim) * self.qkv_bias
        return self.layers * per_layer

    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    def params(self) -> int:
        norms = (2 * self.layers + 1) * self.hidden
        return self.linear_params() + self.embedding_params() + norms

    def lora_params(self, r: int) -> int:
        return self.layers * sum(r * (a + b) for a, b in self.linear_shapes())


QWEN2_5_3B = Arch(
    "Qwen2.5-3B", hidden=2048, intermediate=11008, layers=36, heads=16, kv_heads=2, vocab=151936, tied=True
)
QWEN2_5_7B = Arch(
    "Qwen2.5-7B", hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4, vocab=152064, tied=False
)

NF4_BYTES = 0.5 + 4 / 64  # 4-bit codes + one fp32 scale per 64-weight block (no double quantization)
RUNTIME_OVERHEAD = 1.0 * GiB  # CUDA context, kernels, allocator fragmentation


def estimate(arch: Arch, method: str, *, seq_len: int = 4096, lora_r: int = 16, num_generations: int = 8) -> dict:
    """Bytes per component for one training step of `method` ("full", "lora", "qlora") on one GPU."""
    if method not in ("full", "lora", "qlora"):
        raise ValueError(f"method={method!r}; use 'full', 'lora' or 'qlora'.")
    params, lora = arch.params(), arch.lora_params(lora_r)
    if method == "qlora":
        weights = arch.linear_params() * NF4_BYTES + (params - arch.linear_params()) * 2
    else:
        weights = params * 2
    # LoRA: PEFT keeps adapters in fp32 (weight, grad, two AdamW moments: 16 bytes); QLoRA: TRL's GRPOTrainer casts
    # the adapters of a quantized model to bf16 (8 bytes, the AdamW moments follow the parameter dtype).
    trainable = {"full": params * 14, "lora": lora * 16, "qlora": lora * 8}[method]
    # Activations: one bf16 hidden state per layer is kept (checkpointing); while one layer is recomputed it holds
    # its own inputs for backward: norms, q/k/v/o, gate/up/activation/product (elements per token, bf16).
    checkpoints = arch.layers * seq_len * arch.hidden * 2
    per_token_layer = 6 * arch.hidden + 2 * arch.kv_dim + 4 * arch.intermediate
    recompute = seq_len * per_token_layer * 2
    logits = seq_len * arch.vocab * 2 * 2  # bf16 logits and their gradient
    kv_cache = num_generations * 2 * arch.layers * arch.kv_dim * seq_len * 2
    parts = {
        "weights": weights,
        "trainable_state": trainable,
        "activations": checkpoints + recompute,
        "logits": logits,
        "rollout_kv_cache": kv_cache,
        "runtime": RUNTIME_OVERHEAD,
    }
    parts["total"] = sum(parts.values())
    parts["params"] = params
    parts["trainable_params"] = params if method == "full" else lora
    return parts


def _fits(total: float, capacity: float) -> str:
    if total <= 0.85 * capacity:
        return "yes"
    return "tight" if total <= capacity else "no"


def estimate_table(seq_len: int, lora_r: int, num_generations: int) -> str:
    header = (
        "| model | method | weights | trainable state | activations | logits | rollout KV | total | "
        "24 GB | 80 GB |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [header]
    for arch in (QWEN2_5_3B, QWEN2_5_7B):
        for method in ("full", "lora", "qlora"):
            e = estimate(arch, method, seq_len=seq_len, lora_r=lora_r, num_generations=num_generations)
            cells = [
                e[k] / GiB for k in ("weights", "trainable_state", "activations", "logits", "rollout_kv_cache", "total")
            ]
            fits = [_fits(e["total"], gpu * GiB) for gpu in (24, 80)]
            rows.append(
                f"| {arch.name} | {method} | "
                + " | ".join(f"{c:.1f} GiB" for c in cells)
                + f" | {fits[0]} | {fits[1]} |"
            )
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------------------------
# Measurement on CPU
# ---------------------------------------------------------------------------------------------------------------


def _status_kib(field: str, pid: int | str = "self") -> int:
    """``field`` (VmRSS, VmHWM) of ``/proc/<pid>/status`` in KiB."""
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/{pid}/status (measuring needs Linux; an exited process has none)")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as handle:  # "5" resets VmHWM to the current RSS (Linux >= 4.0)
        handle.write("5")


def _materialize(model) -> None:
    """Copy weights that still live in the memory-mapped checkpoint into process memory, and drop the mapping.

    Transformers loads safetensors through mmap: untouched weights are not resident, touched ones are counted as
    file pages until the mapping goes. Copying makes "loaded" mean what it means on a GPU: the weights are held.
    4-bit weights were created by quantization and are already in process memory.
    """
    import gc

    for tensor in [*model.parameters(), *model.buffers()]:
        if type(tensor).__name__ != "Params4bit":
            tensor.data = tensor.data.clone()
    gc.collect()


def measure_one(method: str, batch: int, seq_len: int, lora_r: int) -> dict:
    """One training step of SmolLM2-135M-Instruct with `method`, in this process; memory in MiB."""
    import torch

    from trl_multiturn.models import load_smollm2, prepare_qlora_for_cpu, smollm2_path

    path = smollm2_path()
    torch.manual_seed(0)
    ids = torch.randint(0, 49152, (batch, seq_len))
    baseline = _status_kib("VmRSS")
    if method == "qlora":
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
        model = AutoModelForCausalLM.from_pretrained(
            path, quantization_config=config, dtype=torch.float32, device_map="cpu"
        )
        prepare_qlora_for_cpu(model)
    else:
        model, _ = load_smollm2(dtype=torch.float32)
    _materialize(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    if method in ("lora", "qlora"):
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=lora_r, lora_alpha=2 * lora_r, target_modules=targets))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5)
    loaded = _status_kib("VmRSS")
    _reset_peak()
    loss = model(ids, labels=ids).loss
    loss.backward()
    optimizer.step()  # the first step allocates AdamW's two moments
    optimizer.zero_grad(set_to_none=True)
    peak = _status_kib("VmHWM")
    return {
        "method": method,
        "trainable_params": sum(p.numel() for p in trainable),
        "loaded_mib": (loaded - baseline) / 1024,
        "step_peak_mib": (peak - baseline) / 1024,
        "batch": batch,
        "seq_len": seq_len,
    }


def measure_table(results: list[dict]) -> str:
    rows = [
        "| method | trainable parameters | model + optimizer loaded | peak during the step |",
        "|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r['method']} | {r['trainable_params'] / 1e6:.1f} M | {r['loaded_mib']:.0f} MiB | "
            f"{r['step_peak_mib']:.0f} MiB |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="measure SmolLM2-135M on CPU, one process per method")
    m.add_argument("--methods", nargs="+", default=["full", "lora", "qlora"], choices=["full", "lora", "qlora"])
    m.add_argument("--batch", type=int, default=1)
    m.add_argument("--seq-len", type=int, default=512)
    m.add_argument("--lora-r", type=int, default=16)
    m.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one method in this process, print JSON
    e = sub.add_parser("estimate", help="estimate Qwen2.5-3B and 7B on one GPU")
    e.add_argument("--seq-len", type=int, default=4096)
    e.add_argument("--lora-r", type=int, default=16)
    e.add_argument("--num-generations", type=int, default=8)
    args = parser.parse_args(argv)

    if args.command == "estimate":
        print(estimate_table(args.seq_len, args.lora_r, args.num_generations))
        return
    if args.one:
        print(json.dumps(measure_one(args.one, args.batch, args.seq_len, args.lora_r)))
        return
    results = []
    for method in args.methods:
        cmd = [sys.executable, __file__, "measure", "--one", method, "--batch", str(args.batch)]
        cmd += ["--seq-len", str(args.seq_len), "--lora-r", str(args.lora_r)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(f"{method}: {results[-1]}", file=sys.stderr)
    print(f"SmolLM2-135M-Instruct, batch {args.batch} x {args.seq_len} tokens, float32 on CPU, gradient checkpointing")
    print(measure_table(results))


if __name__ == "__main__":
    main()
