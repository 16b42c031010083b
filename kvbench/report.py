"""Rendering an experiment's scores: ``scores.json``, ``scores.csv``, ``scores.md`` and ``scores.png``.

The table has one column per setting and one row per task (the benchmark's rows: LongBench-E adds one per length
bucket), then the benchmark's averages (LongBench: the English-16 mean papers print, only when all 16 tasks were
evaluated; RULER: the mean over its tasks). Two rows are the runner's own, for every benchmark:

- **KV ×**: the real key/value bytes the setting's caches held over what the full cache held for the same tokens,
  summed over every sample (measured on the cache tensors, see ``kvbench.generation``);
- **full-cache solved** (benchmarks scored per sample, with a full-cache setting in the report): the share of the
  samples the full cache answers perfectly that the setting also answers perfectly, so that compression is judged
  where the model itself succeeds.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .experiment import CompressionSetting, Experiment
from .layout import OutputLayout

__all__ = ["SettingResult", "summarise", "write_reports"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SettingResult:
    setting: CompressionSetting
    scores: dict[str, Any] = dataclasses.field(default_factory=dict)
    samples: dict[str, int] = dataclasses.field(default_factory=dict)
    sample_scores: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    kv_bytes: int = 0
    full_kv_bytes: int = 0


def _full_cache_solved(
    results: Sequence[SettingResult],
) -> tuple[dict[str, tuple[int, int]], str | None]:
    """Per setting (solved, out of): samples the full cache answers perfectly that the setting answers perfectly."""
    full = next((r for r in results if r.setting.is_full_cache and r.sample_scores), None)
    if full is None:
        return {}, None
    solved = {(task, sample) for task, scores in full.sample_scores.items() for sample, s in scores.items() if s == 1}
    counts = {}
    for result in results:
        mine = [(task, sample) for task, sample in solved if sample in result.sample_scores.get(task, {})]
        if mine:
            counts[result.setting.name] = (sum(result.sample_scores[t][s] == 1 for t, s in mine), len(mine))
    return counts, full.setting.name


def summarise(experiment: Experiment, results: Sequence[SettingResult]) -> dict[str, Any]:
    """The content of ``scores.json``: per setting its scores, sample counts, averages, KV ratio and pipeline."""
    layout = OutputLayout(experiment.output_dir, experiment.benchmark)
    solved, full_name = _full_cache_solved(results)
    settings = []
    for result in results:
        pipeline_path = layout.pipeline_file(result.setting.name)
        settings.append({
            **result.setting.describe(),
            "scores": result.scores,
            "samples": result.samples,
            "averages": experiment.benchmark.averages(experiment.options, result.scores),
            "kv_ratio": round(result.kv_bytes / result.full_kv_bytes, 4) if result.full_kv_bytes else None,
            "full_cache_solved": solved.get(result.setting.name),
            "pipeline": json.loads(pipeline_path.read_text(encoding="utf-8")) if pipeline_path.exists() else None,
        })
    return {
        "benchmark": experiment.benchmark.name,
        "experiment": experiment.name,
        "tasks": list(experiment.tasks),
        "limit": experiment.limit,
        "full_cache_setting": full_name,
        "settings": settings,
        **experiment.benchmark.pipeline(experiment.options),
    }


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


def _solved(setting: dict[str, Any]) -> str:
    if setting["full_cache_solved"] is None:
        return "—"
    hits, total = setting["full_cache_solved"]
    return f"{hits}/{total}"


def _markdown(summary: dict[str, Any], experiment: Experiment) -> str:
    benchmark, settings = experiment.benchmark, summary["settings"]
    lines = [
        f"# {benchmark.title} scores{': ' + summary['experiment'] if summary['experiment'] else ''}",
        "",
        "| task | " + " | ".join(setting["name"] for setting in settings) + " |",
        "|---|" + "---:|" * len(settings),
    ]
    short = _short_tasks(settings)
    for row in benchmark.rows(summary["tasks"]):
        cells = (_format(_cell(s, row.task, row.bucket)) + ("*" if (s["name"], row.task) in short else "")
                 for s in settings)
        lines.append(f"| {row.label} | " + " | ".join(cells) + " |")
    for name in settings[0]["averages"]:
        lines.append(f"| **{name}** | " + " | ".join(_format(s["averages"][name]) for s in settings) + " |")
    if summary["full_cache_setting"]:
        lines.append("| full-cache solved kept | " + " | ".join(_solved(s) for s in settings) + " |")
    lines.append("| KV × | " + " | ".join("—" if s["kv_ratio"] is None else f"{s['kv_ratio']:.3f}"
                                         for s in settings) + " |")
    lines.append("")
    lines += benchmark.notes(experiment.options)
    if summary["full_cache_setting"]:
        lines.append(
            f"Full-cache solved kept: of the samples `{summary['full_cache_setting']}` answers perfectly, how many "
            "the setting answers perfectly too."
        )
    lines.append(
        "KV ×: the key/value bytes the setting's caches held (after compressing the prompt) over the full cache's "
        "for the same tokens, summed over the samples; measured on the cache tensors."
    )
    if short:
        lines.append("\\* fewer samples than another setting has for this task: its predictions are not finished.")
    pipeline = next((s["pipeline"]["generation"] for s in settings if s["pipeline"]), None)
    if pipeline:
        new_tokens = pipeline["max_new_tokens"] or "the benchmark's per task"
        lines.append(
            f"Pipeline: model `{pipeline['model']}` ({pipeline.get('computed_dtype') or pipeline['dtype']}, "
            f"{pipeline['attn_implementation']}), chat "
            f"template {'on' if pipeline['chat_template'] else 'off'}, max_new_tokens {new_tokens}; limit "
            f"{summary['limit'] or 'none'} per task."
        )
    return "\n".join(lines) + "\n"


def _csv(summary: dict[str, Any], experiment: Experiment) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["setting", "method", "budget", "task", "bucket", "score", "samples"])
    for setting in summary["settings"]:
        head = [setting["name"], setting["method"], setting["budget"]]
        for row in experiment.benchmark.rows(summary["tasks"]):
            score = _cell(setting, row.task, row.bucket)
            if score is not None:
                writer.writerow(head + [row.task, row.bucket or "", score, setting["samples"][row.task]])
        for name, value in setting["averages"].items():
            if value is not None:
                writer.writerow(head + [name, "", value, ""])
        if setting["kv_ratio"] is not None:
            writer.writerow(head + ["kv_ratio", "", setting["kv_ratio"], ""])
    return buffer.getvalue()


def _plot(summary: dict[str, Any], path: Path, title: str) -> None:
    """The first average every setting has, against budget, one line per method; the full cache as a horizontal
    line. Integer budgets (slots) on a log axis, fractions of the prompt on a linear one."""
    try:
        from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend and figures alone
    except ImportError:
        logger.warning("matplotlib is not installed; skipping %s (pip install matplotlib)", path)
        return
    settings = summary["settings"]
    names = [name for name in settings[0]["averages"] if all(s["averages"][name] is not None for s in settings)]
    if not names:
        return
    key = names[0]
    figure = Figure(figsize=(6, 4))
    axes = figure.subplots()
    methods = sorted({s["method"] for s in settings if s["budget"] is not None})
    for method in methods:
        points = sorted((s["budget"], s["averages"][key]) for s in settings
                        if s["method"] == method and s["budget"] is not None)
        if points:
            axes.plot(*zip(*points), marker="o", label=method)
    for setting in settings:
        if setting["budget"] is None:
            label = "full cache" if setting["name"] == "full" else f"{setting['name']} (full cache)"
            axes.axhline(setting["averages"][key], linestyle="--", color="black", label=label)
    budgets = sorted({s["budget"] for s in settings if s["budget"] is not None})
    fractions = bool(budgets) and all(isinstance(budget, float) for budget in budgets)
    if budgets and not fractions:
        axes.set_xscale("log", base=2)
        axes.set_xticks(budgets, [str(budget) for budget in budgets])
        axes.minorticks_off()
    elif fractions:
        axes.set_xticks(budgets, [f"{budget:.0%}" for budget in budgets])
    axes.set_xlabel("KV budget (share of the prompt kept)" if fractions else "KV budget per layer (tokens)")
    axes.set_ylabel(key)
    axes.set_title(f"{title}{': ' + summary['experiment'] if summary['experiment'] else ''}")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120, metadata={"Software": None})


def write_reports(summary: dict[str, Any], experiment: Experiment, layout: OutputLayout) -> None:
    layout.root.mkdir(parents=True, exist_ok=True)
    layout.report_file(".json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    layout.report_file(".csv").write_text(_csv(summary, experiment), encoding="utf-8")
    layout.report_file(".md").write_text(_markdown(summary, experiment), encoding="utf-8")
    _plot(summary, layout.report_file(".png"), experiment.benchmark.title)
