"""The per-turn layout's rows (trl_multiturn.turn_rows) and the loss's split invariance (issue 19, items 1-2).

The property: a trajectory weighs the same in the loss whether it is one row or K rows. Under every aggregation, the
loss and its gradient computed on per-turn rows equal the single-sequence layout's whenever each turn's context is
the sequence so far (the template keeps the prefix property)."""

import random

import pytest
import torch

from trl_multiturn.batching import attach_normalizers, balanced_micro_batches, chunk_normalizers
from trl_multiturn.loss import AGGREGATIONS, aggregate_loss, grpo_loss, loss_normalizers, sequence_shares
from trl_multiturn.trajectory import Trajectory
from trl_multiturn.turn_rows import (
    TRAJECTORY_ID,
    TurnRowRegistry,
    expand_turn_rows,
    trajectory_mini_batches,
    turn_rows_of,
)

PAD = 0


def _trajectory(rng: random.Random, prompt_len: int, turns: int, vocab: int = 50) -> Trajectory:
    """A per-turn trajectory whose contexts are the sequence so far (the prefix property holds)."""
    t = Trajectory(prompt_ids=[rng.randrange(1, vocab) for _ in range(prompt_len)])
    for k in range(turns):
        t.turn_contexts.append(t.input_ids)
        t.add_action([rng.randrange(1, vocab) for _ in range(rng.randint(1, 5))])
        if k < turns - 1:
            t.add_observation([rng.randrange(1, vocab) for _ in range(rng.randint(1, 4))])
    return t


def _scored(trajs: list[Trajectory], advantages: torch.Tensor | None = None) -> dict:
    """TRL's layout of a scored rollout: prompts left-padded, completions right-padded, the action mask as tool_mask."""
    n, p_w, c_w = len(trajs), max(len(t.prompt_ids) for t in trajs), max(len(t.completion_ids) for t in trajs)
    batch = {"prompt_ids": torch.full((n, p_w), PAD), "prompt_mask": torch.zeros((n, p_w), dtype=torch.long),
             "completion_ids": torch.full((n, c_w), PAD), "completion_mask": torch.zeros((n, c_w), dtype=torch.long),
             "tool_mask": torch.zeros((n, c_w), dtype=torch.long),
             "sampling_per_token_logps": torch.zeros((n, c_w)),
             "advantages": torch.randn(n) if advantages is None else advantages, "num_items_in_batch": torch.tensor(7)}
    for b, t in enumerate(trajs):
        p, c = len(t.prompt_ids), len(t.completion_ids)
        batch["prompt_ids"][b, p_w - p :] = torch.tensor(t.prompt_ids)
        batch["prompt_mask"][b, p_w - p :] = 1
        batch["completion_ids"][b, :c] = torch.tensor(t.completion_ids)
        batch["completion_mask"][b, :c] = 1
        batch["tool_mask"][b, :c] = torch.tensor(t.action_mask)
        batch["sampling_per_token_logps"][b, :c] = torch.arange(c, dtype=torch.float32) + 100 * b
    return batch


def test_expand_turn_rows_cuts_each_turn_and_repeats_the_trajectory():
    rng = random.Random(0)
    trajs = [_trajectory(rng, 4, 3), _trajectory(rng, 6, 1), Trajectory(prompt_ids=[5, 6])]
    trajs[2].add_observation([9])  # a failed reset: one masked token, no turn -> kept as one row
    batch = _scored(trajs)
    rows, owner = expand_turn_rows(batch, [turn_rows_of(t, merge=False) for t in trajs], PAD)
    assert owner == [0, 0, 0, 1, 2]
    assert rows["num_items_in_batch"] is batch["num_items_in_batch"]
    for r, b in enumerate(owner):
        t = trajs[b]
        prompt = rows["prompt_ids"][r][rows["prompt_mask"][r].bool()].tolist()
        completion = rows["completion_ids"][r][rows["completion_mask"][r].bool()].tolist()
        if b < 2:
            k = owner[:r].count(b)
            sampled = [i for i, tid, m in zip(t.completion_ids, t.turn_ids, t.action_mask) if tid == k and m]
            head = len(t.turn_contexts[k]) - len(t.prompt_ids)  # the context past the prompt heads the completion
            assert prompt == t.prompt_ids  # every row of the trajectory has its prompt (shared by the group)
            assert prompt + completion == t.turn_contexts[k] + sampled  # the row is the context, then turn k's ids
            loss = rows["tool_mask"][r][rows["completion_mask"][r].bool()].tolist()
            assert loss == [0] * head + [1] * len(sampled)  # the moved context carries no loss
            assert rows["context_tokens"][r] == head  # counted apart (perf/completion_token_frac leaves it out)
            cols = [c for c, (tid, m) in enumerate(zip(t.turn_ids, t.action_mask)) if tid == k and m]
            expected = [0.0] * head + [float(c + 100 * b) for c in cols]  # per-token tensors cut at the same columns
            assert rows["sampling_per_token_logps"][r, : head + len(cols)].tolist() == expected
        else:
            assert prompt == [5, 6] and completion == [9] and rows["tool_mask"][r].sum() == 0
            assert rows["context_tokens"][r] == 0
        assert rows["advantages"][r] == batch["advantages"][b]  # per trajectory: repeated
        assert rows["sequence_tokens"][r] == trajs[b].num_action_tokens  # N_g over all its rows
    assert sequence_shares(rows["completion_mask"] * rows["tool_mask"], rows["sequence_tokens"]).tolist()[:4] == \
        pytest.approx([len(trajs[0].turn_rows()[k][1]) / trajs[0].num_action_tokens for k in range(3)] + [1.0])


def test_nested_contexts_merge_into_one_row_and_a_rewritten_context_starts_a_new_one():
    rng = random.Random(2)
    t = _trajectory(rng, 4, 3)  # contexts nest: the single sequence comes back as one row
    whole = turn_rows_of(t)
    assert whole.contexts == [t.prompt_ids] and whole.columns == [list(range(len(t.completion_ids)))]
    batch = _scored([t])
    rows, owner = expand_turn_rows(batch, [whole], PAD)
    for key in ("prompt_ids", "completion_ids", "completion_mask", "tool_mask", "sampling_per_token_logps"):
        assert torch.equal(rows[key], batch[key]), key  # exactly the single-sequence row
    # turn 2's context rewritten (a dropped think block, a cut observation): turns 0-1 share a row, turn 2 has its own
    t.turn_contexts[2] = t.turn_contexts[2][:-1]
    split = turn_rows_of(t)
    start2 = t.turn_ids.index(2)
    end1 = max(c for c, (k, m) in enumerate(zip(t.turn_ids, t.action_mask)) if k == 1 and m) + 1
    assert split.contexts == [t.prompt_ids, t.turn_contexts[2]]
    assert split.columns == [list(range(0, end1)), list(range(start2, len(t.completion_ids)))]
    rows, _ = expand_turn_rows(_scored([t]), [split], PAD)
    assert rows["tool_mask"].sum() == t.num_action_tokens  # observations inside a merged row carry no loss
    assert rows["sequence_tokens"].tolist() == [t.num_action_tokens] * 2


def test_registry_round_trip_and_trajectory_mini_batches():
    rng = random.Random(1)
    trajs = [_trajectory(rng, 3, rng.randint(1, 3)) for _ in range(4)]
    batch = _scored(trajs)
    registry = TurnRowRegistry(merge=False)
    registry.register(batch, trajs)
    assert batch[TRAJECTORY_ID].tolist() == [0, 1, 2, 3]
    perm = [2, 3, 0, 1]  # the group shuffle reorders rows; the ids follow them
    shuffled = {k: (v[perm] if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in batch.items()}
    rows, owner = registry.expand(shuffled, PAD)
    assert TRAJECTORY_ID not in rows
    assert rows["completion_ids"].size(0) == sum(trajs[b].num_turns for b in perm)
    minis = trajectory_mini_batches(owner, 4, 2)
    assert [sorted({owner[r] for r in m}) for m in minis] == [[0, 1], [2, 3]]
    assert sum(minis, []) == list(range(len(owner)))
    with pytest.raises(ValueError, match="do not split"):
        trajectory_mini_batches(owner, 4, 3)


def _split_rows(mat: torch.Tensor, cuts: list[list[int]], n_tok: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of (B, T) cut into per-turn rows at ``cuts`` (column boundaries per trajectory)."""
    rows, masks, seq = [], [], []
    for b, bounds in enumerate(cuts):
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            row = torch.zeros_like(mat[b])
            m = torch.zeros(mat.size(1), dtype=torch.long)
            row[: hi - lo], m[: hi - lo] = mat[b, lo:hi], 1
            rows.append(row)
            masks.append(m)
            seq.append(n_tok[b])
    return torch.stack(rows), torch.stack(masks), torch.tensor(seq, dtype=torch.float32)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregate_loss_is_invariant_to_the_split(mode):
    gen = torch.Generator().manual_seed(0)
    lengths = [7, 3, 10, 5]
    T = max(lengths)
    loss_mat = torch.randn(4, T, generator=gen)
    mask = torch.zeros(4, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    whole = aggregate_loss(loss_mat, mask, mode, norm_constant=16)
    cuts = [[0, 2, 7], [0, 3], [0, 1, 4, 9, 10], [0, 5]]
    rows, row_mask, seq = _split_rows(loss_mat, cuts, lengths)
    split = aggregate_loss(rows, row_mask, mode, norm_constant=16, sequence_tokens=seq)
    torch.testing.assert_close(split, whole)
    n_seq, n_tok = loss_normalizers(row_mask, seq)
    assert float(n_seq) == pytest.approx(4.0) and int(n_tok) == sum(lengths)
    # sharded over two micro-batches with the mini-batch's global counts: the shards add up to the same loss
    halves = [slice(0, 3), slice(3, rows.size(0))]
    total = sum(aggregate_loss(rows[h], row_mask[h], mode, norm_constant=16, sequence_tokens=seq[h],
                               global_num_sequences=n_seq, global_num_tokens=n_tok) for h in halves)
    torch.testing.assert_close(total.float(), whole.float())


def test_sequence_tokens_smaller_than_the_row_is_refused():
    with pytest.raises(ValueError, match="N_g"):
        loss_normalizers(torch.ones(1, 4), torch.tensor([2.0]))


@pytest.mark.parametrize("mode, merge", [(mode, False) for mode in AGGREGATIONS] + [("seq-mean-token-mean", True)])
def test_per_turn_rows_give_the_single_sequence_loss_and_gradient_on_a_real_forward(tiny_model_factory, mode, merge):
    """A tiny Llama forwards both layouts; prefix contexts make the per-turn rows' log-probs those of the sequence,
    and the planner's micro-batches with their normalizers then give the same loss and the same gradient."""
    model = tiny_model_factory(hidden_size=32, num_layers=2, seed=3).float()
    rng = random.Random(4)
    trajs = [_trajectory(rng, rng.randint(3, 6), rng.randint(1, 3), vocab=400) for _ in range(4)]
    batch = _scored(trajs, advantages=torch.tensor([1.0, -0.5, 0.25, -0.75]))

    def logps(chunk: dict) -> torch.Tensor:
        ids = torch.cat([chunk["prompt_ids"], chunk["completion_ids"]], 1)  # (b, P+C)
        attention = torch.cat([chunk["prompt_mask"], chunk["completion_mask"]], 1)  # (b, P+C)
        position = (attention.cumsum(1) - 1).clamp(min=0)  # (b, P+C) left padding
        logits = model(input_ids=ids, attention_mask=attention, position_ids=position).logits.float()
        c = chunk["completion_ids"].size(1)
        lp = torch.log_softmax(logits[:, -c - 1 : -1], -1)  # (b, C, V)
        return lp.gather(-1, chunk["completion_ids"].unsqueeze(-1)).squeeze(-1)  # (b, C)

    def step_loss(chunks: list[dict]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        attach_normalizers(chunks, chunk_normalizers(chunks), len(chunks))
        model.zero_grad()
        total = 0.0
        for chunk in chunks:
            lp = logps(chunk)
            loss, _ = grpo_loss(lp, lp.detach(), chunk["advantages"], chunk["completion_mask"] * chunk["tool_mask"],
                                aggregation=mode, global_num_sequences=chunk["mb_num_sequences"],
                                global_num_tokens=chunk["mb_num_tokens"], norm_constant=32.0,
                                sequence_tokens=chunk.get("sequence_tokens"))
            loss.backward()
            total = total + loss.detach()
        return total, [p.grad.clone() for p in model.parameters() if p.grad is not None]

    whole, whole_grads = step_loss(balanced_micro_batches(batch, 2, 2))
    rows, owner = expand_turn_rows(batch, [turn_rows_of(t, merge=merge) for t in trajs], PAD)
    assert rows["completion_ids"].size(0) == (len(trajs) if merge else sum(t.num_turns for t in trajs))
    minis = trajectory_mini_batches(owner, len(trajs), 1)
    split, split_grads = step_loss(balanced_micro_batches(rows, 2, 2, mini_batches=minis))
    torch.testing.assert_close(split, whole, atol=1e-6, rtol=1e-5)
    for a, b in zip(split_grads, whole_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    assert any(float(g.abs().sum()) > 0 for g in whole_grads)  # the gradient is not trivially 0


def test_completion_token_frac_leaves_out_the_moved_context():
    from accelerate import Accelerator

    from trl_multiturn import metrics

    rng = random.Random(3)
    t = _trajectory(rng, 4, 3)
    rows, _ = expand_turn_rows(_scored([t]), [turn_rows_of(t, merge=False)], PAD)
    logged = {"perf/useful_token_frac": [], "perf/completion_token_frac": []}
    processed = int(rows["completion_mask"].numel() + rows["prompt_mask"].numel())
    metrics.log_padding(logged, [(processed, processed)], [rows], Accelerator(cpu=True))
    added = int(rows["completion_mask"].sum()) - sum(len(c) - len(t.prompt_ids) for c in t.turn_contexts)
    assert added == sum(len(cols) for cols in (turn_rows_of(t, merge=False).columns))  # the turns' own columns
    assert logged["perf/completion_token_frac"] == [pytest.approx(added / processed)]
