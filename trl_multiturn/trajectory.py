"""One multi-turn rollout as exact token ids, and its collation into padded tensors.

A trajectory is ``tau = (u_1, a_1, u_2, a_2, ..., u_K, a_K)`` forwarded once as one sequence. ``u_1`` is the prompt
(``prompt_ids``); everything after it is the *completion*: the actions ``a_k`` sampled by the policy (action mask 1)
interleaved with what the environment inserted (observations, tool results and the template tokens around them,
action mask 0). This module is the ONE place where ids and masks are assembled into tensors; the action mask has a
single meaning everywhere in the package: 1 = this token was sampled by the policy and carries loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Trajectory:
    """One rollout of the policy. Shapes are given in tokens; ``C = len(completion_ids)``, ``K = num_turns``.

    Attributes:
        prompt_ids: (P,) the initial context ``u_1`` (chat template applied), never trained on.
        completion_ids: (C,) every token after the prompt, exactly as the model was conditioned on it.
        action_mask: (C,) 1 where the token was sampled by the policy, 0 where the environment inserted it.
        logprobs: (C,) sampling log-prob of each sampled token under the behaviour policy; 0.0 where mask is 0.
        turn_ids: (C,) the turn (0-based action index k) each completion token belongs to. Observation tokens that
            follow action k carry turn k: they are the consequence of that action.
        turn_rewards: (K,) reward the environment returned for each action's ``step`` (0.0 when it gave none).
        reward: final scalar reward (environment rewards + reward functions), filled by the trainer.
        num_turns: K, the number of actions the policy took.
        truncated: True when the trajectory stopped on a limit (turns, tokens, context) instead of finishing.
        info: free-form per-trajectory record (stop reason, env errors, action kinds, parsed answer, ...).
    """

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_ids: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    reward: float = 0.0
    num_turns: int = 0
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    # ----- building (used by the rollout and by SFT; the only way ids and masks grow) -----
    def add_action(self, ids: list[int], logprobs: list[float] | None = None) -> None:
        """Append tokens sampled by the policy for a new turn (mask 1)."""
        if logprobs is None:
            logprobs = [0.0] * len(ids)
        if len(logprobs) != len(ids):
            raise ValueError(f"add_action got {len(ids)} ids but {len(logprobs)} logprobs; they must match.")
        turn = self.num_turns
        self.completion_ids.extend(ids)
        self.action_mask.extend([1] * len(ids))
        self.logprobs.extend(float(x) for x in logprobs)
        self.turn_ids.extend([turn] * len(ids))
        self.num_turns += 1
        self.turn_rewards.append(0.0)

    def add_observation(self, ids: list[int]) -> None:
        """Append tokens inserted by the environment after the last action (mask 0, attended, never trained)."""
        turn = max(self.num_turns - 1, 0)
        self.completion_ids.extend(ids)
        self.action_mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.turn_ids.extend([turn] * len(ids))

    # ----- views -----
    @property
    def input_ids(self) -> list[int]:
        """(P + C,) the full sequence the model is forwarded on."""
        return list(self.prompt_ids) + list(self.completion_ids)

    @property
    def num_action_tokens(self) -> int:
        """N_g: the number of tokens the policy sampled (the per-trajectory loss normalizer)."""
        return int(sum(self.action_mask))

    @property
    def num_observation_tokens(self) -> int:
        return len(self.completion_ids) - self.num_action_tokens

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field when the per-token lists disagree or hold bad values."""
        c = len(self.completion_ids)
        for name in ("action_mask", "logprobs", "turn_ids"):
            n = len(getattr(self, name))
            if n != c:
                raise ValueError(f"Trajectory.{name} has length {n} but completion_ids has length {c}; they must match.")
        if any(m not in (0, 1) for m in self.action_mask):
            raise ValueError("Trajectory.action_mask must contain only 0 and 1.")
        if len(self.turn_rewards) != self.num_turns:
            raise ValueError(
                f"Trajectory.turn_rewards has {len(self.turn_rewards)} entries but num_turns is {self.num_turns}."
            )
        if self.turn_ids and (min(self.turn_ids) < 0 or max(self.turn_ids) >= max(self.num_turns, 1)):
            raise ValueError(f"Trajectory.turn_ids must lie in [0, num_turns={self.num_turns}).")
        if not math.isfinite(self.reward):
            raise ValueError(f"Trajectory.reward is {self.reward}; rewards must be finite.")
