"""Rendering an experiment's scores: ``scores.json``, ``scores.csv``, ``scores_summary.csv``, ``scores.md`` and
``scores.png``.

The table has one column per setting and one row per task (the benchmark's rows: LongBench-E adds one per length
bucket), then the benchmark's averages (LongBench: the English-16 mean papers print, only when all 16 tasks were
evaluated; RULER: the mean over its tasks). Task scores are the benchmark's official ones (RULER and LongBench round
them to 2 decimals); the averages are taken of the task scores before that rounding
(``Benchmark.unrounded_score``; a benchmark that cannot give them averages its official ones), so that rounding
happens once, for display. The rest is the runner's own, for every benchmark:

- **KV bytes**: the real key/value bytes the setting's caches held and the bytes the full cache holds for the same
  tokens, summed over every sample (measured on the cache tensors, see ``kvbench.generation``), and **KV ×**, their
  ratio, so the ratio can be checked against the report's own byte rows. Which tokens: the compressed ones, once
  compressed, when the context is compressed before the question (the full-cache setting is measured over the
  same context), else every token the cache saw, each setting's own answer included. Where the full-cache
  setting's bytes differ from a setting's full-cache bytes on the same samples (other tokens: its own answers,
  context-first predictions made before the full cache was measured over the context; or another dtype), the
  report says so: that setting is read against its own full-cache bytes, not against the full-cache setting's;
- **full-cache solved** (benchmarks scored per sample, with a full-cache setting in the report): the share of the
  samples the full cache answers perfectly that the setting also answers perfectly, so that compression is judged
  where the model itself succeeds.

``scores.csv`` is tidy: one row per task (and bucket) and setting; the per-setting summaries (averages, byte
totals, KV ×, full-cache solved) are in ``scores_summary.csv``, one row per setting.
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

from .experiment import Experiment
from .layout import OutputLayout
from .settings import CompressionSetting, budget_label

__all__ = ["SettingResult", "summarise", "write_reports"]

logger = logging.getLogger(__name__)

MB = 1e6  # the byte rows of the table are in MB


@dataclasses.dataclass
class SettingResult:
    setting: CompressionSetting
    scores: dict[str, Any] = dataclasses.field(default_factory=dict)  # official, as the benchmark rounds them
    unrounded_scores: dict[str, Any] = dataclasses.field(default_factory=dict)  # what averages are taken of
    samples: dict[str, int] = dataclasses.field(default_factory=dict)
    sample_scores: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    # task -> sample id -> (kv_bytes, full_kv_bytes), for the lines that recorded them
    sample_bytes: dict[str, dict[str, tuple[int, int]]] = dataclasses.field(default_factory=dict)


def _full_cache_solved(full: SettingResult | None, results: Sequence[SettingResult]) -> dict[str, tuple[int, int]]:
    """Per setting (solved, out of): samples the full cache answers perfectly that the setting answers perfectly."""
    if full is None or not full.sample_scores:
        return {}
    solved = {(task, sample) for task, scores in full.sample_scores.items() for sample, s in scores.items() if s == 1}
    counts = {}
    for result in results:
        mine = [(task, sample) for task, sample in solved if sample in result.sample_scores.get(task, {})]
        if mine:
            counts[result.setting.name] = (sum(result.sample_scores[t][s] == 1 for t, s in mine), len(mine))
    return counts


def _matches_full_cache(full: SettingResult | None, result: SettingResult) -> bool | None:
    """Whether, on every sample both measured, the full-cache setting held the bytes the setting's
    ``full_kv_bytes`` say the full cache holds for its tokens: then the setting's bytes can be divided by the
    full-cache setting's (same tokens, same dtype). None: nothing to compare."""
    if full is None:
        return None
    pairs = [(full.sample_bytes[task][sample][0], full_kv_bytes) for task, samples in result.sample_bytes.items()
             for sample, (_, full_kv_bytes) in samples.items() if sample in full.sample_bytes.get(task, {})]
    return all(held == full_kv_bytes for held, full_kv_bytes in pairs) if pairs else None


def summarise(experiment: Experiment, results: Sequence[SettingResult]) -> dict[str, Any]:
    """The content of ``scores.json``: per setting its official and unrounded scores, sample counts, averages (of
    the unrounded scores), KV bytes per task and their ratio, and pipeline."""
    layout = OutputLayout(experiment.output_dir, experiment.benchmark)
    full = next((result for result in results if result.setting.is_full_cache), None)
    solved = _full_cache_solved(full, results)
    settings = []
    for result in results:
        pipeline_path = layout.pipeline_file(result.setting.name)
        kv_bytes = {task: sum(kv for kv, _ in samples.values()) for task, samples in result.sample_bytes.items()}
        full_kv_bytes = {task: sum(f for _, f in samples.values()) for task, samples in result.sample_bytes.items()}
        total = sum(full_kv_bytes.values())
        settings.append({
            **result.setting.describe(),
            "scores": result.scores,
            "unrounded_scores": result.unrounded_scores,
            "samples": result.samples,
            "averages": experiment.benchmark.averages(experiment.options, result.unrounded_scores),
            "kv_bytes": kv_bytes,
            "full_kv_bytes": full_kv_bytes,
            "kv_ratio": sum(kv_bytes.values()) / total if total else None,
            "matches_full_cache_bytes": _matches_full_cache(full, result),
            "full_cache_solved": solved.get(result.setting.name),
            "pipeline": json.loads(pipeline_path.read_text(encoding="utf-8")) if pipeline_path.exists() else None,
        })
    return {
        "benchmark": experiment.benchmark.name,
        "experiment": experiment.name,
        "tasks": list(experiment.tasks),
        "limit": experiment.limit,
        "full_cache_setting": full.setting.name if full is not None else None,
        "settings": settings,
        **experiment.benchmark.pipeline(experiment.options),
    }


def _cell(setting: dict[str, Any], task: str, bucket: str | None, key: str = "scores") -> float | None:
    score = setting[key].get(task)
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


def _megabytes(setting: dict[str, Any], key: str) -> str:
    return f"{sum(setting[key].values()) / MB:.2f}" if setting[key] else "—"


def _markdown(summary: dict[str, Any], experiment: Experiment) -> str:
    benchmark, settings = experiment.benchmark, summary["settings"]
    full = summary["full_cache_setting"]
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
    solved = any(s["full_cache_solved"] is not None for s in settings)
    if solved:
        lines.append("| full-cache solved kept | " + " | ".join(_solved(s) for s in settings) + " |")
    lines.append("| KV held (MB) | " + " | ".join(_megabytes(s, "kv_bytes") for s in settings) + " |")
    lines.append("| full cache, same tokens (MB) | " + " | ".join(_megabytes(s, "full_kv_bytes") for s in settings)
                 + " |")
    lines.append("| KV × | " + " | ".join("—" if s["kv_ratio"] is None else f"{s['kv_ratio']:.3f}"
                                         for s in settings) + " |")
    lines.append("")
    lines += benchmark.notes(experiment.options)
    lines.append("Averages: the mean of the task scores before their official rounding (where the benchmark gives "
                 "them), rounded for display.")
    if solved:
        lines.append(
            f"Full-cache solved kept: of the samples `{full}` answers perfectly, how many the setting answers "
            "perfectly too."
        )
    lines.append(
        "KV held: the key/value bytes the setting's caches held, summed over the samples; full cache, same tokens: "
        "what the uncompressed cache holds for the same tokens; KV ×: the first over the second. Measured on the "
        "cache tensors, over the compressed tokens once compressed when the context is compressed before the "
        "question, else over every token the cache saw (each setting's own answer included)."
    )
    other = [s["name"] for s in settings if s["matches_full_cache_bytes"] is False]
    if other:
        which = "every other setting" if len(other) == len(settings) - 1 else ", ".join(f"`{n}`" for n in other)
        lines.append(
            f"`{full}`'s bytes differ from the full cache's bytes of {which} on the same samples: other tokens (each "
            "setting's own answer when the whole prompt is compressed during generation; context-first predictions "
            "made before the full cache was measured over the context) or another dtype. Read their KV × against "
            f"their own full-cache row, not against `{full}`'s KV held."
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


def _csv(rows: Sequence[Sequence[Any]]) -> str:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerows(rows)
    return buffer.getvalue()


def _task_rows(summary: dict[str, Any], experiment: Experiment) -> list[list[Any]]:
    """``scores.csv``: one row per task (and LongBench-E bucket) and setting. The bytes belong to a task, not to
    a length bucket: bucket rows leave them empty (the setting's totals in ``scores_summary.csv`` count them)."""
    rows: list[list[Any]] = [["task", "bucket", "setting", "method", "budget", "score", "unrounded_score", "samples",
                              "kv_bytes", "full_kv_bytes", "kv_ratio"]]
    for setting in summary["settings"]:
        head = [setting["name"], setting["method"], setting["budget"]]
        for row in experiment.benchmark.rows(summary["tasks"]):
            score = _cell(setting, row.task, row.bucket)
            if score is None:
                continue
            kv, full = setting["kv_bytes"].get(row.task), setting["full_kv_bytes"].get(row.task)
            measured = [kv, full, kv / full] if full and row.bucket is None else ["", "", ""]
            rows.append([row.task, row.bucket or "", *head, score, _cell(setting, row.task, row.bucket,
                                                                         "unrounded_scores"),
                         setting["samples"][row.task], *measured])
    return rows


def _summary_rows(summary: dict[str, Any]) -> list[list[Any]]:
    """``scores_summary.csv``: one row per setting with its averages, byte totals, KV × and full-cache solved."""
    settings = summary["settings"]
    averages = list(settings[0]["averages"])
    rows: list[list[Any]] = [["setting", "method", "budget", "samples", *averages, "kv_bytes", "full_kv_bytes",
                              "kv_ratio", "matches_full_cache_bytes", "full_cache_solved", "full_cache_solved_of"]]
    for s in settings:
        solved = s["full_cache_solved"] or ("", "")
        same = "" if s["matches_full_cache_bytes"] is None else str(s["matches_full_cache_bytes"]).lower()
        rows.append([s["name"], s["method"], s["budget"], sum(s["samples"].values()),
                     *("" if s["averages"][name] is None else s["averages"][name] for name in averages),
                     sum(s["kv_bytes"].values()) if s["kv_bytes"] else "",
                     sum(s["full_kv_bytes"].values()) if s["full_kv_bytes"] else "",
                     "" if s["kv_ratio"] is None else s["kv_ratio"], same, *solved])
    return rows


def _line(setting: dict[str, Any]) -> str:
    """The plot line of a setting with a budget: its name without the budget a sweep appends, so that variants
    of one method (``kvzip-0.1`` and ``kvzip-headwise-0.1``) are lines of their own."""
    return setting["name"].removesuffix(f"-{budget_label(setting['budget'])}")


def _figure(summary: dict[str, Any], title: str) -> Any:
    """The first average every setting has, against budget, one line per swept setting; the full cache as a level. A
    fraction of the compressed tokens goes on a linear axis from 0 to 1.05, where the full cache also stands as a
    point at 1.0 (all of them kept); integer budgets (slots per layer) on a log axis at least a factor 2 wide each
    side, so that one budget or one setting still gives a readable axis. None without such an average."""
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend and figures alone

    settings = summary["settings"]
    names = [name for name in settings[0]["averages"] if all(s["averages"][name] is not None for s in settings)]
    if not names:
        return None
    key = names[0]
    figure = Figure(figsize=(6, 4))
    axes = figure.subplots()
    swept = [s for s in settings if s["budget"] is not None]
    for line in sorted({_line(s) for s in swept}):
        points = sorted((s["budget"], s["averages"][key]) for s in swept if _line(s) == line)
        axes.plot(*zip(*points), marker="o", label=line)
    budgets = sorted({s["budget"] for s in settings if s["budget"] is not None})
    fractions = all(isinstance(budget, float) for budget in budgets)  # also with the full cache alone
    for setting in settings:
        if setting["budget"] is None:
            label = "full cache" if setting["name"] == "full" else f"{setting['name']} (full cache)"
            axes.axhline(setting["averages"][key], linestyle="--", color="black", linewidth=0.8,
                         label=None if fractions else label)
            if fractions:
                axes.plot([1.0], [setting["averages"][key]], marker="*", markersize=12, color="black",
                          linestyle="none", label=f"{label}, 100 %")
    if fractions:
        axes.set_xlim(0, 1.05)
        axes.set_xticks([*budgets, 1.0], [*(f"{budget:.0%}" for budget in budgets), "100 %\n(full)"])
        axes.set_xlabel("KV budget (share of the compressed tokens kept)")
    else:
        axes.set_xscale("log", base=2)
        axes.set_xlim(budgets[0] / 2, budgets[-1] * 2)
        axes.set_xticks(budgets, [str(budget) for budget in budgets])
        axes.minorticks_off()
        axes.set_xlabel("KV budget per layer (tokens)")
    axes.set_ylabel(key)
    axes.set_title(f"{title}{': ' + summary['experiment'] if summary['experiment'] else ''}")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    return figure


def _plot(summary: dict[str, Any], path: Path, title: str) -> None:
    try:
        figure = _figure(summary, title)
    except ImportError:
        logger.warning("matplotlib is not installed; skipping %s (pip install matplotlib)", path)
        return
    if figure is not None:
        figure.savefig(path, dpi=120, metadata={"Software": None})


def write_reports(summary: dict[str, Any], experiment: Experiment, layout: OutputLayout) -> None:
    layout.root.mkdir(parents=True, exist_ok=True)
    layout.report_file(".json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    layout.report_file(".csv").write_text(_csv(_task_rows(summary, experiment)), encoding="utf-8")
    layout.report_file("_summary.csv").write_text(_csv(_summary_rows(summary)), encoding="utf-8")
    layout.report_file(".md").write_text(_markdown(summary, experiment), encoding="utf-8")
    _plot(summary, layout.report_file(".png"), experiment.benchmark.title)
