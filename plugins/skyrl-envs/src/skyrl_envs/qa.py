"""Short-answer matching for question answering: SQuAD-style normalised exact match.

``normalize_answer`` lowercases, drops punctuation and the articles a/an/the, and collapses
spaces; ``exact_match`` is true when the prediction equals any accepted answer after that.
Ground truths may be a string, a list of strings, or ``{"target": string-or-list}`` (the shape
upstream search datasets use).
"""

from __future__ import annotations

import re
import string
from typing import Any

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def accepted_answers(ground_truth: Any) -> list[str]:
    """The accepted answers of a ground truth, as strings."""
    if isinstance(ground_truth, dict):
        if "target" not in ground_truth:
            raise ValueError(f"a dict ground truth needs a 'target' key, got {ground_truth!r:.120}")
        ground_truth = ground_truth["target"]
    if isinstance(ground_truth, (list, tuple)) or hasattr(ground_truth, "tolist"):
        answers = [str(a) for a in (ground_truth.tolist() if hasattr(ground_truth, "tolist") else ground_truth)]
    else:
        answers = [str(ground_truth)]
    if not answers:
        raise ValueError("the ground truth lists no accepted answer")
    return answers


def exact_match(prediction: str | None, answers: list[str]) -> bool:
    if prediction is None:
        return False
    normalized = normalize_answer(prediction)
    return bool(normalized) and any(normalized == normalize_answer(answer) for answer in answers)
