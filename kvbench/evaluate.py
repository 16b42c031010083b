"""Scoring an experiment's prediction files with its benchmark's official metric, and writing the reports."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from .experiment import Experiment
from .layout import OutputLayout
from .predictions import read_predictions
from .report import SettingResult, summarise, write_reports
from .settings import CompressionSetting

__all__ = ["evaluate_experiment", "evaluate_setting"]

logger = logging.getLogger(__name__)


def evaluate_setting(experiment: Experiment, setting: CompressionSetting) -> SettingResult:
    """The setting's official and unrounded scores per task (tasks without predictions are left out), sample
    counts, per-sample scores where the metric has them, and the KV bytes each line recorded."""
    benchmark = experiment.benchmark
    layout = OutputLayout(experiment.output_dir, benchmark)
    result = SettingResult(setting)
    for task in experiment.tasks:
        lines = [line.record for line in read_predictions(layout.prediction_file(setting.name, task),
                                                          benchmark.line_keys)]
        if not lines:
            continue
        result.scores[task] = benchmark.score(experiment.options, task, lines)
        result.unrounded_scores[task] = benchmark.unrounded_score(experiment.options, task, lines)
        result.samples[task] = len(lines)
        per_sample = benchmark.sample_scores(experiment.options, task, lines)
        if per_sample is not None:
            result.sample_scores[task] = dict(zip((line["_id"] for line in lines), per_sample, strict=True))
        measured = {line["_id"]: (line["kv_bytes"], line["full_kv_bytes"]) for line in lines if "kv_bytes" in line}
        if measured:
            result.sample_bytes[task] = measured
    if result.scores:
        benchmark.write_official_results(layout.setting_dir(setting.name), result.scores)
    return result


def evaluate_experiment(experiment: Experiment, settings: Sequence[CompressionSetting]) -> dict[str, Any]:
    """Scores every setting that has predictions and writes the reports (``kvbench.report``) for them."""
    evaluated = []
    for setting in settings:
        result = evaluate_setting(experiment, setting)
        if result.scores:
            evaluated.append(result)
        else:
            logger.warning("setting %s has no predictions yet; left out of the report", setting.name)
    if not evaluated:
        raise FileNotFoundError(f"no prediction files under {experiment.output_dir}; run `predict` first")
    summary = summarise(experiment, evaluated)
    write_reports(summary, experiment, OutputLayout(experiment.output_dir, experiment.benchmark))
    return summary
