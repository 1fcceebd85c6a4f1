"""Multi-turn SFT: exact masks from chat templates, tag text and scripted policies; TRL's SFTTrainer loss on them.

What is proven here: the mask of a 3-turn tool conversation and of an inline-tag trajectory equals a hand-built
one; a scripted policy run through an environment gives exactly the ids of an RL rollout of the same actions (and
of the conversation / tag-text builders); SFTTrainer's loss on our pre-tokenized dataset is minus the token mean of
the log-probs of exactly the assistant tokens, packed or not; predictions at observation positions do not enter it;
single-turn SFT is the one-assistant-turn case (TRL's own prompt-completion labels); a short real run learns.
"""

from __future__ import annotations

import copy

import pytest
import torch
from scripted import ScriptedLM

from trl_multiturn.environment import Step
from trl_multiturn.generation import SamplingParams, TransformersGenerator
from trl_multiturn.models import tool_chat_template
from trl_multiturn.protocols import ChatToolProtocol, TagProtocol
from trl_multiturn.rollout import MultiTurnRollout, RolloutConfig
from trl_multiturn.sft import (
    sft_dataset,
    train_sft,
    trajectories_from_policy,
    trajectory_from_messages,
    trajectory_from_tag_text,
)
from trl_multiturn.trajectory import Trajectory

SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


@pytest.fixture(scope="module")
def tool_tok(smollm2_tokenizer):
    """SmolLM2's tokenizer with the tool chat template (a copy: the shared fixture stays untouched)."""
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = tool_chat_template()
    return tok


CONVERSATION = [
    {"role": "user", "content": "What is (1+2)*4?"},
    {"role": "assistant", "content": "", "tool_calls": [call("add", a=1, b=2)]},
    {"role": "tool", "name": "add", "content": "3"},
    {"role": "assistant", "content": "Now multiply.", "tool_calls": [call("mul", a=3, b=4)]},
    {"role": "tool", "name": "mul", "content": "12"},
    {"role": "assistant", "content": "It is 12."},
]
TAG_TEXT = (
    "<think>I need to search.</think>\n<search>capital of France</search>"
    "\n\n<information>Doc 1(Title: France) Paris is the capital of France.</information>\n\n"
    "<think>Found it.</think>\n<answer>Paris</answer>"
)


def expected(tok, prompt: str, pieces: list[tuple[str, int]]):
    """Hand-built (prompt ids, completion ids, mask): each piece tokenized on its own, with the mask written by hand."""
    comp, mask = [], []
    for text, m in pieces:
        piece = ids(tok, text)
        comp += piece
        mask += [m] * len(piece)
    return ids(tok, prompt), comp, mask


# ---------------------------------------------------------------------------------------------------- masks
def test_chat_template_masks_of_a_three_turn_tool_conversation(tool_tok):
    tok = tool_tok
    traj = trajectory_from_messages(CONVERSATION, tok)
    prompt, comp, mask = expected(
        tok,
        SYSTEM + "<|im_start|>user\nWhat is (1+2)*4?<|im_end|>\n<|im_start|>assistant\n",
        [
            ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>', 1),
            ("\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n", 0),
            ('Now multiply.\n<tool_call>\n{"name": "mul", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>', 1),
            ("\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n<|im_start|>assistant\n", 0),
            ("It is 12.<|im_end|>", 1),
            ("\n", 0),  # the template's newline after the last EOS: not written by the model
        ],
    )
    assert traj.prompt_ids == prompt
    assert traj.completion_ids == comp
    assert traj.action_mask == mask
    assert traj.input_ids == list(tok.apply_chat_template(CONVERSATION, tokenize=True)["input_ids"])  # one-shot
    assert traj.num_turns == 3 and sorted(set(traj.turn_ids)) == [0, 1, 2]
    traj.validate()


def test_chat_template_problems_are_named(tool_tok, smollm2_tokenizer):
    with pytest.raises(ValueError, match="no assistant message"):
        trajectory_from_messages(CONVERSATION[:1], tool_tok)
    with pytest.raises(ValueError, match="starts with an assistant"):
        trajectory_from_messages(CONVERSATION[1:], tool_tok)
    # SmolLM2's own template renders an assistant turn without its tool call
    with pytest.raises(ValueError, match="tool_chat_template"):
        trajectory_from_messages(CONVERSATION, smollm2_tokenizer)
    # a template that rewrites earlier turns once more messages follow
    unstable = copy.deepcopy(tool_tok)
    unstable.chat_template = (
        "{% for m in messages %}{{ m.content if loop.last else m.content[:3] }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}A:{% endif %}"
    )
    with pytest.raises(ValueError, match="prefix-stable"):
        trajectory_from_messages(CONVERSATION[:1] + [{"role": "assistant", "content": "It is 12."}] * 2, unstable)


def test_inline_tag_masks(smollm2_tokenizer):
    tok = smollm2_tokenizer
    protocol = TagProtocol()
    traj = trajectory_from_tag_text("Question: capital of France?", TAG_TEXT, tok, protocol)
    _, comp, mask = expected(
        tok,
        "",
        [
            ("<think>I need to search.</think>\n<search>capital of France</search>", 1),
            ("\n\n<information>Doc 1(Title: France) Paris is the capital of France.</information>\n\n", 0),
            ("<think>Found it.</think>\n<answer>Paris</answer>", 1),
            ("<|im_end|>", 1),  # EOS after the final answer (add_eos=True): the model learns to stop
        ],
    )
    assert traj.prompt_ids == protocol.prompt_ids(tok, "Question: capital of France?")
    assert traj.completion_ids == comp and traj.action_mask == mask
    assert traj.num_turns == 2 and traj.info["final_answer"] == "Paris"
    # without EOS: exactly what the rollout produces (it stops at </answer>)
    bare = trajectory_from_tag_text("Question: capital of France?", TAG_TEXT + "\n", tok, protocol, add_eos=False)
    assert bare.completion_ids == comp[:-1] and bare.action_mask == mask[:-1]


def test_inline_tag_problems_are_named(smollm2_tokenizer):
    tok = smollm2_tokenizer
    with pytest.raises(ValueError, match="observation_template"):  # the observation is not in the template's layout
        trajectory_from_tag_text("Q", "<search>q</search>\n<information>x</information>\n<answer>a</answer>", tok)
    with pytest.raises(ValueError, match="inside the action"):
        trajectory_from_tag_text("Q", "<information>made up</information><answer>a</answer>", tok)
    with pytest.raises(ValueError, match="after the final answer"):
        trajectory_from_tag_text("Q", "<answer>a</answer> and more", tok)
    with pytest.raises(ValueError, match="after its last complete action"):
        trajectory_from_tag_text("Q", "I think it is Paris.", tok)
    with pytest.raises(TypeError, match="TagProtocol"):
        trajectory_from_tag_text("Q", "<answer>a</answer>", tok, ChatToolProtocol())


# ---------------------------------------------------------------------------------------------------- policies
class SearchLikeEnv:
    """Answers a search with a fixed observation; an answer ends the episode with reward 1 if it says 'paris'."""

    def reset(self, example):
        return f"Question: {example['q']}"

    def step(self, action):
        if action.kind == "tool":
            return Step(observation=f"Doc 1(Title: {action.arguments['query']}) Paris is the capital of France.")
        if action.kind == "answer":
            return Step(reward=float(action.content.lower() == "paris"), done=True)
        return Step(observation="Invalid.")


SEARCH = "<think>I need to search.</think>\n<search>capital of France</search>"
ANSWER = "<think>Found it.</think>\n<answer>Paris</answer>"


def expert(example, observations):
    """Searches, then answers from what the environment returned (an observation-dependent scripted policy)."""
    if not observations:
        return SEARCH + " text after the closing tag is never part of the turn"
    return ANSWER if "Paris" in observations[-1] else None


def test_policy_trajectories_equal_an_rl_rollout(smollm2_tokenizer):
    tok = smollm2_tokenizer
    examples = [{"q": "capital of France?"}, {"q": "where is the Louvre?"}]
    config = RolloutConfig(max_turns=4, max_completion_length=256, env_timeout=2.0)
    # RL: the real generation loop sampling the same two turns (stops at the stop strings)
    lm = ScriptedLM([ids(tok, SEARCH), ids(tok, ANSWER)], len(tok), tok.eos_token_id)
    rollout = MultiTurnRollout(SearchLikeEnv, TagProtocol(), tok, config)
    rl = rollout.run(examples, TransformersGenerator(lm, tok), SamplingParams())
    rollout.close()

    kept, fraction = trajectories_from_policy(
        examples, SearchLikeEnv, TagProtocol(), tok, expert, config, add_eos=False
    )
    assert fraction == 1.0 and len(kept) == 2
    for sft, ref in zip(kept, rl):
        assert sft.input_ids == ref.input_ids and sft.prompt_ids == ref.prompt_ids
        assert sft.action_mask == ref.action_mask and sft.turn_ids == ref.turn_ids
        assert sft.turn_rewards == ref.turn_rewards == [0.0, 1.0]
        assert sft.info["stop_reason"] == "answer"

    # with EOS: the RL ids plus one EOS, mask 1, after the answer; and the tag-text builder agrees token for token
    (with_eos,), _ = trajectories_from_policy(examples[:1], SearchLikeEnv, TagProtocol(), tok, expert, config)
    assert with_eos.input_ids == rl[0].input_ids + [tok.eos_token_id]
    assert with_eos.action_mask == rl[0].action_mask + [1]
    observation = SearchLikeEnv().step(TagProtocol().parse(SEARCH)).observation
    text = SEARCH + f"\n\n<information>{observation}</information>\n\n" + ANSWER
    from_text = trajectory_from_tag_text(SearchLikeEnv().reset(examples[0]), text, tok)
    assert from_text.input_ids == with_eos.input_ids and from_text.action_mask == with_eos.action_mask


class CalculatorEnv:
    def reset(self, example):
        return [{"role": "user", "content": example["question"]}]

    def step(self, action):
        if action.kind == "tool":
            ops = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b}
            return Step(observation=str(ops[action.name](**action.arguments)))
        return Step(reward=1.0, done=True)


def test_chat_tool_policy_equals_the_conversation(tool_tok):
    """The same behaviour through ChatToolProtocol's rollout and through the chat template gives the same ids."""
    tok = tool_tok
    turns = [
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
        'Now multiply.\n<tool_call>\n{"name": "mul", "arguments": {"a": 3, "b": 4}}\n</tool_call>',
        "It is 12.",
    ]
    (traj,), fraction = trajectories_from_policy(
        [{"question": "What is (1+2)*4?"}],
        CalculatorEnv,
        ChatToolProtocol(),
        tok,
        lambda example, observations: turns[len(observations)],
    )
    assert fraction == 1.0 and traj.info["stop_reason"] == "answer"
    conversation = trajectory_from_messages(CONVERSATION, tok)
    n = len(traj.input_ids)
    assert conversation.input_ids[:n] == traj.input_ids
    assert conversation.action_mask[: n - len(traj.prompt_ids)] == traj.action_mask
    assert tok.decode(conversation.input_ids[n:]) == "\n"  # the template's newline after the last EOS, mask 0


def test_search_expert_trajectories_convert_identically(smollm2_tokenizer):
    """The search expert's text (observations inline) and a replay of its actions through the environment agree."""
    from trl_multiturn.search.data import build_offline_dataset
    from trl_multiturn.search.environment import SearchEnvironment
    from trl_multiturn.search.expert import build_expert_trajectories
    from trl_multiturn.search.retrievers import BM25Retriever

    tok, protocol = smollm2_tokenizer, TagProtocol()
    kb = build_offline_dataset(num_entities=20, seed=0)
    retriever = BM25Retriever(kb.corpus)
    experts, stats = build_expert_trajectories(kb.train_rows[:6], retriever, seed=0, topk=3)
    assert stats["kept"] >= 4
    from_text = [trajectory_from_tag_text(t.prompt, t.to_text(), tok, protocol) for t in experts]
    actions = {t.example["question"]: t.actions for t in experts}
    replayed, fraction = trajectories_from_policy(
        [t.example for t in experts],
        lambda: SearchEnvironment(retriever, topk=3),
        protocol,
        tok,
        lambda example, observations: actions[example["question"]][len(observations)],
        RolloutConfig(max_turns=4, max_completion_length=2048),
    )
    assert fraction == 1.0
    for a, b, expert_traj in zip(from_text, replayed, experts):
        assert a.input_ids == b.input_ids and a.action_mask == b.action_mask
        assert (
            a.num_turns == len(expert_traj.turns) and a.info["final_answer"] == expert_traj.example["golden_answers"][0]
        )


class FlakyEnv(SearchLikeEnv):
    def step(self, action):
        if "explode" in action.text:
            raise RuntimeError("retriever down")
        return super().step(action)


def test_policy_rejection_and_kept_fraction(smollm2_tokenizer):
    tok = smollm2_tokenizer

    def policy(example, observations):
        mode = example["mode"]
        if mode == "gives_up":
            return expert(example, observations) if not observations else None
        if mode == "never_answers":
            return "<search>again</search>"
        if mode == "env_error":
            return "<search>explode</search>"
        return expert(example, observations)

    modes = ["ok", "gives_up", "never_answers", "env_error", "ok"]
    kept, fraction = trajectories_from_policy(
        [{"q": "x", "mode": m} for m in modes],
        FlakyEnv,
        TagProtocol(),
        tok,
        policy,
        RolloutConfig(max_turns=3, max_completion_length=256, env_timeout=2.0),
    )
    assert fraction == 2 / 5 and len(kept) == 2
    assert all(t.info["stop_reason"] == "answer" and not t.truncated for t in kept)


# ---------------------------------------------------------------------------------------------------- loss
def sft_args(tmp_path, **overrides):
    from trl import SFTConfig

    kw = {
        "output_dir": str(tmp_path / "sft"),
        "per_device_train_batch_size": 3,
        "max_length": None,
        "bf16": False,
        "gradient_checkpointing": False,
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": True,
        "seed": 0,
    }
    return SFTConfig(**{**kw, **overrides})


def hand_loss(model, trajectories: list[Trajectory]) -> torch.Tensor:
    """- 1/N sum_t m_t log p(x_t | x_<t) over all trajectories, each forwarded alone (no padding, no packing)."""
    total, count = torch.zeros(()), 0
    for t in trajectories:
        x = torch.tensor([t.input_ids])  # (1, T)
        m = torch.tensor([0] * len(t.prompt_ids) + t.action_mask)  # (T,)
        logp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), -1)  # (T-1, V) predicts x[1:]
        token_logp = logp.gather(-1, x[0, 1:, None])[:, 0]  # (T-1,)
        total = total - (token_logp * m[1:]).sum()
        count += int(m[1:].sum())
    return total / count


def three_trajectories(tool_tok):
    single = trajectory_from_messages(CONVERSATION[:1] + [{"role": "assistant", "content": "It is 12."}], tool_tok)
    return [
        single,
        trajectory_from_messages(CONVERSATION, tool_tok),
        trajectory_from_tag_text("Q?", TAG_TEXT, tool_tok),
    ]


def batch_for(trainer):
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    return trainer.data_collator(rows)


def test_sft_loss_is_the_token_mean_over_assistant_tokens(tmp_path, tool_tok, tiny_model_factory):
    from trl import SFTTrainer

    trajectories = three_trajectories(tool_tok)
    model = tiny_model_factory(seed=1)
    trainer = SFTTrainer(
        model=model, args=sft_args(tmp_path), train_dataset=sft_dataset(trajectories), processing_class=tool_tok
    )
    # TRL turned our masks into labels: the token where the mask is 1, -100 elsewhere
    for row, t in zip(trainer.train_dataset, trajectories):
        assert row["input_ids"] == t.input_ids
        assert row["labels"] == [x if m else -100 for x, m in zip(t.input_ids, [0] * len(t.prompt_ids) + t.action_mask)]
    batch = batch_for(trainer)
    model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(model, dict(batch))
        reference = hand_loss(model, trajectories)
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-6)

    # Predictions at positions whose target is an observation / prompt / template token do not enter the loss:
    # perturbing the final hidden state there (after the last attention layer, so nothing else moves) changes nothing,
    # while perturbing one position whose target is an assistant token does.
    labels = batch["labels"]  # (B, L)
    observation_target = torch.zeros_like(labels, dtype=torch.bool)
    observation_target[:, :-1] = labels[:, 1:] == -100  # (B, L) position t predicts token t+1
    assistant_target = ~observation_target
    assistant_target[:, -1] = False

    def perturbed_loss(where: torch.Tensor) -> torch.Tensor:
        handle = model.model.norm.register_forward_hook(lambda mod, inp, out: out + 10.0 * where[..., None])
        try:
            with torch.no_grad():
                return trainer.compute_loss(model, dict(batch))
        finally:
            handle.remove()

    torch.testing.assert_close(perturbed_loss(observation_target), loss, rtol=0, atol=1e-6)
    one = torch.zeros_like(assistant_target)
    one[1, assistant_target[1].nonzero()[0]] = True
    assert abs(perturbed_loss(one) - loss) > 1e-3


def test_single_turn_is_one_assistant_turn(tmp_path, tool_tok, tiny_model_factory):
    """Single-turn SFT is the case K = 1: TRL's own prompt-completion SFT supervises the same tokens."""
    from datasets import Dataset
    from trl import SFTTrainer

    prompt = [{"role": "user", "content": "What is (1+2)*4?"}]
    completion = [{"role": "assistant", "content": "It is 12."}]
    traj = trajectory_from_messages(prompt + completion, tool_tok)
    assert traj.num_turns == 1
    assert traj.prompt_ids == list(tool_tok.apply_chat_template(prompt, add_generation_prompt=True)["input_ids"])
    assert traj.completion_ids[: traj.num_action_tokens] == ids(tool_tok, "It is 12.") + [tool_tok.eos_token_id]

    model = tiny_model_factory()
    trainer = SFTTrainer(
        model=model,
        args=sft_args(tmp_path, completion_only_loss=True),
        train_dataset=Dataset.from_list([{"prompt": prompt, "completion": completion}]),
        processing_class=tool_tok,
    )
    trl_single = trainer.train_dataset[0]
    assert trl_single["input_ids"] == traj.input_ids
    ours = [x if m else -100 for x, m in zip(traj.input_ids, [0] * len(traj.prompt_ids) + traj.action_mask)]
    # identical labels, except that TRL also supervises the template's newline after the EOS (never generated)
    assert trl_single["labels"][:-1] == ours[:-1]
    assert tool_tok.decode(traj.input_ids[-1:]) == "\n" and ours[-1] == -100

    # the loss on our example is the classic one: -1/|y| sum_t log p(y_t | x, y_<t), y = answer + EOS
    x, y = traj.prompt_ids, traj.completion_ids[: traj.num_action_tokens]
    model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(model, trainer.data_collator([{"input_ids": traj.input_ids, "labels": ours}]))
        logits = model(input_ids=torch.tensor([x + y])).logits[0].float()  # (|x| + |y|, V)
        logp = torch.log_softmax(logits[len(x) - 1 : -1], -1)  # (|y|, V) predicts y
        classic = -logp.gather(-1, torch.tensor(y)[:, None]).mean()
    torch.testing.assert_close(loss, classic, rtol=1e-5, atol=1e-6)


def test_packing_keeps_the_loss(tmp_path, tool_tok, tiny_model_factory):
    """BFD packing puts whole trajectories in one padding-free row; the loss equals the unpacked one."""
    from trl import SFTTrainer

    trajectories = three_trajectories(tool_tok)
    model = tiny_model_factory(seed=2)
    args = sft_args(tmp_path, packing=True, max_length=512)
    trainer = SFTTrainer(model=model, args=args, train_dataset=sft_dataset(trajectories), processing_class=tool_tok)
    assert len(trainer.train_dataset) == 1  # one packed row
    batch = batch_for(trainer)
    assert "position_ids" in batch and batch["input_ids"].shape[1] == sum(len(t.input_ids) for t in trajectories)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            trainer.compute_loss(model, dict(batch)), hand_loss(model, trajectories), rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("packing", [False, True])
def test_compact_head_equals_trl(tmp_path, tool_tok, tiny_model_factory, packing):
    """MultiTurnSFTTrainer on CPU: the LM head sees only supervised positions; loss, gradients and metrics are TRL's."""
    from trl import SFTTrainer

    from trl_multiturn.sft import MultiTurnSFTTrainer

    trajectories = three_trajectories(tool_tok)
    extra = {"packing": True, "max_length": 512} if packing else {}
    results = []
    for cls in (SFTTrainer, MultiTurnSFTTrainer):
        model = tiny_model_factory(seed=4)
        trainer = cls(model=model, args=sft_args(tmp_path, **extra), train_dataset=sft_dataset(trajectories),
                      processing_class=tool_tok)
        batch = batch_for(trainer)
        rows = []
        handle = model.lm_head.register_forward_hook(lambda mod, inp, out: rows.append(inp[0].shape[:-1].numel()))
        model.train()
        n_items = (batch["labels"][:, 1:] != -100).sum()
        loss = trainer.compute_loss(model, dict(batch), num_items_in_batch=n_items)
        loss.backward()
        handle.remove()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        results.append((loss.detach(), grads, metrics, rows, batch))
    (trl_loss, trl_grads, trl_metrics, trl_rows, batch), (loss, grads, metrics, rows, _) = results
    torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == trl_grads.keys()
    for k in grads:
        torch.testing.assert_close(grads[k], trl_grads[k], rtol=1e-4, atol=1e-6)
    for k in ("entropy", "mean_token_accuracy", "num_tokens"):
        assert metrics[k] == pytest.approx(trl_metrics[k], rel=1e-4), k
    supervised = int((batch["labels"][:, 1:] != -100).any(0).sum())
    # the head ran once, on the supervised positions (TRL's fused head on CPU scores all labels.numel() positions)
    assert rows == [batch["labels"].shape[0] * supervised] and rows[0] < batch["labels"].numel()
    with torch.no_grad():
        torch.testing.assert_close(loss, hand_loss(model.eval(), trajectories), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------- training
def test_train_sft_short_run_learns(tmp_path, tool_tok, tiny_model_factory):
    from peft import LoraConfig

    trajectories = three_trajectories(tool_tok)
    model = tiny_model_factory(seed=3)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    trainer = train_sft(model, tool_tok, trajectories, sft_args(tmp_path, max_steps=4, learning_rate=3e-2))
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.5, losses  # the same batch each step: loss goes down
    assert all(not torch.equal(v, dict(model.named_parameters())[k]) for k, v in before.items())

    # PEFT through SFTTrainer: only the adapter trains
    trainer = train_sft(
        tiny_model_factory(seed=3),
        tool_tok,
        trajectories,
        sft_args(tmp_path, max_steps=1),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    params = dict(trainer.model.named_parameters())
    assert any("lora_" in k for k in params) and all(("lora_" in k) == p.requires_grad for k, p in params.items())
    assert any("lora_B" in k and p.abs().sum() > 0 for k, p in params.items())  # lora_B starts at zero


def test_bad_settings_are_named(tmp_path, tool_tok, tiny_model_factory):
    trajectories = three_trajectories(tool_tok)
    with pytest.raises(ValueError, match="assistant_only_loss"):
        train_sft(None, tool_tok, trajectories, sft_args(tmp_path, assistant_only_loss=True))
    with pytest.raises(ValueError, match="wrapped"):
        train_sft(
            None, tool_tok, trajectories, sft_args(tmp_path, packing=True, max_length=512, packing_strategy="wrapped")
        )
    with pytest.raises(ValueError, match="max_length=16"):
        train_sft(None, tool_tok, trajectories, sft_args(tmp_path, max_length=16))
    with pytest.raises(ValueError, match="no trajectories"):
        sft_dataset([])
    empty = Trajectory(prompt_ids=[1, 2])
    empty.add_observation([3])
    with pytest.raises(ValueError, match="trajectory 1 has no assistant token"):
        sft_dataset([trajectories[0], empty])


def test_trl_sft_private_seams_are_still_there(tmp_path, tool_tok, tiny_model_factory):
    """The SFTTrainer state MultiTurnSFTTrainer's loss reads and writes (metrics, token count, tensor-parallel size,
    the cases it leaves to TRL): if TRL renames or reshapes it, this fails before users do."""
    import inspect

    from trl import SFTTrainer

    from trl_multiturn.sft import MultiTurnSFTTrainer

    assert list(inspect.signature(SFTTrainer.compute_loss).parameters) == [
        "self", "model", "inputs", "return_outputs", "num_items_in_batch"]
    trainer = MultiTurnSFTTrainer(model=tiny_model_factory(seed=4), args=sft_args(tmp_path),
                                  train_dataset=sft_dataset(three_trajectories(tool_tok)), processing_class=tool_tok)
    assert set(trainer._metrics) >= {"train", "eval"} and isinstance(trainer._metrics["train"], dict)
    assert isinstance(trainer._total_train_tokens, int) and isinstance(trainer._tp_size, int)
    assert trainer.aux_loss_enabled is False and trainer.label_smoother is None and trainer.compute_loss_func is None
    assert trainer._accepts_logits_to_keep(trainer.model)
    assert trainer._compact_head_applies(trainer.model, {"labels": torch.zeros(1, 2, dtype=torch.long)}, False)
