"""Evaluation statistics with hand-computed numbers: the paired bootstrap interval, pairing by question, the fixed
held-out set, and sampled exact match through the real rollout loop with a scripted policy."""

import json
import random

import pytest
import torch

from scripted import ScriptedLM

from trl_multiturn.generation import SamplingParams
from trl_multiturn.protocols import TagProtocol
from trl_multiturn.search import build_offline_dataset
from trl_multiturn.search.evaluation import (
    bootstrap_mean_ci,
    compare_evaluations,
    evaluate_search_agent,
    heldout_rows,
    summarize,
    unpaired_bootstrap_ci,
    validation_rows,
)


def test_bootstrap_interval_of_known_differences():
    # every question changed by the same amount: every resample's mean is that amount
    assert bootstrap_mean_ci([0.25] * 10) == (0.25, 0.25)
    # n = 2, differences {0, 1}: resampled means 0, 1/2, 1 with probabilities 1/4, 1/2, 1/4, so the 2.5% and 97.5%
    # quantiles are 0 and 1
    assert bootstrap_mean_ci([0.0, 1.0]) == (0.0, 1.0)
    # n = 20, one difference of 1: the resampled mean is X/20 with X ~ Binomial(20, 1/20); P(X = 0) = 0.358 > 0.025
    # and P(X <= 2) = 0.925 < 0.975 <= P(X <= 3) = 0.984, so the interval is [0, 3/20]
    assert bootstrap_mean_ci([0.0] * 19 + [1.0]) == (0.0, 0.15)
    # seeded: the same seed gives the same interval
    values = [random.Random(1).random() for _ in range(50)]
    assert bootstrap_mean_ci(values, seed=3) == bootstrap_mean_ci(values, seed=3)


def test_paired_interval_sees_what_the_unpaired_one_cannot():
    # 128 questions, half solved by both stages; stage B also solves 8 that A missed and loses none
    a = [1.0, 0.0] * 64
    b = list(a)
    for i in range(1, 16, 2):
        b[i] = 1.0
    diffs = [y - x for x, y in zip(a, b)]
    assert sum(diffs) / len(diffs) == 8 / 128
    low, high = bootstrap_mean_ci(diffs)
    # paired: X/128 with X ~ Binomial(128, 1/16), mean 8, sd 2.7: the interval lies above 0
    assert 0 < low < 8 / 128 < high
    # unpaired: the spread of the questions' difficulty (sd 0.5 each) swamps the change: the interval holds 0
    u_low, u_high = unpaired_bootstrap_ci(a, b)
    assert u_low < 0 < u_high
    # widths ~ 3.92 sd: paired sd = sqrt(1/16 * 15/16 / 128) = 0.021, unpaired sd = sqrt((1/4 + 9/16 * 7/16) / 128)
    # = 0.062, about 2.9 times wider
    assert u_high - u_low > 2 * (high - low)


def _rec(qid, hops, em, **kw):
    return {"id": qid, "hops": hops, "exact_match": em, **kw}


def test_compare_evaluations_pairs_by_id_per_hop():
    a = [_rec("q1", 1, 1.0), _rec("q2", 1, 0.0), _rec("q3", 2, 0.0), _rec("q4", 2, 0.0)]
    b = [_rec("q4", 2, 1.0), _rec("q3", 2, 1.0), _rec("q2", 1, 0.0), _rec("q1", 1, 1.0)]  # another order
    out = compare_evaluations(a, b, resamples=2_000)
    em = out["exact_match"]
    assert em["all"] == {"n": 4, "a": 0.25, "b": 0.75, "diff": 0.5, "ci_low": pytest.approx(0.25, abs=0.251),
                         "ci_high": 1.0}
    assert em["hops_1"]["diff"] == 0.0 and (em["hops_1"]["ci_low"], em["hops_1"]["ci_high"]) == (0.0, 0.0)
    assert em["hops_2"]["diff"] == 1.0 and (em["hops_2"]["ci_low"], em["hops_2"]["ci_high"]) == (1.0, 1.0)
    assert "sampled_exact_match" not in out  # only when both stages have it
    with pytest.raises(ValueError, match="1 only in A"):
        compare_evaluations(a, b[:3])


def test_compare_evaluations_includes_sampled_exact_match():
    a = [_rec("q1", 1, 1.0, sampled_exact_match=0.5), _rec("q2", 2, 0.0, sampled_exact_match=0.25)]
    b = [_rec("q1", 1, 1.0, sampled_exact_match=0.75), _rec("q2", 2, 0.0, sampled_exact_match=0.5)]
    out = compare_evaluations(a, b)
    assert out["sampled_exact_match"]["all"]["diff"] == 0.25
    assert (out["sampled_exact_match"]["all"]["ci_low"], out["sampled_exact_match"]["all"]["ci_high"]) == (0.25, 0.25)


def test_compare_script_prints_and_writes(tmp_path, capsys):
    from repo_scripts import load_script

    script = load_script("recipes/compare_evaluations.py")
    a = [_rec(f"q{i}", 1 + i % 2, float(i % 3 == 0)) for i in range(12)]
    b = [_rec(f"q{i}", 1 + i % 2, float(i % 3 != 1)) for i in range(12)]
    (tmp_path / "a.json").write_text(json.dumps({"records": a}))
    (tmp_path / "b.json").write_text(json.dumps({"records": b}))
    out = script.main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--output_json", str(tmp_path / "c.json")])
    assert json.loads((tmp_path / "c.json").read_text())["exact_match"] == out["exact_match"]
    assert out["exact_match"]["all"]["diff"] == pytest.approx(4 / 12)  # 4 solved -> 8 solved
    assert "exact_match          all" in capsys.readouterr().out
    assert "versions_differ" not in out  # neither file names its versions

    env = {"versions": {"PEFT": "0.21.2", "TRL": "1.16.0"}}
    (tmp_path / "a.json").write_text(json.dumps({"records": a, "environment": env}))
    (tmp_path / "b.json").write_text(json.dumps({"records": b, "environment": {"versions": {"PEFT": "0.22.0",
                                                                                         "TRL": "1.16.0"}}}))
    out = script.main([str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert out["versions_differ"] == {"PEFT": ["0.21.2", "0.22.0"]}
    assert "different library versions" in capsys.readouterr().out


def test_compare_script_pools_several_evaluations_paired_within_each(tmp_path, capsys):
    from repo_scripts import load_script

    script = load_script("recipes/compare_evaluations.py")
    # two knowledge bases whose questions share ids; q0 keeps its answer in each, q1 is solved in both by B
    files = {"a1": [_rec("q0", 1, 1.0), _rec("q1", 2, 0.0)], "a2": [_rec("q0", 1, 0.0), _rec("q1", 2, 0.0)],
             "b1": [_rec("q1", 2, 1.0), _rec("q0", 1, 1.0)], "b2": [_rec("q0", 1, 0.0), _rec("q1", 2, 1.0)]}
    for name, records in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({"records": records}))
    a, b = (",".join(str(tmp_path / f"{s}{i}.json") for i in (1, 2)) for s in "ab")
    out = script.main([a, b, "--resamples", "500"])
    em = out["exact_match"]
    assert out["pooled_files"] == 2 and em["all"]["n"] == 4 and em["all"]["diff"] == pytest.approx(0.5)
    assert em["hops_1"] == {"n": 2, "a": 0.5, "b": 0.5, "diff": 0.0, "ci_low": 0.0, "ci_high": 0.0}
    assert (em["hops_2"]["a"], em["hops_2"]["b"], em["hops_2"]["ci_low"]) == (0.0, 1.0, 1.0)
    # B's files in the other order pair kb 1's records with kb 2's: q0 then goes 1 -> 0 and 0 -> 1
    swapped = script.main([a, ",".join(reversed(b.split(","))), "--resamples", "500"])["exact_match"]["hops_1"]
    assert swapped["diff"] == 0.0 and (swapped["ci_low"], swapped["ci_high"]) == (-1.0, 1.0)
    # library versions are compared pair by pair: kb 1's B file was made with another PEFT than kb 1's A file
    for name, version in {"a1": "1", "b1": "2", "a2": "3", "b2": "3"}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({"records": files[name],
                                                           "environment": {"versions": {"PEFT": version}}}))
    assert script.main([a, b, "--resamples", "10"])["versions_differ"] == {"PEFT": ["1", "2"]}
    # in a notebook: pool_records joins the record lists, each id prefixed with its list's position
    from trl_multiturn.search.evaluation import pool_records

    assert [r["id"] for r in pool_records([files["a1"], files["a2"]])] == ["0:q0", "0:q1", "1:q0", "1:q1"]
    assert pool_records([files["a1"]]) == files["a1"]
    with pytest.raises(SystemExit):
        script.main([a, str(tmp_path / "b1.json")])
    assert "give B one file per file of A" in capsys.readouterr().err


def test_heldout_set_is_balanced_fixed_and_order_free():
    data = build_offline_dataset()  # the recipes' default knowledge base: 256 one-hop and 225 two-hop test questions
    rows = heldout_rows(data.test_rows, 256)
    assert len(rows) == 256 and sum(r["hops"] == 1 for r in rows) == 128
    assert len({r["id"] for r in rows}) == 256
    shuffled = list(data.test_rows)
    random.Random(7).shuffle(shuffled)
    assert [r["id"] for r in heldout_rows(shuffled, 256)] == [r["id"] for r in rows]
    assert [r["id"] for r in heldout_rows(data.test_rows, 256, seed=1)] != [r["id"] for r in rows]
    with pytest.raises(ValueError, match="225 questions with 2 hop"):
        heldout_rows(data.test_rows, 460)
    with pytest.raises(ValueError, match="heldout_size=7"):
        heldout_rows(data.test_rows, 7)


def test_validation_set_is_disjoint_from_the_heldout_set_balanced_and_fixed():
    data = build_offline_dataset(num_entities=600)  # the learning proof's knowledge base: 307 / 270 test questions
    held = {r["id"] for r in heldout_rows(data.test_rows, 256)}
    val = validation_rows(data.test_rows, 256)
    assert len(val) == 256 and sum(r["hops"] == 1 for r in val) == 128
    assert not held & {r["id"] for r in val}
    shuffled = list(data.test_rows)
    random.Random(3).shuffle(shuffled)
    assert [r["id"] for r in validation_rows(shuffled, 256)] == [r["id"] for r in val]
    # 270 two-hop questions: a 300-question held-out set takes 150 and leaves 120, fewer than the 150 needed
    with pytest.raises(ValueError, match="leaves out: the held-out split has 120 questions with 2 hop"):
        validation_rows(data.test_rows, 300)


class AnswerEnv:
    """One turn: the policy's answer ends the episode."""

    def reset(self, example):
        return f"Question: {example['question']}"

    def step(self, action):
        from trl_multiturn.environment import Step

        return Step(observation=None, done=True)


def test_sampled_exact_match_rolls_out_k_samples_per_question(smollm2_tokenizer):
    tok = smollm2_tokenizer
    lm = ScriptedLM([tok("<answer>Paris</answer>", add_special_tokens=False)["input_ids"]], len(tok), tok.eos_token_id)
    rows = [{"id": "a", "question": "capital of France?", "golden_answers": ["Paris"], "hops": 1},
            {"id": "b", "question": "capital of Italy?", "golden_answers": ["Rome"], "hops": 2},
            {"id": "c", "question": "city of lights?", "golden_answers": ["paris"], "hops": 2}]
    out = evaluate_search_agent(lm, tok, rows, AnswerEnv, protocol=TagProtocol(), max_turns=1, max_completion_length=32,
                                max_tokens_per_turn=16, batch_size=4, progress=False, num_samples=3,
                                sampling=SamplingParams(temperature=0.7))
    assert len(lm.contexts) == 3 + 3 * 3  # one greedy and k = 3 sampled trajectories per question
    assert [r["sampled_exact_match"] for r in out["records"]] == [1.0, 0.0, 1.0]
    assert out["summary"]["hops_2"]["sampled_exact_match"] == 0.5
    assert out["summary"] == summarize(out["records"])
    from importlib.metadata import version

    assert out["environment"]["versions"]["PEFT"] == version("peft")  # the versions that made these records
    assert out["environment"]["torch_threads"] == torch.get_num_threads()
    with pytest.raises(ValueError, match="num_samples=1"):
        evaluate_search_agent(lm, tok, rows, AnswerEnv, num_samples=1)


def test_answering_the_bridge_is_counted_and_old_records_still_summarize(smollm2_tokenizer):
    """A 2-hop answer that is the bridge entity (one search short) is recorded as answered_bridge; summarize leaves
    out a metric that some records lack instead of counting it as 0."""
    tok = smollm2_tokenizer
    lm = ScriptedLM([tok("<answer>Paris</answer>", add_special_tokens=False)["input_ids"]], len(tok), tok.eos_token_id)
    rows = [{"id": "a", "question": "country of the capital city?", "golden_answers": ["France"], "hops": 2,
             "bridge": "paris"},
            {"id": "b", "question": "capital of France?", "golden_answers": ["Paris"], "hops": 1, "bridge": None},
            {"id": "c", "question": "river of the city?", "golden_answers": ["Seine"], "hops": 2, "bridge": "Lyon"}]
    out = evaluate_search_agent(lm, tok, rows, AnswerEnv, protocol=TagProtocol(), max_turns=1, max_completion_length=32,
                                max_tokens_per_turn=16, batch_size=4, progress=False)
    assert [r["answered_bridge"] for r in out["records"]] == [1.0, 0.0, 0.0]
    assert out["summary"]["hops_2"]["answered_bridge"] == 0.5 and out["summary"]["hops_1"]["answered_bridge"] == 0.0
    old = [{k: v for k, v in r.items() if k != "answered_bridge"} for r in out["records"][:2]] + out["records"][2:]
    assert "answered_bridge" not in summarize(old)["all"] and summarize(old)["all"]["exact_match"] == 1 / 3


def test_records_keep_the_queries_and_count_repeats_greedy_and_sampled(smollm2_tokenizer):
    """A policy that searches the same query twice (case and spacing aside) before answering: each record lists the
    greedy trajectory's queries and counts one repeated query; the sampled trajectories' queries, answers, searches,
    answer rate and repeats are recorded per sample and averaged per question, and summarized like the others."""
    from trl_multiturn.search import BM25Retriever, SearchEnvironment

    tok = smollm2_tokenizer
    kb = build_offline_dataset(num_entities=20, seed=0)
    retriever = BM25Retriever(kb.corpus)
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    looping = [ids("<search>Paris</search>"), ids("<search>  paris </search>"), ids("<answer>Paris</answer>")]
    # each turn's action by the observations already in its context (greedy and sampled passes alike)
    lm = ScriptedLM(lambda ctx: [looping[min(tok.decode(ctx).count("<information>"), 2)]], len(tok), tok.eos_token_id)
    rows = [{"id": "a", "question": "capital of France?", "golden_answers": ["Paris"], "hops": 1},
            {"id": "b", "question": "capital of Italy?", "golden_answers": ["Rome"], "hops": 2}]
    out = evaluate_search_agent(lm, tok, rows, lambda: SearchEnvironment(retriever, topk=2), protocol=TagProtocol(),
                                max_turns=4, max_completion_length=512, max_tokens_per_turn=16, batch_size=4,
                                progress=False, num_samples=2, sampling=SamplingParams(temperature=0.7))
    first = out["records"][0]
    assert first["queries"] == ["Paris", "paris"] and first["repeated_queries"] == 1 and first["searches"] == 2
    assert [s["queries"] for s in first["samples"]] == [["Paris", "paris"]] * 2
    assert [s["answer"] for s in first["samples"]] == ["Paris", "Paris"]
    assert [s["exact_match"] for s in out["records"][1]["samples"]] == [0.0, 0.0]
    for r in out["records"]:
        assert (r["sampled_searches"], r["sampled_answered"], r["sampled_repeated_queries"]) == (2.0, 1.0, 1.0)
    assert out["summary"]["all"]["repeated_queries"] == 1.0 and out["summary"]["all"]["sampled_searches"] == 2.0
    assert out["summary"]["all"]["sampled_exact_match"] == 0.5
