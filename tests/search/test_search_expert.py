"""The scripted expert: well-formed trajectories built from REAL retrieval results, ending with the gold answer;
rejection when retrieval misses the gold evidence; the kept fraction reported; varied wording."""

from __future__ import annotations

import re

from trl_multiturn.search.environment import SearchEnvironment, render_documents
from trl_multiturn.search.expert import ExpertPolicy, build_expert_trajectories
from trl_multiturn.search.retrievers import Document
from trl_multiturn.search.rewards import check_format, extract_answer

SEARCH = re.compile(r"<search>(.*?)</search>")


def test_trajectories_are_well_formed_and_real(kb, kb_bm25):
    rows = kb.train_rows[:60]
    trajs, stats = build_expert_trajectories(rows, kb_bm25, seed=0, topk=3)
    assert stats["total"] == 60 and stats["kept"] == len(trajs)
    assert stats["kept_fraction"] == stats["kept"] / 60 >= 0.95
    assert set(stats["kept_fraction_by_hops"]) == {1, 2}
    for t in trajs:
        assert t.kept and t.reason == "ok"
        assert len(t.turns) == t.example["hops"] + 1  # one search per hop, then the answer
        ok, why = check_format(t.to_text())
        assert ok, (why, t.to_text())
        for action, obs in t.turns[:-1]:
            assert re.fullmatch(r"<think>[^<]+</think>\n<search>[^<]+</search>", action)
            (query,) = SEARCH.findall(action)
            assert obs == render_documents(kb_bm25.retrieve([query], 3)[0])  # the real retrieval result
        last_action, last_obs = t.turns[-1]
        assert last_obs is None and re.fullmatch(r"<think>[^<]+</think>\n<answer>[^<]+</answer>", last_action)
        assert extract_answer(last_action) == t.example["golden_answers"][0]
        if t.example["hops"] == 2:  # the second query uses the bridge entity read from the first result
            assert t.example["bridge"] in SEARCH.findall(t.turns[1][0])[0]
            assert t.example["bridge"] in t.turns[0][1]
        assert t.prompt.endswith(t.example["question"] + "\n")


def test_wording_varies_and_is_seeded(kb, kb_bm25):
    rows = kb.train_rows[:40]
    a, _ = build_expert_trajectories(rows, kb_bm25, seed=0)
    b, _ = build_expert_trajectories(rows, kb_bm25, seed=0)
    c, _ = build_expert_trajectories(rows, kb_bm25, seed=1)
    assert [t.actions for t in a] == [t.actions for t in b]
    assert [t.actions for t in a] != [t.actions for t in c]
    first_thoughts = {re.sub(r"[A-Z][a-z]+", "X", t.actions[0].split("</think>")[0]) for t in a}
    assert len(first_thoughts) >= 4  # several reasoning templates, not one string


class Scrambled:
    """A retriever that never returns the gold evidence: the expert must reject every trajectory."""

    corpus = [Document("junk", "Nothing", "Nothing useful here.")]

    def retrieve(self, queries, k):
        return [[self.corpus[0]] for _ in queries]


def test_rejection_when_retrieval_misses(kb):
    trajs, stats = build_expert_trajectories(kb.train_rows[:10], Scrambled(), keep_rejected=True)
    assert stats["kept"] == 0 and stats["kept_fraction"] == 0.0
    assert stats["rejected_reasons"] == {"hop 1: gold document not retrieved": 10}
    assert all(not t.kept and len(t.turns) == 1 for t in trajs)


def test_search_budget_rejects_two_hop(kb, kb_bm25):
    two_hop = [r for r in kb.train_rows if r["hops"] == 2][:5]
    trajs, stats = build_expert_trajectories(two_hop, env_factory=lambda: SearchEnvironment(kb_bm25, max_searches=1))
    assert stats["kept"] == 0 and list(stats["rejected_reasons"]) == ["hop 2: search_limit ()"]


def test_rows_without_gold_evidence_use_one_search(small_bm25):
    rows = [
        {"question": "Where was Zorvek Talamir born?", "golden_answers": ["Quellport"]},
        {"question": "What does Orvik Industries make?", "golden_answers": ["tin cans"]},  # not in any document
    ]
    trajs, stats = build_expert_trajectories(rows, small_bm25, keep_rejected=True)
    assert [t.kept for t in trajs] == [True, False] and stats["kept_fraction"] == 0.5
    assert SEARCH.findall(trajs[0].actions[0]) == ["Where was Zorvek Talamir born?"]
    assert extract_answer(trajs[0].actions[-1]) == "Quellport"


def test_policy_object_plays_one_episode(kb, kb_bm25):
    row = next(r for r in kb.test_rows if r["hops"] == 2)
    traj = ExpertPolicy(seed=3).rollout(row, SearchEnvironment(kb_bm25))
    assert traj.kept and [i["action"] for i in traj.infos] == ["search", "search", "answer"]
    assert traj.infos[-1]["exact_match"] == 1.0
