"""Environment faults inside a rollout, through the real ``trainer.train()`` on a tiny model.

One training run of two optimizer steps over a dataset whose every prompt selects one fault of
:class:`reliability_helpers.FaultEnv` (each prompt's group of G=2 trajectories shares it): exceptions in ``reset``
and ``step``, a step that hangs past ``env_timeout``, observations that are huge, empty, not a string or carry the
protocol's own tags, NaN and infinite rewards (from the environment and from a reward function), and no ``done`` at
all (the turn limit ends every healthy episode). The tests check that training finished, that each fault is
recorded on its trajectory, that the logged metrics are the counts over the trajectories, and that exactly the
trajectories that must leave the loss did. A second run has every trajectory dropped.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from trl_multiturn import MultiTurnGRPOTrainer
from trl_multiturn.models import tiny_random_model
from trl_multiturn.protocols import TRUNCATION_MARKER

from reliability_helpers import (
    FAULT_MODES,
    HANG_RELEASE,
    FaultEnv,
    Recorder,
    fault_dataset,
    inf_for_some,
    logged,
    tiny_args,
    vowel_reward,
)

# every test here reads one of two module-scoped training runs (~20 s and ~10 s on 2 cores)
pytestmark = pytest.mark.slow

FAILING = ("reset_raises", "step_raises", "step_hangs")
NON_FINITE = ("nan_reward", "inf_reward", "inf_reward_function")
DROPPED = FAILING + NON_FINITE


class LogKeeper(logging.Handler):
    """Keeps the package's log records of a whole module (caplog is per test)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def messages(self) -> list[str]:
        return [r.getMessage() for r in self.records]


@pytest.fixture(scope="module")
def fault_run(tmp_path_factory, smollm2_tokenizer):
    """Two optimizer steps over every fault mode; returns (trainer, recorder, logs, parameters before)."""
    n = len(FAULT_MODES)
    args = tiny_args(
        tmp_path_factory.mktemp("faults"), prompts_per_rollout=n, mini_batch_size=2 * n, micro_batch_size=n, max_steps=2
    )
    trainer = MultiTurnGRPOTrainer(
        model=tiny_random_model(smollm2_tokenizer), args=args, train_dataset=fault_dataset(),
        environment_factory=FaultEnv, reward_funcs=[vowel_reward, inf_for_some], processing_class=smollm2_tokenizer,
    )
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    recorder = Recorder(trainer)
    keeper = LogKeeper()
    package_logger = logging.getLogger("trl_multiturn")
    package_logger.addHandler(keeper)
    HANG_RELEASE.clear()
    try:
        trainer.train()
    finally:
        package_logger.removeHandler(keeper)
        HANG_RELEASE.set()  # the hanging steps, long abandoned by the rollout, may end now
    return trainer, recorder, keeper, before


def trajectories_by_mode(trainer, recorder, tokenizer):
    """Per rollout: {mode: [(row, trajectory)]}, the mode read back from the prompt the environment returned."""
    result = []
    for rollout in recorder.rollouts:
        groups = {}
        for row, t in enumerate(rollout):
            if t.info.get("stop_reason") == "reset_error":
                mode = "reset_raises"  # no prompt: reset never returned one
            else:
                prompt = tokenizer.decode(t.prompt_ids)
                mode = next(m for m in FAULT_MODES if f"Question {m}:" in prompt)
            groups.setdefault(mode, []).append((row, t))
        result.append(groups)
    return result


def test_training_finishes_and_learns_despite_faults(fault_run):
    trainer, recorder, _, before = fault_run
    assert trainer.state.global_step == 2
    assert len(recorder.rollouts) == 2 and all(len(r) == 2 * len(FAULT_MODES) for r in recorder.rollouts)
    assert all(g > 0 and math.isfinite(g) for g in logged(trainer, "grad_norm"))
    assert all(math.isfinite(x) for x in logged(trainer, "loss/pg_loss"))
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(v, after[k]) for k, v in before.items())


def test_each_fault_is_recorded_on_its_trajectory(fault_run, smollm2_tokenizer):
    trainer, recorder, _, _ = fault_run
    tok = smollm2_tokenizer
    for groups in trajectories_by_mode(trainer, recorder, tok):
        assert sorted(groups) == sorted(FAULT_MODES)
        assert all(len(members) == 2 for members in groups.values())
        for mode, members in groups.items():
            for _, t in members:
                observations = tok.decode([i for i, m in zip(t.completion_ids, t.action_mask) if m == 0])
                if mode == "reset_raises":
                    assert t.info["stop_reason"] == "reset_error" and t.info["failed"]
                    assert "reset exploded on purpose" in t.info["env_errors"][0]
                elif mode == "step_raises":
                    assert t.info["stop_reason"] == "env_error" and "step exploded on purpose" in t.info["env_errors"][0]
                elif mode == "step_hangs":
                    assert t.info["stop_reason"] == "env_error"
                    assert "timed out after env_timeout=0.4 s" in t.info["env_errors"][0]
                elif mode == "huge_observation":
                    assert t.info["observation_truncated"] >= 1 and TRUNCATION_MARKER in observations
                    assert not t.info.get("failed")
                elif mode == "empty_observation":
                    assert t.info["observation_problems"][0] == "empty observation" and not t.info.get("failed")
                elif mode == "non_string_observation":
                    assert "not a string (got dict)" in t.info["observation_problems"][0]
                    assert '{"docs": [1, 2, 3]}' in observations
                elif mode == "tagged_observation":
                    assert t.info["observation_sanitized"] >= 1
                    assert "[answer]forged[/answer]" in observations and "[search]injected[/search]" in observations
                    assert "[information]nested[/information]" in observations
                    assert "<answer>" not in observations and "<search>" not in observations
                elif mode in ("nan_reward", "inf_reward"):
                    assert not all(math.isfinite(r) for r in t.turn_rewards)
                if mode in ("ok", "empty_observation", "non_string_observation", "tagged_observation", *NON_FINITE):
                    # no done ever comes: the turn limit ends the episode
                    assert t.info["stop_reason"] == "max_turns" and not t.truncated and t.num_turns == 2


def test_dropped_trajectories_leave_the_loss_and_the_rest_stay(fault_run, smollm2_tokenizer):
    trainer, recorder, _, _ = fault_run
    for groups, batch in zip(trajectories_by_mode(trainer, recorder, smollm2_tokenizer), recorder.batches):
        loss_mask = batch["tool_mask"] * batch["completion_mask"]  # (B, C) in rollout order (before the shuffle)
        advantages = batch["advantages"]
        for mode, members in groups.items():
            for row, t in members:
                if mode in DROPPED:
                    assert math.isnan(t.reward), mode
                    assert int(loss_mask[row].sum()) == 0 and float(advantages[row]) == 0.0, mode
                else:
                    assert math.isfinite(t.reward), mode
                    assert int(loss_mask[row].sum()) == t.num_action_tokens > 0, mode
        assert torch.isfinite(advantages).all()


def test_metrics_are_the_counts_over_the_trajectories(fault_run):
    trainer, recorder, _, _ = fault_run
    for step, rollout in enumerate(recorder.rollouts):
        n = len(rollout)
        assert logged(trainer, "env/errors")[step] == sum(len(t.info.get("env_errors", [])) for t in rollout) == 6
        assert logged(trainer, "env/failed_frac")[step] == pytest.approx(6 / n)
        assert logged(trainer, "rollout/dropped_frac")[step] == pytest.approx(len(DROPPED) * 2 / n)
        assert logged(trainer, "env/observations_truncated")[step] == sum(
            t.info.get("observation_truncated", 0) for t in rollout
        ) > 0
        assert logged(trainer, "rollout/truncated_frac")[step] == pytest.approx(sum(t.truncated for t in rollout) / n)


def test_sanitized_and_problem_observations_are_counted(fault_run):
    trainer, recorder, _, _ = fault_run
    for step, rollout in enumerate(recorder.rollouts):
        assert logged(trainer, "env/observations_sanitized")[step] == sum(
            t.info.get("observation_sanitized", 0) for t in rollout
        ) > 0
        assert logged(trainer, "env/observation_problems")[step] == sum(
            len(t.info.get("observation_problems", [])) for t in rollout
        ) > 0


def test_failures_are_logged_naming_the_call_and_example(fault_run):
    _, _, logs, _ = fault_run
    messages = logs.messages()
    assert any("reset" in m and "reset exploded on purpose" in m and "example" in m for m in messages)
    assert any("step" in m and "timed out after env_timeout=0.4 s" in m for m in messages)
    assert any("dropped from the loss" in m for m in messages)


REASONS = {
    "reset_raises": "reset exploded on purpose",
    "step_raises": "step exploded on purpose",
    "step_hangs": "timed out after env_timeout=0.4 s",
    "nan_reward": "env_reward=nan",
    "inf_reward": "env_reward=inf",
    "inf_reward_function": "inf_for_some=inf",
}


def test_drop_warning_names_environment_example_and_reason(fault_run):
    _, _, logs, _ = fault_run
    drops = [m for m in logs.messages() if "dropped from the loss" in m]
    assert len(drops) == 2  # one per rollout
    for message in drops:
        assert message.startswith("12 of 22 trajectories from FaultEnv dropped")
        entries = message.split(": ", 1)[1].split(" | ")
        listed = [e for e in entries if e != "..."]
        assert len(listed) == 8 and entries[-1] == "..."  # the list is capped
        for entry in listed:  # "example <row> {'mode': '<mode>'}: <reason>"
            mode = entry.split("'mode': '")[1].split("'")[0]
            assert REASONS[mode] in entry, entry


# ---------------------------------------------------------------------------------------------------- all dropped
class HealthyThenBrokenEnv(FaultEnv):
    """Rollout 1 healthy; rollout 2: every trajectory but the first has a NaN reward (so the first prompt's group keeps
    one member); rollout 3 and later: every reward NaN. Rollouts create their environments in row order, so the
    creation count says which rollout and row an instance serves (the trainer's probe is created first)."""

    created = 0

    def __init__(self):
        HealthyThenBrokenEnv.created += 1
        index = HealthyThenBrokenEnv.created - 2  # -1 for the probe
        rollout, row = divmod(index, 4)
        self.broken = rollout >= 2 or (rollout == 1 and row > 0)

    def step(self, action):
        step = super().step(action)
        if self.broken:
            step.reward = math.nan
        return step


@pytest.fixture(scope="module")
def dropping_run(tmp_path_factory, smollm2_tokenizer):
    """Three optimizer steps: healthy, one lone survivor, all dropped. Returns (trainer, recorder, snapshots)."""
    from transformers import TrainerCallback

    HealthyThenBrokenEnv.created = 0
    args = tiny_args(tmp_path_factory.mktemp("all_dropped"), max_steps=3)
    trainer = MultiTurnGRPOTrainer(
        model=tiny_random_model(smollm2_tokenizer), args=args, train_dataset=fault_dataset(["ok"] * 6),
        environment_factory=HealthyThenBrokenEnv, reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer,
    )
    snapshots = {}

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            snapshots[state.global_step] = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}

    trainer.add_callback(Snapshot())
    recorder = Recorder(trainer)
    keeper = LogKeeper()
    logging.getLogger("trl_multiturn").addHandler(keeper)
    try:
        trainer.train()
    finally:
        logging.getLogger("trl_multiturn").removeHandler(keeper)
    return trainer, recorder, snapshots, keeper


def test_a_rollout_with_every_trajectory_dropped_does_not_crash(dropping_run):
    trainer, recorder, _, _ = dropping_run
    assert trainer.state.global_step == 3
    assert logged(trainer, "rollout/dropped_frac") == [0.0, 0.75, 1.0]
    pg, grad = logged(trainer, "loss/pg_loss"), logged(trainer, "grad_norm")
    assert all(math.isfinite(x) for x in pg) and all(math.isfinite(g) for g in grad)
    assert pg[2] == 0.0 and grad[2] == 0.0  # nothing left to learn from
    assert torch.equal(recorder.batches[2]["advantages"], torch.zeros(4))


def test_a_rollout_with_every_trajectory_dropped_leaves_the_parameters(dropping_run):
    trainer, _, snapshots, logs = dropping_run
    # zero gradient, but Adam's moments from the steps before would still move every parameter at step 3
    assert all(torch.equal(v, snapshots[3][k]) for k, v in snapshots[2].items())
    assert logged(trainer, "rollout/skipped_update") == [0.0, 0.0, 1.0]
    (message,) = [m for m in logs.messages() if m.startswith("4 of 4 trajectories")]
    assert "HealthyThenBrokenEnv" in message and "optimizer update is skipped" in message
    assert message.count("env_reward=nan") == 4 and "{'mode': 'ok'}" in message


def test_a_group_left_with_one_member_gets_no_advantage(dropping_run):
    _, recorder, _, _ = dropping_run
    rollout, batch = recorder.rollouts[1], recorder.batches[1]
    assert math.isfinite(rollout[0].reward) and all(math.isnan(t.reward) for t in rollout[1:])
    # the survivor's group lost its other member: (r - mean) / std over one reward is undefined; advantage 0
    assert torch.equal(batch["advantages"], torch.zeros(4))
