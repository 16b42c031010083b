"""Rendering an experiment's scores: ``scores.json``, ``scores.csv``, ``scores.md`` and ``scores.png``.

The averages are the ones papers print: the unweighted mean of the 16 English and code task scores (each already
rounded to 2 decimals), reported only when all 16 were evaluated so that a partial run is never mistaken for a
comparable number; a mean over whatever v1 tasks were evaluated is given separately.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .experiment import CompressionSetting, Experiment
from .layout import OutputLayout
from .tasks import ENGLISH16, TASKS

__all__ = ["summarise", "write_reports"]

logger = logging.getLogger(__name__)

BUCKETS = ("0-4k", "4-8k", "8k+")


def _mean(values: Sequence[float]) -> float | None:
    return round(sum(values) / len(values), 2) if values else None


def summarise(
    experiment: Experiment, evaluated: Sequence[tuple[CompressionSetting, dict[str, Any], dict[str, int]]]
) -> dict[str, Any]:
    """The content of ``scores.json``: per setting its scores, sample counts, averages and recorded pipeline."""
    layout = OutputLayout(experiment.output_dir)
    settings = []
    for setting, scores, samples in evaluated:
        pipeline_path = layout.pipeline_file(setting.name)
        v1 = [score for task, score in scores.items() if not TASKS[task].is_longbench_e]
        settings.append({
            **setting.describe(),
            "scores": scores,
            "samples": samples,
            "english16_average": _mean([scores[task] for task in ENGLISH16]) if set(ENGLISH16) <= set(scores) else None,
            "average": _mean(v1),
            "average_tasks": len(v1),
            "pipeline": json.loads(pipeline_path.read_text(encoding="utf-8")) if pipeline_path.exists() else None,
        })
    return {
        "experiment": experiment.name,
        "tasks": list(experiment.tasks),
        "data": experiment.data.describe(),
        "limit": experiment.limit,
        "metric_fixes": sorted(experiment.metric_fixes),
        "settings": settings,
    }


def _rows(summary: dict[str, Any]) -> list[tuple[str, str, str | None]]:
    """Table rows as (label, task, bucket) in task order, LongBench-E tasks one row per bucket."""
    rows = []
    for task in summary["tasks"]:
        if TASKS[task].is_longbench_e:
            rows.extend((f"{task} {bucket}", task, bucket) for bucket in BUCKETS)
        else:
            rows.append((task, task, None))
    return rows


def _cell(setting: dict[str, Any], task: str, bucket: str | None) -> float | None:
    score = setting["scores"].get(task)
    return score[bucket] if bucket is not None and score is not None else score


def _format(value: float | None) -> str:
    if value is None:
        return "—"
    return "nan" if math.isnan(value) else f"{value:.2f}"


def _short_tasks(settings: Sequence[dict[str, Any]]) -> set[tuple[str, str]]:
    """(setting, task) pairs with fewer samples than another setting has for the task: unfinished predictions."""
    most: dict[str, int] = {}
    for setting in settings:
        for task, count in setting["samples"].items():
            most[task] = max(most.get(task, 0), count)
    return {(s["name"], task) for s in settings for task, count in s["samples"].items() if count < most[task]}


def _markdown(summary: dict[str, Any]) -> str:
    settings = summary["settings"]
    lines = [
        f"# LongBench scores{': ' + summary['experiment'] if summary['experiment'] else ''}",
        "",
        "| task | " + " | ".join(setting["name"] for setting in settings) + " |",
        "|---|" + "---:|" * len(settings),
    ]
    short = _short_tasks(settings)
    for label, task, bucket in _rows(summary):
        cells = (_format(_cell(s, task, bucket)) + ("*" if (s["name"], task) in short else "") for s in settings)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| **average (english16)** | " + " | ".join(_format(s["english16_average"]) for s in settings) + " |")
    lines.append(
        "| average (evaluated v1 tasks) | "
        + " | ".join(f"{_format(s['average'])} ({s['average_tasks']})" for s in settings) + " |"
    )
    lines += ["", "english16 is the 16 English and code tasks the KV-compression papers average; it is shown only when"
              " all 16 were evaluated."]
    if short:
        lines.append("\\* fewer samples than another setting has for this task: its predictions are not finished.")
    pipeline = next((s["pipeline"]["generation"] for s in settings if s["pipeline"]), None)
    if pipeline:
        new_tokens = pipeline["max_new_tokens"] or "official per task"
        lines.append(
            f"Pipeline: model `{pipeline['model']}` ({pipeline['dtype']}, {pipeline['attn_implementation']}), chat "
            f"template {'on' if pipeline['chat_template'] else 'off'}, truncation cap {pipeline['max_length']} tokens,"
            f" max_new_tokens {new_tokens}, min_one_new_token {str(pipeline['min_one_new_token']).lower()}."
        )
    lines.append(
        f"Data: {summary['data']}, limit {summary['limit'] or 'none'} per task; metric fixes: "
        f"{', '.join(summary['metric_fixes']) or 'none (official metrics)'}."
    )
    return "\n".join(lines) + "\n"


def _csv(summary: dict[str, Any]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["setting", "method", "budget", "task", "bucket", "score", "samples"])
    for setting in summary["settings"]:
        head = [setting["name"], setting["method"], setting["budget"]]
        for _, task, bucket in _rows(summary):
            score = _cell(setting, task, bucket)
            if score is not None:
                writer.writerow(head + [task, bucket or "", score, setting["samples"][task]])
        for key in ("english16_average", "average"):
            if setting[key] is not None:
                writer.writerow(head + [key, "", setting[key], ""])
    return buffer.getvalue()


def _plot(summary: dict[str, Any], path: Path) -> None:
    """Average score against budget, one line per method, the full cache as a horizontal line."""
    try:
        from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend and figures alone
    except ImportError:
        logger.warning("matplotlib is not installed; skipping %s (pip install matplotlib)", path)
        return
    settings = summary["settings"]
    key = "english16_average" if all(s["english16_average"] is not None for s in settings) else "average"
    figure = Figure(figsize=(6, 4))
    axes = figure.subplots()
    methods = sorted({s["method"] for s in settings if s["budget"] is not None})
    for method in methods:
        points = sorted((s["budget"], s[key]) for s in settings if s["method"] == method and s[key] is not None)
        if points:
            axes.plot(*zip(*points), marker="o", label=method)
    for setting in settings:
        if setting["budget"] is None and setting[key] is not None:
            label = "full cache" if setting["name"] == "full" else f"{setting['name']} (full cache)"
            axes.axhline(setting[key], linestyle="--", color="black", label=label)
    budgets = sorted({s["budget"] for s in settings if s["budget"] is not None})
    if budgets:
        axes.set_xscale("log", base=2)
        axes.set_xticks(budgets, [str(budget) for budget in budgets])
        axes.minorticks_off()
    axes.set_xlabel("KV budget per layer (tokens)")
    axes.set_ylabel("english16 average" if key == "english16_average" else "average over evaluated v1 tasks")
    axes.set_title(f"LongBench{': ' + summary['experiment'] if summary['experiment'] else ''}")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120, metadata={"Software": None})


def write_reports(summary: dict[str, Any], layout: OutputLayout) -> None:
    layout.root.mkdir(parents=True, exist_ok=True)
    layout.report_file(".json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    layout.report_file(".csv").write_text(_csv(summary), encoding="utf-8")
    layout.report_file(".md").write_text(_markdown(summary), encoding="utf-8")
    _plot(summary, layout.report_file(".png"))
