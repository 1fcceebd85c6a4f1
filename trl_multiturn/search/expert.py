"""A scripted expert for the search task: gold multi-turn trajectories for the SFT warm start.

The expert plays a :class:`~trl_multiturn.search.environment.SearchEnvironment` with the REAL retriever: it writes
``<think>reasoning</think>\\n<search>query</search>``, reads the documents the environment returns, searches again
with the bridge entity for two-hop questions, and ends with ``<think>reasoning</think>\\n<answer>gold</answer>``.
Reasoning sentences and queries are drawn from several templates with a seeded RNG, so a model fine-tuned on the
result learns the behaviour rather than one string.

Rejection sampling: a trajectory is kept only when every search surfaced its gold evidence (the gold document of
that hop among the top-k, and the entity it should reveal in the returned text). Rows without gold evidence
(``qtype`` / ``gold_doc_ids``, e.g. NQ) get one search with the question as query and are kept when a gold answer
appears in the returned documents. :func:`build_expert_trajectories` reports the kept fraction.

API: :class:`ExpertPolicy` ``.rollout(example, env) -> ExpertTrajectory`` drives the environment itself (the
environment decides what the observations are; the expert only writes the actions). ``ExpertTrajectory.turns`` is
the list of ``(action_text, observation)`` pairs the rollout would have produced (``observation`` None after the
answer): render each observation with the protocol (``TagProtocol.observation_ids``) to build token trajectories.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..environment import Action
from .data import QUESTION_TYPES, RELATIONS
from .environment import SearchEnvironment
from .retrievers import Retriever
from .rewards import answer_in_text, normalize_answer

# Reasoning templates. {need}: what is sought; {found}: a fact read from the documents; {next}: the second need.
_THINK_FIRST = (
    "I need to find {need}. I do not know it, so I will search.",
    "The question asks for {need}. Let me search for it.",
    "To answer this I have to know {need}. I should look it up.",
    "I am not sure about {need}, so I will search for it.",
)
_THINK_FIRST_TWO_HOP = (
    "This takes two steps. First I need {need}, then {next}. Let me search for the first part.",
    "I need {need} first; after that I can find {next}. I will search.",
    "The question has two parts: {need}, and then {next}. I will start with the first.",
)
_THINK_SECOND = (
    "The documents say that {found}. Now I need {next}.",
    "From the search results, {found}. Next I should find {next}.",
    "I learned that {found}. I still need {next}, so I will search again.",
)
_THINK_ANSWER = (
    "The documents say that {found}. So the answer is {answer}.",
    "According to the search results, {found}. The answer is {answer}.",
    "I found that {found}. I can answer now.",
)
_THINK_ANSWER_GENERIC = (
    "The search results contain the answer: {answer}.",
    "Based on the documents, the answer is {answer}.",
)
_THINK_FIRST_GENERIC = (
    "I do not know the answer, so I will search for it.",
    "Let me search for information about this question.",
)
_NEXT = {  # the second hop, said about "that" entity before the bridge is known
    "city_country": "the country that city is in",
    "company_hq": "where that company is headquartered",
}


@dataclass
class ExpertTrajectory:
    """One expert episode.

    Attributes:
        example: the question row.
        prompt: what ``env.reset(example)`` returned.
        turns: ``(action_text, observation)`` per turn; the observation is the environment's text (None after the
            answer, or when the episode was rejected before the environment answered).
        kept: whether every search surfaced its gold evidence.
        reason: "ok", or why the trajectory was rejected (e.g. "hop 2: gold document not retrieved").
        infos: the environment's ``info`` of each step.
    """

    example: dict[str, Any]
    prompt: str
    turns: list[tuple[str, str | None]] = field(default_factory=list)
    kept: bool = False
    reason: str = ""
    infos: list[dict[str, Any]] = field(default_factory=list)

    @property
    def actions(self) -> list[str]:
        """The action text of each turn, in order."""
        return [a for a, _ in self.turns]

    def to_text(self, information_template: str = "\n\n<information>{text}</information>\n\n") -> str:
        """The whole assistant side as one string, observations inline (Search-R1's layout), for reading."""
        out = []
        for action, obs in self.turns:
            out.append(action)
            if obs is not None:
                out.append(information_template.replace("{text}", obs))
        return "".join(out)


class ExpertPolicy:
    """Scripted search expert. ``rollout(example, env)`` plays one episode; deterministic given ``seed`` and the
    order of calls."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    # ----- text -----
    def _search_text(self, think: str, query: str) -> str:
        return f"<think>{think}</think>\n<search>{query}</search>"

    def _answer_text(self, think: str, answer: str) -> str:
        return f"<think>{think}</think>\n<answer>{answer}</answer>"

    def _query(self, relation: str, subject: str, question: str | None) -> str:
        """A query about ``subject`` for ``relation``; the question itself is one of the choices on the first hop."""
        options = [t.format(s=subject) for t in RELATIONS[relation].queries]
        if question is not None:
            options.append(question)
        return self.rng.choice(options)

    # ----- episode -----
    def _act(
        self, env: SearchEnvironment, traj: ExpertTrajectory, text: str, action: Action
    ) -> tuple[str | None, dict]:
        step = env.step(action)
        traj.turns.append((text, step.observation))
        traj.infos.append(step.info)
        return step.observation, step.info

    def rollout(self, example: dict[str, Any], env: SearchEnvironment) -> ExpertTrajectory:
        """Play one episode of ``example`` in ``env``; the returned trajectory says whether it was kept."""
        traj = ExpertTrajectory(example=dict(example), prompt=env.reset(example))
        golds = example["golden_answers"]
        gold = golds if isinstance(golds, str) else golds[0]
        qtype = QUESTION_TYPES.get(example.get("qtype") or "")
        if qtype is None or not example.get("gold_doc_ids"):
            return self._rollout_generic(example, env, traj, gold)

        chain = [RELATIONS[r] for r in qtype.chain]
        subject = example["subject"]
        objects = [example["bridge"], gold] if len(chain) == 2 else [gold]
        entity = subject
        facts: list[str] = []
        for hop, rel in enumerate(chain):
            need = rel.need.format(s=entity)
            if hop == 0 and len(chain) == 2:
                think = self.rng.choice(_THINK_FIRST_TWO_HOP).format(need=need, next=_NEXT[chain[1].name])
            elif hop == 0:
                think = self.rng.choice(_THINK_FIRST).format(need=need)
            else:
                think = self.rng.choice(_THINK_SECOND).format(found=facts[-1], next=need)
            query = self._query(rel.name, entity, example["question"] if hop == 0 else None)
            text = self._search_text(think, query)
            obs, info = self._act(
                env, traj, text, Action(kind="tool", name="search", arguments={"query": query}, text=text)
            )
            if info.get("action") != "search":
                traj.reason = f"hop {hop + 1}: {info.get('action')} ({info.get('error', '')})"
                return traj
            if example["gold_doc_ids"][hop] not in info["doc_ids"]:
                traj.reason = f"hop {hop + 1}: gold document not retrieved"
                return traj
            if normalize_answer(objects[hop]) not in normalize_answer(obs or ""):
                traj.reason = f"hop {hop + 1}: {objects[hop]!r} not in the retrieved text"
                return traj
            facts.append(rel.found.format(s=entity, o=objects[hop]))
            entity = objects[hop]
        found = " and ".join(facts) if len(facts) == 1 else f"{facts[0]}, and {facts[1]}"
        think = self.rng.choice(_THINK_ANSWER).format(found=found, answer=gold)
        return self._finish(env, traj, think, gold)

    def _rollout_generic(self, example: dict[str, Any], env: SearchEnvironment, traj: ExpertTrajectory, gold: str):
        query = str(example["question"]).strip()
        text = self._search_text(self.rng.choice(_THINK_FIRST_GENERIC), query)
        obs, info = self._act(
            env, traj, text, Action(kind="tool", name="search", arguments={"query": query}, text=text)
        )
        if info.get("action") != "search" or not answer_in_text(obs or "", example["golden_answers"]):
            traj.reason = "no gold answer in the retrieved documents"
            return traj
        return self._finish(env, traj, self.rng.choice(_THINK_ANSWER_GENERIC).format(answer=gold), gold)

    def _finish(self, env: SearchEnvironment, traj: ExpertTrajectory, think: str, gold: str) -> ExpertTrajectory:
        think = think[0].upper() + think[1:]
        text = self._answer_text(think, gold)
        _, info = self._act(env, traj, text, Action(kind="answer", content=gold, text=text))
        traj.kept = info.get("exact_match") == 1.0
        traj.reason = "ok" if traj.kept else "final answer did not match"
        return traj


def build_expert_trajectories(
    examples: Iterable[dict[str, Any]],
    retriever: Retriever | None = None,
    *,
    seed: int = 0,
    env_factory: Callable[[], SearchEnvironment] | None = None,
    keep_rejected: bool = False,
    **env_kwargs: Any,
) -> tuple[list[ExpertTrajectory], dict[str, Any]]:
    """Run the expert on every example and keep the trajectories whose searches surfaced the gold evidence.

    Args:
        examples: question rows (e.g. ``build_offline_dataset(...).train_rows`` or a ``datasets.Dataset``).
        retriever: the real retriever; a fresh ``SearchEnvironment(retriever, **env_kwargs)`` plays each example.
        seed: the expert's RNG seed (wording and query choice).
        env_factory: builds the environment instead of ``retriever`` + ``env_kwargs`` (use the training env's).
        keep_rejected: also return rejected trajectories (their ``kept`` is False).

    Returns:
        ``(trajectories, stats)``; ``stats`` has ``total``, ``kept``, ``kept_fraction``, ``kept_fraction_by_hops``
        and ``rejected_reasons`` (reason -> count).
    """
    if env_factory is None:
        if retriever is None:
            raise ValueError("build_expert_trajectories needs retriever= or env_factory=.")
        env_factory = lambda: SearchEnvironment(retriever, **env_kwargs)  # noqa: E731
    policy = ExpertPolicy(seed)
    out: list[ExpertTrajectory] = []
    total = kept = 0
    by_hops: dict[int, list[int]] = {}
    reasons: dict[str, int] = {}
    for example in examples:
        traj = policy.rollout(example, env_factory())
        total += 1
        counts = by_hops.setdefault(int(example.get("hops", 1)), [0, 0])
        counts[1] += 1
        if traj.kept:
            kept += 1
            counts[0] += 1
        else:
            reasons[traj.reason] = reasons.get(traj.reason, 0) + 1
        if traj.kept or keep_rejected:
            out.append(traj)
    stats = {
        "total": total,
        "kept": kept,
        "kept_fraction": kept / total if total else 0.0,
        "kept_fraction_by_hops": {h: k / n for h, (k, n) in sorted(by_hops.items())},
        "rejected_reasons": reasons,
    }
    return out, stats
