"""The private parts of TRL and transformers this package overrides, calls or reads, checked in one place.

``MultiTurnGRPOTrainer`` plugs into TRL 1.16 through its public ``rollout_func`` seam and a few private members of
``GRPOTrainer`` / ``Trainer``; ``MultiTurnSFTTrainer`` reads a few of ``SFTTrainer``. pyproject.toml pins TRL to the
tested minor version. When an upgrade renames a member, changes a signature or the keys of a batch, a test here
fails with the name of the seam, instead of a training run failing (or silently changing) somewhere else.
"""

import inspect
import math
import re
from pathlib import Path

import pytest
import torch
import transformers
import trl
from datasets import Dataset
from transformers import Trainer
from trl import GRPOTrainer, SFTTrainer

from trl_multiturn import MultiTurnGRPOConfig, MultiTurnGRPOTrainer
from trl_multiturn.checkpointing import AtomicCheckpointMixin
from trl_multiturn.environment import Step

REPO = Path(__file__).resolve().parents[1]


class FeedbackEnv:
    def reset(self, example):
        return f"Question: {example['q']}"

    def step(self, action):
        return Step(observation="Invalid. Answer inside answer tags.")


def seen_kwargs_reward(completions, env_reward, num_turns, turn_rewards, truncated, final_answer, stop_reason, **kw):
    """A reward function that needs every field the rollout hands to TRL through rollout_func."""
    return [float(len(c) % 3) for c in completions]


@pytest.fixture
def trainer(tmp_path, smollm2_tokenizer, tiny_model_factory):
    args = MultiTurnGRPOConfig(
        output_dir=str(tmp_path / "out"), num_generations=2, prompts_per_rollout=2, mini_batch_size=2,
        micro_batch_size=1, ppo_epochs=1, max_completion_length=24, max_tokens_per_turn=8, max_turns=2, max_steps=1,
        report_to="none", save_strategy="no", seed=0, logging_steps=1,
    )
    return MultiTurnGRPOTrainer(
        model=tiny_model_factory(), args=args, train_dataset=Dataset.from_dict({"q": ["a", "b", "c", "d"]}),
        environment_factory=FeedbackEnv, reward_funcs=[seen_kwargs_reward], processing_class=smollm2_tokenizer,
    )


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


# ---------------------------------------------------------------------------------------------------- versions
def test_installed_trl_is_in_the_pinned_range():
    pin = re.search(r'"trl>=([\d.]+),<([\d.]+)"', (REPO / "pyproject.toml").read_text())
    assert pin, "pyproject.toml must pin trl as 'trl>=X,<Y'"
    version = tuple(int(x) for x in trl.__version__.split(".")[:2])
    low, high = (tuple(int(x) for x in v.split(".")[:2]) for v in pin.groups())
    assert low <= version < high, f"trl {trl.__version__} is outside the tested range {pin.group(0)}"


# ---------------------------------------------------------------------------------------------------- overrides
#: (class that defines the member, member, its parameters as this package calls / overrides it)
OVERRIDDEN = [
    (GRPOTrainer, "_generate_and_score_completions", ["self", "inputs"]),
    (GRPOTrainer, "_calculate_rewards", ["self", "inputs", "prompts", "completions", "completion_ids_list"]),
    (GRPOTrainer, "_prepare_inputs", ["self", "generation_batch"]),
    (GRPOTrainer, "compute_loss", ["self", "model", "inputs", "return_outputs", "num_items_in_batch"]),
    (GRPOTrainer, "training_step", ["self", "model", "inputs", "num_items_in_batch"]),
    (Trainer, "_get_output_dir", ["self", "trial"]),
    (Trainer, "_save_checkpoint", ["self", "model", "trial"]),
    (Trainer, "_save_rng_state", ["self", "output_dir"]),
    (Trainer, "_load_rng_state", ["self", "checkpoint"]),
    (SFTTrainer, "compute_loss", ["self", "model", "inputs", "return_outputs", "num_items_in_batch"]),
]


@pytest.mark.parametrize("owner, name, params", OVERRIDDEN, ids=[f"{o.__name__}.{n}" for o, n, _ in OVERRIDDEN])
def test_overridden_members_keep_their_signature(owner, name, params):
    assert hasattr(owner, name), f"{owner.__name__}.{name} is gone"
    assert [p for p, _ in _params(getattr(owner, name))] == params


def test_get_per_token_logps_and_entropies_signature():
    """The override takes TRL's first seven parameters by name and swallows the multimodal ones (all None by
    default) with ``**multimodal``; it returns TRL's ``(logps, entropies, aux_loss)``."""
    params = _params(GRPOTrainer._get_per_token_logps_and_entropies)
    head = [("self", inspect._empty), ("model", inspect._empty), ("input_ids", inspect._empty),
            ("attention_mask", inspect._empty), ("logits_to_keep", inspect._empty), ("batch_size", None),
            ("compute_entropy", False), ("compute_aux_loss", False)]
    assert params[: len(head)] == head
    assert all(default is None for _, default in params[len(head):]), params[len(head):]
    ours = _params(MultiTurnGRPOTrainer._get_per_token_logps_and_entropies)
    assert ours[: len(head)] == head and ours[-1][0] == "multimodal"


def test_every_override_of_this_package_exists_upstream():
    """Each private method MultiTurnGRPOTrainer defines that TRL or transformers also defines is listed above (so a
    new override cannot bypass this file)."""
    listed = {name for _, name, _ in OVERRIDDEN} | {"_get_per_token_logps_and_entropies"}
    for cls in (MultiTurnGRPOTrainer, AtomicCheckpointMixin):
        for name, member in vars(cls).items():
            if callable(member) and name.startswith("_") and not name.startswith("__") and hasattr(GRPOTrainer, name):
                assert name in listed, f"{cls.__name__}.{name} overrides a TRL/transformers member: list it above"


# ---------------------------------------------------------------------------------------------------- class attributes
def test_loss_is_scaled_for_ga():
    """compute_loss returns each micro-batch's share of the mini-batch loss (mini-batch-global normalizers), so the
    Trainer must not divide it by the accumulation steps: GRPOTrainer says so with ``loss_is_scaled_for_ga``."""
    assert GRPOTrainer.loss_is_scaled_for_ga is True
    assert MultiTurnGRPOTrainer.loss_is_scaled_for_ga is True
    source = inspect.getsource(Trainer.training_step)
    assert "self.loss_is_scaled_for_ga" in source and "current_gradient_accumulation_steps" in source


def test_trl_sources_still_hold_the_seams_read_by_name():
    """Members set or read inside TRL methods this package relies on without calling them directly."""
    grpo_init = inspect.getsource(GRPOTrainer.__init__)
    for attr in ("self._last_loaded_step", "self._buffered_inputs", "self._step", "self._metrics", "self._logs",
                 "self.aux_loss_enabled", "self.router_aux_loss_coef", "self.rollout_func", "self.reward_weights",
                 "self.reward_func_names", "self.epsilon_low", "self.epsilon_high", "self.num_generations_eval",
                 "self.mask_truncated_completions", "self.vllm_generation"):
        assert attr in grpo_init, f"GRPOTrainer.__init__ no longer sets {attr}"
    assert "self._step += 1" in inspect.getsource(GRPOTrainer.training_step)  # one per micro-batch
    generate = inspect.getsource(GRPOTrainer._generate)
    assert "self.rollout_func(prompts, self)" in generate
    assert 'extra_fields.pop("env_mask"' in generate  # the action mask becomes TRL's tool_mask
    assert "sync_weights()" in inspect.getsource(GRPOTrainer._generate_single_turn)
    # when TRL scores pi_old over the whole rollout (MultiTurnGRPOTrainer mirrors the rule to defer that pass)
    score = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert "generate_every = self.args.steps_per_generation * self.num_iterations" in score
    assert "self.args.gradient_accumulation_steps % generate_every != 0" in score
    assert "self.use_vllm and self.vllm_importance_sampling_correction" in score
    sft_init = inspect.getsource(SFTTrainer.__init__)
    for attr in ("self._total_train_tokens", "self._tp_size", "self._metrics", "self.aux_loss_enabled"):
        assert attr in sft_init, f"SFTTrainer.__init__ no longer sets {attr}"


def test_vllm_generation_members_read_by_the_vllm_generator():
    from trl.generation.vllm_generation import VLLMGeneration

    source = inspect.getsource(VLLMGeneration)
    for attr in ("self.mode", "self.llm", "self.vllm_client", "self.generation_kwargs", "self.accelerator",
                 "self.tp_group", "self.tensor_parallel_size"):
        assert attr in source, f"VLLMGeneration no longer has {attr}"
    assert callable(getattr(VLLMGeneration, "sync_weights", None))


def test_helpers_imported_from_trl():
    from trl.models.utils import disable_gradient_checkpointing, unwrap_model_for_generation
    from trl.trainer.utils import split_tensor_dict

    assert [p for p, _ in _params(disable_gradient_checkpointing)] == ["model", "gradient_checkpointing_kwargs"]

    names = [p for p, _ in _params(unwrap_model_for_generation)]
    assert names[:3] == ["model", "accelerator", "gather_deepspeed3_params"]
    assert "gradient_checkpointing_kwargs" in names
    chunks = split_tensor_dict({"x": torch.arange(4), "y": None}, 2)
    assert [c["x"].tolist() for c in chunks] == [[0, 1], [2, 3]]


# ---------------------------------------------------------------------------------------------------- behaviour
def test_instance_attributes_after_construction(trainer, smollm2_tokenizer):
    assert trainer._step == 0 and trainer._buffered_inputs is None
    assert trainer._tokenizer is smollm2_tokenizer
    assert trainer.reward_func_names == ["seen_kwargs_reward", "env_reward"]
    assert trainer.reward_weights.tolist() == [1.0, 1.0]
    assert (trainer.epsilon_low, trainer.epsilon_high, trainer.beta) == (0.2, 0.2, 0.0)
    assert trainer.aux_loss_enabled is False and trainer.use_vllm is False
    trainer._metrics["train"]["seam/probe"].append(1.0)  # a defaultdict of lists per mode
    assert set(trainer._logs) >= {"prompt", "completion", "rewards", "advantages", "extra"}


def test_fused_lm_head_returns_shifted_log_probs_and_entropy(trainer):
    """``model(..., labels=, fused_lm_head=True)`` (TRL's patch) returns ``log_probs`` and ``entropy`` of shape
    (B, L - 1): column t scores token t + 1 under ``log_softmax(logits / temperature)``."""
    model = trainer.model
    ids = torch.randint(100, 1000, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=ids, fused_lm_head=True)
        logits = model(input_ids=ids, attention_mask=mask).logits  # (2, 6, V)
    assert out.log_probs.shape == (2, 5) and out.entropy.shape == (2, 5)
    logp = torch.log_softmax(logits[:, :-1].float() / trainer.temperature, -1)  # (2, 5, V)
    torch.testing.assert_close(out.log_probs, logp.gather(-1, ids[:, 1:, None]).squeeze(-1), rtol=0, atol=1e-5)
    torch.testing.assert_close(out.entropy, -(logp.exp() * logp).sum(-1), rtol=1e-5, atol=1e-5)


def test_trl_per_token_logps_and_entropies_output(trainer):
    ids = torch.randint(100, 1000, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        out = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask, 3, compute_entropy=True)
        ours = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 3, compute_entropy=True)
    assert len(out) == 3 and out[0].shape == (2, 3) and out[1].shape == (2, 3) and out[2] is None
    assert len(ours) == 3 and ours[2] is None
    torch.testing.assert_close(ours[0], out[0], rtol=0, atol=1e-5)


def test_generate_and_score_completions_output_and_rollout_func(trainer):
    """TRL's own ``_generate_and_score_completions`` (no override), fed by this package's ``rollout_func``: the keys
    and shapes the trainer reads, the action mask as ``tool_mask``, and the rollout fields reaching the rewards."""
    inputs = [{"q": q} for q in ("a", "a", "b", "b")]
    trainer.model.train()
    trajectories = trainer._run_rollout(inputs)
    rows = [dict(x, prompt=trainer._tokenizer.decode(t.prompt_ids)) for x, t in zip(inputs, trajectories)]
    trainer._pending_trajectories = trajectories
    out = GRPOTrainer._generate_and_score_completions(trainer, rows)
    trainer._pending_trajectories = None
    b, c = out["completion_ids"].shape
    assert b == 4 and out["prompt_ids"].shape[0] == 4 and out["prompt_mask"].shape == out["prompt_ids"].shape
    for key in ("completion_mask", "tool_mask"):
        assert out[key].shape == (b, c), key
    assert out["advantages"].shape == (b,) and out["num_items_in_batch"].dim() == 0
    for row, t in enumerate(trajectories):
        n = len(t.completion_ids)
        assert out["completion_ids"][row, :n].tolist() == t.completion_ids
        assert out["tool_mask"][row, :n].tolist() == t.action_mask
    # _calculate_rewards: (B, F) over the user's reward and the environment's, gathered over processes
    rewards = trainer._last_rewards_per_func
    assert rewards.shape == (4, 2) and not torch.isnan(rewards[:, 0]).any()
    assert {"old_per_token_logps", "ref_per_token_logps", "importance_sampling_ratio",
            "sampling_per_token_logps"} >= {k for k in out if k.endswith(("logps", "ratio"))}


def test_training_steps_the_buffer_and_the_step_counter(trainer):
    """TRL's ``_step`` counts micro-batches (``training_step`` adds one) and ``_prepare_inputs`` keeps the rollout's
    micro-batches in ``_buffered_inputs``, indexed by ``_step % steps_per_generation``."""
    trainer.train()
    accum, steps = trainer.args.gradient_accumulation_steps, trainer.args.steps_per_generation
    assert trainer.state.global_step == 1 and trainer._step == accum
    assert isinstance(trainer._buffered_inputs, list) and len(trainer._buffered_inputs) == steps
    assert all(math.isfinite(x) for x in trainer._metrics["train"]["loss/pg_loss"])


def test_transformers_version_has_the_attention_interface():
    """The shared-prompt forward wraps entries of transformers' ``AttentionInterface._global_mapping``."""
    from transformers import AttentionInterface

    assert "sdpa" in AttentionInterface._global_mapping
    assert callable(getattr(AttentionInterface, "register", None))
    assert transformers.__version__
