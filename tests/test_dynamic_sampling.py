"""Dynamic sampling: the pure decisions with hand-made numbers, then the refill, the cap and the balance by a
dataset column through ``trainer.train()`` on a tiny random model, with prompts whose groups always get equal
rewards."""

import copy
import re

import pytest
import torch
from datasets import Dataset

from scripted import Recorder, logged
from test_trainer import FeedbackEnv, make_args

from trl_multiturn import MultiTurnGRPOConfig, MultiTurnGRPOTrainer
from trl_multiturn.dynamic_sampling import (
    Selection, group_signal, merge_scored_rows, next_refill, refill_prompts, refill_rows, stratum_quotas,
)

nan = float("nan")


# ---------------------------------------------------------------------------------------------------- pure parts
def test_group_signal_names_why_a_group_carries_none():
    rewards = torch.tensor([
        1.0, 1.0, 1.0,  # all correct
        0.0, 0.0, 0.0,  # all wrong
        0.5, 0.5, 0.5,  # all equal
        1.0, 0.0, 1.0,  # signal
        1.0, nan, 0.0,  # signal among the 2 finite members
        1.0, nan, 1.0,  # the finite members are equal
        nan, 0.0, nan,  # one finite member: no baseline
    ])
    assert group_signal(rewards, 3) == [
        "all_correct", "all_wrong", "all_equal", None, None, "all_correct", "no_baseline"]
    with pytest.raises(ValueError, match="num_generations=4"):
        group_signal(rewards, 4)


def test_refill_prompts_follows_the_keep_rate():
    assert refill_prompts(missing=0, kept=0, sampled=4, quota=4) == 0
    assert refill_prompts(missing=3, kept=0, sampled=4, quota=4) == 4  # nothing kept yet: one rollout's prompts
    assert refill_prompts(missing=1, kept=1, sampled=4, quota=4) == 4  # keep rate 1/4: 1 / (1/4) = 4
    assert refill_prompts(missing=1, kept=2, sampled=4, quota=4) == 2  # keep rate 1/2: 1 / (1/2) = 2
    assert refill_prompts(missing=3, kept=1, sampled=2, quota=8) == 6  # 3 * 2 / 1
    assert refill_prompts(missing=2, kept=1, sampled=8, quota=4) == 4  # 2 * 8 = 16, capped at the quota


def test_every_rank_takes_the_same_refill_decision():
    # rows: (groups sampled, kept, missing) of rank 0 and rank 1; rank 0 is full, rank 1 misses 2 of its 2 groups
    table = torch.tensor([[2, 2, 0], [2, 0, 2]])
    # both ranks see the same table: both roll out 2 prompts (2 missing / keep rate 2 of 4, at most the quota 2)
    assert next_refill(table, rounds_done=0, max_rounds=4, quota=2) == 2
    assert next_refill(table, rounds_done=4, max_rounds=4, quota=2) == 0  # the cap
    assert next_refill(torch.tensor([[2, 2, 0], [2, 2, 0]]), 0, 4, 2) == 0  # every rank is full
    assert next_refill(torch.tensor([[4, 1, 3], [4, 0, 4]]), 0, 4, 4) == 4  # 4 / (1/8), capped at the quota


def test_selection_keeps_the_quota_and_fills_from_dropped_groups():
    s = Selection(quota=3)
    s.add_round(0, ["all_correct", None, "all_wrong"])
    s.add_round(1, [None, "all_correct"])
    assert s.kept == [(0, 1), (1, 0)] and s.missing == 1
    assert dict(s.dropped) == {"all_correct": 2, "all_wrong": 1}
    kept, filler = s.rows(group_size=2)
    assert kept == [(0, [2, 3]), (1, [0, 1])]
    assert filler == [(0, [0, 1])]  # the first dropped group fills the one empty place
    s.add_round(2, [None, None])  # one place left: the second group with signal is surplus
    assert s.missing == 0 and s.surplus == 1 and s.rows(2)[1] == []


def test_selection_with_strata_keeps_a_quota_per_value():
    s = Selection(quota=4, strata={1: 2, 2: 2})
    s.add_round(0, [None, None, None, "all_correct"], [1, 1, 1, 2])  # three 1-hop groups with signal: one too many
    assert s.kept == [(0, 0), (0, 1)] and s.surplus == 1 and s.missing == 2
    assert s.missing_values() == [2]
    s.add_round(1, [None, "all_wrong", None, None], [2, 2, 1, 2])  # 2-hop groups 0 and 3 fill the 2-hop places
    assert s.kept == [(0, 0), (0, 1), (1, 0), (1, 3)] and s.surplus == 2
    assert s.missing == 0 and s.missing_values() == [] and dict(s.kept_by) == {1: 2, 2: 2}
    assert dict(s.dropped) == {"all_correct": 1, "all_wrong": 1}
    plain = Selection(quota=4)  # the same first round without strata keeps the three 1-hop groups
    plain.add_round(0, [None, None, None, "all_correct"])
    assert plain.kept == [(0, 0), (0, 1), (0, 2)] and plain.surplus == 0
    with pytest.raises(ValueError, match="one value per group"):
        s.add_round(2, [None])
    with pytest.raises(ValueError, match="do not sum to quota=4"):
        Selection(quota=4, strata={1: 1, 2: 2})


def test_selection_with_strata_fills_the_cap_from_dropped_then_surplus_groups():
    s = Selection(quota=4, strata={1: 2, 2: 2})
    s.add_round(0, [None, None, None, "all_wrong"], [1, 1, 1, 2])  # no 2-hop group with signal, one 1-hop surplus
    kept, filler = s.rows(group_size=2)
    assert kept == [(0, [0, 1, 2, 3])]
    assert filler == [(0, [6, 7, 4, 5])]  # the dropped group 3 first, then the surplus group 2


def test_stratum_quotas_share_the_groups_equally():
    assert stratum_quotas([1, 2, 1, 1], groups=4, column="hops") == {1: 2, 2: 2}  # in order of first appearance
    assert stratum_quotas(["b", "a", "c"], groups=3, column="kind") == {"b": 1, "a": 1, "c": 1}
    with pytest.raises(ValueError) as err:
        stratum_quotas([1, 2, 1, 1, 3], groups=4, column="hops")
    text = str(err.value)
    assert "values [1, 2, 3] (rows per value: {1: 3, 2: 1, 3: 1})" in text
    assert "holds 4 groups per rollout, not a multiple of 3" in text and "prompts_per_rollout" in text


def test_refill_rows_draws_only_the_missing_values():
    values = [1, 2, 1, 3, 2, 1, 1, 2]
    rows = refill_rows((0, 5, 1, 0), 400, len(values), values, missing=[2])
    assert {values[i] for i in rows} == {2} and set(rows) == {1, 4, 7}  # every 2-hop row, and only those
    two = refill_rows((0, 5, 1, 0), 400, len(values), values, missing=[2, 3])
    assert set(two) == {1, 3, 4, 7}
    assert refill_rows((0, 5, 1, 0), 400, len(values), values, missing=[2]) == rows  # seeded: a resume draws these
    assert refill_rows((0, 5, 2, 0), 400, len(values), values, missing=[2]) != rows  # another round: other rows
    # nothing missing (this rank is full) or no balance: every row, exactly the draw of the unbalanced trainer
    gen = torch.Generator().manual_seed(hash((0, 5, 1, 0)) & (2**62 - 1))
    expected = torch.randint(len(values), (400,), generator=gen).tolist()
    assert refill_rows((0, 5, 1, 0), 400, len(values)) == expected
    assert refill_rows((0, 5, 1, 0), 400, len(values), values, missing=[]) == expected


def _scored(prompts, completions, adv, pad=0):
    """A scored batch as the trainer's scoring returns it: prompts left-, completions right-padded."""
    p_w = max(len(p) for p in prompts)
    c_w = max(len(c) for c in completions)
    pid = torch.tensor([[pad] * (p_w - len(p)) + p for p in prompts])
    pm = torch.tensor([[0] * (p_w - len(p)) + [1] * len(p) for p in prompts])
    cid = torch.tensor([c + [pad] * (c_w - len(c)) for c in completions])
    cm = torch.tensor([[1] * len(c) + [0] * (c_w - len(c)) for c in completions])
    return {"prompt_ids": pid, "prompt_mask": pm, "completion_ids": cid, "completion_mask": cm, "tool_mask": cm.clone(),
            "advantages": torch.tensor(adv), "old_per_token_logps": -cm.float(), "num_items_in_batch": cm.sum()}


def test_merge_scored_rows_repads_and_masks_the_filler():
    a = _scored([[5, 6], [5, 6]], [[7], [8, 9]], [1.0, -1.0])
    b = _scored([[3, 4, 5], [3, 4, 5]], [[1, 2, 3], [4]], [0.0, 0.0])
    out = merge_scored_rows([(a, [0, 1], True), (b, [0, 1], False)], pad_token_id=0)
    assert out["prompt_ids"].tolist() == [[0, 5, 6], [0, 5, 6], [3, 4, 5], [3, 4, 5]]
    assert out["prompt_mask"].tolist() == [[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]]
    assert out["completion_ids"].tolist() == [[7, 0, 0], [8, 9, 0], [1, 2, 3], [4, 0, 0]]
    assert out["completion_mask"].tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0]]
    assert out["tool_mask"].tolist() == [[1, 0, 0], [1, 1, 0], [0, 0, 0], [0, 0, 0]]  # filler: no loss
    assert out["old_per_token_logps"].tolist() == [[-1, 0, 0], [-1, -1, 0], [-1, -1, -1], [-1, 0, 0]]
    assert out["advantages"].tolist() == [1.0, -1.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------------------------- the trainer
def toy_reward(completions, q, **kwargs):
    """'easy' prompts always score 1, 'hard' ones 0, 'flat' ones 0.5 (groups of equal rewards); 'live' ones the
    vowel fraction of the sampled text, which varies inside a group of a random model."""
    out = []
    for c, question in zip(completions, q):
        kind = question.split()[0]
        out.append({"easy": 1.0, "hard": 0.0, "flat": 0.5}.get(kind, sum(ch in "aeiou" for ch in c) / max(len(c), 1)))
    return out


def toy_dataset(kinds, hops=None):
    columns = {"q": [f"{k} question {i}" for i, k in enumerate(kinds)]}
    return Dataset.from_dict(columns if hops is None else {**columns, "hops": hops})


def _train(tmp_path, tokenizer, model, kinds, hops=None, **overrides):
    overrides = {"dynamic_sampling": True, **overrides}
    args = make_args(tmp_path, max_steps=1, **overrides)
    trainer = MultiTurnGRPOTrainer(model=model, args=args, train_dataset=toy_dataset(kinds, hops),
                                   environment_factory=FeedbackEnv, reward_funcs=[toy_reward],
                                   processing_class=tokenizer)
    rec = Recorder(trainer)
    merged = []
    run = trainer._dynamic_sampling_rollout
    trainer._dynamic_sampling_rollout = lambda inputs: merged.append(run(inputs)) or merged[-1]
    trainer.train()
    return trainer, rec, merged


def _kind(tokenizer, prompt_ids):
    text = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    return next(k for k in ("easy", "hard", "flat", "live") if f"{k} question" in text)


def test_refill_keeps_only_groups_with_signal(tmp_path, smollm2_tokenizer, tiny_model_factory):
    kinds = ["easy", "hard", "flat", "easy", "hard", "easy", "live", "live"]
    model = tiny_model_factory()
    before = copy.deepcopy(model.state_dict())
    trainer, rec, merged = _train(tmp_path, smollm2_tokenizer, model, kinds, max_dynamic_sampling_rounds=20)
    G = 4
    # every round's groups, by the kind of their prompt
    sampled = [_kind(smollm2_tokenizer, t.prompt_ids) for trajs in rec.rollouts for t in trajs[::G]]
    assert len(rec.batches) >= 2, "the first rollout should not have held two live groups at seed 0"
    rounds = len(rec.batches) - 1
    assert logged(trainer, "rollout/dynamic_sampling/rounds") == [rounds]
    assert logged(trainer, "rollout/dynamic_sampling/prompts_sampled") == [len(sampled)]
    assert logged(trainer, "rollout/dynamic_sampling/groups_dropped_all_correct") == [sampled.count("easy")]
    assert logged(trainer, "rollout/dynamic_sampling/groups_dropped_all_wrong") == [sampled.count("hard")]
    assert logged(trainer, "rollout/dynamic_sampling/groups_dropped_all_equal") == [sampled.count("flat")]
    assert logged(trainer, "rollout/dynamic_sampling/groups_kept") == [2]
    assert logged(trainer, "rollout/dynamic_sampling/groups_surplus") == [sampled.count("live") - 2]
    assert logged(trainer, "rollout/dynamic_sampling/groups_filler") == [0]
    # the step trains on two live groups only, every trajectory carrying loss, and the parameters move
    batch = merged[0]
    assert batch["prompt_ids"].size(0) == 8
    rows = [_kind(smollm2_tokenizer, p[m.bool()]) for p, m in zip(batch["prompt_ids"], batch["prompt_mask"])]
    assert rows == ["live"] * 8
    assert bool(((batch["tool_mask"] * batch["completion_mask"]).sum(1) > 0).all())
    assert bool((batch["advantages"].view(-1, G).abs().sum(1) > 0).all())
    assert float(trainer._buffered_inputs[0]["mb_num_sequences"]) == 8
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_cap_hit_trains_on_the_kept_trajectories_only(tmp_path, smollm2_tokenizer, tiny_model_factory):
    # one live prompt among many equal ones and no refill round: the rollout keeps at most one group with signal
    kinds = ["live"] + ["easy"] * 3
    for seed in range(20):  # the first seed whose first rollout holds the live prompt and one equal one
        trainer, rec, merged = _train(tmp_path, smollm2_tokenizer, tiny_model_factory(), kinds,
                                      max_dynamic_sampling_rounds=0, seed=seed)
        sampled = [_kind(smollm2_tokenizer, t.prompt_ids) for t in rec.rollouts[0][::4]]
        if sorted(sampled) == ["easy", "live"]:
            break
    assert len(rec.batches) == 1 and logged(trainer, "rollout/dynamic_sampling/rounds") == [0]
    assert logged(trainer, "rollout/dynamic_sampling/groups_kept") == [1]
    assert logged(trainer, "rollout/dynamic_sampling/groups_filler") == [1]
    batch = merged[0]
    kinds_rows = [_kind(smollm2_tokenizer, p[m.bool()]) for p, m in zip(batch["prompt_ids"], batch["prompt_mask"])]
    assert kinds_rows == ["live"] * 4 + ["easy"] * 4  # kept first, then the filler
    loss_mask = batch["tool_mask"] * batch["completion_mask"]  # (8, C)
    assert bool((loss_mask[4:] == 0).all()) and bool((loss_mask[:4].sum(1) > 0).all())
    # the normalizers count the kept trajectories only: M = 4 sequences and their N_g tokens
    chunks = trainer._buffered_inputs
    assert float(chunks[0]["mb_num_sequences"]) == 4
    assert float(chunks[0]["mb_num_tokens"]) == float(loss_mask[:4].sum())
    assert logged(trainer, "grad_norm")[0] > 0


def test_cap_hit_with_nothing_kept_skips_the_update(tmp_path, smollm2_tokenizer, tiny_model_factory):
    model = tiny_model_factory()
    before = copy.deepcopy(model.state_dict())
    trainer, rec, merged = _train(tmp_path, smollm2_tokenizer, model, ["easy", "hard"] * 4,
                                  max_dynamic_sampling_rounds=1)
    assert len(rec.batches) == 2  # the first rollout and one refill round, then the cap
    assert logged(trainer, "rollout/dynamic_sampling/groups_kept") == [0]
    assert logged(trainer, "rollout/dynamic_sampling/groups_filler") == [2]
    assert float((merged[0]["tool_mask"] * merged[0]["completion_mask"]).sum()) == 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # Adam's update skipped


def _row(tokenizer, prompt_ids) -> int:
    """The dataset row a prompt came from ("<kind> question <row>")."""
    return int(re.search(r"question (\d+)", tokenizer.decode(prompt_ids, skip_special_tokens=True)).group(1))


def test_balance_keeps_as_many_groups_of_each_value(tmp_path, smollm2_tokenizer, tiny_model_factory):
    # every 1-hop prompt carries signal, one 2-hop prompt of two does: unbalanced, the first round keeps 1-hop only
    kinds = ["live"] * 6 + ["live", "hard"]
    hops = [1] * 6 + [2, 2]
    for seed in range(20):  # the first seed whose first round draws two 1-hop prompts
        trainer, rec, merged = _train(tmp_path, smollm2_tokenizer, tiny_model_factory(), kinds, hops, seed=seed,
                                      max_dynamic_sampling_rounds=20)
        if [hops[_row(smollm2_tokenizer, t.prompt_ids)] for t in rec.rollouts[0][::4]] == [1, 1]:
            break
    rows = [_row(smollm2_tokenizer, p[m.bool()]) for p, m in zip(merged[0]["prompt_ids"], merged[0]["prompt_mask"])]
    assert [hops[r] for r in rows] == [1] * 8 and len(rec.batches) == 1  # without the option: two 1-hop groups

    trainer, rec, merged = _train(tmp_path, smollm2_tokenizer, tiny_model_factory(), kinds, hops, seed=seed,
                                  max_dynamic_sampling_rounds=20, dynamic_sampling_balance="hops")
    first = [_row(smollm2_tokenizer, t.prompt_ids) for t in rec.rollouts[0][::4]]
    assert [hops[r] for r in first] == [1, 1]  # the same first round (the same seed) ...
    refills = [_row(smollm2_tokenizer, t.prompt_ids) for trajs in rec.rollouts[1:] for t in trajs[::4]]
    assert refills and {hops[r] for r in refills} == {2}  # ... then refill rounds draw 2-hop prompts only
    rows = [_row(smollm2_tokenizer, p[m.bool()]) for p, m in zip(merged[0]["prompt_ids"], merged[0]["prompt_mask"])]
    assert sorted(hops[r] for r in rows) == [1] * 4 + [2] * 4 and 6 in rows  # one group each; the live 2-hop one
    assert bool(((merged[0]["tool_mask"] * merged[0]["completion_mask"]).sum(1) > 0).all())  # both carry loss
    assert logged(trainer, "rollout/dynamic_sampling/kept_hops_1") == [1]
    assert logged(trainer, "rollout/dynamic_sampling/kept_hops_2") == [1]
    assert logged(trainer, "rollout/dynamic_sampling/groups_kept") == [2]
    # surplus: the second 1-hop group of the first round, and every live 2-hop group after the first
    assert logged(trainer, "rollout/dynamic_sampling/groups_surplus") == [1 + (refills.count(6) - 1)]
    assert logged(trainer, "rollout/dynamic_sampling/groups_filler") == [0]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(dynamic_sampling_balance="level"), r"dynamic_sampling_balance='level' is not a column of train_dataset, "
                                                 r"which has \['q', 'hops'\]"),
        (dict(dynamic_sampling=False, dynamic_sampling_balance="hops"),
         "dynamic_sampling_balance='hops' balances the groups that dynamic sampling keeps, but dynamic_sampling=False"),
        (dict(dynamic_sampling_balance="hops", prompts_per_rollout=3, mini_batch_size=12, micro_batch_size=4),
         r"values \[1, 2\] \(rows per value: \{1: 2, 2: 2\}\) and a device holds 3 groups per rollout, not a "
         r"multiple of 2"),
    ],
)
def test_balance_is_refused_where_it_cannot_work(tmp_path, smollm2_tokenizer, tiny_model_factory, overrides,
                                                 message):
    args = make_args(tmp_path, max_steps=1, **{"dynamic_sampling": True, **overrides})
    with pytest.raises(ValueError, match=message):
        MultiTurnGRPOTrainer(model=tiny_model_factory(), args=args, environment_factory=FeedbackEnv,
                             train_dataset=toy_dataset(["live"] * 4, hops=[1, 2, 1, 2]), reward_funcs=[toy_reward],
                             processing_class=smollm2_tokenizer)


def test_config_checks_the_cap(tmp_path):
    with pytest.raises(ValueError, match="max_dynamic_sampling_rounds=-1"):
        MultiTurnGRPOConfig(output_dir=str(tmp_path), max_completion_length=8, max_dynamic_sampling_rounds=-1)
