"""Scoring predictions as the official ``eval.py`` does.

``scorer`` and ``scorer_e`` keep the official names, arguments and return values (first-line post-processing,
max over gold answers, ``round(100 * mean, 2)``, LongBench-E buckets with NaN for an empty bucket), so numbers
from this module can be put next to published LongBench tables.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from .metrics import METRICS, check_fixes
from .tasks import TASKS, V1_TASKS

__all__ = ["BUCKETS", "dataset2metric", "scorer", "scorer_e", "sample_score"]

BUCKETS = ("0-4k", "4-8k", "8k+")  # LongBench-E's length buckets, in eval.py's order

dataset2metric = {name: METRICS[TASKS[name].metric] for name in V1_TASKS}


def _base(dataset: str) -> str:
    """eval.py takes the task from the file name, which drops the ``_e``; accept either spelling."""
    if dataset not in TASKS:
        raise ValueError(f"unknown LongBench dataset {dataset!r}; allowed: {list(TASKS)}")
    return TASKS[dataset].base


def sample_score(
    dataset: str, prediction: str, ground_truths: Sequence[str], all_classes: Any, fixes: Collection[str] = ()
) -> float:
    """Best score over the gold answers, after the first-line rule of the few-shot tasks.

    Only leading newlines are stripped before taking the first line, so " \\nCity" keeps the blank " " line and
    scores 0, as upstream.
    """
    base = _base(dataset)
    if TASKS[base].first_line_only:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric, options = dataset2metric[base], {"all_classes": all_classes}
    if fixes:
        options["fixes"] = check_fixes(fixes)
    score = 0.0
    for ground_truth in ground_truths:
        score = max(score, metric(prediction, ground_truth, **options))
    return score


def scorer(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    all_classes: Any,
    *,
    fixes: Collection[str] = (),
    rounded: bool = True,
) -> float:
    """The task score: ``round(100 * mean per-sample score, 2)`` (unrounded with ``rounded=False``: what averages
    over tasks are taken of)."""
    if not predictions:
        raise ValueError(f"no predictions to score for {dataset}")
    total = 0.0
    for prediction, ground_truths in zip(predictions, answers):
        total += sample_score(dataset, prediction, ground_truths, all_classes, fixes)
    score = 100 * total / len(predictions)
    return round(score, 2) if rounded else score


def scorer_e(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    lengths: Sequence[int],
    all_classes: Any,
    *,
    fixes: Collection[str] = (),
    rounded: bool = True,
) -> dict[str, float]:
    """LongBench-E: the same per-sample scores averaged per length bucket (< 4000, < 8000, the rest), rounded
    as ``scorer``'s unless ``rounded=False``.

    An empty bucket is NaN (numpy's mean of nothing), which ``json.dump`` writes as ``NaN`` like upstream.
    """
    buckets: dict[str, list[float]] = {bucket: [] for bucket in BUCKETS}
    for prediction, ground_truths, length in zip(predictions, answers, lengths):
        score = sample_score(dataset, prediction, ground_truths, all_classes, fixes)
        buckets["0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"].append(score)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "Mean of empty slice" is the documented NaN
        means = {key: 100 * float(np.mean(values)) for key, values in buckets.items()}
    return {key: round(mean, 2) if rounded else mean for key, mean in means.items()}
