"""The forward layouts read back the right columns: with a stand-in head whose output at column t is the token at
t + 1 (what a fused LM head scores there), every layout must hand back each real completion token at its column."""

import torch

from trl_multiturn.batching import first_fit_decreasing
from trl_multiturn.layouts import (
    compact_rows, pack_rows, prompt_completion_contiguous, prompt_keys, read_completion_columns, read_packed,
    shared_prompt_row, shares_prompts,
)


def trl_rows(rows, pad=0):
    """TRL's layout of (prompt, completion) lists: left-padded prompts | right-padded completions."""
    p_w, c_w = max(len(p) for p, _ in rows), max(max(len(c) for _, c in rows), 1)
    ids = torch.full((len(rows), p_w + c_w), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(rows):
        ids[i, p_w - len(p) : p_w] = torch.tensor(p)
        ids[i, p_w : p_w + len(c)] = torch.tensor(c, dtype=torch.long)
        mask[i, p_w - len(p) : p_w + len(c)] = 1
    return ids, mask, c_w


def next_token(ids):
    """(n, S) -> (n, S - 1): column t holds token t + 1, as a fused head's output scores it."""
    return ids[:, 1:]


ROWS = [([11, 12, 13], [21, 22]), ([11, 12, 13], [23]), ([14, 15], [24, 25, 26]), ([11, 12, 13], [])]


def test_every_layout_reads_back_the_completion_tokens():
    ids, mask, c_w = trl_rows(ROWS)
    completion, valid = ids[:, -c_w:], mask[:, -c_w:].bool()  # (4, 3)
    assert prompt_completion_contiguous(mask, c_w)

    rows = compact_rows(ids, mask, c_w)
    assert rows.ids.shape == (4, 5) and torch.equal(rows.valid, valid)  # W = longest row, 2 + 3
    assert torch.equal(read_completion_columns(next_token(rows.ids), rows.index)[valid], completion[valid])
    assert (rows.labels[rows.is_completion] == rows.ids[rows.is_completion]).all()
    assert (rows.labels[~rows.is_completion] == -100).all()

    lengths = rows.mask.sum(1).tolist()  # 5, 4, 5, 3
    packed = pack_rows(rows.ids, rows.labels, lengths, first_fit_decreasing(lengths, 9))
    assert packed.ids.shape == (2, 9)  # [5, 4] and [5, 3]
    back = read_completion_columns(read_packed(next_token(packed.ids), packed), rows.index)
    assert torch.equal(back[valid], completion[valid])
    assert packed.positions[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]  # each sequence from position 0

    keys = prompt_keys(ids[:, :-c_w], mask[:, :-c_w])
    assert shares_prompts(keys) and not shares_prompts([keys[0], keys[2]])
    shared = shared_prompt_row(ids, mask, c_w, keys)
    # prompt (11, 12) once, then [13, 21, 22], [13, 23], [13]; prompt (14) once, then [15, 24, 25, 26]
    assert shared.ids[0].tolist() == [11, 12, 13, 21, 22, 13, 23, 13, 14, 15, 24, 25, 26]
    assert shared.positions[0].tolist() == [0, 1, 2, 3, 4, 2, 3, 2, 0, 1, 2, 3, 4]
    assert shared.segments[:2] == [(0, 2, 0, 0), (2, 5, 0, 2)]
    assert torch.equal(next_token(shared.ids)[0][shared.cols][valid], completion[valid])
