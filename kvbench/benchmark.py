"""What a benchmark brings to the shared runner, and the registry of benchmarks.

The runner (experiment YAML, resumable and sharded predictions, scoring loop, reports) is the same for every
benchmark; a benchmark module supplies only what differs: its own YAML keys and task list, where its records come
from, how a record becomes a prompt (and which part of it is compressed first), the line it writes per sample, its
official metric and averages, and where its prediction files live. ``longbench.benchmark`` and
``ruler.benchmark`` are the two implementations.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["BENCHMARKS", "Benchmark", "Prompt", "TableRow", "get_benchmark"]

# name -> "module:class"; imported on first use, so the runner loads only the benchmark it runs.
BENCHMARKS: dict[str, str] = {"longbench": "longbench.benchmark:LongBench", "ruler": "ruler.benchmark:Ruler"}


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A record made ready for generation: its token ids, how many of them the first forward pass takes and
    compresses (all of them when the question is seen, the context alone when it is compressed first), and the
    benchmark's generation rules (``max_new_tokens``, ``min_length``, ``eos_token_id`` as ``generate`` takes
    them)."""

    input_ids: list[int]
    prefill_length: int
    generation: Mapping[str, Any]

    @property
    def context_first(self) -> bool:
        return self.prefill_length < len(self.input_ids)


@dataclasses.dataclass(frozen=True)
class TableRow:
    """One row of the report: its label, the task it reads and, for scores split by length, the bucket."""

    label: str
    task: str
    bucket: str | None = None


class Benchmark(abc.ABC):
    """One benchmark's part of an experiment. ``options`` is the object ``parse_options`` returned."""

    name: str
    title: str  # as reports print it
    keys: Mapping[str, str]  # the benchmark's top-level YAML keys -> the message when a required one is missing
    required: frozenset[str]
    errors: tuple[type[Exception], ...] = ()  # its data errors, reported by the command line without a traceback
    # records that cannot be made for one task (at one length): the runner says so and goes on with the others
    unavailable: tuple[type[Exception], ...] = ()

    @abc.abstractmethod
    def parse_options(self, config: Mapping[str, Any], base_dir: Path, model_path: str) -> Any:
        """Validates the benchmark's keys (``ConfigError`` naming the key) and returns its options; the options
        have ``tasks``, the names the runner iterates over, in report order."""

    @abc.abstractmethod
    def pipeline(self, options: Any) -> dict[str, Any]:
        """The benchmark options that shape predictions; resuming refuses files made with different ones."""

    @abc.abstractmethod
    def load_records(self, options: Any, task: str, output_dir: Path) -> list[dict[str, Any]]:
        """The task's records, each with a unique string ``_id``; ``output_dir`` may hold generated data."""

    @abc.abstractmethod
    def prediction_path(self, task: str) -> Path:
        """Where the task's predictions go, relative to the setting's folder."""

    @abc.abstractmethod
    def prompt(self, options: Any, task: str, record: Mapping[str, Any], tokenizer: Any, chat_template: bool
               ) -> Prompt:
        """The record's prompt, as the benchmark's official pipeline builds it."""

    @abc.abstractmethod
    def prediction_line(self, record: Mapping[str, Any], prediction: str) -> dict[str, Any]:
        """The line written for a sample (the runner adds ``_id`` and the KV bytes)."""

    line_keys: tuple[str, ...]  # keys every prediction line of this benchmark has, ``_id`` and ``pred`` included

    @abc.abstractmethod
    def score(self, options: Any, task: str, lines: Sequence[Mapping[str, Any]]) -> Any:
        """The task's official score from its prediction lines (a number, or a mapping of length buckets)."""

    def sample_scores(self, options: Any, task: str, lines: Sequence[Mapping[str, Any]]) -> list[float] | None:
        """Each line's score in [0, 1], when the benchmark's metric is per sample and the task's score is 100 ×
        their mean (rounded as the official evaluator rounds it); None otherwise."""
        return None

    def unrounded_score(self, options: Any, task: str, lines: Sequence[Mapping[str, Any]]) -> Any:
        """The task's score before the official rounding: averages are taken of these, since a mean of rounded
        scores drifts (66.67 and 100 average to 83.34 where 5 of 6 samples is 83.33). By default 100 × the mean
        of ``sample_scores``; a benchmark without them gets its official ``score`` back unless it overrides this."""
        per_sample = self.sample_scores(options, task, lines)
        if per_sample is None:
            return self.score(options, task, lines)
        return 100 * sum(per_sample) / len(per_sample)

    def source_problems(self, options: Any) -> list[str]:
        """Why the records' sources cannot be read (a Hub the machine cannot reach), each naming the alternatives;
        checked with ``model.path`` before any work, so that a run reports every unloadable source at once."""
        return []

    def write_official_results(self, setting_dir: Path, scores: Mapping[str, Any]) -> None:
        """Writes the score files the benchmark's own tools write, if any."""

    @abc.abstractmethod
    def averages(self, options: Any, scores: Mapping[str, Any]) -> dict[str, float | None]:
        """The averages the benchmark reports, by name, in report order; None where one cannot be given."""

    def rows(self, tasks: Sequence[str]) -> list[TableRow]:
        return [TableRow(task, task) for task in tasks]

    def notes(self, options: Any) -> list[str]:
        """Lines explaining the report's averages and pipeline, appended under the table."""
        return []


def get_benchmark(name: str) -> Benchmark:
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; allowed: {sorted(BENCHMARKS)}")
    module, _, attribute = BENCHMARKS[name].partition(":")
    return getattr(importlib.import_module(module), attribute)()
