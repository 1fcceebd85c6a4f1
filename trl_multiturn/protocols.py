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

Per-turn layout: :meth:`Protocol.render_context` turns a message history (the prompt messages, then each turn's
``assistant`` message and the ``tool`` message holding the environment's answer) into the ids a deployed model is
given for the next turn. ``TagProtocol`` reuses the sampled ids of every assistant message whose text is unchanged, so
without a context function its rendering equals the single sequence; ``ChatToolProtocol`` renders the conversation
through the chat template, so a thinking template drops earlier ``<think>`` blocks as it does at deployment.

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


#: keys of a rollout's history messages that only the rollout and the protocols read (never given to a chat template)
_PRIVATE_KEYS = ("ids", "action")


def prompt_messages(prompt: Any) -> list[dict]:
    """The chat messages of what ``Environment.reset`` returned: a string is one user message.

    Args:
        prompt: a string, or a list of chat messages (dicts with a ``role``).

    Returns:
        A new list of shallow copies of the messages.
    """
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
        return [dict(m) for m in prompt]
    raise ValueError(
        f"Environment.reset must return a string or a list of chat messages with a 'role'; got {type(prompt)!r}: "
        f"{str(prompt)[:100]!r}."
    )


def _chat_template_ids(tokenizer, messages: list[dict], tools: list | None) -> list[int]:
    """``apply_chat_template`` with the assistant generation prompt, tokenized, as a plain list of ids."""
    kwargs = {"tools": tools} if tools else {}
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)


def _render_prompt_ids(tokenizer, prompt, use_chat_template: bool, tools: list | None = None) -> list[int]:
    """Token ids of the initial context ``u_1`` (with the assistant generation prompt when a template is used)."""
    messages = prompt_messages(prompt)
    if use_chat_template:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "The tokenizer has no chat template but the protocol was created with use_chat_template=True. "
                "Set tokenizer.chat_template, or create the protocol with use_chat_template=False."
            )
        return _chat_template_ids(tokenizer, messages, tools)
    text = "\n\n".join(m["content"] for m in messages if isinstance(m.get("content"), str))
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def truncate_text(tokenizer, text: str, max_tokens: int | None) -> tuple[str, bool]:
    """Cut ``text`` to its first ``max_tokens`` tokens followed by :data:`TRUNCATION_MARKER`.

    Args:
        tokenizer: the policy's tokenizer (counts the tokens).
        text: the text to cut.
        max_tokens: the most tokens kept; None keeps everything.

    Returns:
        ``(text, truncated)``: the text, cut or not, and whether it was cut.
    """
    if max_tokens is None:
        return text, False
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text, False
    return tokenizer.decode(ids[:max_tokens]) + TRUNCATION_MARKER, True


def _prompt_length(messages: list[dict]) -> int:
    """How many leading messages form the prompt: those before the first assistant or tool message."""
    for n, m in enumerate(messages):
        if m.get("role") in ("assistant", "tool"):
            return n
    return len(messages)


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

    # ---- per-turn contexts ----
    def render_context(self, tokenizer, messages: list[dict], tools: list | None = None) -> list[int]:
        """The ids a deployed model is given for its next turn, rendered from a message history.

        ``messages`` are the prompt messages, then per turn ``{"role": "assistant", "content": text, "ids": sampled
        ids}`` and ``{"role": "tool", "content": observation text, "action": Action, "name": tool name}`` (the
        environment's text, before the protocol sanitizes or truncates it). Used by the rollout's per-turn layout
        (``RolloutConfig(turn_layout="per_turn")``); a protocol that does not override it supports only the sequence
        layout.

        Args:
            tokenizer: the policy's tokenizer.
            messages: the history, possibly rewritten by a context function.
            tools: tool definitions rendered into the prompt (the environment's ``tools``).

        Returns:
            The context ids, ending where the policy starts writing.
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not implement render_context, which the per-turn layout needs. Use "
            "RolloutConfig(turn_layout='sequence'), or implement render_context(tokenizer, messages, tools)."
        )

    def validate(self, tokenizer) -> None:
        """Raise ``ValueError`` when the protocol cannot work with this tokenizer."""

    # ---- shared helpers ----
    def _truncate(self, tokenizer, text: str) -> tuple[str, bool]:
        """Cut an observation to ``max_observation_tokens`` tokens, with a visible marker."""
        return truncate_text(tokenizer, text, self.max_observation_tokens)


def _assistant_ids(tokenizer, message: dict) -> list[int]:
    """The sampled ``ids`` of an assistant message whose ``content`` still decodes from them; its re-tokenized
    ``content`` when a context function changed the text (or no ids were kept)."""
    ids = message.get("ids")
    if ids is not None and tokenizer.decode(ids, skip_special_tokens=True) == message["content"]:
        return list(ids)
    return list(tokenizer(message["content"], add_special_tokens=False)["input_ids"])


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

    def render_context(self, tokenizer, messages: list[dict], tools: list | None = None) -> list[int]:
        """``prompt_ids`` of the prompt messages, then each turn inline as the single sequence holds it: an assistant
        message's sampled ``ids`` while its ``content`` is unchanged (its text re-tokenized when a context function
        changed it), an observation through :meth:`observation_ids` (sanitized, truncated, in the invalid-action
        template when its ``action`` was invalid). Without a context function this is the single sequence itself."""
        n = _prompt_length(messages)
        if n == 0:
            raise ValueError("TagProtocol.render_context needs the prompt messages first; the history starts with "
                             f"a {messages[0].get('role') if messages else 'missing'!r} message.")
        ids = self.prompt_ids(tokenizer, messages[:n], tools)  # (P,)
        for m in messages[n:]:
            if m.get("role") == "assistant":
                ids += _assistant_ids(tokenizer, m)  # the turn's sampled ids
            elif m.get("role") == "tool":
                ids += self.observation_ids(tokenizer, m["content"], m.get("action") or Action(kind="tool"))[0]
            else:
                raise ValueError(
                    f"TagProtocol.render_context got a {m.get('role')!r} message after the first turn; inline tags "
                    "have only assistant turns and tool observations after the prompt. A context function may rewrite "
                    "or drop messages but not add other roles."
                )
        return ids


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

    def render_context(self, tokenizer, messages: list[dict], tools: list | None = None) -> list[int]:
        """The chat template over the history with the generation prompt, tokenized: what a deployed model is given.
        Assistant messages are their text ``content`` (sampled ids are not reused: the template decides what an
        earlier turn looks like, e.g. without its ``<think>`` block); observations are ``observation_role`` messages
        holding the truncated text. With a ChatML template this reproduces the single sequence wherever the text of
        the sampled ids tokenizes back to them."""
        return _chat_template_ids(tokenizer, [self._chat_message(tokenizer, m) for m in messages], tools)

    def _chat_message(self, tokenizer, message: dict) -> dict:
        """A history message as the chat template takes it (the rollout's private keys removed)."""
        if message.get("role") != "tool":
            return {k: v for k, v in message.items() if k not in _PRIVATE_KEYS}
        text, _ = self._truncate(tokenizer, message["content"])
        out = {"role": self.observation_role, "content": text}
        if self.observation_role == "tool" and message.get("name"):
            out["name"] = message["name"]
        return out
