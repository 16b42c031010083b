"""RULER's scores, as its evaluator defines them (``eval/synthetic/constants.py`` and ``eval/evaluate.py`` of
``nvidia-long-context-eval`` 26.3).

A prediction is cleaned (``None`` becomes "", otherwise strip, every character in ``\\x00``-``\\x1f`` becomes a
newline, strip again) and compared with the references by case-insensitive substring containment, nothing more:
no punctuation removal, no first-line cut, so "1234567" counts inside "12345678". ``string_match_all`` gives each
sample the share of its references found (niah, vt, cwe, fwe); ``string_match_part`` gives 1 when any reference
is found (qa_1, qa_2). A task's score is the mean over samples × 100, rounded to 2 decimals; the average over
tasks is their unweighted mean, as RULER's result summary takes it.

Two deliberate differences from the package: mismatched numbers of predictions and references raise instead of
being silently zipped to the shorter list, and an empty list raises instead of dividing by zero. kvpress's scorer
deletes the control characters instead of turning them into newlines; the scores here are RULER's.

Standard library only, like ``prompts``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

from .prompts import task_family

__all__ = [
    "METRICS", "average_score", "metric_name", "postprocess_prediction", "score_task", "string_match_all",
    "string_match_all_per_sample", "string_match_part", "string_match_part_per_sample",
]

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess_prediction(prediction: str | None) -> str:
    """RULER's ``postprocess_pred``: ``None`` → "", strip, control characters → newline, strip."""
    if prediction is None:
        return ""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def _pairs(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> list[tuple[str, Sequence[str]]]:
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} reference lists")
    if not predictions:
        raise ValueError("no predictions to score")
    if any(len(refs) == 0 for refs in references):
        raise ValueError("every sample needs at least one reference")
    return list(zip(predictions, references, strict=True))


def _found(reference: str, prediction: str) -> float:
    return 1.0 if reference.lower() in prediction.lower() else 0.0


def string_match_all_per_sample(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> list[float]:
    """Per sample: 100 × the share of its references contained in the prediction (case-insensitive)."""
    return [sum(_found(r, pred) for r in refs) / len(refs) * 100 for pred, refs in _pairs(predictions, references)]


def string_match_part_per_sample(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> list[float]:
    """Per sample: 100 if any of its references is contained in the prediction (case-insensitive), else 0."""
    return [max(_found(r, pred) for r in refs) * 100 for pred, refs in _pairs(predictions, references)]


def string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Mean over samples of the share of references found, × 100, rounded to 2 decimals."""
    pairs = _pairs(predictions, references)
    return round(sum(sum(_found(r, pred) for r in refs) / len(refs) for pred, refs in pairs) / len(pairs) * 100, 2)


def string_match_part(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Share of samples with at least one reference found, × 100, rounded to 2 decimals."""
    pairs = _pairs(predictions, references)
    return round(sum(max(_found(r, pred) for r in refs) for pred, refs in pairs) / len(pairs) * 100, 2)


METRICS: dict[str, Callable[[Sequence[str], Sequence[Sequence[str]]], float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
}


def metric_name(task: str) -> str:
    """``string_match_part`` for qa_*, ``string_match_all`` for every other RULER task."""
    return "string_match_part" if task_family(task) == "qa" else "string_match_all"


def score_task(task: str, predictions: Sequence[str | None], references: Sequence[Sequence[str]]) -> float:
    """The task's RULER score (0-100): its metric on the cleaned predictions."""
    return METRICS[metric_name(task)]([postprocess_prediction(p) for p in predictions], references)


def average_score(task_scores: Mapping[str, float]) -> float:
    """Unweighted mean of the task scores (RULER averages its tasks at each length this way)."""
    if not task_scores:
        raise ValueError("no task scores to average")
    return sum(task_scores.values()) / len(task_scores)
