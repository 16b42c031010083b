"""``kvcompress-ruler report``: the leaderboard view of finished runs, as kvpress's RULER leaderboard shows it.

A run's ``scores.json`` (the runner's; ``benchmarks/peer_kvpress.py`` writes the peer's in the same form) holds
every setting's score per task. Only the tasks the full cache solves count (score >= 0.5 of RULER's 0-100, by the
full-cache setting of the calibration run): a task the model cannot do with its whole cache says nothing about
compression. Each setting's mean over the counted tasks is shown against its budget (the share of the compressed
tokens kept) with the KV bytes its caches really held, one table per run (a protocol, a library), and one plot of
score against the measured KV fraction: one line per method, the peer's dashed, the full cache as a level and as a
point at 1.0 (all of its bytes), on an axis from 0 to 1.05 whatever the budgets. The full cache's score heads each
table rather than sitting in a budget's column: it keeps everything, not that share.

Means are taken of the unrounded task scores where the run's ``scores.json`` has them (the runner's); the peer's
(``benchmarks/peer_kvpress.py``) holds RULER's rounded scores only, whose mean can differ in the last digit.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["COUNTED", "Run", "counted_tasks", "leaderboard", "load_run"]

logger = logging.getLogger(__name__)

COUNTED = 50.0  # a task counts where the full cache scores at least this (RULER's scores are 0-100)
_BUDGET_SUFFIX = re.compile(r"-(\d+(\.\d+)?)$")


class Run:
    """One finished run: its folder's ``scores.json``, named by its experiment (and library, for the peer)."""

    def __init__(self, folder: Path, summary: dict[str, Any]):
        self.folder, self.summary = folder, summary
        self.library = summary.get("library", "kvcompress")
        self.protocol = summary.get("protocol", "")
        self.title = summary.get("experiment") or folder.name

    @property
    def settings(self) -> list[dict[str, Any]]:
        return self.summary["settings"]

    @property
    def full(self) -> dict[str, Any] | None:
        name = self.summary.get("full_cache_setting")
        return next((s for s in self.settings if s["name"] == name), None) if name else None


def load_run(folder: str | Path) -> Run:
    path = Path(folder) / "scores.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no scores (run `kvcompress-ruler evaluate CONFIG` first)")
    return Run(Path(folder), json.loads(path.read_text(encoding="utf-8")))


def counted_tasks(calibration: Run) -> list[str]:
    """The tasks (``<task>_<length>``) whose full-cache score reaches ``COUNTED``, in the run's order."""
    full = calibration.full
    if full is None:
        raise ValueError(f"{calibration.folder}: no full-cache setting to calibrate on (add `none` to its config)")
    return [task for task, score in full["scores"].items() if score >= COUNTED]


def _method(setting: dict[str, Any]) -> str:
    """The setting's name without its budget: one line of the table and the plot per method variant."""
    return _BUDGET_SUFFIX.sub("", setting["name"]) if setting["budget"] is not None else setting["name"]


def _mean(setting: dict[str, Any], tasks: Sequence[str]) -> tuple[float | None, bool]:
    """The mean score over ``tasks`` (over those it has) and whether it has all of them."""
    given = setting.get("unrounded_scores", setting["scores"])
    scores = [given[task] for task in tasks if task in given]
    return (sum(scores) / len(scores) if scores else None), len(scores) == len(tasks)


def _table(run: Run, tasks: Sequence[str], full_mean: float | None) -> list[str]:
    budgets = sorted({s["budget"] for s in run.settings if isinstance(s["budget"], float)})
    methods = list(dict.fromkeys(_method(s) for s in run.settings if s["budget"] is not None))
    lines = [f"### {run.title} ({run.library}, {run.protocol})", ""]
    if full_mean is not None:
        lines += [f"Full cache (all of its KV bytes, 1.00): {full_mean:.1f}", ""]
    lines += ["| method | " + " | ".join(f"{budget:.0%} kept" for budget in budgets) + " |",
              "|---|" + "---:|" * len(budgets)]
    for method in methods:
        cells = []
        for budget in budgets:
            setting = next((s for s in run.settings if _method(s) == method and s["budget"] == budget), None)
            mean, complete = _mean(setting, tasks) if setting else (None, False)
            if mean is None:
                cells.append("—")
                continue
            kv = "" if setting.get("kv_ratio") is None else f" ({setting['kv_ratio']:.2f})"
            cells.append(f"{mean:.1f}{kv}{'' if complete else '*'}")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines + [""]


def _figure(runs: Sequence[Run], tasks: Sequence[str], full_mean: float | None) -> Any:
    from matplotlib import colormaps
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend and figures alone

    figure = Figure(figsize=(9, 5))
    axes = figure.subplots()
    axes.set_prop_cycle(color=colormaps["tab20"].colors)
    distinct = len({(run.library, run.protocol) for run in runs}) > 1
    for run in runs:
        style = "--" if run.library != "kvcompress" else "-"
        for method in dict.fromkeys(_method(s) for s in run.settings if s["budget"] is not None):
            measured = [(s["kv_ratio"], _mean(s, tasks)[0]) for s in run.settings
                        if _method(s) == method and s["budget"] is not None and s.get("kv_ratio") is not None]
            points = sorted((kv, mean) for kv, mean in measured if mean is not None)
            if points:
                label = f"{method} ({run.library}, {run.protocol})" if distinct else method
                axes.plot(*zip(*points), style, marker="o", label=label)
    if full_mean is not None:
        axes.axhline(full_mean, linestyle=":", color="black", linewidth=0.8)
        axes.plot([1.0], [full_mean], marker="*", markersize=12, color="black", linestyle="none",
                  label="full cache (1.0)")
    axes.set_xlim(0, 1.05)
    axes.set_xlabel("KV bytes held / full cache's")
    axes.set_ylabel(f"mean RULER score over {len(tasks)} counted tasks")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    return figure


def _plot(runs: Sequence[Run], tasks: Sequence[str], full_mean: float | None, path: Path) -> None:
    try:
        figure = _figure(runs, tasks, full_mean)
    except ImportError:
        logger.warning("matplotlib is not installed; skipping %s (pip install matplotlib)", path)
        return
    # "tight": the legend sits right of the axes, and a long one would be cut off at the figure's edge
    figure.savefig(path, dpi=120, bbox_inches="tight", metadata={"Software": None})


def leaderboard(folders: Sequence[str | Path], out: str | Path, calibration: str | Path | None = None) -> str:
    """Writes ``<out>.md`` and ``<out>.png`` for the runs in ``folders`` and returns the markdown. The counted
    tasks come from ``calibration`` (default: the first run with a full-cache setting)."""
    runs = [load_run(folder) for folder in folders]
    reference = load_run(calibration) if calibration else next((run for run in runs if run.full), None)
    if reference is None:
        raise ValueError("no run has a full-cache setting to calibrate on; pass --calibration FOLDER")
    tasks = counted_tasks(reference)
    if not tasks:
        raise ValueError(f"{reference.folder}: the full cache scores below {COUNTED:g} on every task")
    full_mean = _mean(reference.full, tasks)[0]
    skipped = [task for task in reference.full["scores"] if task not in tasks]
    lines = [
        "# RULER leaderboard", "",
        f"Counted tasks ({len(tasks)}, where the full cache of `{reference.title}` scores >= {COUNTED:g}): "
        f"{', '.join(tasks)}" + (f"; left out: {', '.join(skipped)}." if skipped else "."),
        "Cells: the mean RULER score (0-100) over the counted tasks, and in brackets the KV bytes the caches held "
        "over the full cache's; * a setting that lacks some counted task (unfinished).", "",
    ]
    for run in runs:
        lines += _table(run, tasks, full_mean if run is reference or run.full is None else _mean(run.full, tasks)[0])
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _plot(runs, tasks, full_mean, out.with_suffix(".png"))
    lines.append(f"![score against KV bytes]({out.with_suffix('.png').name})")
    text = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(text, encoding="utf-8")
    return text
