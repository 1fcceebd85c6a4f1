"""The scorer projects only the loss's tokens through the LM head (``scored=``, the trainer's loss mask): observation
tokens and trajectories without loss stay in the forward as context, but their log-probs are not computed. On CPU,
where TRL's fused head projects every position, :func:`trl_multiturn.scoring.lm_head_on_labelled_positions` makes it
project the labelled ones only. The values and gradients of the scored tokens are those of scoring everything."""

from __future__ import annotations

import pytest
import torch
from test_layouts import trl_rows as trl_layout
from test_prefix_tree import _trainer, nested_rows
from trl.trainer import utils as trl_utils

from trl_multiturn.layouts import compact_rows, prompt_keys, scored_labels
from trl_multiturn.loss import loss_mask
from trl_multiturn.scoring import lm_head_on_labelled_positions


class ProjectedRows:
    """Replaces TRL's chunked log-prob function; records how many positions each call projects onto the vocabulary."""

    seen: list[int] = []

    def __init__(self, original):
        self.original = original

    def apply(self, hidden, *args):
        ProjectedRows.seen.append(hidden.size(0))
        return self.original.apply(hidden, *args)


@pytest.fixture
def projected(monkeypatch):
    ProjectedRows.seen = []
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", ProjectedRows(trl_utils._ChunkedLogProbFunction))
    return ProjectedRows.seen


def test_scored_labels_keeps_the_label_columns_of_scored_tokens():
    labels = torch.tensor([[-100, 5, 6, 7], [-100, -100, 8, 9]])
    positions = torch.tensor([[1, 2, 3], [2, 3, 3]])  # the last column of row 1 is padding (clamped)
    scored = torch.tensor([[True, False, True], [False, True, False]])
    assert scored_labels(labels, positions, scored).tolist() == [[-100, 5, -100, 7], [-100, -100, -100, 9]]
    # one row for all (the prefix tree): two rows reading the same column keep it when either is scored
    row = torch.tensor([[-100, 4, 5, 6, 7]])
    cols = torch.tensor([[1, 2], [1, 4]])
    assert scored_labels(row, cols, torch.tensor([[False, True], [True, False]])).tolist() == [[-100, 4, 5, -100, -100]]
    assert scored_labels(row, cols, torch.zeros(2, 2, dtype=torch.bool)).eq(-100).all()


def test_loss_mask_is_the_completion_mask_times_the_tool_mask():
    batch = {"completion_mask": torch.tensor([[1, 1, 1, 0]])}
    assert loss_mask(batch).tolist() == [[1, 1, 1, 0]]
    batch["tool_mask"] = torch.tensor([[1, 0, 1, 1]])
    assert loss_mask(batch).tolist() == [[1, 0, 1, 0]]


@pytest.mark.parametrize("layout", ["compact", "packed", "shared", "tree"])
def test_only_the_loss_tokens_are_projected_and_their_values_stay(layout, tmp_path, smollm2_tokenizer,
                                                                   tiny_model_factory, projected):
    rows = nested_rows()
    trainer = _trainer(tmp_path, smollm2_tokenizer, tiny_model_factory(seed=5))
    scorer, model = trainer._scorer, trainer.model.train()
    scorer.min_shared = 16 if layout == "tree" else None  # "shared": the prompts only
    ids, mask, c_w = trl_layout(rows, pad=smollm2_tokenizer.pad_token_id)
    valid = mask[:, -c_w:].bool()  # (9, C)
    scored = valid & (torch.arange(c_w) % 4 != 1)  # every fourth column an observation token
    scored[4] = False  # a trajectory that carries no loss (dropped)
    compact, keys = compact_rows(ids, mask, c_w), prompt_keys(ids[:, :-c_w], mask[:, :-c_w])
    params = [p for p in model.parameters() if p.requires_grad]
    weights = torch.linspace(0.5, 2.0, int(scored.sum()))

    with lm_head_on_labelled_positions(ids.device):
        full, _ = scorer._forward(layout, model, ids, mask, c_w, compact, keys, False)
        full_projected = projected.pop()
        part, _ = scorer._forward(layout, model, ids, mask, c_w, compact, keys, False, scored)
        part_projected = projected.pop()
    torch.testing.assert_close(part[scored], full[scored], atol=1e-6, rtol=1e-6)
    assert (part[valid & ~scored] == 0).all() and part[scored].abs().min() > 0
    g_full = torch.autograd.grad((full[scored] * weights).sum(), params)
    g_part = torch.autograd.grad((part[scored] * weights).sum(), params)
    for a, b in zip(g_part, g_full):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)

    if layout == "tree":  # rows 3 and 5 share X and Y: a shared column is projected once
        row = scorer._tree_row(ids, mask, c_w, keys, 16)
        assert row.shares_past_prompts
        expected, everything = len(set((row.cols + 1)[scored].tolist())), len(set((row.cols + 1)[valid].tolist()))
    else:
        expected, everything = int(scored.sum()), int(valid.sum())
    assert (part_projected, full_projected) == (expected, everything)
    assert part_projected < full_projected


def test_on_cpu_trls_head_projects_every_position_unless_asked(tmp_path, smollm2_tokenizer, tiny_model_factory,
                                                                projected):
    trainer = _trainer(tmp_path, smollm2_tokenizer, tiny_model_factory(seed=5))
    model = trainer.model.eval()
    ids = torch.randint(10, 400, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = ids.masked_fill(torch.arange(12) < 9, -100)  # 3 labelled positions per row
    with torch.no_grad():
        everything = model(input_ids=ids, labels=labels, fused_lm_head=True).log_probs
        with lm_head_on_labelled_positions(ids.device):
            labelled = model(input_ids=ids, labels=labels, fused_lm_head=True).log_probs
    assert projected == [2 * 11, 2 * 3]  # TRL's CPU path: every position of (2, 12 - 1); here: the labelled ones
    assert torch.equal(labelled == 0, everything == 0)
    torch.testing.assert_close(labelled, everything, atol=1e-6, rtol=1e-6)

    original = trl_utils._use_triton
    with pytest.raises(KeyError), lm_head_on_labelled_positions(torch.device("cpu")):
        assert trl_utils._use_triton is not original
        raise KeyError("boom")
    assert trl_utils._use_triton is original  # restored on error too
    with lm_head_on_labelled_positions(torch.device("meta")):  # other devices: TRL's own choice
        assert trl_utils._use_triton is original


def test_the_trainer_scores_pi_old_and_the_loss_on_the_loss_tokens_only(tmp_path, smollm2_tokenizer,
                                                                          tiny_model_factory, projected):
    rows = nested_rows()
    trainer = _trainer(tmp_path, smollm2_tokenizer, tiny_model_factory(seed=5))
    ids, mask, c_w = trl_layout(rows, pad=smollm2_tokenizer.pad_token_id)
    p_w = ids.size(1) - c_w
    tool = (torch.arange(c_w) % 4 != 1).long().expand(len(rows), c_w).clone()  # (9, C) 0 on observation tokens
    chunk = {"prompt_ids": ids[:, :p_w], "prompt_mask": mask[:, :p_w], "completion_ids": ids[:, p_w:],
             "completion_mask": mask[:, p_w:], "tool_mask": tool}
    seen = []
    real = trainer._scorer.score
    trainer._scorer.score = lambda *a, **k: seen.append(k["scored"]) or real(*a, **k)
    trainer._score_old_logps([chunk])
    old = chunk["old_per_token_logps"]
    assert torch.equal(seen[0], loss_mask(chunk))
    assert trainer._scorer.tree is True  # these rows share past their prompts: the prefix tree scored them
    row = trainer._scorer._tree_row(ids, mask, c_w, prompt_keys(ids[:, :p_w], mask[:, :p_w]), 16)
    assert projected[-1] == len(set((row.cols + 1)[loss_mask(chunk).bool()].tolist()))  # the CPU head: those only
    assert (old[loss_mask(chunk) == 0] == 0).all() and old[loss_mask(chunk).bool()].abs().min() > 0
