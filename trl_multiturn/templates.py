"""Does the chat template keep the prefix property? The check the trainer runs at construction.

The trainer trains a trajectory as ONE token sequence: turn k+1's context is turn k's context, the tokens sampled in
turn k and the observation's tokens (``ChatToolProtocol.observation_ids``), never re-rendered. A deployed agent loop
that calls ``apply_chat_template`` on the message history before every turn gives the model exactly that context
only if the template keeps the *prefix property*: the rendering of the conversation up to turn k is a token prefix of
its rendering up to turn k+1. Thinking templates break it: they drop the ``<think>`` blocks of earlier assistant
turns (DeepSeek-R1 and QwQ from every earlier turn; Qwen3 from the turns before the last user message, so from every
earlier turn when observations come back as ``user`` messages, and empty ``<think></think>`` blocks of earlier turns
always).

:func:`check_template_prefix` renders a probe conversation (system, user, then assistant turns that think inside
``<think>...</think>`` and call a tool, each answered by an observation, and a final answer) both ways: as the
trainer's single sequence (built with the protocol's own ``prompt_ids`` and ``observation_ids``, the tokens of each
assistant turn being the template's own rendering of that message, cut after EOS; where the protocol cannot find an
observation's template tokens, the template's rendering of it stands in) and as the template renders each turn's
context. It names the first turn whose two contexts differ, the token position and both sides.

``TagProtocol`` is not checked: it writes every turn inline in one assistant message, and an agent loop deployed
with it appends the same tokens; nothing is re-rendered.
"""

from __future__ import annotations

from dataclasses import dataclass

from .environment import Action
from .protocols import ChatToolProtocol, Protocol

#: tokens of each side shown in :meth:`TemplateCheck.explain`
SNIPPET_TOKENS = 16


@dataclass
class TemplateCheck:
    """What :func:`check_template_prefix` found.

    Attributes:
        keeps_prefix: every turn's context, as the trainer builds it, equals the chat template's rendering of the
            same messages (True also where the check does not apply).
        protocol: the protocol's class name.
        turns: assistant turns in the probe conversation (0 when the check does not apply).
        applies: False for protocols that do not render turns through the chat template (``TagProtocol``).
        turn: the first assistant turn (1-based) whose context differs, or None.
        position: the token position of the first difference inside that context, or None.
        before: decoded tokens just before ``position`` (the same on both sides).
        trained: decoded tokens from ``position`` in the trainer's single sequence.
        deployed: decoded tokens from ``position`` in the chat template's rendering.
    """

    keeps_prefix: bool
    protocol: str
    turns: int = 0
    applies: bool = True
    turn: int | None = None
    position: int | None = None
    before: str = ""
    trained: str = ""
    deployed: str = ""

    def explain(self) -> str:
        """A few lines for a person: the verdict and, when the property fails, where and how."""
        if not self.applies:
            return (f"Chat template check: not applicable to {self.protocol}, which writes every turn inline in one "
                    "assistant message; nothing is re-rendered through the chat template.")
        if self.keeps_prefix:
            return (f"Chat template check ({self.protocol}, {self.turns} assistant turns probed): the template keeps "
                    "the prefix property; each turn's context is the previous one plus the new tokens, so one "
                    "sequence per trajectory trains on what the deployed model sees.")
        return (
            f"Chat template check ({self.protocol}, {self.turns} assistant turns probed): the chat template does not "
            f"keep turn {self.turn - 1} a prefix of turn {self.turn}. The context of assistant turn {self.turn} as the "
            f"trainer builds it (one sequence: earlier turns as sampled) and as the template renders the same "
            f"messages first differ at token {self.position}, after {self.before!r}:\n"
            f"  trained on: {self.trained!r}\n"
            f"  deployed:   {self.deployed!r}"
        )


def probe_messages(observation_role: str = "tool") -> list[dict]:
    """The probe conversation: system, user, a turn that thinks and calls a tool, a turn that calls a tool after an
    empty ``<think>`` block (as thinking models write with thinking off), each answered by an observation in
    ``observation_role``, and a turn that thinks and answers."""
    def call(query: str) -> dict:
        return {"type": "function", "function": {"name": "search", "arguments": {"query": query}}}

    def observation(text: str) -> dict:
        return {"role": observation_role, "content": text, **({"name": "search"} if observation_role == "tool" else {})}

    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Who wrote the novel Solaris?"},
        {"role": "assistant", "content": "<think>\nI should look this up.\n</think>\n\n",
         "tool_calls": [call("Solaris")]},
        observation("Solaris is a 1961 novel."),
        {"role": "assistant", "content": "<think>\n\n</think>\n\n", "tool_calls": [call("Solaris novel author")]},
        observation("Solaris was written by Stanislaw Lem."),
        {"role": "assistant", "content": "<think>\nThe second result names him.\n</think>\n\nStanislaw Lem."},
    ]


def check_template_prefix(tokenizer, protocol: Protocol | None = None, tools: list | None = None) -> TemplateCheck:
    """Whether the trainer's single sequence per trajectory equals, at every turn, the context the tokenizer's chat
    template renders for the same messages (the prefix property), on :func:`probe_messages`.

    Args:
        tokenizer: a tokenizer with a chat template (and, for ``ChatToolProtocol``, an EOS token and tool support).
        protocol: the protocol the trainer uses (default ``ChatToolProtocol()``); protocols other than
            ``ChatToolProtocol`` and its subclasses do not re-render turns and give ``applies=False``.
        tools: tool definitions rendered into the prompt, as the rollout passes an environment's ``tools``.
    """
    protocol = ChatToolProtocol() if protocol is None else protocol
    name = type(protocol).__name__
    if not isinstance(protocol, ChatToolProtocol):
        return TemplateCheck(keeps_prefix=True, protocol=name, applies=False)
    messages = probe_messages(protocol.observation_role)
    starts = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    kwargs = {"tools": tools} if tools else {}
    stream = protocol.prompt_ids(tokenizer, messages[: starts[0]], tools)  # the trainer's sequence so far
    deployed = stream  # the turn's context as the template renders it
    for turn, start in enumerate(starts, 1):
        if stream != deployed:
            return _divergence(tokenizer, name, len(starts), turn, stream, deployed)
        if turn == len(starts):
            break
        context = tokenizer.apply_chat_template(messages[:start], add_generation_prompt=True, tokenize=False, **kwargs)
        rendered = tokenizer.apply_chat_template(messages[: start + 1], tokenize=False, **kwargs)
        if not rendered.startswith(context):  # the generation prompt is not how the template renders the message
            full = list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
            return _divergence(tokenizer, name, len(starts), turn + 1, stream, full)
        stream = stream + _sampled_ids(tokenizer, rendered[len(context):])
        deployed = protocol.prompt_ids(tokenizer, messages[: starts[turn]], tools)
        if deployed[: len(stream)] != stream:  # the template re-renders this turn (or an earlier one) differently
            return _divergence(tokenizer, name, len(starts), turn + 1, stream, deployed)
        call = messages[start]["tool_calls"][0]["function"]
        action = Action(kind="tool", text="", name=call["name"], arguments=call["arguments"])
        try:
            observation, _ = protocol.observation_ids(tokenizer, messages[start + 1]["content"], action)
        except ValueError:  # the protocol cannot find the observation's template tokens: the template's stand in
            observation = deployed[len(stream):]
        stream = stream + observation
    return TemplateCheck(keeps_prefix=True, protocol=name, turns=len(starts))


def _sampled_ids(tokenizer, text: str) -> list[int]:
    """The ids of an assistant message as the policy samples them: its rendering, up to and including EOS (what
    follows EOS belongs to the next message)."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    eos = tokenizer.eos_token_id
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def _divergence(tokenizer, protocol: str, turns: int, turn: int, trained: list[int], deployed: list[int]
                ) -> TemplateCheck:
    """The first position where ``trained`` and ``deployed`` differ (or where the shorter one ends), with snippets."""
    position = next((i for i, (a, b) in enumerate(zip(trained, deployed)) if a != b), min(len(trained), len(deployed)))

    def text(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    return TemplateCheck(
        keeps_prefix=False, protocol=protocol, turns=turns, turn=turn, position=position,
        before=text(trained[max(0, position - SNIPPET_TOKENS // 2) : position]),
        trained=text(trained[position : position + SNIPPET_TOKENS]),
        deployed=text(deployed[position : position + SNIPPET_TOKENS]),
    )
