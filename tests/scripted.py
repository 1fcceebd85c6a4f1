"""Scripted policies for tests: a language model that writes a fixed script, a generator that replays texts, a
one-shot environment, and two ChatML tool templates (``CHATML``; ``THINK_DROPPING``, which drops earlier ``<think>``
blocks as thinking templates do).

``ScriptedLM`` is a real ``torch.nn.Module`` with the causal-LM call signature used by the generation loop. It
puts all probability mass on the next token of a per-row script, chosen from the text it has generated since the
last context it was given, so a test controls exactly what the "policy" writes while the real generation loop,
stop strings and log-probs run unchanged.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import TrainerCallback

from trl_multiturn.environment import Step
from trl_multiturn.generation import GenerationOutput


@dataclass
class _Out:
    logits: torch.Tensor
    cache: object = None

    @property
    def past_key_values(self):
        return self.cache


class ScriptedLM(torch.nn.Module):
    """Writes ``turns[k]`` (token ids) at turn k of each row, then EOS. Records every context it was fed.

    ``turns`` may also be a callable ``turns(context_ids) -> list of turn scripts``, called at each turn's prefill,
    to give each row its own script (e.g. chosen by the question in the prompt)."""

    def __init__(self, turns, vocab_size: int, eos_token_id: int):
        super().__init__()
        self.turns = turns
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.contexts: list[list[int]] = []  # every prefilled context (padding removed), in order
        self.turn_of_row: list[int] = []

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=True, logits_to_keep=0, **kw):
        cache = kw.get("cache", kw.get("past_key_values"))
        if cache is None:  # prefill: a new turn for every row
            rows = []
            for r in range(input_ids.size(0)):
                ids = input_ids[r][attention_mask[r].bool()].tolist()
                self.contexts.append(ids)
                turn = sum(1 for c in self.contexts if c[: len(ids)] == ids[: len(c)]) - 1
                rows.append({"turn": turn, "pos": 0, "script": self.turns(ids) if callable(self.turns) else self.turns})
            cache = {"rows": rows}
        else:
            for row in cache["rows"]:
                row["pos"] += 1
        logits = torch.full((input_ids.size(0), 1, self.vocab_size), -1e4)
        for r, row in enumerate(cache["rows"]):
            script = row["script"][min(row["turn"], len(row["script"]) - 1)]
            token = script[row["pos"]] if row["pos"] < len(script) else self.eos_token_id
            logits[r, 0, token] = 1e4
        return _Out(logits=logits + 0 * self.dummy, cache=cache)


class ReplayGenerator:
    """A generation backend that replays fixed texts per turn (for environment and rollout tests)."""

    def __init__(self, tokenizer, turns: list[str], finish_reason: str = "stop"):
        self.tokenizer = tokenizer
        self.turns = turns
        self.finish_reason = finish_reason
        self.calls = 0
        self.contexts: list[list[list[int]]] = []

    def generate(self, contexts, max_new_tokens, params):
        self.contexts.append([list(c) for c in contexts])
        text = self.turns[min(self.calls, len(self.turns) - 1)]
        self.calls += 1
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        outs = []
        limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(contexts)
        for limit in limits:
            cut = ids[:limit]
            reason = self.finish_reason if len(cut) == len(ids) else "length"
            outs.append(GenerationOutput(ids=list(cut), logprobs=[-0.5] * len(cut), finish_reason=reason))
        return outs


#: a ChatML tool template written out (DROP_THINK is replaced below): assistant messages with their tool calls, tool
#: results as ``<tool_response>`` user messages
_TEMPLATE = """
{%- for message in messages %}
  {%- set content = message.content if message.content is string else '' %}
  {%- if message.role == 'assistant' %}
    {%- if DROP_THINK and not loop.last and '</think>' in content %}
      {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
    {%- endif %}
    {{- '<|im_start|>assistant\\n' + content }}
    {%- for call in message.tool_calls or [] %}
      {%- set call = call.function if call.function else call %}
      {{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' + (call.arguments | tojson) }}
      {{- '}\\n</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>\\n' }}
  {%- elif message.role == 'tool' %}
    {{- '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}
  {%- else %}
    {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
#: renders every assistant message as it was written: keeps the prefix property
CHATML = _TEMPLATE.replace("DROP_THINK", "false")
#: drops the ``<think>...</think>`` block of every assistant message but the last, as thinking templates do
#: (DeepSeek-R1, QwQ; Qwen3 before the last user message)
THINK_DROPPING = _TEMPLATE.replace("DROP_THINK", "true")


def with_template(tokenizer, template: str):
    """A copy of the shared tokenizer with another chat template."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


class OneShotEnv:
    """Searches ``example["searches"]`` times (each tool call gets the observation "doc"), then any action ends the
    episode with reward 1: trajectories that end after different numbers of turns."""

    def reset(self, example):
        self.left = example["searches"]
        return "Question"

    def step(self, action):
        if action.kind == "tool" and self.left > 0:
            self.left -= 1
            return Step(observation="doc")
        return Step(reward=1.0, done=True)


def logged(trainer, key):
    """Every value the trainer logged under ``key``, in order."""
    return [h[key] for h in trainer.state.log_history if key in h]


class Recorder:
    """Keeps every rollout (list of trajectories) and every scored batch the trainer produced."""

    def __init__(self, trainer):
        self.rollouts, self.batches = [], []
        run, score = trainer.rollout.run, trainer._generate_and_score_completions

        def run_and_keep(*a, **k):
            out = run(*a, **k)
            self.rollouts.append(out)
            return out

        def score_and_keep(*a, **k):
            out = score(*a, **k)
            self.batches.append(out)
            return out

        trainer.rollout.run = run_and_keep
        trainer._generate_and_score_completions = score_and_keep


class SnapshotAfterFirstStep(TrainerCallback):
    """Keeps a copy of the model's parameters as they were after the first optimizer step."""

    def __init__(self, model):
        self.model, self.state = model, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.state = copy.deepcopy(self.model.state_dict())
