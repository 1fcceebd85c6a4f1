"""The prefix-tree row (``trl_multiturn.layouts.prefix_tree_row``): rows that share a prefix, not only a prompt,
compute it once.

When a chat template rewrites the context at every turn (a thinking template drops earlier ``<think>`` blocks, a
context function cuts old observations), the per-turn rows of a trajectory all start with the group's prompt and
then repeat the same earlier turns. The prefix tree lays every shared run out once (a run past the prompt only when
it is at least ``MIN_SHARED_RUN`` tokens long); these tests check that it is exact (log-probs and gradients of the
plain per-row forward), that it computes the tokens it should, that it is the old shared-prompt row where only
prompts are shared, and that the trainer trains the same with it while computing fewer positions.
"""

import pytest
import torch
from datasets import Dataset

from scripted import THINK_DROPPING, Recorder, ScriptedLM, logged, with_template
from test_layouts import trl_rows as trl_layout  # TRL's layout of (prompt, completion) lists
from test_rollout import SearchLikeEnv
from test_trainer import FeedbackEnv, dataset, make_args, vowel_reward

from trl_multiturn import MultiTurnGRPOConfig, MultiTurnGRPOTrainer
from trl_multiturn.batching import chunk_tokens
from trl_multiturn.generation import TransformersGenerator
from trl_multiturn.layouts import MIN_SHARED_RUN, prefix_tree_row, shared_prompt_row
from trl_multiturn.protocols import ChatToolProtocol
from trl_multiturn.scoring import deep_check_rows


def distinct_tokens(sizes, seed=0):
    """Runs of token ids, all different from each other (no accidental shared token between two runs)."""
    pool = (torch.randperm(4000, generator=torch.Generator().manual_seed(seed)) + 10).tolist()
    runs, at = [], 0
    for n in sizes:
        runs.append(pool[at : at + n])
        at += n
    return runs


def nested_rows():
    """Two prompts. Prompt A (9 tokens): one trajectory's turn rows whose contexts share X (30 tokens past the
    prompt) and then X + Y (50 tokens), a row that is a prefix of another (a truncated copy of turn 3), another
    trajectory sharing only the prompt, and a row sharing 10 tokens of X only (below the minimum run: laid out again
    in its own branch). Prompt B (6 tokens): rows sharing only the prompt, one without a completion token."""
    A, B, X, Y, a1, a2, a3, b1, z, c1, c2 = distinct_tokens([9, 6, 30, 20, 7, 6, 8, 5, 4, 6, 3])
    return [
        (A, a1),  # r0: trajectory 1, turn 1
        (B, c1),  # r1
        (A, X + a2),  # r2: turn 2, its context past the prompt moved into the completion (loss mask 0)
        (A, X + Y + a3),  # r3: turn 3: X and Y again
        (A, b1),  # r4: another trajectory of the group: only the prompt in common
        (A, X + Y + a3[:3]),  # r5: a prefix of r3
        (A, X[:10] + z),  # r6: 10 tokens of X, then its own
        (B, c2),  # r7
        (B, []),  # r8: no completion token
    ]


# Where the rows of nested_rows() land (row offsets):
#   A's prompt less its last token                       [0, 8)
#   r0: [last prompt token, a1]                          [8, 16)
#   X, from the last prompt token, less X's last token   [16, 46)  shared by r2, r3, r5
#   r2: [X's last token, a2]                             [46, 53)  attends to [0, 8) and [16, 46)
#   r3 (and r5): [X's last token, Y, a3]                 [53, 82)  attends to [0, 8) and [16, 46)
#   r4: [last prompt token, b1]                          [82, 88)
#   r6: [last prompt token, X[:10], z]                   [88, 103) (a shared run of 10 < 16: not a segment)
#   B's prompt less its last token                       [103, 108)
#   r1, r7, r8: [last prompt token, completion]          [108, 115), [115, 119), [119, 120)
NESTED_SEGMENTS = [(0, 8, 0, 0), (8, 16, 0, 8), (16, 46, 0, 8), (46, 53, 0, 8, 16, 46), (53, 82, 0, 8, 16, 46),
                   (82, 88, 0, 8), (88, 103, 0, 8), (103, 108, 103, 103), (108, 115, 103, 108),
                   (115, 119, 103, 108), (119, 120, 103, 108)]
#: tokens the prefix tree computes for nested_rows(), and the shared-prompt row: each prompt less its last token
#: (8 + 5), each row's [last prompt token, completion] (8 + 37 + 59 + 6 + 54 + 15 + 7 + 4 + 1)
NESTED_TOKENS, PROMPT_ONLY_TOKENS = 120, 204


def test_the_prefix_tree_lays_every_shared_run_out_once():
    ids, mask, c_w = trl_layout(nested_rows())
    tree = prefix_tree_row(ids, mask, c_w)
    assert tree.ids.size(1) == NESTED_TOKENS and tree.shares_past_prompts
    assert shared_prompt_row(ids, mask, c_w).ids.size(1) == PROMPT_ONLY_TOKENS
    assert [tuple(s) for s in tree.segments] == NESTED_SEGMENTS
    assert tree.segments[3].spans == [(0, 8), (16, 46)]
    # every completion token is the label of the column after the one that scores it, at its own position
    completion, valid = ids[:, -c_w:], mask[:, -c_w:].bool()
    assert torch.equal(tree.labels[0][tree.cols + 1][valid], completion[valid])
    assert torch.equal(tree.positions[0][tree.cols + 1][valid], (mask.sum(1, keepdim=True) - mask[:, -c_w:].sum(
        1, keepdim=True) + torch.arange(c_w))[valid])
    # shared columns: r5 reads r3's, r2 and r3 read X's (X is r2's completion columns 0..28 and r3's)
    assert torch.equal(tree.cols[5, :53], tree.cols[3, :53])
    assert torch.equal(tree.cols[2, :29], tree.cols[3, :29]) and tree.cols[2, 29] == tree.cols[3, 29] == 45
    # X's last token is scored at X's last column (45) through the label of the first child's first column
    assert tree.labels[0, 46] == ids[2, -c_w + 29] and tree.labels[0, 53] == -100
    # labelled columns: exactly the distinct scoring columns
    assert int((tree.labels != -100).sum()) == len(set(tree.cols[valid].tolist()))


def old_shared_prompt_row(rows):
    """The shared-prompt row as it always was, from first principles: per distinct prompt (in order of first
    appearance) the prompt less its last token at positions 0..n-2, then per row of that prompt, in row order, the
    suffix [last prompt token, completion] at positions n-1.., labels -100 on the prompt and on each suffix's first
    token, the completion tokens elsewhere; segments (prompt: itself causally; suffix: its prompt); completion
    column j of row i scored at the suffix start + j."""
    ids, positions, labels, segments, start = [], [], [], [], {}
    prompts = list(dict.fromkeys(tuple(p) for p, _ in rows))
    for prompt in prompts:
        n, offset = len(prompt), len(ids)
        ids += prompt[:-1]
        positions += range(n - 1)
        labels += [-100] * (n - 1)
        segments.append((offset, offset + n - 1, offset, offset))
        for i, (p, c) in enumerate(rows):
            if tuple(p) == prompt:
                start[i] = len(ids)
                ids += [prompt[-1]] + c
                positions += range(n - 1, n + len(c))
                labels += [-100] + c
                segments.append((start[i], len(ids), offset, offset + n - 1))
    c_w = max(max(len(c) for _, c in rows), 1)
    cols = [[min(start[i] + j, len(ids) - 2) for j in range(c_w)] for i in range(len(rows))]
    return ids, positions, labels, segments, cols


def test_sharing_only_prompts_gives_the_old_shared_prompt_row():
    P, Q, S, a, b, c, d, e, f = distinct_tokens([4, 3, 15, 3, 1, 2, 5, 4, 6], seed=1)
    rows = [(P, a), (Q, d), (P, b), (P, []), (P, S + c),
            (P, S + e),  # shares 15 tokens with the previous row: under the minimum, laid out in each
            (Q, f), (P, S[:5] + a)]
    ids, mask, c_w = trl_layout(rows)
    want_ids, want_positions, want_labels, want_segments, want_cols = old_shared_prompt_row(rows)
    for row in (prefix_tree_row(ids, mask, c_w), shared_prompt_row(ids, mask, c_w)):
        assert row.ids[0].tolist() == want_ids and row.positions[0].tolist() == want_positions
        assert row.labels[0].tolist() == want_labels
        assert row.segments == want_segments and all(len(s) == 4 for s in row.segments)
        assert row.cols.tolist() == want_cols
        assert not row.shares_past_prompts


def test_the_minimum_shared_run():
    assert MIN_SHARED_RUN == 16
    P, S, t1, t2, u, v1, v2 = distinct_tokens([5, 40, 4, 6, 5, 3, 2], seed=2)
    for run in (15, 16):
        ids, mask, c_w = trl_layout([(P, S[:run] + t1), (P, S[:run] + t2)])
        tree = prefix_tree_row(ids, mask, c_w)
        if run == 15:  # not worth a segment: the shared-prompt row
            assert tree.segments == shared_prompt_row(ids, mask, c_w).segments and not tree.shares_past_prompts
            assert tree.ids.size(1) == 4 + (15 + 4 + 1) + (15 + 6 + 1)
        else:  # the run once (from the last prompt token, less its own last token), then the two branches
            assert tree.segments == [(0, 4, 0, 0), (4, 20, 0, 4), (20, 25, 0, 20), (25, 32, 0, 20)]
            assert tree.ids.size(1) == 4 + 16 + (1 + 4) + (1 + 6) < 4 + 2 * (16 + 1) + 4 + 6
        prompt_only = shared_prompt_row(ids, mask, c_w).segments
        assert prefix_tree_row(ids, mask, c_w, min_shared=run + 1).segments == prompt_only
        assert prefix_tree_row(ids, mask, c_w, min_shared=run).shares_past_prompts

    # below a shared segment too: S (20 tokens) is a segment; the 5 tokens u that two of its branches share next
    # are laid out again in each of them
    rows = [(P, S[:20] + u + v1), (P, S[:20] + u + v2), (P, S[:20] + t1)]
    ids, mask, c_w = trl_layout(rows)
    tree = prefix_tree_row(ids, mask, c_w)
    assert tree.segments == [(0, 4, 0, 0), (4, 24, 0, 4), (24, 33, 0, 24), (33, 41, 0, 24), (41, 46, 0, 24)]
    assert prefix_tree_row(ids, mask, c_w, min_shared=5).segments == [
        (0, 4, 0, 0), (4, 24, 0, 4), (24, 29, 0, 24), (29, 33, 0, 29), (33, 36, 0, 29), (36, 41, 0, 24)]

    # identical rows, and a row that is a prefix of another, read one segment whatever its length
    ids, mask, c_w = trl_layout([(P, t1), (P, t1), (P, t1[:2])])
    tree = prefix_tree_row(ids, mask, c_w)
    assert tree.segments == [(0, 4, 0, 0), (4, 9, 0, 4)] and tree.shares_past_prompts
    assert torch.equal(tree.cols[0], tree.cols[1]) and torch.equal(tree.cols[2, :2], tree.cols[0, :2])


def test_bad_input_is_refused_clearly():
    P, Q, a = distinct_tokens([4, 4, 3], seed=3)
    ids, mask, c_w = trl_layout([(P, a), (P, a[:1])])
    with pytest.raises(ValueError, match="min_shared"):
        prefix_tree_row(ids, mask, c_w, min_shared=0)
    holed = mask.clone()
    holed[0, -c_w + 1] = 0
    with pytest.raises(ValueError, match="no holes"):
        prefix_tree_row(ids, holed, c_w)
    ids2, mask2, c_w2 = trl_layout([(P, a), (Q, a)])
    with pytest.raises(ValueError, match="same key but different prompt"):
        prefix_tree_row(ids2, mask2, c_w2, keys=[("k",), ("k",)])
    ids3, mask3, c_w3 = trl_layout([(P[:1], a), (P[:1], a[:2])])
    with pytest.raises(ValueError, match="at least two tokens"):
        prefix_tree_row(ids3, mask3, c_w3)
    with pytest.raises(ValueError, match="keys for"):
        prefix_tree_row(ids, mask, c_w, keys=[tuple(P)])


def _trainer(tmp_path, smollm2_tokenizer, model):
    return MultiTurnGRPOTrainer(
        model=model, args=make_args(tmp_path, pack_sequences=False), train_dataset=dataset(),
        environment_factory=FeedbackEnv, reward_funcs=[vowel_reward], processing_class=smollm2_tokenizer)


def _per_row_logps(model, rows):
    """The plain forward, one row at a time without padding: log-probs of each completion token."""
    out = []
    for p, c in rows:
        if not c:
            out.append(torch.zeros(0))
            continue
        ids = torch.tensor([p + c])
        logits = model(input_ids=ids).logits[0, len(p) - 1 : -1]  # (len(c), V) the columns scoring c
        out.append(torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(c).unsqueeze(1)).squeeze(1))
    return out


@pytest.mark.parametrize("checkpointing", [None, "non-reentrant"])
def test_the_prefix_tree_gives_the_per_row_log_probs_and_gradients(tmp_path, smollm2_tokenizer, tiny_model_factory,
                                                                   checkpointing):
    rows = nested_rows()
    trainer = _trainer(tmp_path, smollm2_tokenizer, tiny_model_factory(seed=4))
    model = trainer.model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    ids, mask, c_w = trl_layout(rows, pad=smollm2_tokenizer.pad_token_id)
    valid = mask[:, -c_w:].bool()
    weights = torch.linspace(0.5, 2.0, int(valid.sum()))
    params = [p for p in model.parameters() if p.requires_grad]

    seen = []
    hook = model.register_forward_pre_hook(
        lambda m, a, k: seen.append(k["input_ids"].numel()) if not trainer._in_packing_check else None,
        with_kwargs=True)
    try:
        ours, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, c_w)  # (9, C)
    finally:
        hook.remove()
    assert trainer._scorer.shared is True and trainer._scorer.tree is True  # checked on this very micro-batch
    assert seen == [NESTED_TOKENS]  # one forward, the tree: 120 positions (204 sharing only prompts, 9 x 67 compact)
    g_ours = torch.autograd.grad((ours[valid] * weights).sum(), params)

    plain = _per_row_logps(model, rows)
    theirs = torch.zeros_like(ours)
    for i, lp in enumerate(plain):
        theirs[i, : len(lp)] = lp
    torch.testing.assert_close(ours[valid], theirs[valid], atol=1e-5, rtol=1e-5)
    assert (ours[~valid] == 0).all()
    assert ours[5, :53].tolist() == ours[3, :53].tolist()  # the same columns: identical log-probs
    g_plain = torch.autograd.grad((theirs[valid] * weights).sum(), params)
    for p, a, b in zip(params, g_ours, g_plain):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        assert p.grad is None


def test_the_one_time_check_covers_sharing_past_the_prompts(tmp_path, smollm2_tokenizer, tiny_model_factory,
                                                            monkeypatch, caplog):
    """A first micro-batch that shares only prompts checks the shared-prompt row; the first one that shares more is
    checked again. Where that check fails (here: an attention that reads only the first ancestor span), the rows
    share their prompts only, with a warning, and the log-probs stay exact."""
    import trl_multiturn.shared_attention as attention

    rows = nested_rows()
    ids, mask, c_w = trl_layout(rows, pad=smollm2_tokenizer.pad_token_id)
    prompt_only = [0, 1, 4, 7]  # rows sharing nothing past their prompts
    for broken in (False, True):
        trainer = _trainer(tmp_path / str(broken), smollm2_tokenizer, tiny_model_factory(seed=5))
        model = trainer.model.eval()
        if broken:
            spans = attention.prefix_spans
            monkeypatch.setattr(attention, "prefix_spans", lambda segment: spans(segment)[:1])
        with torch.no_grad(), caplog.at_level("WARNING"):
            trainer._get_per_token_logps_and_entropies(model, ids[prompt_only], mask[prompt_only], c_w)
            assert trainer._scorer.shared is True and trainer._scorer.tree is None
            ours, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, c_w)
        assert trainer._scorer.shared is True and trainer._scorer.tree is (not broken)
        assert ("sharing prompts only" in caplog.text) is broken
        with torch.no_grad():
            plain = _per_row_logps(model, rows)
        for i, lp in enumerate(plain):
            torch.testing.assert_close(ours[i, : len(lp)], lp, atol=1e-5, rtol=1e-5)
        monkeypatch.undo()
        caplog.clear()


def test_deep_check_rows_picks_rows_that_share_past_their_prompt():
    rows = nested_rows()
    ids, mask, c_w = trl_layout(rows)
    keys = [tuple(p) for p, _ in rows]
    picked = deep_check_rows(keys, ids[:, -c_w:], mask[:, -c_w:], MIN_SHARED_RUN)
    assert picked == [0, 2, 3, 4]  # r2 and r3 share X; r0 before them, r4 after
    assert prefix_tree_row(ids[picked], mask[picked], c_w).shares_past_prompts
    only = [0, 1, 4, 6, 7]  # r6 shares 10 tokens with nobody here
    assert deep_check_rows([keys[i] for i in only], ids[only, -c_w:], mask[only, -c_w:], MIN_SHARED_RUN) is None


#: per turn, the two members' scripts: they search for different things, so a group's trajectories differ
THINK_TURNS = [
    ['<think>I should look it up.</think>\n<tool_call>\n{"name": "search", "arguments": {"query": "capital of '
     'France"}}\n</tool_call>',
     '<think>Search first.</think>\n<tool_call>\n{"name": "search", "arguments": {"query": "French government '
     'seat"}}\n</tool_call>'],
    ['<think>Once more, to be sure.</think>\n<tool_call>\n{"name": "search", "arguments": {"query": "French capital '
     'city"}}\n</tool_call>'] * 2,
    ["<think>Both documents say Paris.</think>\nParis"] * 2,
]


def alternating_reward(completions, **kwargs):
    return [float(i % 2) for i in range(len(completions))]


def _train_per_turn(tmp_path, tok, tiny_model_factory, min_shared):
    args = MultiTurnGRPOConfig(
        output_dir=str(tmp_path / "out"), num_generations=2, prompts_per_rollout=2, mini_batch_size=2,
        micro_batch_size=2, max_completion_length=300, max_turns=3, max_steps=2, logging_steps=1, optim="sgd",
        learning_rate=0.5, report_to="none", save_strategy="no", seed=0, turn_layout="per_turn", bf16=False,
    )
    trainer = MultiTurnGRPOTrainer(
        model=tiny_model_factory(seed=2), args=args, processing_class=tok, protocol=ChatToolProtocol(),
        train_dataset=Dataset.from_dict({"q": ["capital of France?", "capital of Peru?"]}),
        environment_factory=SearchLikeEnv, reward_funcs=[alternating_reward],
    )
    trainer._scorer.min_shared = min_shared  # None: share the prompts only (the layout before the prefix tree)
    scripts = [[tok(t, add_special_tokens=False)["input_ids"] for t in turn] for turn in THINK_TURNS]
    seen: dict[tuple, int] = {}

    def script(context_ids):  # search twice, then answer; the second member of a group writes its own text
        member = seen.get(tuple(context_ids), 0)
        seen[tuple(context_ids)] = member + 1
        return [scripts[min(tok.decode(context_ids).count("<tool_response>"), 2)][member % 2]]

    policy = ScriptedLM(script, len(tok), tok.eos_token_id)
    trainer._run_rollout = lambda inputs: trainer.rollout.run(inputs, TransformersGenerator(policy, tok),
                                                               trainer._sampling_params())
    positions = []  # tokens through the training forwards (with gradient; not the one-time checks)
    hook = trainer.model.register_forward_pre_hook(
        lambda m, a, k: positions.append(k["input_ids"].numel())
        if torch.is_grad_enabled() and not trainer._in_packing_check else None, with_kwargs=True)
    rec = Recorder(trainer)
    trainer.train()
    hook.remove()
    return trainer, rec, sum(positions)


def test_per_turn_rows_of_a_thinking_template_share_their_earlier_turns(tmp_path, smollm2_tokenizer,
                                                                        tiny_model_factory):
    """Through ``trainer.train()``: three turns per trajectory (search, search, answer) under a template that drops
    earlier ``<think>`` blocks, so each turn is a row whose context repeats the earlier turns without their
    reasoning. The prefix tree computes those once: fewer positions than sharing the prompt only, the same training
    (losses, ratios, parameters), a ratio of exactly 1 on the first mini-batch, checked once on a micro-batch that
    shares past its prompt."""
    tok = with_template(smollm2_tokenizer, THINK_DROPPING)
    tree, rec, tree_positions = _train_per_turn(tmp_path / "tree", tok, tiny_model_factory, MIN_SHARED_RUN)
    flat, _, flat_positions = _train_per_turn(tmp_path / "flat", tok, tiny_model_factory, None)

    (trajs,) = rec.rollouts
    assert all(t.info["actions"] == ["tool", "tool", "answer"] for t in trajs)
    assert trajs[0].completion_ids != trajs[1].completion_ids  # the members of a group differ
    repeated = 0  # per trajectory, turn 2's context past the prompt: turn 3's context starts with it
    for t in trajs:
        contexts = [ctx for ctx, _, _ in t.turn_rows()]
        assert contexts[2][: len(contexts[1])] == contexts[1] and len(contexts[1]) - len(t.prompt_ids) >= 16
        repeated += len(contexts[1]) - len(t.prompt_ids)
    assert tree._scorer.tree is True and tree._scorer.shared is True  # checked exact on a deep micro-batch
    assert flat._scorer.tree is None  # nothing shared past a prompt: never needed
    # each mini-batch (one group) is trained once; sharing prompts only, a micro-batch computes each prompt less
    # its last token once and every row's [last prompt token, completion] (the cost model of the planner)
    assert flat_positions == sum(chunk_tokens(c, True, False, True)[0] for c in flat._buffered_inputs)
    # the tree lays turn 2's context out once for turns 2 and 3 (their branches start with its last token): at least
    # that much less; a little more where the two members' contexts open alike for 16 tokens or more
    assert tree_positions <= flat_positions - repeated, (tree_positions, flat_positions, repeated)
    for trainer in (tree, flat):
        assert logged(trainer, "loss/ratio_min")[0] == 1.0 and logged(trainer, "loss/ratio_max")[0] == 1.0
        assert logged(trainer, "grad_norm")[0] > 0
    for key in ("loss", "grad_norm", "loss/ratio_min", "loss/ratio_max"):
        assert logged(tree, key) == pytest.approx(logged(flat, key), abs=1e-6, rel=1e-4), key
    for (name, p), q in zip(flat.model.named_parameters(), tree.model.parameters()):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-4, msg=name)
