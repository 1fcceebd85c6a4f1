"""trl-multiturn: multi-turn agentic GRPO for Hugging Face TRL.

Public names are imported lazily so that the pure-math modules (trajectory, advantages, loss, batching) can be
used without importing TRL or transformers.
"""

from importlib import import_module
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_LAZY = {
    "Trajectory": "trl_multiturn.trajectory",
    "group_advantages": "trl_multiturn.advantages",
    "turn_advantages": "trl_multiturn.advantages",
    "aggregate_loss": "trl_multiturn.loss",
    "policy_loss": "trl_multiturn.loss",
    "BatchPlan": "trl_multiturn.batching",
    "Action": "trl_multiturn.environment",
    "Step": "trl_multiturn.environment",
    "Environment": "trl_multiturn.environment",
    "TagProtocol": "trl_multiturn.protocols",
    "ChatToolProtocol": "trl_multiturn.protocols",
    "keep_last_observations": "trl_multiturn.context",
    "truncate_observations": "trl_multiturn.context",
    "MultiTurnGRPOConfig": "trl_multiturn.config",
    "MultiTurnGRPOTrainer": "trl_multiturn.trainer",
    "trajectory_from_messages": "trl_multiturn.sft",
    "trajectory_from_tag_text": "trl_multiturn.sft",
    "trajectories_from_policy": "trl_multiturn.sft",
    "sft_dataset": "trl_multiturn.sft",
    "train_sft": "trl_multiturn.sft",
    "MultiTurnSFTTrainer": "trl_multiturn.sft",
}

__all__ = sorted(_LAZY)


def _lazy_getattr(package: str, table: dict[str, str]):
    """The module ``__getattr__`` (PEP 562) of a package whose public names are imported on first access.

    ``table`` maps each name to the module that defines it: a dotted module path, or the bare name of a submodule of
    ``package``. Used here and by ``trl_multiturn.search``.
    """

    def __getattr__(name: str):
        if name in table:
            module = table[name] if "." in table[name] else f"{package}.{table[name]}"
            return getattr(import_module(module), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


__getattr__ = _lazy_getattr(__name__, _LAZY)


if TYPE_CHECKING:  # pragma: no cover
    from .advantages import group_advantages, turn_advantages
    from .batching import BatchPlan
    from .config import MultiTurnGRPOConfig
    from .context import keep_last_observations, truncate_observations
    from .environment import Action, Environment, Step
    from .loss import aggregate_loss, policy_loss
    from .protocols import ChatToolProtocol, TagProtocol
    from .sft import MultiTurnSFTTrainer, sft_dataset, train_sft, trajectories_from_policy, trajectory_from_messages, trajectory_from_tag_text
    from .trainer import MultiTurnGRPOTrainer
    from .trajectory import Trajectory
