"""Scoring prediction files as the official ``eval.py`` does, and collecting an experiment's scores.

``scorer`` and ``scorer_e`` keep the official names, arguments and return values (first-line post-processing,
max over gold answers, ``round(100 * mean, 2)``, LongBench-E buckets with NaN for an empty bucket), so numbers
from this module can be put next to published LongBench tables.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from .experiment import CompressionSetting, Experiment
from .layout import OutputLayout
from .metrics import METRICS, check_fixes
from .predictions import read_predictions
from .report import summarise, write_reports
from .tasks import TASKS, V1_TASKS

__all__ = ["dataset2metric", "scorer", "scorer_e", "sample_score", "evaluate_experiment"]

logger = logging.getLogger(__name__)

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
) -> float:
    """The task score: ``round(100 * mean per-sample score, 2)``."""
    if not predictions:
        raise ValueError(f"no predictions to score for {dataset}")
    total = 0.0
    for prediction, ground_truths in zip(predictions, answers):
        total += sample_score(dataset, prediction, ground_truths, all_classes, fixes)
    return round(100 * total / len(predictions), 2)


def scorer_e(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    lengths: Sequence[int],
    all_classes: Any,
    *,
    fixes: Collection[str] = (),
) -> dict[str, float]:
    """LongBench-E: the same per-sample scores averaged per length bucket (< 4000, < 8000, the rest).

    An empty bucket is NaN (numpy's mean of nothing), which ``json.dump`` writes as ``NaN`` like upstream.
    """
    buckets: dict[str, list[float]] = {"0-4k": [], "4-8k": [], "8k+": []}
    for prediction, ground_truths, length in zip(predictions, answers, lengths):
        score = sample_score(dataset, prediction, ground_truths, all_classes, fixes)
        buckets["0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"].append(score)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "Mean of empty slice" is the documented NaN
        return {key: round(100 * float(np.mean(values)), 2) for key, values in buckets.items()}


def _score_file(task: str, lines: list[dict[str, Any]], fixes: Collection[str]) -> float | dict[str, float]:
    predictions = [line["pred"] for line in lines]
    answers = [line["answers"] for line in lines]
    all_classes = lines[-1]["all_classes"]  # eval.py keeps the last line's value
    if TASKS[task].is_longbench_e:
        return scorer_e(task, predictions, answers, [line["length"] for line in lines], all_classes, fixes=fixes)
    return scorer(task, predictions, answers, all_classes, fixes=fixes)


def _evaluate_setting(experiment: Experiment, setting: CompressionSetting) -> tuple[dict[str, Any], dict[str, int]]:
    """Scores of the setting's prediction files (tasks without a file are left out), and sample counts."""
    layout = OutputLayout(experiment.output_dir)
    scores: dict[str, Any] = {}
    samples: dict[str, int] = {}
    for task in experiment.tasks:
        lines = [line.record for line in read_predictions(layout.prediction_file(setting.name, task))]
        if lines:
            scores[task] = _score_file(task, lines, experiment.metric_fixes)
            samples[task] = len(lines)
    for longbench_e in (False, True):
        official = {
            TASKS[task].base: score for task, score in scores.items() if TASKS[task].is_longbench_e == longbench_e
        }
        if official:
            path = layout.result_file(setting.name, longbench_e)
            path.write_text(json.dumps(official, ensure_ascii=False, indent=4), encoding="utf-8")
    return scores, samples


def evaluate_experiment(experiment: Experiment, settings: Sequence[CompressionSetting]) -> dict[str, Any]:
    """Scores every setting that has predictions and writes ``scores.json/.csv/.md/.png`` for them."""
    evaluated = []
    for setting in settings:
        scores, samples = _evaluate_setting(experiment, setting)
        if scores:
            evaluated.append((setting, scores, samples))
        else:
            logger.warning("setting %s has no predictions yet; left out of the report", setting.name)
    if not evaluated:
        raise FileNotFoundError(f"no prediction files under {experiment.output_dir}; run `predict` first")
    summary = summarise(experiment, evaluated)
    write_reports(summary, OutputLayout(experiment.output_dir))
    return summary
