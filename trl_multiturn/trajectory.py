"""One multi-turn rollout as exact token ids, the ONE place where its ids and masks are built.

A trajectory is ``tau = (u_1, a_1, u_2, a_2, ..., u_K, a_K)`` forwarded once as one sequence. ``u_1`` is the prompt
(``prompt_ids``); everything after it is the *completion*: the actions ``a_k`` sampled by the policy (action mask 1)
interleaved with what the environment inserted (observations, tool results and the template tokens around them,
action mask 0). The mask is built where the tokens are produced (:meth:`Trajectory.add_action`,
:meth:`Trajectory.add_observation`), and has a single meaning everywhere in the package: 1 = this token was sampled by
the policy and carries loss.

Two layouts share this container. In the *sequence* layout the trajectory is trained as that one sequence. In the
*per-turn* layout each turn k was generated from its own context ``turn_contexts[k]``, the conversation rendered as the
deployed model sees it (a thinking template drops earlier ``<think>`` blocks; a context function drops or cuts old
observations), and is trained as its own row ``(turn_contexts[k], a_k)`` (:meth:`Trajectory.turn_rows`). The
single-sequence fields are built the same way in both layouts: reward functions and logging read them.

Tensors: the trainer hands the exact lists to TRL through ``rollout_func`` and TRL pads them into its layout
(``prompt_ids`` left-padded, ``completion_ids`` and the action mask, TRL's ``tool_mask``, right-padded);
:func:`completion_tensors` lays out the per-token lists TRL does not carry (turn ids) in that same layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch


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
        truncated: True when a token limit cut the trajectory: ``max_completion_length`` (actions and observations
            together) or the model's context (``max_context_length``) left no room to finish the action being sampled,
            the next observation or the next turn (``info["stop_reason"] == "max_tokens"``). This is the one meaning
            of truncation in the package (``mask_truncated_completions``, ``rollout/truncated_frac``,
            ``completions/clipped_ratio``), as in TRL, where a completion is truncated when the token budget ends it
            before EOS. NOT truncated: a trajectory that used all ``max_turns`` (``stop_reason="max_turns"``: every
            action it took was complete, and its reward judges the choice to keep acting), and a turn cut by
            ``max_tokens_per_turn`` (it ends the turn, not the trajectory; the protocol parses it as invalid).
        info: free-form per-trajectory record (stop reason, env errors, action kinds, parsed answer, ...).
        turn_contexts: (K,) lists of ids, per-turn layout only (empty in the sequence layout): ``turn_contexts[k]``
            is exactly the id list the generator was given for turn k, the context the turn was conditioned on.
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
    turn_contexts: list[list[int]] = field(default_factory=list)

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

    def turn_rows(self) -> list[tuple[list[int], list[int], list[float]]]:
        """One training row per turn: ``(context_ids, action_ids, action_logprobs)`` for k = 0 .. K-1.

        ``action_ids`` (n_k,) and ``action_logprobs`` (n_k,) are the tokens sampled in turn k (``turn_ids == k`` and
        ``action_mask == 1``) with their sampling log-probs. ``context_ids`` is ``turn_contexts[k]`` in the per-turn
        layout; in the sequence layout (no ``turn_contexts``) it is the single sequence before turn k's first token,
        which is what that turn was conditioned on there.

        Returns:
            K tuples of lists, in turn order.
        """
        actions: list[list[int]] = [[] for _ in range(self.num_turns)]  # K lists of (n_k,)
        logprobs: list[list[float]] = [[] for _ in range(self.num_turns)]  # K lists of (n_k,)
        for token, logprob, turn, m in zip(self.completion_ids, self.logprobs, self.turn_ids, self.action_mask):
            if m == 1:
                actions[turn].append(token)
                logprobs[turn].append(logprob)
        if self.turn_contexts:
            contexts = [list(c) for c in self.turn_contexts]
        else:  # turn ids never decrease: turn k starts after every token of the turns before it
            starts = [sum(1 for turn in self.turn_ids if turn < k) for k in range(self.num_turns)]
            contexts = [list(self.prompt_ids) + list(self.completion_ids[:s]) for s in starts]
        return list(zip(contexts, actions, logprobs))

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
        if len(self.turn_contexts) not in (0, self.num_turns):
            raise ValueError(
                f"Trajectory.turn_contexts has {len(self.turn_contexts)} entries but num_turns is {self.num_turns}; "
                "it must hold one context per turn (per-turn layout) or none (sequence layout)."
            )
        if not math.isfinite(self.reward):
            raise ValueError(f"Trajectory.reward is {self.reward}; rewards must be finite.")


def completion_tensors(turn_ids: Sequence[Sequence[int]], action_masks: Sequence[Sequence[int]], width: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token lists of ``B`` completions (``Trajectory.turn_ids``, ``Trajectory.action_mask``) as ``(B, C)``
    tensors laid out as TRL lays out ``completion_ids``: right-padded to ``width`` = C columns. Returns
    ``(turn_ids, action_mask)``, long, -1 and 0 on padding."""
    turns = torch.full((len(turn_ids), width), -1, dtype=torch.long)  # (B, C)
    mask = torch.zeros((len(turn_ids), width), dtype=torch.long)  # (B, C)
    for b, (tid, m) in enumerate(zip(turn_ids, action_masks)):
        turns[b, : len(tid)] = torch.tensor(tid, dtype=torch.long)
        mask[b, : len(m)] = torch.tensor(m, dtype=torch.long)
    return turns, mask


def rollout_fields(trajs: Sequence[Trajectory]) -> dict[str, list]:
    """What TRL's ``rollout_func`` returns for ``trajs``: the ids, the sampler's log-probs, the action mask as
    ``env_mask``, and the fields reward functions receive as keyword arguments (``env_reward`` NaN where the
    environment failed, ``num_turns``, ``turn_rewards``, ``truncated``, ``final_answer``, ``stop_reason``)."""
    return {
        "prompt_ids": [t.prompt_ids for t in trajs], "completion_ids": [t.completion_ids for t in trajs],
        "logprobs": [t.logprobs for t in trajs], "env_mask": [t.action_mask for t in trajs],
        "env_reward": [float("nan") if t.info.get("failed") else float(sum(t.turn_rewards)) for t in trajs],
        "num_turns": [t.num_turns for t in trajs], "turn_rewards": [list(t.turn_rewards) for t in trajs],
        "truncated": [t.truncated for t in trajs], "final_answer": [t.info.get("final_answer") for t in trajs],
        "stop_reason": [t.info.get("stop_reason") for t in trajs],
    }
