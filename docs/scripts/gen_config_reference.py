"""Generate docs/configuration.md from the ``MultiTurnGRPOConfig`` dataclass.

    python docs/scripts/gen_config_reference.py           # rewrite docs/configuration.md
    python docs/scripts/gen_config_reference.py --check   # exit 1 when docs/configuration.md is out of date

The page lists every field ``MultiTurnGRPOConfig`` adds to TRL's ``GRPOConfig`` (grouped by the ``# > Parameters
that control ...`` comments of trl_multiturn/config.py, with the ``help`` text users also see in ``--help``), then the
TRL fields that matter most for multi-turn training, with TRL's own help text and a note on how this trainer uses
them. Defaults are the dataclass defaults, before ``__post_init__`` derives anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import sys
import textwrap
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

PAGE = Path(__file__).resolve().parents[1] / "configuration.md"

#: TRL fields worth knowing for multi-turn training, by section; the note says how this trainer uses each one.
TRL_FIELDS: dict[str, list[tuple[str, str]]] = {
    "Sampling and rollout size": [
        ("num_generations", "G, the group size. Set by the batch plan when `prompts_per_rollout` is given."),
        ("max_completion_length", "The token budget of a whole trajectory: actions AND observations after the "
                                  "prompt. Must be a positive int."),
        ("temperature", "Sampling temperature of every turn; log-probs are taken under `logits / temperature`."),
        ("top_p", "Nucleus filtering of every turn."),
        ("top_k", "Top-k filtering of every turn (0 = off)."),
        ("generation_batch_size", "Derived (B*G) when the batch plan is used; leave unset."),
        ("steps_per_generation", "Derived by the batch plan: micro-batches per device per rollout."),
    ],
    "Optimization": [
        ("learning_rate", ""),
        ("per_device_train_batch_size", "Set by the batch plan to `micro_batch_size`."),
        ("gradient_accumulation_steps", "Set by the batch plan to `mini_batch_size / (micro_batch_size * world_size)`."),
        ("num_iterations", "Set from `ppo_epochs` when that is given."),
        ("max_grad_norm", "Clipping threshold; the logged `grad_norm` is the norm before clipping."),
        ("max_steps", "Optimizer steps (mini-batches), not rollouts."),
        ("gradient_checkpointing", "On by default in TRL; turn it off on small CPU runs to save a forward pass."),
        ("bf16", "This config sets it to False unless a CUDA device supports bf16."),
    ],
    "Loss and advantages": [
        ("epsilon", "`eps_low` of the clip range `[1 - epsilon, 1 + epsilon_high]`."),
        ("epsilon_high", "`eps_high`; defaults to `epsilon`."),
        ("beta", "Weight of the KL penalty to the reference model (k3 estimator), aggregated like the policy loss; "
                 "logged as `loss/kl`."),
        ("scale_rewards", "Advantage scale: 'group' (GRPO), 'batch', 'none' (Dr. GRPO); used by this trainer's own "
                          "advantages."),
        ("reward_weights", "One weight per entry of `reward_funcs`; the environment reward is appended with weight 1."),
        ("loss_type", "Mapped onto `loss_aggregation` when set: 'grpo' -> 'seq-mean-token-mean', 'dr_grpo' -> "
                      "'seq-mean-token-sum-norm', 'dapo' and 'bnpo' -> 'token-mean'. Unset here (None): the project "
                      "default 'seq-mean-token-mean' applies, not TRL's 'dapo'. A disagreeing `loss_aggregation` "
                      "raises; 'cispo', 'sapo', 'vespo', 'luspo' are refused."),
        ("delta", "Two-sided clipping: the unclipped ratio is capped at `delta`."),
        ("importance_sampling_level", "'token' or 'sequence' (GSPO: one ratio per trajectory)."),
        ("use_bias_correction_kl", "With `beta != 0`, the per-token KL is weighted by the importance ratio, as TRL."),
        ("mask_truncated_completions", "Applied by this trainer, not by TRL's EOS test (a multi-turn trajectory "
                                       "ends on `</answer>` or `done` without EOS): True drops from the loss the "
                                       "trajectories cut by a token limit, `max_completion_length` or the model's "
                                       "context (`rollout/truncated_frac`); a trajectory that used up `max_turns` is "
                                       "complete and keeps its loss (see [what truncated means]"
                                       "(trainer.md#what-truncated-means))."),
        ("disable_dropout", "Default True here (TRL: False), so the recomputed old log-probs match and the ratio is "
                            "exactly 1 on a fresh rollout."),
    ],
    "Logging": [
        ("logging_steps", "TRL averages every `loss/*`, `rollout/*`, `env/*` metric over the window; `grad_norm` "
                          "is the last step's."),
        ("report_to", ""),
        ("log_completions", ""),
        ("seed", "Also seeds the rollout's sampling generator."),
    ],
}


def _fields():
    from trl import GRPOConfig

    from trl_multiturn.config import MultiTurnGRPOConfig

    own = {f.name: f for f in dataclasses.fields(MultiTurnGRPOConfig)}
    base = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    return own, base, MultiTurnGRPOConfig


def _sections(cls, names: set[str]) -> list[tuple[str, list[str]]]:
    """The fields of ``names`` in source order, grouped under the class body's ``# > ...`` comments."""
    sections: list[tuple[str, list[str]]] = [("Other parameters", [])]
    for line in inspect.getsource(cls).splitlines():
        header = re.match(r"\s*# > (.+)", line)
        if header:
            sections.append((header.group(1).strip(), []))
            continue
        name = re.match(r"\s{4}(\w+)\s*:", line)
        if name and name.group(1) in names:
            sections[-1][1].append(name.group(1))
    return [(title, fields) for title, fields in sections if fields]


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return f"`{f.default!r}`"
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f"`{f.default_factory()!r}`"  # type: ignore[misc]
    return "required"


def _type(f: dataclasses.Field) -> str:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return f"`{t}`".replace("|", "\\|")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    own, base, cls = _fields()
    added = {name for name in own if name not in base}
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by docs/scripts/gen_config_reference.py from trl_multiturn/config.py; do not edit by hand. -->",
        "",
        "`MultiTurnGRPOConfig` is TRL's `GRPOConfig` plus the fields below. Every field is a keyword argument, a",
        "`--flag` of `TrlParser` and a key of a YAML config. The formulas behind the loss and advantage fields are on",
        "[the math page](math.md) and [the turn credit page](turn_credit.md); the batch knobs on",
        "[batching](batching.md).",
        "",
        "## Fields added by MultiTurnGRPOConfig",
        "",
    ]
    for title, names in _sections(cls, added):
        out += [f"### {title}", "", "| field | type | default | help |", "|---|---|---|---|"]
        for name in names:
            f = own[name]
            out.append(f"| `{name}` | {_type(f)} | {_default(f)} | {_cell(f.metadata.get('help', ''))} |")
        out.append("")
    out += [
        "### What `__post_init__` derives and checks",
        "",
        "- `prompts_per_rollout`, `mini_batch_size` and `micro_batch_size` are given together or not at all. When",
        "  given, `BatchPlan` checks them (with `num_generations`, `ppo_epochs` and `WORLD_SIZE`) and writes TRL's",
        "  `per_device_train_batch_size`, `gradient_accumulation_steps`, `steps_per_generation`, `num_iterations` and",
        "  `num_generations`; the plan is kept as `config.batch_plan` (`print(config.batch_plan.describe())`).",
        "- Without them, `ppo_epochs` (when given) sets `num_iterations`, and TRL's own batch fields apply.",
        "- `loss_aggregation`, `turn_advantage`, `max_turns >= 1` and `max_completion_length >= 1` are validated.",
        "- `loss_type` (TRL's name) is mapped onto `loss_aggregation`; both set and disagreeing raises.",
        "- `steps_per_generation` (set or derived from `generation_batch_size`) must be a multiple of",
        "  `gradient_accumulation_steps`, so that a rollout holds whole optimizer steps.",
        "- Every field of `GRPOConfig` this trainer does not honor raises when it differs from TRL's default (table",
        "  below); the trainer's constructor checks again, for fields changed after the config was built.",
        "- `bf16` left unset becomes True only where a CUDA device supports bf16.",
        "",
        "## TRL fields that matter most",
        "",
        "Help text from TRL's `GRPOConfig` (first sentence), with how this trainer uses the field.",
        "",
    ]
    for title, entries in TRL_FIELDS.items():
        out += [f"### {title}", "", "| field | default | TRL's help | here |", "|---|---|---|---|"]
        for name, note in entries:
            f = base[name]
            help_text = _cell(f.metadata.get("help", ""))
            first = re.split(r"(?<=\.)\s", help_text, maxsplit=1)[0]
            out.append(f"| `{name}` | {_default(f)} | {first} | {_cell(note)} |")
        out.append("")
    out += _field_table(base)
    return "\n".join(out).rstrip() + "\n"


def _field_table(base: dict) -> list[str]:
    """Every field TRL's GRPOConfig adds to TrainingArguments: honored (how) or refused (what to use instead)."""
    from trl_multiturn.config import GRPO_FIELDS, HONORED, TRAINER_FIELDS

    out = [
        "## Every GRPOConfig field",
        "",
        "`MultiTurnGRPOTrainer` honors or refuses every field of TRL's `GRPOConfig`; a refused field raises when it",
        "differs from TRL's default (some honored fields refuse only the values named here). The",
        f"{len(TRAINER_FIELDS)} plain `TrainingArguments` fields (optimizer, schedule, logging, saving, precision,",
        "distribution) are applied by transformers' `Trainer` as usual. `tests/test_config_fields.py` fails when",
        "TRL or transformers adds a field that is not classified here.",
        "",
        "| field | TRL default | here | how, or what to use instead |",
        "|---|---|---|---|",
    ]
    for name, (status, note) in GRPO_FIELDS.items():
        verdict = "honored" if status == HONORED else "**refused**"
        out.append(f"| `{name}` | {_default(base[name])} | {verdict} | {_cell(note)} |")
    return out + [""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from the generated text")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = PAGE.read_text(encoding="utf-8") if PAGE.exists() else ""
        if current != text:
            print(f"{PAGE} is out of date; run: python docs/scripts/gen_config_reference.py", file=sys.stderr)
            return 1
        print(f"{PAGE} is up to date")
        return 0
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
