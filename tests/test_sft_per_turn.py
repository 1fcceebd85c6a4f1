"""The per-turn layout of the SFT warm start (issue 19): ``sft_dataset(..., turn_layout="per_turn")``.

What is proven here: under a template that drops earlier ``<think>`` blocks, each example is the context its turn was
generated from (the earlier reasoning gone) followed by the trajectory's own ids, the supervised ids are exactly the
sampled ids and the observations inside a merged row stay masked; with a prefix-keeping template the per-turn examples
are exactly the single-sequence example; the SFT loss (the token mean of ``MultiTurnSFTTrainer``) over per-turn rows
equals the single-sequence loss when the contexts nest, also split into micro-batches, and is the per-row objective
when they do not; ``trajectories_from_policy`` records the contexts of a per-turn rollout with a context function as
the real rollout does; the search recipe's warm start replays its experts per turn with the run's context policy.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from scripted import CHATML, THINK_DROPPING, ReplayGenerator, with_template
from test_rollout import SearchLikeEnv

from trl_multiturn import sft
from trl_multiturn.context import OBSERVATION_PLACEHOLDER, keep_last_observations
from trl_multiturn.generation import SamplingParams
from trl_multiturn.protocols import ChatToolProtocol, TagProtocol
from trl_multiturn.rollout import MultiTurnRollout, RolloutConfig
from trl_multiturn.sft import sft_dataset, train_sft, trajectories_from_policy, trajectory_from_tag_text
from trl_multiturn.trajectory import Trajectory
from trl_multiturn.turn_rows import turn_rows_of

#: search (with reasoning), search (without), answer (with reasoning): under THINK_DROPPING turn 2's context drops
#: turn 1's <think> block (a new row), and turn 3's context is turn 2's context followed by turn 2 and its observation
#: (turn 2 has no <think> block to drop), so turns 2 and 3 share a row with the observation between them
TURNS = [
    '<think>I should look it up.</think>\n<tool_call>\n{"name": "search", "arguments": {"query": "capital of France"}}'
    "\n</tool_call>",
    '<tool_call>\n{"name": "search", "arguments": {"query": "French capital"}}\n</tool_call>',
    "<think>Both documents say Paris.</think>\nParis",
]


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def per_turn_trajectories(tok, questions=("capital of France?",)) -> list[Trajectory]:
    """The three TURNS as an expert, through the real per-turn rollout (ChatToolProtocol: the chat template)."""
    kept, fraction = trajectories_from_policy(
        [{"q": q} for q in questions], SearchLikeEnv, ChatToolProtocol(), tok,
        lambda example, observations: TURNS[len(observations)],
        RolloutConfig(max_turns=4, max_completion_length=512, env_timeout=5.0, turn_layout="per_turn"),
    )
    assert fraction == 1.0 and all(t.info["actions"] == ["tool", "tool", "answer"] for t in kept)
    return kept


def examples(trajectories, turn_layout):
    ds = sft_dataset(trajectories, turn_layout=turn_layout)
    return [(row["input_ids"], row["assistant_masks"]) for row in ds]


# ---------------------------------------------------------------------------------------------------- examples
def test_per_turn_examples_under_a_thinking_template(smollm2_tokenizer):
    tok = with_template(smollm2_tokenizer, THINK_DROPPING)
    (t,) = per_turn_trajectories(tok)
    c1, c2, c3 = t.turn_contexts
    assert "I should look it up" not in tok.decode(c2) + tok.decode(c3)  # the template dropped turn 1's reasoning
    (x1, m1), (x2, m2) = examples([t], "per_turn")  # turn 1; turns 2 and 3 merged

    # each example: the turn's context (mask 0), then the trajectory's ids exactly, with its action mask
    start2 = t.turn_ids.index(1)
    assert x1[: len(c1)] == c1 and m1[: len(c1)] == [0] * len(c1)
    assert x1[len(c1):] == ids(tok, TURNS[0]) + [tok.eos_token_id] and set(m1[len(c1):]) == {1}
    assert x2[: len(c2)] == c2 and m2[: len(c2)] == [0] * len(c2)
    assert x2[len(c2):] == t.completion_ids[start2:] and m2[len(c2):] == t.action_mask[start2:]
    # turn 3 is trained on the context it was generated from: the row's prefix before turn 3 is c3
    assert x2[: len(c3)] == c3 and m2[len(c3):] == [1] * (len(x2) - len(c3))
    # the observation between turns 2 and 3 is inside the row, masked
    observation = [x for x, m in zip(x2[len(c2):], m2[len(c2):]) if m == 0]
    assert "<tool_response>\nDoc 1(Title: French capital) text\n</tool_response>" in tok.decode(observation)

    # the supervised ids are exactly the sampled ids, each once, in order (hand-built: each turn + EOS)
    supervised = [x for x, m in zip(x1 + x2, m1 + m2) if m == 1]
    assert supervised == [i for turn in TURNS for i in ids(tok, turn) + [tok.eos_token_id]]
    assert supervised == [x for x, m in zip(t.completion_ids, t.action_mask) if m == 1]

    # the sequence layout trains turns 2 and 3 after turn 1's reasoning, which the deployed model never sees
    ((x, m),) = examples([t], "sequence")
    assert x == t.input_ids and "I should look it up" in tok.decode(x[: len(t.prompt_ids) + start2 + 1])


@pytest.mark.parametrize("template", ["chatml", "tag"])
def test_prefix_keeping_template_gives_back_the_single_sequence(smollm2_tokenizer, template, caplog):
    """ChatML (the chat template keeps the prefix property) and TagProtocol without a context function: the turn
    contexts nest, the rows merge, and the per-turn examples are exactly the single-sequence examples."""
    tok = with_template(smollm2_tokenizer, CHATML)
    if template == "chatml":
        trajectories = per_turn_trajectories(tok, ("capital of France?", "where is the Louvre?"))
    else:
        texts = ["<think>Look it up.</think>\n<search>capital</search>", "<answer>Paris</answer>"]
        trajectories, _ = trajectories_from_policy(
            [{"q": "capital of France?"}], SearchLikeEnv, TagProtocol(), tok,
            lambda example, observations: texts[len(observations)],
            RolloutConfig(max_turns=4, max_completion_length=512, env_timeout=5.0, turn_layout="per_turn"))
    assert all(len(t.turn_contexts) == t.num_turns >= 2 for t in trajectories)
    assert all(len(turn_rows_of(t, merge=False).contexts) == t.num_turns for t in trajectories)  # before merging
    per_turn = examples(trajectories, "per_turn")
    assert per_turn == examples(trajectories, "sequence")
    assert [x for x, _ in per_turn] == [t.input_ids for t in trajectories]

    # a trajectory without turn contexts stays one example, and the warning counts it
    plain = trajectory_from_tag_text("Question: capital of France?", "<answer>Paris</answer>", tok)
    with caplog.at_level(logging.WARNING, logger="trl_multiturn.sft"):
        mixed = examples([plain, *trajectories], "per_turn")
    assert mixed == examples([plain, *trajectories], "sequence")
    assert f"1 of {len(trajectories) + 1} trajectories have no turn_contexts" in caplog.text


def test_conversations_under_a_thinking_template_need_the_per_turn_collection(smollm2_tokenizer):
    """docs/turn_layouts.md, "Not covered yet": a conversation whose earlier ``<think>`` blocks the template drops
    cannot become one exact sequence (``trajectory_from_messages`` refuses it); it is collected per turn instead."""
    tok = with_template(smollm2_tokenizer, THINK_DROPPING)
    conversation = [{"role": "user", "content": "Capital of France?"},
                    {"role": "assistant", "content": "<think>Not sure.</think>\nLet me think."},
                    {"role": "user", "content": "Go on."},
                    {"role": "assistant", "content": "<think>It is Paris.</think>\nParis"}]
    with pytest.raises(ValueError, match="prefix-stable"):
        sft.trajectory_from_messages(conversation, tok)


def test_bad_turn_layout_is_named(smollm2_tokenizer, tmp_path):
    tok = with_template(smollm2_tokenizer, CHATML)
    trajectories = [trajectory_from_tag_text("Q?", "<answer>Paris</answer>", tok)]
    with pytest.raises(ValueError, match=r"turn_layout must be one of \('sequence', 'per_turn'\); got 'per-turn'"):
        sft_dataset(trajectories, turn_layout="per-turn")
    with pytest.raises(ValueError, match="got 'rows'"):  # refused before the trainer is built
        train_sft(None, tok, trajectories, SimpleNamespace(max_length=None), turn_layout="rows")


# ---------------------------------------------------------------------------------------------------- loss
def nll_token_mean(model, rows) -> torch.Tensor:
    """- 1/N sum_t m_t log p(x_t | x_<t) over ``rows`` ((ids, mask) pairs), each forwarded alone, N = sum_t m_t."""
    total, count = torch.zeros(()), 0
    for x, m in rows:
        x, m = torch.tensor([x]), torch.tensor(m)  # (1, T), (T,)
        logp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), -1)  # (T-1, V) predicts x[1:]
        token_logp = logp.gather(-1, x[0, 1:, None])[:, 0]  # (T-1,)
        total = total - (token_logp * m[1:]).sum()
        count += int(m[1:].sum())
    return total / count


def sft_trainer(tmp_path, tok, model, dataset):
    from trl import SFTConfig

    args = SFTConfig(output_dir=str(tmp_path / "sft"), per_device_train_batch_size=len(dataset), max_length=None,
                     bf16=False, report_to="none", save_strategy="no", disable_tqdm=True, seed=0)
    return sft._sft_trainer_class()(model=model, args=args, train_dataset=dataset, processing_class=tok)


def trainer_loss(trainer, model, rows: list[int], num_items: int) -> torch.Tensor:
    """``MultiTurnSFTTrainer.compute_loss`` on the dataset rows ``rows`` collated into one micro-batch, normalized by
    ``num_items`` supervised tokens (the accumulated batch's, as ``Trainer`` passes them)."""
    batch = trainer.data_collator([trainer.train_dataset[i] for i in rows])
    return trainer.compute_loss(model, dict(batch), num_items_in_batch=torch.tensor(num_items))


def supervised_tokens(dataset) -> int:
    return sum(sum(m[1:]) for m in dataset["assistant_masks"])


def test_per_turn_loss_equals_the_single_sequence_loss_when_contexts_nest(smollm2_tokenizer, tiny_model_factory,
                                                                          tmp_path, monkeypatch):
    """ChatML: every context is the single sequence so far. With the rows left unmerged (each turn its own example,
    its context repeated), the token mean over all rows equals the single-sequence loss: every supervised token once,
    with the same prefix. Merged (the default), the rows are the single sequence itself."""
    tok = with_template(smollm2_tokenizer, CHATML)
    trajectories = per_turn_trajectories(tok, ("capital of France?", "where is the Louvre?"))
    model = tiny_model_factory(seed=5).eval()
    sequence = sft_dataset(trajectories)
    monkeypatch.setattr(sft, "turn_rows_of", lambda t: turn_rows_of(t, merge=False))
    unmerged = sft_dataset(trajectories, turn_layout="per_turn")
    assert len(unmerged) == 6 and len(sequence) == 2  # three rows per trajectory
    n = supervised_tokens(sequence)
    assert supervised_tokens(unmerged) == n  # the rows partition the supervised tokens
    with torch.no_grad():
        reference = nll_token_mean(model, zip(sequence["input_ids"], sequence["assistant_masks"]))
        torch.testing.assert_close(nll_token_mean(model, zip(unmerged["input_ids"], unmerged["assistant_masks"])),
                                   reference, rtol=1e-5, atol=1e-6)
        # through the trainer's loss, one batch, and the same batch as two accumulated micro-batches (N the batch's)
        trainer = sft_trainer(tmp_path, tok, model, unmerged)
        torch.testing.assert_close(trainer_loss(trainer, model, list(range(6)), n), reference, rtol=1e-5, atol=1e-6)
        split = trainer_loss(trainer, model, [0, 1, 2, 3], n) + trainer_loss(trainer, model, [4, 5], n)
        torch.testing.assert_close(split, reference, rtol=1e-5, atol=1e-6)


def test_per_turn_loss_is_the_per_row_objective_under_a_thinking_template(smollm2_tokenizer, tiny_model_factory,
                                                                          tmp_path):
    """THINK_DROPPING: the contexts do not nest. The trainer's loss is the token mean over the rows, each token
    conditioned on its turn's context, which differs from the single-sequence loss (turns 2 and 3 lose turn 1's
    reasoning from their context)."""
    tok = with_template(smollm2_tokenizer, THINK_DROPPING)
    trajectories = per_turn_trajectories(tok, ("capital of France?", "where is the Louvre?"))
    model = tiny_model_factory(seed=6).eval()
    with torch.no_grad():  # a random init hardly reads its context: stronger attention outputs, a sharper head
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(5.0)
            layer.self_attn.o_proj.weight.mul_(5.0)
        model.lm_head.weight.mul_(20.0)
    per_turn, sequence = sft_dataset(trajectories, turn_layout="per_turn"), sft_dataset(trajectories)
    assert len(per_turn) == 4 and supervised_tokens(per_turn) == supervised_tokens(sequence)
    with torch.no_grad():
        rows = nll_token_mean(model, zip(per_turn["input_ids"], per_turn["assistant_masks"]))
        single = nll_token_mean(model, zip(sequence["input_ids"], sequence["assistant_masks"]))
        trainer = sft_trainer(tmp_path, tok, model, per_turn)
        loss = trainer_loss(trainer, model, list(range(4)), supervised_tokens(per_turn))
    torch.testing.assert_close(loss, rows, rtol=1e-5, atol=1e-6)
    assert abs(rows - single) > 1e-3, (rows, single)  # the contexts matter: not the single-sequence loss


# ---------------------------------------------------------------------------------------------------- collection
SEARCHES = ["<search>first</search>", "<search>second</search>", "<answer>Paris</answer>"]


def test_policy_trajectories_carry_the_contexts_of_a_per_turn_rollout(smollm2_tokenizer):
    """``trajectories_from_policy`` with ``RolloutConfig(turn_layout="per_turn", context_fn=...)`` records the same
    ``turn_contexts`` as the real rollout sampling the same turns; its per-turn examples show the placeholder where
    the context function removed an observation."""
    tok = smollm2_tokenizer
    config = RolloutConfig(max_turns=4, max_completion_length=256, env_timeout=5.0, turn_layout="per_turn",
                           context_fn=keep_last_observations(1))
    (t,), _ = trajectories_from_policy([{"q": "x"}], SearchLikeEnv, TagProtocol(), tok,
                                       lambda example, observations: SEARCHES[len(observations)], config, add_eos=False)
    rollout = MultiTurnRollout(SearchLikeEnv, TagProtocol(), tok, config)
    try:
        (rl,) = rollout.run([{"q": "x"}], ReplayGenerator(tok, SEARCHES), SamplingParams())
    finally:
        rollout.close()
    assert t.turn_contexts == rl.turn_contexts and len(t.turn_contexts) == 3
    assert t.input_ids == rl.input_ids and t.action_mask == rl.action_mask
    (_, _), (x2, m2) = examples([t], "per_turn")  # turns 1-2 nest; turn 3's context replaced observation 1
    assert x2[: len(t.turn_contexts[2])] == t.turn_contexts[2]
    assert OBSERVATION_PLACEHOLDER in tok.decode(x2) and "Doc 1(Title: first)" not in tok.decode(x2)
    assert [x for x, m in zip(x2, m2) if m] == ids(tok, SEARCHES[2])


def test_search_recipe_warm_start_replays_the_experts_per_turn(smollm2_tokenizer):
    """The recipe's ``warm_start_trajectories``: in the per-turn layout every expert episode is replayed to its
    answer, with the ids of the tag-text trajectory and the contexts of the run's context policy."""
    from repo_scripts import load_recipe

    from trl_multiturn.search.data import build_offline_dataset
    from trl_multiturn.search.environment import SearchEnvironment
    from trl_multiturn.search.expert import build_expert_trajectories
    from trl_multiturn.search.retrievers import BM25Retriever

    recipe = load_recipe()
    tok, protocol = smollm2_tokenizer, TagProtocol()
    kb = build_offline_dataset(num_entities=20, seed=0)
    retriever = BM25Retriever(kb.corpus)
    env_factory = lambda: SearchEnvironment(retriever, topk=2)  # noqa: E731
    experts, _ = build_expert_trajectories(kb.train_rows[:8], env_factory=env_factory, seed=0)
    assert any(len(e.turns) == 3 for e in experts)  # a two-hop episode: search, search, answer

    sequence = recipe.warm_start_trajectories(
        experts, tok, protocol, env_factory, SimpleNamespace(turn_layout="sequence"))
    per_turn = recipe.warm_start_trajectories(
        experts, tok, protocol, env_factory, SimpleNamespace(turn_layout="per_turn", keep_last_observations=1))
    assert len(per_turn) == len(sequence) == len(experts)
    assert all(not t.turn_contexts for t in sequence)
    for a, b, e in zip(sequence, per_turn, experts):
        assert b.input_ids == a.input_ids and b.action_mask == a.action_mask
        assert len(b.turn_contexts) == len(e.turns)
    two_hop = [b for b, e in zip(per_turn, experts) if len(e.turns) == 3]
    for t in two_hop:  # turn 3 sees the placeholder instead of the first search's documents: a row of its own
        assert OBSERVATION_PLACEHOLDER in tok.decode(t.turn_contexts[2])
        assert len(turn_rows_of(t).contexts) == 2
    assert len(sft_dataset(per_turn, turn_layout="per_turn")) == len(per_turn) + len(two_hop)
