"""``turn_layout="per_turn"`` through ``MultiTurnGRPOTrainer.train()`` (issue 19): one row per turn, each turn
trained on the context it was generated from, and a trajectory weighing the same as in the single-sequence layout.

- With a template that keeps the prefix property (Search-R1's tags), the per-turn layout trains exactly what the
  single-sequence layout trains: the same rollout, the same losses, the same parameters after two optimizer steps
  (one of them off-policy).
- With a thinking template that drops earlier ``<think>`` blocks, each trained row is (the context the turn was
  generated from, the ids sampled in that turn): turn 2's row does not see turn 1's reasoning, the ratio is exactly 1
  on the fresh rollout, and a KL term is scored on the same rows.
"""

import pytest
import torch
from datasets import Dataset

from scripted import THINK_DROPPING, Recorder, ScriptedLM, logged, with_template
from test_rollout import SearchLikeEnv
from test_trainer import FeedbackEnv, dataset, make_args, vowel_reward

from trl_multiturn import MultiTurnGRPOConfig, MultiTurnGRPOTrainer
from trl_multiturn.generation import TransformersGenerator
from trl_multiturn.protocols import ChatToolProtocol


def _train(tmp_path, tiny_model_factory, tokenizer, layout, **overrides):
    torch.manual_seed(0)
    # plain SGD: Adam's m / sqrt(v) turns float noise in a near-zero gradient entry into a full-size step
    args = make_args(tmp_path / layout, max_steps=2, mini_batch_size=4, micro_batch_size=2, turn_layout=layout,
                     optim="sgd", learning_rate=0.5, **overrides)
    trainer = MultiTurnGRPOTrainer(model=tiny_model_factory(seed=1), args=args, train_dataset=dataset(),
                                   environment_factory=FeedbackEnv, reward_funcs=[vowel_reward],
                                   processing_class=tokenizer)
    rec = Recorder(trainer)
    trainer.train()
    return trainer, rec


@pytest.mark.parametrize("aggregation, budget", [("seq-mean-token-mean", None), ("token-mean", None),
                                                 ("seq-mean-token-mean", 200)])
def test_per_turn_rows_train_exactly_what_the_sequence_trains_when_the_prefix_property_holds(
        tmp_path, smollm2_tokenizer, tiny_model_factory, aggregation, budget):
    kw = dict(loss_aggregation=aggregation, max_tokens_per_micro_batch=budget)  # budget: token-budget micro-batches
    seq, seq_rec = _train(tmp_path, tiny_model_factory, smollm2_tokenizer, "sequence", **kw)
    per, per_rec = _train(tmp_path, tiny_model_factory, smollm2_tokenizer, "per_turn", **kw)
    for a, b in zip(seq_rec.rollouts[0], per_rec.rollouts[0]):  # the same trajectories, sampled from the same contexts
        assert a.completion_ids == b.completion_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert b.turn_contexts == [b.input_ids[: len(b.prompt_ids) + a.turn_ids.index(k)] for k in range(b.num_turns)]
    assert max(t.num_turns for t in per_rec.rollouts[0]) > 1  # several rows per trajectory
    for key in ("loss", "grad_norm", "loss/ratio_min", "loss/ratio_max"):
        assert logged(per, key) == pytest.approx(logged(seq, key), abs=1e-6, rel=1e-4), key
    assert logged(per, "loss/ratio_min")[1] != 1.0  # the second step is off-policy: a real comparison of ratios
    for (name, p), q in zip(seq.model.named_parameters(), per.model.parameters()):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-4, msg=name)


THINK_TURNS = [
    '<think>I should look it up.</think>\n<tool_call>\n{"name": "search", "arguments": {"query": "capital of France"}}'
    "\n</tool_call>",
    "<think>The document says Paris.</think>\nParis",
]


def alternating_reward(completions, **kwargs):
    """1 for every other trajectory: each group has reward variance under a deterministic scripted policy."""
    return [float(i % 2) for i in range(len(completions))]


def test_a_thinking_template_trains_each_turn_on_the_context_it_was_generated_from(
        tmp_path, smollm2_tokenizer, tiny_model_factory):
    from peft import LoraConfig

    tok = with_template(smollm2_tokenizer, THINK_DROPPING)
    args = MultiTurnGRPOConfig(
        output_dir=str(tmp_path / "out"), num_generations=2, prompts_per_rollout=2, mini_batch_size=4,
        micro_batch_size=2, max_completion_length=160, max_turns=3, max_steps=1, logging_steps=1, beta=0.05,
        learning_rate=1e-2, report_to="none", save_strategy="no", seed=0, turn_layout="per_turn",
        template_check="error",  # not raised: the per-turn layout trains on the template's own rendering
    )
    trainer = MultiTurnGRPOTrainer(
        model=tiny_model_factory(seed=2), args=args, processing_class=tok, protocol=ChatToolProtocol(),
        train_dataset=Dataset.from_dict({"q": ["capital of France?", "capital of Peru?"]}),
        environment_factory=SearchLikeEnv, reward_funcs=[alternating_reward],
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),  # reference: adapter off
    )
    scripts = [tok(t, add_special_tokens=False)["input_ids"] for t in THINK_TURNS]
    def script(context_ids):  # search first, answer once a tool response is in the context
        return [scripts[1] if "<tool_response>" in tok.decode(context_ids) else scripts[0]]

    policy = ScriptedLM(script, len(tok), tok.eos_token_id)  # samples the scripted turns; the tiny model is trained
    trainer._run_rollout = lambda inputs: trainer.rollout.run(inputs, TransformersGenerator(policy, tok),
                                                               trainer._sampling_params())
    rec = Recorder(trainer)
    trainer.train()

    (trajs,) = rec.rollouts
    assert all(t.info["actions"] == ["tool", "answer"] for t in trajs)
    expected = {(tuple(ctx + ids), tuple(ids)) for t in trajs for ctx, ids, _ in t.turn_rows()}
    rows = set()
    for chunk in trainer._buffered_inputs:  # the micro-batches the step trained on
        if chunk.get("empty_micro_batch"):
            continue
        for b in range(chunk["prompt_ids"].size(0)):
            prompt = chunk["prompt_ids"][b][chunk["prompt_mask"][b].bool()].tolist()
            real = chunk["completion_mask"][b].bool()
            completion = chunk["completion_ids"][b][real].tolist()
            trained = chunk["completion_ids"][b][real & chunk["tool_mask"][b].bool()].tolist()
            assert tuple(prompt) in {tuple(t.prompt_ids) for t in trajs}  # its group's prompt, shared by its rows
            rows.add((tuple(prompt + completion), tuple(trained)))  # (the context and the turn, the turn)
            assert chunk["sequence_tokens"][b] == sum(len(ids) for _, ids, _ in trajs[0].turn_rows())
    assert rows == expected and len(rows) == 2 * 2  # one row per turn (the two questions' groups sample alike)
    second_turn_contexts = [tok.decode(ctx) for t in trajs for ctx, _, _ in t.turn_rows()[1:]]
    assert second_turn_contexts and all("I should look it up" not in c for c in second_turn_contexts)
    assert "I should look it up" in tok.decode(trajs[0].input_ids)  # the single sequence keeps it
    assert trainer._sharing_checked is True  # the group's rows went through the shared-prompt forward, checked exact
    assert logged(trainer, "loss/ratio_min") == [1.0] and logged(trainer, "loss/ratio_max") == [1.0]
    # the two members of each group wrote the same text with opposite advantages (and the KL term is at its minimum),
    # so the gradient is exactly 0 once identical rows share their columns; a non-zero gradient through per-turn rows
    # with distinct members: tests/test_prefix_tree.py::test_per_turn_rows_of_a_thinking_template_share_their_earlier_turns
    assert torch.isfinite(torch.tensor(logged(trainer, "grad_norm"))).all()
    assert all(torch.isfinite(c["ref_per_token_logps"]).all() for c in trainer._buffered_inputs)
    kl = logged(trainer, "loss/kl")
    assert len(kl) == 1 and kl[0] == pytest.approx(0.0, abs=1e-6)  # a fresh LoRA adapter: policy == reference


def test_per_turn_refusals(tmp_path):
    with pytest.raises(ValueError, match="turn_layout='per_turn'"):
        MultiTurnGRPOConfig(output_dir=str(tmp_path), keep_last_observations=2)
    with pytest.raises(ValueError, match="importance_sampling_level='sequence'"):
        MultiTurnGRPOConfig(output_dir=str(tmp_path), turn_layout="per_turn", importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="balance_micro_batches=True"):
        MultiTurnGRPOConfig(output_dir=str(tmp_path), turn_layout="per_turn", balance_micro_batches=False)
    with pytest.raises(ValueError, match="turn_layout=.*not valid"):
        MultiTurnGRPOConfig(output_dir=str(tmp_path), turn_layout="rows")


def test_evaluation_scores_the_per_turn_rows_with_the_reference_on_their_contexts(
        tmp_path, smollm2_tokenizer, tiny_model_factory):
    """``trainer.evaluate()`` on an ``eval_dataset`` under a thinking template: the loss is computed on the rows
    training would see (each turn on the context it was generated from, N_g over the trajectory's rows), and the
    reference's log-probs for the KL term are scored on those contexts, not cut from the single sequence."""
    from peft import LoraConfig

    tok = with_template(smollm2_tokenizer, THINK_DROPPING)
    questions = Dataset.from_dict({"q": ["capital of France?", "capital of Peru?"]})
    args = MultiTurnGRPOConfig(
        output_dir=str(tmp_path / "out"), num_generations=2, prompts_per_rollout=2, mini_batch_size=4,
        micro_batch_size=2, per_device_eval_batch_size=4, max_completion_length=160, max_turns=3, max_steps=1,
        logging_steps=1, beta=0.05, report_to="none", save_strategy="no", seed=0, turn_layout="per_turn",
    )
    trainer = MultiTurnGRPOTrainer(
        model=tiny_model_factory(seed=2), args=args, processing_class=tok, protocol=ChatToolProtocol(),
        train_dataset=questions, eval_dataset=questions, environment_factory=SearchLikeEnv,
        reward_funcs=[alternating_reward],
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),  # reference: adapter off
    )
    with torch.no_grad():  # a trained-looking adapter: the policy differs from the reference
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    scripts = [tok(t, add_special_tokens=False)["input_ids"] for t in THINK_TURNS]
    policy = ScriptedLM(lambda ctx: [scripts[1] if "<tool_response>" in tok.decode(ctx) else scripts[0]],
                        len(tok), tok.eos_token_id)
    trainer._run_rollout = lambda inputs: trainer.rollout.run(inputs, TransformersGenerator(policy, tok),
                                                               trainer._sampling_params())
    rec = Recorder(trainer)
    seen = []
    compute_loss = trainer.compute_loss
    trainer.compute_loss = lambda model, inputs, *a, **k: seen.append(inputs) or compute_loss(model, inputs, *a, **k)
    metrics = trainer.evaluate()

    trajs = [t for rollout in rec.rollouts for t in rollout]
    assert trajs and all(t.info["actions"] == ["tool", "answer"] for t in trajs)
    expected = {(tuple(ctx + ids), tuple(ids)) for t in trajs for ctx, ids, _ in t.turn_rows()}
    rows = set()
    for inputs in seen:
        assert "sequence_tokens" in inputs  # N_g over the trajectory's rows, not the row's own tokens
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        width = inputs["completion_ids"].size(1)
        with torch.no_grad(), trainer.model.disable_adapter():
            position = (mask.cumsum(1) - 1).clamp(min=0)
            logits = trainer.model(input_ids=ids, attention_mask=mask, position_ids=position).logits.float()
        ref = torch.log_softmax(logits[:, -width - 1 : -1], -1).gather(-1, inputs["completion_ids"].unsqueeze(-1))
        loss_mask = (inputs["completion_mask"] * inputs["tool_mask"]).bool()
        torch.testing.assert_close(inputs["ref_per_token_logps"][loss_mask], ref.squeeze(-1)[loss_mask],
                                   atol=1e-4, rtol=1e-4)
        for b in range(ids.size(0)):
            real = inputs["completion_mask"][b].bool()
            prompt = inputs["prompt_ids"][b][inputs["prompt_mask"][b].bool()].tolist()
            trained = inputs["completion_ids"][b][real & inputs["tool_mask"][b].bool()].tolist()
            rows.add((tuple(prompt + inputs["completion_ids"][b][real].tolist()), tuple(trained)))
    assert rows == expected and len(rows) > len({tuple(t.input_ids) for t in trajs})  # per turn, not per sequence
    assert torch.isfinite(torch.tensor(metrics["eval_loss"])) and metrics["eval_loss/kl"] > 0  # policy != reference
