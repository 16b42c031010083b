"""Turns the per-prompt records of the retrieval benchmark into accuracy tables (CSV, JSON, Markdown) and a plot."""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

FULL = "full"
ALL = "all"


@dataclass(frozen=True)
class Record:
    """One generation: a prompt under one method at one budget (``method='full'``, ``budget=1.0``: no eviction).

    ``prompt`` is the prompt's fingerprint: part of the key, so a changed prompt text is run afresh on resume.
    """

    task: str
    length: int
    depth: float
    seed: int
    prompt: str
    method: str
    budget: float
    prompt_tokens: int
    cache_slots: int
    expected: str
    generated: str
    correct: bool
    seconds: float

    @property
    def key(self) -> tuple:
        return (self.prompt, self.method, self.budget)


@dataclass(frozen=True)
class Accuracy:
    task: str
    length: int | str
    method: str
    budget: float
    correct: int
    total: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.total


def load_records(path: Path) -> list[Record]:
    if not path.is_file():
        return []
    with path.open(encoding="utf-8") as handle:
        return [Record(**json.loads(line)) for line in handle if line.strip()]


def append_record(path: Path, record: Record) -> None:
    """One JSON line per generation, flushed at once, so an interrupted run loses at most the prompt in flight."""
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(asdict(record)) + "\n")


def summarise(records: Iterable[Record]) -> list[Accuracy]:
    """Accuracy per (task, length, method, budget), plus ``all`` rows pooled over tasks and over lengths."""
    counts: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for r in records:
        for task in (r.task, ALL):
            for length in (r.length, ALL):
                cell = counts[(task, length, r.method, r.budget)]
                cell[0] += r.correct
                cell[1] += 1
    return [Accuracy(*key, *value) for key, value in counts.items()]


def write_tables(rows: Sequence[Accuracy], out_dir: Path, stem: str) -> None:
    fields = ["task", "length", "method", "budget", "correct", "total", "accuracy"]
    with (out_dir / f"{stem}.csv").open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(fields)
        for row in rows:
            writer.writerow([row.task, row.length, row.method, row.budget, row.correct, row.total,
                             f"{row.accuracy:.3f}"])
    (out_dir / f"{stem}.json").write_text(
        json.dumps([{**asdict(row), "accuracy": round(row.accuracy, 4)} for row in rows], indent=1), encoding="utf-8"
    )


def _with_pooled(lengths: list) -> list:
    """The lengths plus the pooled ``all`` column, which only adds information when there are several."""
    return lengths + [ALL] if len(lengths) > 1 else lengths


def _cell(rows: dict[tuple, Accuracy], key: tuple) -> str:
    row = rows.get(key)
    return f"{row.accuracy:.2f} ({row.correct}/{row.total})" if row else "–"


def markdown_table(rows: Sequence[Accuracy], task: str, methods: Sequence[str], budgets: Sequence[float]) -> str:
    """Methods as rows, (length, budget) as columns; the full cache as a first row."""
    index = {(r.task, r.length, r.method, r.budget): r for r in rows}
    lengths = _with_pooled(sorted({r.length for r in rows if r.task == task and r.length != ALL}))
    header = ["method"] + [f"{length} @ {budget:.0%}" for length in lengths for budget in budgets]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    full = ["full cache"] + [_cell(index, (task, length, FULL, 1.0)) for length in lengths for _ in budgets]
    lines.append("| " + " | ".join(full) + " |")
    for method in methods:
        cells = [_cell(index, (task, length, method, budget)) for length in lengths for budget in budgets]
        lines.append("| " + " | ".join([method, *cells]) + " |")
    return "\n".join(lines)


def headline_table(rows: Sequence[Accuracy], methods: Sequence[str], budgets: Sequence[float]) -> str:
    """Accuracy pooled over every calibrated task and length: one row per method, one column per budget."""
    index = {(r.method, r.budget): r for r in rows if r.task == ALL and r.length == ALL}
    lines = ["| method | " + " | ".join(f"{b:.0%} budget" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for method in (FULL, *methods):
        cells = [_cell(index, (method, 1.0 if method == FULL else budget)) for budget in budgets]
        lines.append(f"| {'full cache' if method == FULL else method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def calibration_table(rows: Sequence[Accuracy], kept: set[tuple[str, int]]) -> str:
    lines = ["| task | length | full-cache accuracy | kept |", "|---|---|---|---|"]
    cells = sorted((r for r in rows if r.method == FULL and ALL not in (r.task, r.length)),
                   key=lambda r: (r.task, r.length))
    for r in cells:
        verdict = "yes" if (r.task, r.length) in kept else "no"
        lines.append(f"| {r.task} | {r.length} | {r.accuracy:.2f} ({r.correct}/{r.total}) | {verdict} |")
    return "\n".join(lines)


def plot(rows: Sequence[Accuracy], methods: Sequence[str], budgets: Sequence[float], path: Path) -> bool:
    """Accuracy against budget per method, one panel per context length; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    index = {(r.length, r.method, r.budget): r.accuracy for r in rows if r.task == ALL}
    lengths = _with_pooled(sorted({r.length for r in rows if r.task == ALL and r.length != ALL}))
    figure, axes = plt.subplots(1, len(lengths), figsize=(4 * len(lengths), 4), sharey=True, squeeze=False)
    for axis, length in zip(axes[0], lengths):
        for method in methods:
            xs = [b for b in budgets if (length, method, b) in index]
            axis.plot([100 * b for b in xs], [index[(length, method, b)] for b in xs], marker="o", label=method)
        if (length, FULL, 1.0) in index:
            axis.axhline(index[(length, FULL, 1.0)], color="black", linestyle="--", linewidth=1, label="full cache")
        axis.set_title(f"{length} tokens" if length != ALL else "all lengths")
        axis.set_xlabel("KV budget (% of prompt)")
        axis.set_ylim(-0.03, 1.03)
        axis.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy")
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
    figure.tight_layout(rect=(0, 0.08, 1, 1))
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True
