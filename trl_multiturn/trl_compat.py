"""Run environments written for TRL 1.16's ``environment_factory`` unchanged.

A TRL environment is a class with ``reset(**row) -> str | None`` (text appended to the last prompt message),
public methods that are exposed as tools, and optionally ``get_reward() -> float``. :class:`TRLEnvironmentAdapter`
wraps one instance into this package's contract: the prompt is the row's ``prompt`` plus what ``reset`` returned,
a tool action calls the method of that name with the parsed arguments, an answer ends the episode (rewarded by
``get_reward`` when defined), and the methods are handed to the chat template as the tool schema.
"""

from __future__ import annotations

import inspect
from typing import Any

from .environment import Action, Step


def is_trl_environment(obj: Any) -> bool:
    """True for TRL-style environments (``reset`` but no ``step``)."""
    return callable(getattr(obj, "reset", None)) and not callable(getattr(obj, "step", None))


class TRLEnvironmentAdapter:
    """Wrap a TRL-style environment instance (see module docstring)."""

    def __init__(self, env: Any):
        self.env = env
        self.tools = [
            getattr(env, name)
            for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")
        ]
        self._tools = {tool.__name__: tool for tool in self.tools}

    def reset(self, example: dict[str, Any]):
        extra = self.env.reset(**example)
        prompt = example.get("prompt")
        if prompt is None:
            if extra is None:
                raise ValueError(
                    "A TRL-style environment needs either a 'prompt' column in the dataset or text from reset(); "
                    "this row has no 'prompt' and reset() returned None."
                )
            return extra
        if extra is None:
            return prompt
        if isinstance(prompt, str):
            return prompt + extra
        last = dict(prompt[-1])
        last["content"] = last["content"] + extra
        return list(prompt[:-1]) + [last]

    async def _maybe_await(self, value):
        return await value if inspect.isawaitable(value) else value

    async def step(self, action: Action) -> Step:
        if action.kind == "tool":
            tool = self._tools.get(action.name)
            if tool is None:
                return Step(observation=f"Error: unknown tool {action.name!r}; available: {sorted(self._tools)}.")
            try:
                result = await self._maybe_await(tool(**action.arguments))
            except Exception as exc:  # a tool error is an observation, as in TRL
                return Step(observation=f"Error: {type(exc).__name__}: {exc}", info={"tool_error": str(exc)})
            return Step(observation=result if isinstance(result, str) else str(result))
        if action.kind == "answer":
            reward = 0.0
            if callable(getattr(self.env, "get_reward", None)):
                reward = float(await self._maybe_await(self.env.get_reward()))
            return Step(done=True, reward=reward)
        return Step(observation=f"Error: {action.error or 'invalid action'}. Call a tool with valid JSON, or answer.")
