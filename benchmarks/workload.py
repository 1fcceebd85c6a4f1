"""The multi-turn search workload shared by the benchmarks: model, questions, retriever, tool environment and the
scripted tool calls that make both sides do exactly the same work.

SmolLM2-135M does not call tools on its own (TRL's loop would then run a single turn), so every turn's text is
forced: a logits processor puts all probability on the next token of a per-trajectory script (a "thought" of
varying length, then a JSON tool call, or the final answer on the last turn, then EOS). The model's forward runs
in full at every position, only its choice is overridden, so the compute is that of a real rollout whose policy
happened to write these texts. The same processor drives TRL's ``model.generate`` (as a ``LogitsProcessor``) and
our ``TransformersGenerator`` (``logits_processor=``), and the environment is one TRL-style class (public method
``search`` = the tool) used by TRL's ``environment_factory`` and, through ``TRLEnvironmentAdapter``, by our
rollout with ``ChatToolProtocol``; prompts and tool results go through the same chat template (TRL's Qwen2.5
template, which speaks SmolLM2's ChatML tokens).

The scripts are a function of the trajectory's prompt only: which trajectory a row is, the turn (the number of
``<|im_start|>assistant`` markers so far) and the position in the turn are read from the row's ids.

What every benchmark reports goes through here too: ``print_table`` (the side-by-side table on the console) and
``write_result`` (the JSON under benchmarks/results/).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

MODEL_SIZES = {
    "tiny": (64, 128, 2, 4, 2),  # smoke tests of the scripts
    # name: (hidden, intermediate, layers, heads, kv_heads) of a Llama-style decoder with SmolLM2's vocabulary
    "135m": (576, 1536, 30, 9, 3),
    "360m": (960, 2560, 32, 15, 5),
    "1.7b": (2048, 8192, 24, 32, 32),
    "3b": (3072, 8192, 28, 24, 8),
}

FILLER = (
    "Let me think about what I already know and what I still need to find out before I can answer the question "
    "with confidence, checking each fact against the documents the search engine returns and keeping track of the "
    "names, places and dates that matter for the final answer"
).split()


def result_record(benchmark: str, args, argv, **fields) -> dict:
    """The head of a benchmark's JSON: its name, the machine (platform, torch threads, device), the settings, the
    exact command and the library versions; then ``fields``."""
    import platform
    import sys

    import transformers
    import trl

    return {
        "benchmark": benchmark,
        "machine": {"platform": platform.platform(), "cpus": torch.get_num_threads(), "device": args.device},
        "settings": vars(args),
        "command": f"python benchmarks/{benchmark}.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        **fields,
    }


def lora_policy_with_fused_head(model: str, lora_r: int, seed: int):
    """The trainer's training forward for the micro-batch benchmarks: ``model`` in fp32 on CPU with TRL's fused LM
    head, LoRA r ``lora_r`` (alpha 2r, no dropout) on every linear layer, in training mode, the adapter's weights
    drawn N(0, 0.02) after ``torch.manual_seed(seed)`` (a non-zero B, so its gradients are not trivially related)."""
    from peft import LoraConfig, get_peft_model
    from trl.trainer.utils import add_fused_lm_head

    base, _ = load_policy(model, "fp32", "cpu")
    add_fused_lm_head(base)
    torch.manual_seed(seed)
    policy = get_peft_model(base, LoraConfig(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0,
                                             target_modules="all-linear", task_type="CAUSAL_LM")).train()
    for p in policy.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.02)
    return policy


def write_result(result: dict, out: str) -> Path:
    """Write a benchmark's result as JSON to ``out`` (folders created) and say where."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return path


def print_table(columns: list[str], rows: list[tuple], label_width: int, widths: int | list[int]) -> None:
    """Print a side-by-side table after a blank line: the column titles, then one line per ``(label, fmt, values)``
    row, the label left-aligned in ``label_width`` characters and each value formatted with ``fmt`` (``"{:.2f}"``;
    None prints as n/a) and right-aligned in its column's width (``widths``: one for all columns, or one each)."""
    widths = [widths] * len(columns) if isinstance(widths, int) else widths
    print(f"\n{'':{label_width}s}" + "".join(f"{c:>{w}s}" for c, w in zip(columns, widths)))
    for label, fmt, values in rows:
        cells = (fmt.format(v) if v is not None else "n/a" for v in values)
        print(f"{label:{label_width}s}" + "".join(f"{c:>{w}s}" for c, w in zip(cells, widths)))


def offline_env() -> None:
    """No call to the Hub, quiet TRL warnings (set before transformers / TRL are imported)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def load_policy(model: str, dtype: str, device: str):
    """``(model, tokenizer)``: "smollm2" (offline SmolLM2-135M-Instruct), "random-<size>" (random weights of a size in
    ``MODEL_SIZES`` with SmolLM2's tokenizer) or a local model directory. The tokenizer gets TRL's Qwen2.5 tool
    template (ChatML, the tokens SmolLM2 was trained on)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl.chat_template_utils import qwen2_5_chat_template

    from trl_multiturn.models import load_smollm2, load_tokenizer_offline

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    if model == "smollm2":
        policy, tok = load_smollm2(dtype=torch_dtype)
    elif model.startswith("random-"):
        size = model.removeprefix("random-")
        if size not in MODEL_SIZES:
            raise ValueError(f"--model {model!r}: unknown size {size!r}; choose one of {sorted(MODEL_SIZES)}.")
        hidden, inter, layers, heads, kv = MODEL_SIZES[size]
        tok = load_tokenizer_offline()
        config = LlamaConfig(
            vocab_size=len(tok), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=8192, tie_word_embeddings=True,
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            policy = LlamaForCausalLM(config).to(torch_dtype)
        policy.generation_config.eos_token_id = tok.eos_token_id
        policy.generation_config.pad_token_id = tok.pad_token_id
    else:
        policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype)
        tok = AutoTokenizer.from_pretrained(model)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
    tok.chat_template = qwen2_5_chat_template
    return policy.to(device).eval(), tok


# ---------------------------------------------------------------------------------------------------------------
# Environment: one TRL-style class for both sides
# ---------------------------------------------------------------------------------------------------------------


class EnvClock:
    """Seconds spent inside environment calls (all threads)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.seconds = 0.0
        self.calls = 0

    def add(self, seconds: float) -> None:
        with self._lock:
            self.seconds += seconds
            self.calls += 1

    def reset(self) -> None:
        with self._lock:
            self.seconds, self.calls = 0.0, 0


def make_search_env_class(retriever, topk: int, latency: float, clock: EnvClock):
    """A TRL 1.16 ``environment_factory`` class: ``reset(**row)``, the tool ``search``, ``get_reward``."""
    from trl_multiturn.search.environment import render_documents

    class SearchTool:
        def reset(self, **row) -> None:
            self.searches = 0
            return None

        def search(self, query: str) -> str:
            """Search the knowledge base and return the top documents.

            Args:
                query: what to look for
            """
            start = time.perf_counter()
            if latency > 0:
                time.sleep(latency)  # a retrieval server's round trip
            docs = retriever.retrieve([query], topk)[0]
            self.searches += 1
            clock.add(time.perf_counter() - start)
            return render_documents(docs)

        def get_reward(self) -> float:
            return 0.0

    return SearchTool


# ---------------------------------------------------------------------------------------------------------------
# Scripts: what each trajectory writes at each turn
# ---------------------------------------------------------------------------------------------------------------


def turn_texts(example: dict, turns: int, rng: random.Random, min_think: int, max_think: int) -> list[str]:
    """The texts of one trajectory: ``turns - 1`` searches, then the answer (each preceded by a thought of
    ``min_think`` to ``max_think`` filler words)."""
    texts = []
    queries = [example["question"], example.get("subject") or example["question"], example["golden_answers"][0]]
    for k in range(turns):
        think = " ".join(FILLER[: rng.randint(min_think, max_think)])
        if k < turns - 1:
            call = json.dumps({"name": "search", "arguments": {"query": queries[k % len(queries)]}})
            texts.append(f"{think}.\n<tool_call>\n{call}\n</tool_call>")
        else:
            texts.append(f"{think}. The answer is {example['golden_answers'][0]}.")
    return texts


@dataclass
class Workload:
    examples: list[dict]  # dataset rows (with "prompt" messages)
    scripts: dict[tuple[int, ...], list[list[int]]]  # prompt ids -> per-turn forced ids (EOS included)
    prompt_ids: list[list[int]]


class ScriptedToolCalls:
    """``fn(row_ids, logits) -> logits`` forcing each row's script (see module docstring)."""

    def __init__(self, tokenizer, scripts: dict[tuple[int, ...], list[list[int]]]):
        self.scripts = scripts
        self.marker = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id
        self._first_marker_end: dict[int, int] = {}

    def _markers(self, ids: list[int]) -> tuple[int, int, int]:
        """(end of the first marker, end of the last marker, number of markers)."""
        m, n = self.marker, len(self.marker)
        first = last = -1
        count, i = 0, 0
        while True:
            try:
                i = ids.index(m[0], i)  # jumps at C speed between <|im_start|> tokens
            except ValueError:
                return first, last, count
            if ids[i : i + n] == m:
                count += 1
                last = i + n
                first = last if first < 0 else first
            i += 1

    def next_token(self, ids: list[int]) -> int:
        start = 0
        while start < len(ids) and ids[start] == self.pad:  # left padding (TRL's batches)
            start += 1
        ids = ids[start:]
        first, last, count = self._markers(ids)
        script = self.scripts.get(tuple(ids[:first]))
        if script is None:
            raise KeyError("a row's prompt is not one of the workload's prompts; the scripts cannot force it.")
        turn = script[min(count - 1, len(script) - 1)]
        position = len(ids) - last
        return turn[position] if position < len(turn) else self.eos

    def __call__(self, rows: list[list[int]], logits: torch.Tensor) -> torch.Tensor:
        forced = torch.full_like(logits, float("-inf"))  # (A, V)
        for a, ids in enumerate(rows):
            forced[a, self.next_token(ids)] = 0.0
        return forced


def hf_logits_processor(script: ScriptedToolCalls):
    """The same forcing as a transformers ``LogitsProcessor`` (for ``model.generate``)."""
    from transformers import LogitsProcessor

    class _Forced(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return script(input_ids.tolist(), scores)

    return _Forced()


def build_workload(
    tokenizer,
    num_trajectories: int,
    turns: int,
    seed: int = 0,
    min_think: int = 4,
    max_think: int = 40,
    group_size: int = 1,
    min_turns: int | None = None,
) -> tuple[Workload, object]:
    """Questions from the offline search dataset, their prompts and scripts; returns ``(workload, retriever)``.

    ``num_trajectories / group_size`` questions, each repeated ``group_size`` times in a row (a GRPO group, as
    TRL's sampler orders them); the members of a group share their prompt, hence their script. Each question gets
    ``turns`` turns, or a number drawn in ``[min_turns, turns]`` when ``min_turns`` is given."""
    if num_trajectories % group_size:
        raise ValueError(f"--trajectories {num_trajectories} must be a multiple of --group-size {group_size}.")
    from trl_multiturn.protocols import ChatToolProtocol
    from trl_multiturn.search import BM25Retriever, build_offline_dataset

    data = build_offline_dataset(num_entities=max(100, 4 * num_trajectories), seed=seed)
    retriever = BM25Retriever(data.corpus)
    rng = random.Random(seed)
    rows = [dict(data.train[i // group_size]) for i in range(num_trajectories)]
    protocol = ChatToolProtocol(max_observation_tokens=None)
    probe = make_search_env_class(retriever, 3, 0.0, EnvClock())()
    examples, scripts, prompt_ids = [], {}, []
    for row in rows:
        row = {k: v for k, v in row.items() if v is not None}
        row["prompt"] = [{"role": "user", "content": f"Answer the question, searching as needed. {row['question']}"}]
        ids = protocol.prompt_ids(tokenizer, row["prompt"], tools=[probe.search])
        if tuple(ids) not in scripts:
            scripts[tuple(ids)] = [
                list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
                for text in turn_texts(
                    row, turns if min_turns is None else rng.randint(min_turns, turns), rng, min_think, max_think
                )
            ]
        examples.append(row)
        prompt_ids.append(ids)
    return Workload(examples, scripts, prompt_ids), retriever


class ForwardCounter:
    """Counts what every forward of a model computes: calls, query positions (padding included) and real tokens
    (attention-mask ones among the queries), split into prefill (more than one query per row) and decode."""

    def __init__(self, model):
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)
        self.reset()

    def reset(self) -> None:
        self.counts = {"prefill_calls": 0, "prefill_positions": 0, "prefill_tokens": 0, "decode_calls": 0,
                       "decode_positions": 0, "decode_tokens": 0}

    def _hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            return
        rows, q = ids.shape
        mask = kwargs.get("attention_mask")
        real = int(mask[:, -q:].sum()) if mask is not None and mask.dim() == 2 else rows * q
        kind = "prefill" if q > 1 else "decode"
        self.counts[f"{kind}_calls"] += 1
        self.counts[f"{kind}_positions"] += rows * q
        self.counts[f"{kind}_tokens"] += real

    def close(self) -> None:
        self.handle.remove()
