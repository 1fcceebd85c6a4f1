"""Question-answering rewards: exact match, substring match, token F1 and a tag-format check.

Each metric is a plain function of one prediction and its gold answers, and has a TRL reward-function twin
(``*_reward(completions, golden_answers, **kwargs) -> list[float]``) that extracts the last ``<answer>`` of each
completion. TRL calls reward functions with ``prompts=``, ``completions=``, ``completion_ids=`` and every dataset
column as a keyword list; completions are strings, or lists of message dicts for conversational prompts.

Normalization follows Search-R1 / SQuAD: lower-case, remove punctuation, drop the articles a/an/the, collapse
white space. Departures from Search-R1: its ``extract_solution`` skips the first ``<answer>`` because its decoded
sequence includes the prompt, which shows an example answer; completions here never include the prompt, so the
LAST ``<answer>`` counts and a single one is enough. Its format check also looks for a Qwen ``<|im_start|>assistant``
marker; here the completion text is checked directly, and conversational completions are accepted.
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Sequence
from typing import Any

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_TAG = re.compile(r"(</?(?:think|search|information|answer)>)")


def normalize_answer(s: str) -> str:
    """Lower-case, strip punctuation, drop a/an/the, collapse white space (SQuAD / Search-R1 normalization)."""
    s = str(s).lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _golds(golds: Any) -> list[str]:
    if golds is None:
        return []
    if isinstance(golds, str):
        return [golds]
    return [str(g) for g in golds]


def exact_match(prediction: str | None, golds: str | Sequence[str]) -> float:
    """1.0 if the normalized prediction equals any normalized gold answer, else 0.0 (None scores 0)."""
    if prediction is None:
        return 0.0
    p = normalize_answer(prediction)
    return float(any(p == normalize_answer(g) for g in _golds(golds)))


def substring_match(prediction: str | None, golds: str | Sequence[str]) -> float:
    """1.0 if any normalized gold answer occurs inside the normalized prediction, else 0.0."""
    if prediction is None:
        return 0.0
    p = normalize_answer(prediction)
    return float(any((g := normalize_answer(x)) and g in p for x in _golds(golds)))


def f1(prediction: str | None, golds: str | Sequence[str]) -> float:
    """Best token-level F1 between the normalized prediction and any gold answer (SQuAD F1)."""
    if prediction is None:
        return 0.0
    pred_tokens = normalize_answer(prediction).split()
    best = 0.0
    for g in _golds(golds):
        gold_tokens = normalize_answer(g).split()
        if not pred_tokens or not gold_tokens:
            best = max(best, float(pred_tokens == gold_tokens))
            continue
        common = collections.Counter(pred_tokens) & collections.Counter(gold_tokens)
        same = sum(common.values())
        if same == 0:
            continue
        precision, recall = same / len(pred_tokens), same / len(gold_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def extract_answer(text: str | None) -> str | None:
    """The stripped content of the LAST ``<answer>...</answer>`` in ``text``; None when there is none."""
    if not text:
        return None
    matches = _ANSWER.findall(text)
    return matches[-1].strip() if matches else None


def answer_in_text(text: str, golds: str | Sequence[str]) -> bool:
    """True when a normalized gold answer occurs in the normalized text (Search-R1's retrieval-hit test)."""
    t = normalize_answer(text)
    return any((g := normalize_answer(x)) and g in t for x in _golds(golds))


def check_format(text: str, *, require_think: bool = True) -> tuple[bool, str]:
    """Check that ``text`` is a well-formed Search-R1 tag sequence and say why not.

    Valid: ``(<think>..</think> <search>..</search> <information>..</information>)*`` then
    ``<think>..</think> <answer>..</answer>``, with only white space between blocks, no nested tags, and exactly one
    answer, at the end. With ``require_think=False`` every ``<think>`` block is optional.
    """
    state = "start"  # start -> in_think -> after_think -> in_search -> after_search -> in_information -> start ...
    for part in _TAG.split(text):
        if not part.strip():
            continue
        if _TAG.fullmatch(part):
            ready = state == "after_think" or (not require_think and state == "start")
            transitions = {
                ("<think>", "start"): "in_think",
                ("</think>", "in_think"): "after_think",
                ("</search>", "in_search"): "after_search",
                ("<information>", "after_search"): "in_information",
                ("</information>", "in_information"): "start",
                ("</answer>", "in_answer"): "end",
            }
            if part == "<search>" and ready:
                state = "in_search"
            elif part == "<answer>" and ready:
                state = "in_answer"
            elif (part, state) in transitions:
                state = transitions[(part, state)]
            else:
                return False, f"unexpected tag {part} in state {state}"
        elif state not in ("in_think", "in_search", "in_information", "in_answer"):
            return False, f"text outside the tags in state {state}: {part.strip()[:40]!r}"
    if state != "end":
        return False, f"the sequence does not end with an answer (state {state})"
    return True, "ok"


def is_valid_format(text: str, *, require_think: bool = True) -> bool:
    """``check_format(text)[0]``."""
    return check_format(text, require_think=require_think)[0]


# ---------------------------------------------------------------------------------------------------------------
# TRL reward functions
# ---------------------------------------------------------------------------------------------------------------
def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multimodal / typed parts: [{"type": "text", "text": ...}, ...]
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def completion_to_text(completion: Any) -> str:
    """One completion as tag text. Strings pass through; for a list of message dicts, assistant contents are
    kept and every other message (tool / user observation) is wrapped in ``<information>`` unless it already is."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    parts = []
    for msg in completion:
        if not isinstance(msg, dict):
            raise TypeError(f"a conversational completion must be a list of message dicts, got {type(msg).__name__}.")
        text = _content_text(msg.get("content"))
        if msg.get("role", "assistant") == "assistant":
            parts.append(text)
        else:
            t = text.strip()
            parts.append(t if t.startswith("<information>") else f"<information>{t}</information>")
    return "\n".join(parts)


def _gold_column(golden_answers: Any, n: int, name: str) -> list[Any]:
    if golden_answers is None:
        raise ValueError(
            f"{name} needs the dataset column 'golden_answers' (a list of gold answer strings per row, FlashRAG "
            "format); rename your answer column to golden_answers."
        )
    golden_answers = list(golden_answers)
    if len(golden_answers) != n:
        raise ValueError(f"{name} got {n} completions but {len(golden_answers)} golden_answers; they must match.")
    return golden_answers


def exact_match_reward(completions: list[Any], golden_answers: list[Any] | None = None, **kwargs: Any) -> list[float]:
    """TRL reward: exact match of each completion's last ``<answer>`` against its row's ``golden_answers``."""
    golds = _gold_column(golden_answers, len(completions), "exact_match_reward")
    return [exact_match(extract_answer(completion_to_text(c)), g) for c, g in zip(completions, golds)]


def substring_match_reward(
    completions: list[Any], golden_answers: list[Any] | None = None, **kwargs: Any
) -> list[float]:
    """TRL reward: a gold answer occurs inside each completion's last ``<answer>``."""
    golds = _gold_column(golden_answers, len(completions), "substring_match_reward")
    return [substring_match(extract_answer(completion_to_text(c)), g) for c, g in zip(completions, golds)]


def f1_reward(completions: list[Any], golden_answers: list[Any] | None = None, **kwargs: Any) -> list[float]:
    """TRL reward: token F1 of each completion's last ``<answer>`` against its row's ``golden_answers``."""
    golds = _gold_column(golden_answers, len(completions), "f1_reward")
    return [f1(extract_answer(completion_to_text(c)), g) for c, g in zip(completions, golds)]


def format_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """TRL reward: 1.0 for a well-formed tag sequence (see :func:`check_format`), else 0.0."""
    return [float(is_valid_format(completion_to_text(c))) for c in completions]
