"""Search-R1-style search agents: retrievers, a retrieval server, corpora, QA data, rewards, the environment and a
scripted expert. Usable without the trainer: nothing here imports TRL or the rollout.

    from trl_multiturn.search import build_offline_dataset, BM25Retriever, SearchEnvironment, exact_match_reward

    data = build_offline_dataset(num_entities=500, seed=0)      # fictional KB: corpus + train/test questions
    retriever = BM25Retriever(data.corpus)
    env = SearchEnvironment(retriever, topk=3, max_searches=4)

Names are imported lazily so that importing one module does not pull in ``datasets`` or ``bm25s``.
"""

from typing import TYPE_CHECKING

from .. import _lazy_getattr

_LAZY = {
    "Document": "document",
    "Retriever": "retrievers",
    "RetrievalError": "retrievers",
    "BM25Retriever": "retrievers",
    "DenseRetriever": "retrievers",
    "HTTPRetriever": "retrievers",
    "RetrievalServer": "server",
    "ServerLimits": "server",
    "start_server": "server",
    "load_corpus": "corpus",
    "parse_contents": "document",
    "write_corpus_jsonl": "corpus",
    "load_qa_dataset": "data",
    "build_offline_dataset": "data",
    "write_offline_dataset": "data",
    "OfflineDataset": "data",
    "QUESTION_TYPES": "data",
    "normalize_answer": "rewards",
    "exact_match": "rewards",
    "substring_match": "rewards",
    "f1": "rewards",
    "extract_answer": "rewards",
    "check_format": "rewards",
    "is_valid_format": "rewards",
    "exact_match_reward": "rewards",
    "substring_match_reward": "rewards",
    "f1_reward": "rewards",
    "format_reward": "rewards",
    "SearchEnvironment": "environment",
    "SEARCH_R1_TEMPLATE": "environment",
    "SEARCH_R1_ORIGINAL_TEMPLATE": "environment",
    "render_documents": "environment",
    "ExpertPolicy": "expert",
    "ExpertTrajectory": "expert",
    "build_expert_trajectories": "expert",
}

__all__ = sorted(_LAZY)


__getattr__ = _lazy_getattr(__name__, _LAZY)


if TYPE_CHECKING:  # pragma: no cover
    from .corpus import load_corpus, write_corpus_jsonl
    from .data import QUESTION_TYPES, OfflineDataset, build_offline_dataset, load_qa_dataset, write_offline_dataset
    from .document import Document, parse_contents
    from .environment import SEARCH_R1_ORIGINAL_TEMPLATE, SEARCH_R1_TEMPLATE, SearchEnvironment, render_documents
    from .expert import ExpertPolicy, ExpertTrajectory, build_expert_trajectories
    from .retrievers import BM25Retriever, DenseRetriever, HTTPRetriever, RetrievalError, Retriever
    from .rewards import (
        check_format,
        exact_match,
        exact_match_reward,
        extract_answer,
        f1,
        f1_reward,
        format_reward,
        is_valid_format,
        normalize_answer,
        substring_match,
        substring_match_reward,
    )
    from .server import RetrievalServer, ServerLimits, start_server
