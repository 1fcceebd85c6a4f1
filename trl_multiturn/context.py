"""Context functions: what of the conversation so far the model sees at its next turn (per-turn layout only).

A context function maps the rollout's message history to the messages the next turn is rendered from
(``Callable[[list[dict]], list[dict]]``); it returns new messages and never changes its input. The history holds the
prompt messages, then per turn an ``assistant`` message (``content``: the sampled text, ``ids``: the sampled ids) and,
when the environment answered, a ``tool`` message (``content``: the environment's text; ``action``, ``name``: what the
protocol needs to render it). Give one as ``RolloutConfig(turn_layout="per_turn", context_fn=...)``: each turn is
then generated from, and trained on, ``protocol.render_context(tokenizer, context_fn(history), tools)``.

Two policies are provided; both rewrite only ``tool`` messages, so earlier turns' sampled ids stay as they were:

* :func:`keep_last_observations` -- observations older than the last ``n`` are replaced by
  :data:`OBSERVATION_PLACEHOLDER`.
* :func:`truncate_observations` -- every observation but the most recent is cut to ``max_tokens`` tokens followed by
  the package's visible ``TRUNCATION_MARKER``.

:func:`context_policy` builds the one context function a trainer passes to its rollout from the configuration's
``keep_last_observations`` / ``truncate_observations`` fields and a user's own ``context_fn``.

Both are stable from turn to turn (an observation, once rewritten, is rewritten the same way at every later turn), so
consecutive contexts share their prefix up to the observation rewritten last and the generator's cached K/V of that
prefix are reused.
"""

from __future__ import annotations

from typing import Any, Callable

from .protocols import truncate_text

#: a context function: the message history -> the messages the next turn sees (never mutating its input)
ContextFn = Callable[[list[dict]], list[dict]]

#: the content that :func:`keep_last_observations` puts in place of an older observation
OBSERVATION_PLACEHOLDER = "[earlier result removed]"


def _observation_positions(messages: list[dict]) -> list[int]:
    """Indices of the observation (``tool``) messages, oldest first."""
    return [i for i, m in enumerate(messages) if m.get("role") == "tool"]


def _check_count(name: str, value, minimum: int, fix: str) -> None:
    """Raise ``ValueError`` unless ``value`` is an integer >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}. {fix}")


def keep_last_observations(n: int) -> ContextFn:
    """A context function that keeps the last ``n`` observations and replaces the content of every older one with
    :data:`OBSERVATION_PLACEHOLDER` (``"[earlier result removed]"``). The message itself stays, so the model still
    sees that a tool answered, and the prompt and assistant turns are untouched.

    Args:
        n: how many of the most recent observations keep their text (0 replaces all of them).

    Returns:
        The context function.
    """
    _check_count("keep_last_observations(n)", n, 0,
                 "Give how many of the most recent observations to keep, e.g. keep_last_observations(2).")

    def context(messages: list[dict]) -> list[dict]:
        observations = _observation_positions(messages)
        old = set(observations[: max(len(observations) - n, 0)])
        return [{**m, "content": OBSERVATION_PLACEHOLDER} if i in old else dict(m) for i, m in enumerate(messages)]

    return context


def truncate_observations(max_tokens: int, tokenizer) -> ContextFn:
    """A context function that cuts every observation but the most recent to its first ``max_tokens`` tokens (counted
    with ``tokenizer``) followed by ``TRUNCATION_MARKER``; shorter observations and the most recent one are kept
    whole. The protocol's own ``max_observation_tokens`` still applies to every observation on top of this.

    Args:
        max_tokens: the most tokens an older observation keeps (>= 1).
        tokenizer: the policy's tokenizer.

    Returns:
        The context function.
    """
    _check_count("truncate_observations(max_tokens)", max_tokens, 1,
                 "Give the tokens an older observation keeps, e.g. truncate_observations(64, tokenizer), or use "
                 "keep_last_observations(n) to remove older observations.")
    if not callable(tokenizer) or not callable(getattr(tokenizer, "decode", None)):
        raise ValueError(
            f"truncate_observations needs the policy's tokenizer to count tokens; got {type(tokenizer).__name__}. "
            "Pass truncate_observations(max_tokens, tokenizer)."
        )

    def context(messages: list[dict]) -> list[dict]:
        older = set(_observation_positions(messages)[:-1])
        return [
            {**m, "content": truncate_text(tokenizer, m["content"], max_tokens)[0]} if i in older else dict(m)
            for i, m in enumerate(messages)
        ]

    return context


def context_policy(args: Any, tokenizer, context_fn: ContextFn | None = None) -> ContextFn | None:
    """The context function of a run: the user's ``context_fn``, then ``truncate_observations(args.
    truncate_observations, tokenizer)``, then ``keep_last_observations(args.keep_last_observations)``, each applied to
    the previous one's output, for those that are set (truncating before replacing, so a placeholder is never cut).

    Args:
        args: the training configuration; its ``keep_last_observations`` and ``truncate_observations`` fields (read
            with ``getattr``, None when absent) are the policies' arguments, None for off.
        tokenizer: the policy's tokenizer (counts tokens for ``truncate_observations``).
        context_fn: the user's own context function, or None.

    Returns:
        The composed context function, or None when nothing is set.
    """
    fns: list[ContextFn] = [] if context_fn is None else [context_fn]
    if getattr(args, "truncate_observations", None) is not None:
        fns.append(truncate_observations(args.truncate_observations, tokenizer))
    if getattr(args, "keep_last_observations", None) is not None:
        fns.append(keep_last_observations(args.keep_last_observations))
    if len(fns) <= 1:
        return fns[0] if fns else None

    def context(messages: list[dict]) -> list[dict]:
        for fn in fns:
            messages = fn(messages)
        return messages

    return context
