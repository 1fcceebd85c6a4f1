"""The warm start on the real model: multi-turn SFT on a few expert trajectories makes SmolLM2-135M follow the
search protocol on held-out questions it has never seen (its invalid-action rate drops), in a short CPU run."""

import pytest
import torch
from peft import LoraConfig
from trl import SFTConfig

from trl_multiturn.models import load_smollm2
from trl_multiturn.protocols import TagProtocol
from trl_multiturn.search import BM25Retriever, SearchEnvironment, build_expert_trajectories, build_offline_dataset
from trl_multiturn.search.evaluation import evaluate_search_agent
from trl_multiturn.sft import train_sft, trajectory_from_tag_text


@pytest.mark.slow
def test_warm_start_makes_smollm2_follow_the_protocol(tmp_path, smollm2_dir):
    torch.manual_seed(0)
    data = build_offline_dataset(num_entities=60, seed=3)
    retriever = BM25Retriever(data.corpus)

    def env_factory():
        return SearchEnvironment(retriever, topk=3, max_searches=3)

    model, tok = load_smollm2()
    held_out = data.test_rows[:8]

    def evaluate():
        out = evaluate_search_agent(model, tok, held_out, env_factory, max_turns=3, max_completion_length=384,
                                    max_tokens_per_turn=64, batch_size=8)
        return out["summary"]["all"]

    before = evaluate()
    experts, stats = build_expert_trajectories(data.train_rows[:16], env_factory=env_factory, seed=0)
    assert stats["kept"] == len(experts) > 0
    protocol = TagProtocol(max_observation_tokens=256)
    trajectories = [trajectory_from_tag_text(e.prompt, e.to_text(), tok, protocol) for e in experts]
    args = SFTConfig(output_dir=str(tmp_path), num_train_epochs=2, learning_rate=1e-3, per_device_train_batch_size=4,
                     logging_steps=1, save_strategy="no", report_to="none", max_length=None, seed=0,
                     lr_scheduler_type="constant", gradient_checkpointing=False, bf16=False)
    trainer = train_sft(model, tok, trajectories, args,
                        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    model = trainer.model
    after = evaluate()
    assert before["invalid_rate"] > 0.5, before  # untrained: it does not follow the protocol
    assert after["invalid_rate"] < before["invalid_rate"] - 0.3, (before, after)
    assert after["answered"] > before["answered"], (before, after)
