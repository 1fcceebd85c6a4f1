"""The environment contract: what an agent's world looks like to the rollout loop.

One environment instance serves one trajectory. The library owns the loop (generate -> parse -> step -> render);
an environment never parses model text itself: it receives a parsed :class:`Action` and answers with a
:class:`Step`. Sync and ``async`` methods are both accepted; async ones run concurrently across a batch.

    class MyEnv:
        def reset(self, example: dict) -> str | list[dict]:   # first user message (text) or chat messages
            ...
        def step(self, action: Action) -> Step:                # observation for the next turn, reward, done
            ...
        def close(self) -> None:                               # optional
            ...

Departure from TRL: TRL 1.16's ``environment_factory`` exposes an environment's public methods as tools and
calls them in lock step; here the environment sees every action (tool call, answer, or invalid text), may end
the episode and may reward each turn. TRL-style classes are still accepted (see ``trl_multiturn.trl_compat``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

ActionKind = Literal["tool", "answer", "invalid"]


@dataclass
class Action:
    """A parsed policy action.

    Attributes:
        kind: "tool" (a tool call / search), "answer" (final answer: the environment's step still runs, e.g. to
            reward it, and then the episode ends), or "invalid" (the text matched no action of the protocol).
        name: the tool name for kind "tool" (e.g. "search"); None otherwise.
        arguments: the tool arguments for kind "tool" (for tag protocols: ``{"query": text}``).
        content: the answer text for kind "answer"; None otherwise.
        text: the raw text the policy produced in this turn (always set; what an invalid action said).
        error: why parsing failed for kind "invalid" (shown to the model through the protocol's feedback).
        cut: True when the turn was cut by ``max_tokens_per_turn`` before the protocol's end of turn (a closing tag or
            EOS); such a turn is always kind "invalid".
    """

    kind: ActionKind
    text: str = ""
    name: str | None = None
    arguments: dict[str, Any] = field(default_factory=dict)
    content: str | None = None
    error: str | None = None
    cut: bool = False


@dataclass
class Step:
    """What the environment returns for one action.

    Attributes:
        observation: text inserted into the context before the next turn (None or "" = nothing to insert).
        reward: reward for this turn; kept per turn on the trajectory and summed into the final reward.
        done: True ends the episode.
        info: free-form record, appended to the trajectory's ``info["step_info"]`` (one entry per step).
    """

    observation: str | None = None
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """Structural type of an environment (sync or async methods)."""

    def reset(self, example: dict[str, Any]) -> Any: ...

    def step(self, action: Action) -> Any: ...
