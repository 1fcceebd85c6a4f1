"""How sampled text becomes an :class:`Action`, and how an observation becomes tokens.

A protocol is the only place that knows the surface format of actions. Two are provided:

* :class:`TagProtocol` -- Search-R1's inline tags inside ONE assistant message: the policy writes
  ``<think>...</think><search>query</search>``; generation stops at the closing tag; the environment's answer is
  inserted inline as ``\\n\\n<information>...</information>\\n\\n`` and generation resumes in the same message.
* :class:`ChatToolProtocol` -- JSON tool calls through the tokenizer's chat template (``<tool_call>{...}</tool_call>``
  in ChatML templates); the turn ends at EOS; the observation is a ``tool`` message rendered by the template, and
  every template token around it gets action mask 0.

Invariant (tested): the rollout never decodes and re-encodes what the policy sampled. A protocol only turns
environment text into ids (``observation_ids``) that are appended after the sampled ids, so the ids stored on a
trajectory are exactly the ids the model was conditioned on at every turn.

Departure from Search-R1: the invalid-action feedback and the observation never contain a parsable action (a small
model copies a literal ``<search> query </search>`` from feedback verbatim), and observations that contain the
protocol's own tags are neutralised before insertion.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import Any

from .environment import Action

TRUNCATION_MARKER = " ... [observation truncated]"

DEFAULT_INVALID_FEEDBACK = (
    "My previous action is invalid. To search, I should write my query inside search tags; to give the final "
    "answer, I should write it inside answer tags. Let me try again."
)


def _render_prompt_ids(tokenizer, prompt, use_chat_template: bool, tools: list | None = None) -> list[int]:
    """Token ids of the initial context ``u_1`` (with the assistant generation prompt when a template is used)."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
        messages = prompt
    else:
        raise ValueError(
            f"Environment.reset must return a string or a list of chat messages with a 'role'; got {type(prompt)!r}: "
            f"{str(prompt)[:100]!r}."
        )
    if use_chat_template:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "The tokenizer has no chat template but the protocol was created with use_chat_template=True. "
                "Set tokenizer.chat_template, or create the protocol with use_chat_template=False."
            )
        kwargs = {"tools": tools} if tools else {}
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)
    text = "\n\n".join(m["content"] for m in messages if isinstance(m.get("content"), str))
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


class Protocol(ABC):
    """Base class. Subclasses define the surface format of actions and observations."""

    #: generation of a turn stops at any of these strings (in addition to EOS)
    stop_strings: tuple[str, ...] = ()
    #: whether a turn ends at EOS (True for chat protocols, where EOS closes the assistant message)
    turn_ends_at_eos: bool = True

    def __init__(self, max_observation_tokens: int | None = None):
        self.max_observation_tokens = max_observation_tokens

    # ---- prompt ----
    @abstractmethod
    def prompt_ids(self, tokenizer, prompt: Any, tools: list | None = None) -> list[int]:
        """Ids of the initial context built from what ``Environment.reset`` returned."""

    # ---- actions ----
    @abstractmethod
    def parse(self, text: str, finished_by_eos: bool) -> Action:
        """Turn the text of one sampled turn into an :class:`Action` (never raises)."""

    # ---- observations ----
    @abstractmethod
    def observation_ids(self, tokenizer, observation: str, action: Action) -> tuple[list[int], dict]:
        """Ids inserted (mask 0) after the action, and a record of what was changed (truncation, sanitising)."""

    def validate(self, tokenizer) -> None:
        """Raise ``ValueError`` when the protocol cannot work with this tokenizer."""

    # ---- shared helpers ----
    def _truncate(self, tokenizer, text: str) -> tuple[str, bool]:
        """Cut an observation to ``max_observation_tokens`` tokens, with a visible marker."""
        if self.max_observation_tokens is None:
            return text, False
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= self.max_observation_tokens:
            return text, False
        return tokenizer.decode(ids[: self.max_observation_tokens]) + TRUNCATION_MARKER, True


class TagProtocol(Protocol):
    """Search-R1 inline tags in one assistant message.

    Args:
        tool_tags: tags that are tool calls; ``<search>q</search>`` becomes ``Action("tool", name="search",
            arguments={"query": q})``.
        answer_tag: the tag holding the final answer.
        observation_template: how an observation is inserted after a tool action (``{text}`` is replaced).
        invalid_template: how the feedback for an invalid action is inserted.
        reserved_tags: tags that may not appear inside an observation (neutralised to ``[tag]``).
        use_chat_template: render the first prompt through the tokenizer's chat template (as Search-R1 does).
        max_observation_tokens: observations longer than this are cut with a visible marker.
    """

    turn_ends_at_eos = True
    #: inline actions only end at a closing tag, so a TagProtocol without stop strings can never act
    requires_stop_strings = True

    def __init__(
        self,
        tool_tags: tuple[str, ...] = ("search",),
        answer_tag: str = "answer",
        observation_template: str = "\n\n<information>{text}</information>\n\n",
        invalid_template: str = "\n{text}\n",
        reserved_tags: tuple[str, ...] = ("information", "think"),
        use_chat_template: bool = True,
        max_observation_tokens: int | None = 512,
        argument_name: str = "query",
    ):
        super().__init__(max_observation_tokens)
        if not tool_tags and not answer_tag:
            raise ValueError("TagProtocol needs at least one tool tag or an answer tag; got neither.")
        for tag in (*tool_tags, answer_tag):
            if not re.fullmatch(r"[A-Za-z_][\w\-]*", tag or "_"):
                raise ValueError(f"TagProtocol tag {tag!r} is not a valid tag name (letters, digits, '_' or '-').")
        if "{text}" not in observation_template:
            raise ValueError(
                f"TagProtocol observation_template {observation_template!r} must contain '{{text}}' where the "
                "observation goes."
            )
        self.tool_tags = tuple(tool_tags)
        self.answer_tag = answer_tag
        self.observation_template = observation_template
        self.invalid_template = invalid_template
        self.use_chat_template = use_chat_template
        self.argument_name = argument_name
        tags = [*self.tool_tags, *([answer_tag] if answer_tag else [])]
        self.stop_strings = tuple(f"</{t}>" for t in tags)
        self.reserved_tags = tuple(dict.fromkeys((*tags, *reserved_tags)))
        alternatives = "|".join(re.escape(t) for t in tags)
        self._action_re = re.compile(rf"<({alternatives})>(.*?)</\1>", re.DOTALL)
        self._reserved_re = re.compile(
            r"</?(" + "|".join(re.escape(t) for t in self.reserved_tags) + r")>", re.IGNORECASE
        )

    def validate(self, tokenizer) -> None:
        if self.use_chat_template and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "TagProtocol(use_chat_template=True) needs a tokenizer with a chat template; this tokenizer has none. "
                "Set tokenizer.chat_template, or use TagProtocol(use_chat_template=False) to give the prompt as text."
            )

    def prompt_ids(self, tokenizer, prompt: Any, tools: list | None = None) -> list[int]:
        return _render_prompt_ids(tokenizer, prompt, self.use_chat_template)

    def parse(self, text: str, finished_by_eos: bool = False) -> Action:
        # The turn ends at the first closing action tag: act on the first complete action in the text.
        match = self._action_re.search(text)
        if match is None:
            return Action(kind="invalid", text=text, error="no complete action tag")
        tag, content = match.group(1), match.group(2).strip()
        if tag == self.answer_tag:
            return Action(kind="answer", text=text, content=content)
        if not content:
            return Action(kind="invalid", text=text, error=f"empty <{tag}> action")
        return Action(kind="tool", text=text, name=tag, arguments={self.argument_name: content})

    def sanitize(self, text: str) -> tuple[str, bool]:
        """Neutralise the protocol's own tags inside environment text (``<search>`` -> ``[search]``)."""
        cleaned = self._reserved_re.sub(lambda m: m.group(0).replace("<", "[").replace(">", "]"), text)
        return cleaned, cleaned != text

    def observation_ids(self, tokenizer, observation: str, action: Action) -> tuple[list[int], dict]:
        record: dict[str, Any] = {}
        text, record["observation_sanitized"] = self.sanitize(observation)
        text, record["observation_truncated"] = self._truncate(tokenizer, text)
        template = self.invalid_template if action.kind == "invalid" else self.observation_template
        rendered = template.replace("{text}", text)
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"]), record


_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ChatToolProtocol(Protocol):
    """JSON tool calls rendered and parsed through the tokenizer's chat template.

    The policy ends each assistant message with EOS. A message with a ``<tool_call>{"name", "arguments"}</tool_call>``
    block is a tool action; a message without one is the final answer. The observation is rendered as a ``tool``
    message (or ``user`` with ``observation_role="user"``) followed by the assistant generation prompt; those template
    tokens are computed once by diffing two renderings of a probe conversation and all get mask 0.

    Requires a chat template that can render tool calls and tool messages (SmolLM2's own cannot; TRL's bundled
    ``chat_templates/qwen2_5.jinja`` uses the same ChatML tokens and can: see ``trl_multiturn.models.tool_chat_template``).
    """

    stop_strings: tuple[str, ...] = ()
    turn_ends_at_eos = True

    def __init__(self, observation_role: str = "tool", max_observation_tokens: int | None = 512):
        super().__init__(max_observation_tokens)
        if observation_role not in ("tool", "user"):
            raise ValueError(f"ChatToolProtocol observation_role must be 'tool' or 'user'; got {observation_role!r}.")
        self.observation_role = observation_role
        self._affix_cache: dict[int, tuple[str, str]] = {}

    # -- template plumbing --
    def _affixes(self, tokenizer) -> tuple[str, str]:
        """(text before, text after) an observation, from the end of a sampled assistant message (after EOS)."""
        key = id(tokenizer)
        if key in self._affix_cache:
            return self._affix_cache[key]
        marker = "OBSERVATION_PLACEHOLDER_7f3a"
        call = {"type": "function", "function": {"name": "probe", "arguments": {"x": 1}}}
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        obs = {"role": self.observation_role, "content": marker}
        if self.observation_role == "tool":
            obs["name"] = "probe"
        try:
            prefix = tokenizer.apply_chat_template(base, tokenize=False)
            full = tokenizer.apply_chat_template(base + [obs], tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # template raised on tool messages
            raise ValueError(
                f"The tokenizer's chat template cannot render tool calls ({type(exc).__name__}: {exc}). Use a template "
                "that can, e.g. tokenizer.chat_template = trl_multiturn.models.tool_chat_template()."
            ) from exc
        if "probe" not in prefix:
            raise ValueError(
                "The tokenizer's chat template drops tool calls (an assistant message with tool_calls renders without "
                "them), so it cannot express a tool action. Use a template with tools, e.g. "
                "tokenizer.chat_template = trl_multiturn.models.tool_chat_template()."
            )
        eos = tokenizer.eos_token
        cut = prefix.rfind(eos)
        if eos is None or cut < 0 or not full.startswith(prefix[: cut + len(eos)]) or marker not in full:
            raise ValueError(
                "The tokenizer's chat template does not render a tool conversation as <assistant ... EOS> followed by "
                "the tool message; ChatToolProtocol cannot find the observation's template tokens. Use a ChatML tool "
                "template such as trl_multiturn.models.tool_chat_template()."
            )
        suffix = full[cut + len(eos) :]
        before, after = suffix.split(marker, 1)
        self._affix_cache[key] = (before, after)
        return before, after

    def validate(self, tokenizer) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "ChatToolProtocol needs a tokenizer with a chat template; this tokenizer has none. Set "
                "tokenizer.chat_template = trl_multiturn.models.tool_chat_template() (a ChatML template with tools)."
            )
        if tokenizer.eos_token is None:
            raise ValueError("ChatToolProtocol needs tokenizer.eos_token (the end of an assistant message); it is None.")
        self._affixes(tokenizer)

    def prompt_ids(self, tokenizer, prompt: Any, tools: list | None = None) -> list[int]:
        return _render_prompt_ids(tokenizer, prompt, True, tools=tools)

    def parse(self, text: str, finished_by_eos: bool = True) -> Action:
        match = _TOOL_CALL_RE.search(text)
        if match is None:
            if "<tool_call>" in text:
                return Action(kind="invalid", text=text, error="unterminated <tool_call>")
            return Action(kind="answer", text=text, content=text.strip())
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError as exc:
            return Action(kind="invalid", text=text, error=f"tool call is not valid JSON: {exc.msg}")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return Action(kind="invalid", text=text, error="tool call must be a JSON object with a string 'name'")
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return Action(kind="invalid", text=text, error="tool call 'arguments' is not a JSON object")
        if not isinstance(arguments, dict):
            return Action(kind="invalid", text=text, error="tool call 'arguments' must be a JSON object")
        return Action(kind="tool", text=text, name=call["name"], arguments=arguments)

    def observation_ids(self, tokenizer, observation: str, action: Action) -> tuple[list[int], dict]:
        record: dict[str, Any] = {}
        text, record["observation_truncated"] = self._truncate(tokenizer, observation)
        record["observation_sanitized"] = False
        before, after = self._affixes(tokenizer)
        ids = list(tokenizer(before + text + after, add_special_tokens=False)["input_ids"])
        if action.cut:
            # the cut message never sampled its EOS: close it (mask 0) as the chat template renders every message
            ids = [tokenizer.eos_token_id, *ids]
        return ids, record
