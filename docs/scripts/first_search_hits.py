"""How often does a search for a question's subject already surface its final answer?

Backs the figure quoted in docs/search_agent.md (a cost on redundant searches) and in
recipes/configs/learning_proof_search_cost_step32.yaml: on a 2-hop question the first search, for the subject's
name, should return the bridge entity, not the answer; when it returns the answer too, a second search is
"redundant" for ``redundant_search_reward`` and costs. This counts, for the training questions the learning proof
draws from (the first ``--num_train_questions`` rows of the offline knowledge base) and for the held-out split,
the questions whose gold answer is in the rendered top-k documents of a BM25 search for the subject, per hop count,
with the environment's own rendering and hit test (``render_documents``, ``answer_in_text``).

    python docs/scripts/first_search_hits.py --output_json docs/results/learning_proof/first_search_hits.json
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path


def count_hits(rows, retriever, topk: int) -> dict:
    from trl_multiturn.search.environment import render_documents
    from trl_multiturn.search.rewards import answer_in_text

    totals, hits = Counter(), Counter()
    docs = retriever.retrieve([str(r["subject"]) for r in rows], topk)
    for row, found in zip(rows, docs):
        hop = str(row["hops"])
        totals[hop] += 1
        hits[hop] += int(answer_in_text(render_documents(found), list(row["golden_answers"])))
    return {f"hops_{h}": {"questions": totals[h], "answer_in_subject_search": hits[h],
                          "fraction": hits[h] / totals[h]} for h in sorted(totals)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--offline_entities", type=int, default=600)
    parser.add_argument("--kb_seed", type=int, default=0)
    parser.add_argument("--num_train_questions", type=int, default=2000)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--output_json", type=Path, default=None)
    args = parser.parse_args(argv)

    from trl_multiturn.search import build_offline_dataset
    from trl_multiturn.search.retrievers import BM25Retriever

    data = build_offline_dataset(num_entities=args.offline_entities, seed=args.kb_seed)
    retriever = BM25Retriever(data.corpus)
    out = {
        "what": "questions whose gold answer is already in the top-k BM25 documents of a search for the subject's name "
                "(the environment's rendering and hit test)",
        "settings": vars(args) | {"output_json": str(args.output_json) if args.output_json else None},
        "train": count_hits(data.train_rows[: args.num_train_questions], retriever, args.topk),
        "heldout_split": count_hits(data.test_rows, retriever, args.topk),
    }
    print(json.dumps(out, indent=1))
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
