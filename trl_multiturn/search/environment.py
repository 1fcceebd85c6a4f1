"""``SearchEnvironment``: Search-R1's search-and-answer task behind the environment contract.

One instance serves one trajectory. ``reset(row)`` returns the user prompt (the template with the row's question);
``step(action)`` answers a parsed :class:`~trl_multiturn.environment.Action`:

* ``tool`` ``search`` with ``{"query": q}`` -> the top-k documents rendered as Search-R1 does
  (``Doc 1(Title: "...") text``, one per line). The protocol (``TagProtocol``) wraps the observation in
  ``<information>...</information>``;
* ``answer`` -> ``done=True`` with the answer and its exact match in ``info``;
* ``invalid`` (or an unknown tool, or an empty query) -> feedback that names the expected format in words;
* a search beyond ``max_searches`` -> feedback that the search budget is spent;
* a :class:`~trl_multiturn.search.retrievers.RetrievalError` -> an error observation, counted, never raised.

Departures from Search-R1: (1) the default prompt and every feedback text describe the tags in words and never
contain a parsable action: Search-R1's prompt and feedback say "call a search engine by ``<search> query </search>``"
and "put the query between ``<search>`` and ``</search>``", and a small model copies such text verbatim (measured: every
search and answer SmolLM2-135M wrote in 1,312 trajectories was the word "and"); (2) searches are capped by
``max_searches`` (Search-R1 only caps turns); (3) retrieval failures become observations instead of crashing the
rollout; (4) an optional per-turn reward for the first search that surfaces a gold answer (off by default).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from ..environment import Action, Step
from .retrievers import Document, RetrievalError, Retriever
from .rewards import answer_in_text, exact_match, f1, substring_match

logger = logging.getLogger(__name__)

#: Our default prompt: Search-R1's instructions with the tags described in words, and no parsable example action.
SEARCH_R1_TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside think tags first every time you get new "
    "information. After reasoning, if you find you lack some knowledge, you can call a search engine by writing a "
    "search query inside search tags, and it will return the top searched results inside information tags. You can "
    "search as many times as you want. If you find no further external knowledge needed, you can directly provide "
    "the answer inside answer tags, without detailed illustrations. A tag is its name in angle brackets, such as "
    "<think>, and is closed by the same name after a slash. Question: {question}\n"
)

#: Search-R1's own prompt, for evaluating its released checkpoints. It contains parsable example actions: a small
#: model copies them, so it is not the default.
SEARCH_R1_ORIGINAL_TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get new "
    "information. After reasoning, if you find you lack some knowledge, you can call a search engine by <search> "
    "query </search> and it will return the top searched results between <information> and </information>. You can "
    "search as many times as your want. If you find no further external knowledge needed, you can directly provide "
    "the answer inside <answer> and </answer>, without detailed illustrations. For example, <answer> Beijing "
    "</answer>. Question: {question}\n"
)

INVALID_FEEDBACK = (
    "My previous action is invalid. If I want to search, I should write my query inside search tags. If I want to "
    "give the final answer, I should write it inside answer tags. Let me try again."
)
EMPTY_QUERY_FEEDBACK = "My previous search query was empty. I should write a real query inside search tags."
UNKNOWN_TOOL_FEEDBACK = (
    "There is no tool named {name}. The only tool is search: I should write a query inside search tags."
)
BUDGET_FEEDBACK = (
    "My search budget is spent: I have already searched {n} times, the most allowed. I should now give the final "
    "answer inside answer tags."
)
ERROR_FEEDBACK = "The search engine failed to answer this time ({error}). I can search again or give the answer."


def query_key(query: str) -> str:
    """The form two queries are compared in: case and spacing ignored (``"Acme  corp"`` repeats ``"acme Corp"``)."""
    return " ".join(str(query).lower().split())


def render_documents(docs: Sequence[Document]) -> str:
    """Search-R1's rendering: ``Doc i(Title: "title") text`` per document, one per line, ``i`` from 1."""
    return "\n".join(f'Doc {i}(Title: "{d.title}") {d.text}' for i, d in enumerate(docs, 1))


class SearchEnvironment:
    """Search QA environment over any :class:`~trl_multiturn.search.retrievers.Retriever`.

    Args:
        retriever: shared by every environment instance (retrievers are thread-safe).
        topk: documents returned per search (Search-R1: 3).
        max_searches: searches allowed per episode; more get ``BUDGET_FEEDBACK`` and no retrieval.
        prompt_template: the user prompt; ``{question}`` is replaced with the question (a ``?`` is appended when
            missing, as Search-R1 does).
        retrieval_hit_reward: per-turn reward for the FIRST search of the episode whose documents contain a gold
            answer (normalized substring, Search-R1's retrieval check); 0.0 turns it off.
        redundant_search_reward: per-turn reward for EVERY search issued after an earlier search of the episode
            already returned a gold answer: a cost when below 0 (e.g. -1.0), for searching on once the answer is in
            the context; 0.0 turns it off. A search refused by ``max_searches`` is not retrieved and not charged.
        repeated_query_reward: per-turn reward for EVERY search whose query (case and spacing ignored,
            :func:`query_key`) the episode already searched: a cost when below 0 (e.g. -1.0). Such a search gets
            the same documents back, so it is never useful, and under greedy decoding one repeat tends to become a
            loop that runs out of turns. Added to the search's other per-turn reward (a repeat after a hit also
            pays ``redundant_search_reward``); 0.0 turns it off. A budget-refused search is not charged.
        tool_name: the tool name the protocol gives search actions.

    Columns read from a row: ``question`` and ``golden_answers`` (``required_columns``); ``gold_doc_ids`` and
    ``id`` when present (gold document hits are then reported).

    ``info`` of each step: ``action`` ("search", "answer", "invalid", "search_limit", "retrieval_error"), and for
    searches ``query``, ``doc_ids``, ``retrieval_hit``, ``redundant_search``, ``repeated_query``, ``gold_doc_hit``; for answers
    ``answer``, ``exact_match``, ``substring_match``, ``f1``; always the running totals ``num_searches``, ``num_retrieval_hits``,
    ``num_invalid``, ``num_search_limit``, ``num_retrieval_errors``.
    """

    required_columns: tuple[str, ...] = ("question", "golden_answers")

    def __init__(
        self,
        retriever: Retriever,
        topk: int = 3,
        max_searches: int = 4,
        prompt_template: str = SEARCH_R1_TEMPLATE,
        retrieval_hit_reward: float = 0.0,
        redundant_search_reward: float = 0.0,
        repeated_query_reward: float = 0.0,
        tool_name: str = "search",
    ) -> None:
        if not hasattr(retriever, "retrieve"):
            raise TypeError(f"retriever must have retrieve(queries, k); got {type(retriever).__name__}.")
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}.")
        if max_searches < 0:
            raise ValueError(f"max_searches must be >= 0, got {max_searches}.")
        if "{question}" not in prompt_template:
            raise ValueError(f"prompt_template must contain '{{question}}'; got {prompt_template[:80]!r}.")
        self.retriever = retriever
        self.topk = topk
        self.max_searches = max_searches
        self.prompt_template = prompt_template
        for name, value in (("retrieval_hit_reward", retrieval_hit_reward),
                            ("redundant_search_reward", redundant_search_reward),
                            ("repeated_query_reward", repeated_query_reward)):
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number; got {value!r}.")
        self.retrieval_hit_reward = retrieval_hit_reward
        self.redundant_search_reward = redundant_search_reward
        self.repeated_query_reward = repeated_query_reward
        self.tool_name = tool_name
        self.example: dict[str, Any] = {}
        self._reset_state()

    def _reset_state(self) -> None:
        self.question = ""
        self.golden_answers: list[str] = []
        self.gold_doc_ids: set[str] = set()
        self.num_searches = 0
        self.num_retrieval_hits = 0
        self.num_invalid = 0
        self.num_search_limit = 0
        self.num_retrieval_errors = 0
        self.queries: list[str] = []
        self.retrieved_doc_ids: list[list[str]] = []
        self.answer: str | None = None
        self.done = False

    # ----- contract -----
    def reset(self, example: dict[str, Any]) -> str:
        missing = [c for c in self.required_columns if c not in example]
        if missing:
            raise KeyError(
                f"SearchEnvironment.reset got a row without {missing} (keys: {sorted(example)}); the dataset needs "
                f"the columns {list(self.required_columns)} (FlashRAG format, see load_qa_dataset)."
            )
        self._reset_state()
        self.example = dict(example)
        self.question = str(example["question"]).strip()
        golds = example["golden_answers"]
        self.golden_answers = [golds] if isinstance(golds, str) else [str(g) for g in golds]
        self.gold_doc_ids = set(example.get("gold_doc_ids") or [])
        question = self.question if self.question.endswith("?") else self.question + "?"
        return self.prompt_template.replace("{question}", question)

    def step(self, action: Action) -> Step:
        if self.done:
            raise RuntimeError("SearchEnvironment.step called after the episode ended; call reset(row) first.")
        if action.kind == "answer":
            return self._answer(action)
        if action.kind == "tool":
            if action.name != self.tool_name:
                self.num_invalid += 1
                return self._step(
                    UNKNOWN_TOOL_FEEDBACK.format(name=action.name),
                    {"action": "invalid", "error": f"unknown tool {action.name!r}"},
                )
            query = str(action.arguments.get("query", "")).strip()
            if not query:
                self.num_invalid += 1
                return self._step(EMPTY_QUERY_FEEDBACK, {"action": "invalid", "error": "empty query"})
            return self._search(query)
        self.num_invalid += 1
        return self._step(INVALID_FEEDBACK, {"action": "invalid", "error": action.error})

    def close(self) -> None:
        """Nothing to release: the retriever is shared."""

    # ----- actions -----
    def _search(self, query: str) -> Step:
        if self.num_searches >= self.max_searches:
            self.num_search_limit += 1
            return self._step(BUDGET_FEEDBACK.format(n=self.num_searches), {"action": "search_limit", "query": query})
        try:
            docs = self.retriever.retrieve([query], self.topk)[0]
        except RetrievalError as e:
            self.num_retrieval_errors += 1
            logger.warning("retrieval failed for query %r: %s", query, e)
            return self._step(
                ERROR_FEEDBACK.format(error=type(e).__name__),
                {"action": "retrieval_error", "query": query, "error": str(e)},
            )
        repeated = query_key(query) in {query_key(q) for q in self.queries}
        self.num_searches += 1
        observation = render_documents(docs)
        doc_ids = [d.id for d in docs]
        self.queries.append(query)
        self.retrieved_doc_ids.append(doc_ids)
        hit = answer_in_text(observation, self.golden_answers)
        redundant = self.num_retrieval_hits > 0  # the answer was already in the context before this search
        if redundant:
            reward = self.redundant_search_reward
        else:
            reward = self.retrieval_hit_reward if hit else 0.0
        if repeated:
            reward += self.repeated_query_reward
        self.num_retrieval_hits += int(hit)
        info = {
            "action": "search",
            "query": query,
            "doc_ids": doc_ids,
            "retrieval_hit": hit,
            "redundant_search": redundant,
            "repeated_query": repeated,
            "gold_doc_hit": bool(self.gold_doc_ids & set(doc_ids)) if self.gold_doc_ids else None,
        }
        return self._step(observation, info, reward=reward)

    def _answer(self, action: Action) -> Step:
        self.answer = (action.content or "").strip()
        self.done = True
        info = {
            "action": "answer",
            "answer": self.answer,
            "exact_match": exact_match(self.answer, self.golden_answers),
            "substring_match": substring_match(self.answer, self.golden_answers),
            "f1": f1(self.answer, self.golden_answers),
        }
        return self._step(None, info, done=True)

    def _step(self, observation: str | None, info: dict[str, Any], reward: float = 0.0, done: bool = False) -> Step:
        info.update(
            num_searches=self.num_searches,
            num_retrieval_hits=self.num_retrieval_hits,
            num_invalid=self.num_invalid,
            num_search_limit=self.num_search_limit,
            num_retrieval_errors=self.num_retrieval_errors,
        )
        return Step(observation=observation, reward=reward, done=done, info=info)
