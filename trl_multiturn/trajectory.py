"""One multi-turn rollout as exact token ids, and its collation into padded tensors.

A trajectory is ``tau = (u_1, a_1, u_2, a_2, ..., u_K, a_K)`` forwarded once as one sequence. ``u_1`` is the prompt
(``prompt_ids``); everything after it is the *completion*: the actions ``a_k`` sampled by the policy (action mask 1)
interleaved with what the environment inserted (observations, tool results and the template tokens around them,
action mask 0). This module is the ONE place where ids and masks are assembled into tensors; the action mask has a
single meaning everywhere in the package: 1 = this token was sampled by the policy and carries loss.

Collation (:func:`collate_trajectories`) turns a list of trajectories into one :class:`TrajectoryBatch` of padded
tensors over the WHOLE sequence (prompt + completion). Departure from TRL, which keeps ``prompt_ids`` and
``completion_ids`` as two separately padded tensors: a multi-turn trajectory is one sequence, so there is one
tensor per quantity and per-token fields are aligned with ``input_ids`` (position ``i`` describes token ``i``).
Prompt tokens and padding carry action mask 0, turn id -1 and old log-prob 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Sequence

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


@dataclass
class TrajectoryBatch:
    """A collated batch of ``B`` trajectories padded to a common length ``L`` (see :func:`collate_trajectories`).

    Every per-token field is aligned with ``input_ids``: position ``i`` describes token ``input_ids[b, i]``. A causal
    LM's logits at position ``i`` predict token ``i + 1``, so a loss on sampled tokens uses
    ``logits[:, :-1]`` against ``input_ids[:, 1:]`` and ``action_mask[:, 1:]``, ``old_logprobs[:, 1:]``.

    Attributes:
        input_ids: (B, L) long. Prompt + completion ids, padded with ``pad_token_id`` on ``padding_side``.
        attention_mask: (B, L) long. 1 on every real token (prompt, actions and observations), 0 on padding.
        action_mask: (B, L) long. 1 only on tokens sampled by the policy; 0 on prompt, observations and padding.
        turn_ids: (B, L) long. Turn (0-based action index) of each completion token; -1 on prompt and padding.
        old_logprobs: (B, L) float32. Behaviour-policy log-prob of each sampled token; 0.0 where action_mask is 0.
        prompt_lengths: (B,) long. Number of prompt tokens ``P_b`` of each trajectory.
        lengths: (B,) long. Unpadded length ``P_b + C_b`` of each trajectory (the attention-mask row sum).
        rewards: (B,) float32. ``Trajectory.reward`` of each trajectory.
        num_turns: (B,) long. ``Trajectory.num_turns`` ``K_b`` of each trajectory.
        padding_side: "right" or "left": where the padding of each row sits.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    turn_ids: torch.Tensor
    old_logprobs: torch.Tensor
    prompt_lengths: torch.Tensor
    lengths: torch.Tensor
    rewards: torch.Tensor
    num_turns: torch.Tensor
    padding_side: str = "right"

    @property
    def batch_size(self) -> int:
        """B, the number of trajectories."""
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        """L, the padded length."""
        return int(self.input_ids.shape[1])

    def __len__(self) -> int:
        return self.batch_size

    def _tensor_fields(self) -> list[str]:
        return [f.name for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]

    def to(self, device: torch.device | str) -> TrajectoryBatch:
        """A copy with every tensor moved to ``device``."""
        moved = {name: getattr(self, name).to(device) for name in self._tensor_fields()}
        return TrajectoryBatch(**moved, padding_side=self.padding_side)

    def select(self, index: slice | Sequence[int] | torch.Tensor) -> TrajectoryBatch:
        """Rows ``index`` of every tensor (a micro-batch). Columns are kept, so padding may remain."""
        if not isinstance(index, slice):
            index = torch.as_tensor(index, dtype=torch.long, device=self.input_ids.device)
        picked = {name: getattr(self, name)[index] for name in self._tensor_fields()}
        return TrajectoryBatch(**picked, padding_side=self.padding_side)


def collate_trajectories(
    trajectories: Sequence[Trajectory],
    pad_token_id: int,
    padding_side: Literal["right", "left"] = "right",
    pad_to_multiple_of: int | None = None,
) -> TrajectoryBatch:
    """Pad ``B`` trajectories into one :class:`TrajectoryBatch` (shapes listed there).

    ``L = max_b (P_b + C_b)``, rounded up to a multiple of ``pad_to_multiple_of`` when given. Row ``b`` holds
    ``prompt_ids + completion_ids`` followed (``padding_side="right"``) or preceded (``"left"``) by ``L - P_b - C_b``
    pad tokens. Padding gets attention 0, action mask 0, turn id -1 and old log-prob 0; prompt tokens get
    attention 1, action mask 0 and turn id -1; observation tokens get attention 1 and action mask 0; only sampled
    tokens get action mask 1. Each trajectory is validated first (``Trajectory.validate``).

    Raises:
        ValueError: empty input, an unknown ``padding_side``, a non-positive ``pad_to_multiple_of``, an invalid
            trajectory, or a non-finite log-prob on a sampled token.
    """
    if len(trajectories) == 0:
        raise ValueError("collate_trajectories got no trajectories; pass at least one.")
    if padding_side not in ("right", "left"):
        raise ValueError(f"padding_side={padding_side!r} is not valid; use 'right' or 'left'.")
    if pad_to_multiple_of is not None and (not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1):
        raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of!r} must be a positive int or None.")
    for b, traj in enumerate(trajectories):
        try:
            traj.validate()
        except ValueError as err:
            raise ValueError(f"trajectory {b}: {err}") from err
        for i, (m, lp) in enumerate(zip(traj.action_mask, traj.logprobs)):
            if m == 1 and not math.isfinite(lp):
                raise ValueError(
                    f"trajectory {b}: sampled completion token {i} has log-prob {lp}; sampled tokens need finite "
                    "log-probs (the generator must return them)."
                )

    lengths = [len(t.prompt_ids) + len(t.completion_ids) for t in trajectories]
    width = max(lengths)
    if pad_to_multiple_of is not None:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    batch = len(trajectories)

    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)  # (B, L)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)  # (B, L)
    action_mask = torch.zeros((batch, width), dtype=torch.long)  # (B, L)
    turn_ids = torch.full((batch, width), -1, dtype=torch.long)  # (B, L)
    old_logprobs = torch.zeros((batch, width), dtype=torch.float32)  # (B, L)

    for b, traj in enumerate(trajectories):
        n_prompt, n_total = len(traj.prompt_ids), lengths[b]
        start = 0 if padding_side == "right" else width - n_total  # first real token of row b
        mask = torch.tensor(traj.action_mask, dtype=torch.long)  # (C,)
        comp = slice(start + n_prompt, start + n_total)  # completion columns of row b
        input_ids[b, start : start + n_total] = torch.tensor(traj.input_ids, dtype=torch.long)
        attention_mask[b, start : start + n_total] = 1
        action_mask[b, comp] = mask
        turn_ids[b, comp] = torch.tensor(traj.turn_ids, dtype=torch.long)
        logprobs = torch.tensor(traj.logprobs, dtype=torch.float32)  # (C,)
        old_logprobs[b, comp] = torch.where(mask.bool(), logprobs, torch.zeros_like(logprobs))  # 0.0 where mask 0

    return TrajectoryBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        action_mask=action_mask,
        turn_ids=turn_ids,
        old_logprobs=old_logprobs,
        prompt_lengths=torch.tensor([len(t.prompt_ids) for t in trajectories], dtype=torch.long),  # (B,)
        lengths=torch.tensor(lengths, dtype=torch.long),  # (B,)
        rewards=torch.tensor([float(t.reward) for t in trajectories], dtype=torch.float32),  # (B,)
        num_turns=torch.tensor([t.num_turns for t in trajectories], dtype=torch.long),  # (B,)
        padding_side=padding_side,
    )
