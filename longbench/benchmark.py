"""LongBench's part of an experiment: its YAML keys, records, official prompts and generation rules, official
file layout, metrics and averages (``kvbench.benchmark.Benchmark``)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvbench.benchmark import Benchmark, Prompt, TableRow
from kvbench.config import ConfigError, check_boolean, check_folder, check_integer, check_one_of, check_string

from .data import DataError, DataSource, hub_source_problem, load_task
from .evaluate import BUCKETS, scorer, scorer_e
from .metrics import METRIC_FIXES
from .prompt import encode_prompt
from .tasks import ENGLISH16, TASK_GROUPS, TASKS, resolve_tasks

__all__ = ["LongBench", "LongBenchOptions"]


@dataclasses.dataclass(frozen=True)
class LongBenchOptions:
    tasks: tuple[str, ...]
    data: DataSource
    max_length: int
    min_one_new_token: bool = False
    metric_fixes: frozenset[str] = frozenset()


def _mean(values: Sequence[float]) -> float | None:
    return round(sum(values) / len(values), 2) if values else None


def _parse_tasks(value: Any) -> tuple[str, ...]:
    if isinstance(value, list) and all(isinstance(item, str) for item in value) or isinstance(value, str):
        try:
            return tuple(resolve_tasks(value))
        except ValueError as error:
            raise ConfigError(f"tasks: {error}") from None
    raise ConfigError(
        f"tasks: must be a group ({sorted(TASK_GROUPS)}) or a list of task names, got {value!r}; tasks: {list(TASKS)}"
    )


def _parse_data(value: Any, base_dir: Path) -> DataSource:
    kind, location = check_one_of(value, "data", ("folder", "zip", "hub"))
    if kind == "folder":
        return DataSource("folder", str(check_folder(location, "data.folder", base_dir)), written=location)
    location = check_string(location, f"data.{kind}")
    if kind == "hub":
        return DataSource("hub", location)
    path = (base_dir / location).resolve()
    if not path.is_file():
        raise ConfigError(f"data.zip: {path} is not a file")
    return DataSource("zip", str(path), written=location)


class LongBench(Benchmark):
    """LongBench v1 and LongBench-E as the official ``pred.py`` / ``eval.py`` run them."""

    name = "longbench"
    title = "LongBench"
    keys = {
        "tasks": f"tasks: required ({sorted(TASK_GROUPS)} or task names)",
        "data": "data: required (one of folder, zip, hub)",
        "max_length": (
            "max_length: required, the prompt truncation cap in tokens (context window - ~500: 31500 for "
            "Mistral-7B-Instruct-v0.2 as in SnapKV/AdaKV, 7950 for Llama-3-8B-Instruct as in PyramidKV)"
        ),
        "min_one_new_token": "",
        "metric_fixes": "",
    }
    required = frozenset({"tasks", "data", "max_length"})
    errors = (DataError,)
    line_keys = ("pred", "answers", "all_classes", "length", "_id")

    def parse_options(self, config: Mapping[str, Any], base_dir: Path, model_path: str) -> LongBenchOptions:
        fixes = config.get("metric_fixes", [])
        if not isinstance(fixes, list) or any(fix not in METRIC_FIXES for fix in fixes):
            raise ConfigError(f"metric_fixes: must be a list drawn from {sorted(METRIC_FIXES)}, got {fixes!r}")
        return LongBenchOptions(
            tasks=_parse_tasks(config["tasks"]),
            data=_parse_data(config["data"], base_dir),
            max_length=check_integer(config["max_length"], "max_length", 2),
            min_one_new_token=check_boolean(config.get("min_one_new_token", False), "min_one_new_token"),
            metric_fixes=frozenset(fixes),
        )

    def pipeline(self, options: LongBenchOptions) -> dict[str, Any]:
        return {"max_length": options.max_length, "min_one_new_token": options.min_one_new_token,
                "data": options.data.describe(), "metric_fixes": sorted(options.metric_fixes)}

    def load_records(self, options: LongBenchOptions, task: str, output_dir: Path) -> list[dict[str, Any]]:
        return load_task(options.data, task)

    def prediction_path(self, task: str) -> Path:
        """The official layout: ``pred/<task>.jsonl``, LongBench-E in ``pred_e/`` under the base task's name."""
        spec = TASKS[task]
        return Path("pred_e" if spec.is_longbench_e else "pred") / f"{spec.base}.jsonl"

    def prompt(self, options: LongBenchOptions, task: str, record: Mapping[str, Any], tokenizer: Any,
               chat_template: bool) -> Prompt:
        """pred.py's prompt and rules: the task's generation length, samsum's stop at the first newline, and
        (``min_one_new_token``, as the SnapKV and KVCache-Factory pipelines) at least one new token."""
        spec = TASKS[task]
        ids = encode_prompt(spec, record, tokenizer, options.max_length, chat_template)["input_ids"][0].tolist()
        generation: dict[str, Any] = {"max_new_tokens": spec.max_new_tokens}
        if spec.base == "samsum":  # upstream's guard against endless "\nDialogue": stop at the first newline
            newline = tokenizer.encode("\n", add_special_tokens=False)[-1]
            generation.update(min_length=len(ids) + 1, eos_token_id=[tokenizer.eos_token_id, newline])
        elif options.min_one_new_token:
            generation["min_length"] = len(ids) + 1
        return Prompt(ids, len(ids), generation)

    def prediction_line(self, record: Mapping[str, Any], prediction: str) -> dict[str, Any]:
        """The official line (``pred, answers, all_classes, length``); the runner adds ``_id``."""
        return {"pred": prediction, "answers": record["answers"], "all_classes": record["all_classes"],
                "length": record["length"]}

    def score(self, options: LongBenchOptions, task: str, lines: Sequence[Mapping[str, Any]]) -> Any:
        return _score_file(task, lines, options.metric_fixes)

    def unrounded_score(self, options: LongBenchOptions, task: str, lines: Sequence[Mapping[str, Any]]) -> Any:
        return _score_file(task, lines, options.metric_fixes, rounded=False)

    def source_problems(self, options: LongBenchOptions) -> list[str]:
        problem = hub_source_problem(options.data.location) if options.data.kind == "hub" else None
        return [] if problem is None else [problem]

    def write_official_results(self, setting_dir: Path, scores: Mapping[str, Any]) -> None:
        """eval.py's ``result.json`` in ``pred/`` and ``pred_e/``: base task name -> score (or buckets)."""
        by_folder: dict[Path, dict[str, Any]] = {}
        for task, score in scores.items():
            by_folder.setdefault(self.prediction_path(task).parent, {})[TASKS[task].base] = score
        for folder, official in by_folder.items():
            path = setting_dir / folder / "result.json"
            path.write_text(json.dumps(official, ensure_ascii=False, indent=4), encoding="utf-8")

    def averages(self, options: LongBenchOptions, scores: Mapping[str, Any]) -> dict[str, float | None]:
        """The English-16 mean papers print (only when all 16 were evaluated, so a partial run is never mistaken
        for a comparable number), and the mean over whatever v1 tasks were evaluated."""
        v1 = [score for task, score in scores.items() if not TASKS[task].is_longbench_e]
        english16 = _mean([scores[task] for task in ENGLISH16]) if set(ENGLISH16) <= set(scores) else None
        return {"average (english16)": english16, "average (evaluated v1 tasks)": _mean(v1)}

    def rows(self, tasks: Sequence[str]) -> list[TableRow]:
        rows = []
        for task in tasks:
            if TASKS[task].is_longbench_e:
                rows.extend(TableRow(f"{task} {bucket}", task, bucket) for bucket in BUCKETS)
            else:
                rows.append(TableRow(task, task))
        return rows

    def notes(self, options: LongBenchOptions) -> list[str]:
        return [
            "english16 is the 16 English and code tasks the KV-compression papers average; it is shown only when all"
            " 16 were evaluated.",
            f"Truncation cap {options.max_length} tokens, min_one_new_token "
            f"{str(options.min_one_new_token).lower()}; data: {options.data.describe()}; metric fixes: "
            f"{', '.join(sorted(options.metric_fixes)) or 'none (official metrics)'}.",
        ]


def _score_file(task: str, lines: Sequence[Mapping[str, Any]], fixes: Collection[str],
                rounded: bool = True) -> float | dict[str, float]:
    predictions = [line["pred"] for line in lines]
    answers = [line["answers"] for line in lines]
    all_classes = lines[-1]["all_classes"]  # eval.py keeps the last line's value
    if TASKS[task].is_longbench_e:
        return scorer_e(task, predictions, answers, [line["length"] for line in lines], all_classes, fixes=fixes,
                        rounded=rounded)
    return scorer(task, predictions, answers, all_classes, fixes=fixes, rounded=rounded)
