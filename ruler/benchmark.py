"""RULER's part of an experiment (``kvbench.benchmark.Benchmark``): tasks at lengths, records made by the official
generator scripts (or read from a folder), kvpress's prompt split and chat rendering, the two compression
protocols, RULER's string-match metrics and per-length averages.

YAML keys (beside the shared ones)::

    benchmark: ruler
    tasks: [niah_single_1, niah_single_2]   # RULER task names
    lengths: [2048]                          # RULER max_seq_length values
    protocol: context_first                  # or query_aware (default: context_first, kvpress's leaderboard)
    data: {generate: {tokenizer: default, samples: 500, seed: 42}}   # the default: the model's tokenizer
    # or data: {folder: DIR} with DIR/<task>_<length>/validation.jsonl

A task at a length is one unit of the runner, named ``<task>_<length>`` as the generator's folders are; its
predictions go to ``pred/<task>_<length>.jsonl``. Generated records are written under the output folder's
``data/`` (and cached, see ``ruler.generate``), so a rerun reads the same records.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvbench.benchmark import Benchmark, Prompt
from kvbench.config import (
    ConfigError,
    check_folder,
    check_integer,
    check_mapping,
    check_one_of,
    check_string,
    check_string_list,
    no_unknown_keys,
)

from .chat import PROTOCOLS, encode_prompt
from .generate import PREPARE_SEED, SUBSET, GenerationError, GenerationTimeout, RulerUnavailableError, generate
from .metrics import (
    average_score,
    metric_name,
    postprocess_prediction,
    score_task,
    string_match_all_per_sample,
    string_match_part_per_sample,
)
from .prompts import max_new_tokens, split_input, task_family

__all__ = ["DataGeneration", "Ruler", "RulerOptions"]

_PER_SAMPLE = {"string_match_all": string_match_all_per_sample, "string_match_part": string_match_part_per_sample}


class RulerDataError(ValueError):
    """A records file that is missing or does not hold RULER records."""


@dataclasses.dataclass(frozen=True)
class DataGeneration:
    """Records made on the fly by the official generator scripts (``kvcompress-ruler generate``)."""

    tokenizer: str
    samples: int = 500
    seed: int = PREPARE_SEED
    cache_dir: str | None = None
    timeout: float = 600.0  # seconds one task's generator may take: qa_2 never finishes at some lengths


@dataclasses.dataclass(frozen=True)
class RulerOptions:
    units: Mapping[str, tuple[str, int]]  # "<task>_<length>" -> (task, length), in report order
    protocol: str
    data: DataGeneration | Path
    data_source: str  # the records' name in the pipeline record (``_parse_data``)

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(self.units)

    @property
    def lengths(self) -> list[int]:
        return sorted({length for _, length in self.units.values()})


def _parse_tasks(value: Any) -> list[str]:
    tasks = check_string_list(value, "tasks")
    for index, task in enumerate(tasks):
        try:
            task_family(task)
        except ValueError as error:
            raise ConfigError(f"tasks[{index}]: {error}") from None
    try:
        from .generate import task_names

        known = task_names()
    except RulerUnavailableError:  # records from a folder need no generator; the families were checked
        return tasks
    unknown = [task for task in tasks if task not in known]
    if unknown:
        raise ConfigError(f"tasks: unknown RULER task(s) {unknown}; allowed: {known}")
    return tasks


def _parse_lengths(value: Any) -> list[int]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"lengths: must be a non-empty list of RULER max_seq_length values, got {value!r}")
    return [check_integer(length, f"lengths[{index}]", 64) for index, length in enumerate(value)]


def _parse_data(value: Any, base_dir: Path, model_path: str) -> tuple[DataGeneration | Path, str]:
    """The records' folder or how to generate them, and their name in the pipeline record (paths as the config
    writes them, so that a run resumes from another checkout of the same files)."""
    kind, given = check_one_of(value, "data", ("generate", "folder"))
    if kind == "folder":
        return check_folder(given, "data.folder", base_dir), f"folder:{given}"
    options = check_mapping(given or {}, "data.generate")
    no_unknown_keys(options, {field.name for field in dataclasses.fields(DataGeneration)}, "data.generate")
    written = check_string(options.get("tokenizer", model_path), "data.generate.tokenizer")
    tokenizer = str((base_dir / written).resolve()) if (base_dir / written).is_dir() else written
    cache_dir = options.get("cache_dir")
    data = DataGeneration(
        tokenizer=tokenizer,
        samples=check_integer(options.get("samples", 500), "data.generate.samples", 1),
        seed=check_integer(options.get("seed", PREPARE_SEED), "data.generate.seed", 0),
        cache_dir=None if cache_dir is None else str((base_dir / check_string(cache_dir, "data.generate.cache_dir"))),
        timeout=float(check_integer(options.get("timeout", 600), "data.generate.timeout", 1)),
    )
    return data, f"generated:{written} seed {data.seed}, {data.samples} samples"


class Ruler(Benchmark):
    """RULER as NVIDIA's generators make it and kvpress's leaderboard prompts it, scored with RULER's metrics."""

    name = "ruler"
    title = "RULER"
    keys = {
        "tasks": "tasks: required (RULER task names, e.g. [niah_single_1, niah_single_2])",
        "lengths": "lengths: required (RULER max_seq_length values, e.g. [4096])",
        "protocol": "",
        "data": "",
    }
    required = frozenset({"tasks", "lengths"})
    errors = (GenerationError, RulerUnavailableError, RulerDataError)
    unavailable = (GenerationTimeout,)
    line_keys = ("pred", "outputs", "_id")

    def parse_options(self, config: Mapping[str, Any], base_dir: Path, model_path: str) -> RulerOptions:
        tasks, lengths = _parse_tasks(config["tasks"]), _parse_lengths(config["lengths"])
        units = {f"{task}_{length}": (task, length) for length in lengths for task in tasks}
        data, data_source = _parse_data(config.get("data", {"generate": {}}), base_dir, model_path)
        return RulerOptions(
            units=units,
            protocol=check_string(config.get("protocol", "context_first"), "protocol", PROTOCOLS),
            data=data,
            data_source=data_source,
        )

    def pipeline(self, options: RulerOptions) -> dict[str, Any]:
        return {"protocol": options.protocol, "data": options.data_source}

    def load_records(self, options: RulerOptions, task: str, output_dir: Path) -> list[dict[str, Any]]:
        name, length = options.units[task]
        if isinstance(options.data, Path):
            path = options.data / task / f"{SUBSET}.jsonl"
        else:
            data = options.data
            path = generate(data.tokenizer, name, length, data.samples, data.seed, output_dir / "data",
                            cache_dir=data.cache_dir, timeout=data.timeout).path
        if not path.is_file():
            raise RulerDataError(f"{path}: no RULER records (make them with `kvcompress-ruler generate`)")
        records = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            try:
                record = json.loads(line)
                records.append({**record, "_id": str(record["index"]), "_task": name})
                split_input(name, record["input"])  # the prompt can be split: fail now, not mid-run
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
                raise RulerDataError(f"{path} line {number}: not a {name} record ({error})") from None
        return records

    def prediction_path(self, task: str) -> Path:
        return Path("pred") / f"{task}.jsonl"

    def prompt(self, options: RulerOptions, task: str, record: Mapping[str, Any], tokenizer: Any,
               chat_template: bool) -> Prompt:
        encoded = encode_prompt(tokenizer, split_input(record["_task"], record["input"]), options.protocol,
                                chat_template)
        return Prompt(encoded.input_ids, encoded.prefill_length,
                      {"max_new_tokens": max_new_tokens(record["_task"])})

    def prediction_line(self, record: Mapping[str, Any], prediction: str) -> dict[str, Any]:
        """RULER's prediction fields (``index``, ``pred``, ``outputs``, ``length``)."""
        return {"index": record["index"], "pred": prediction, "outputs": record["outputs"], "length": record["length"]}

    def score(self, options: RulerOptions, task: str, lines: Sequence[Mapping[str, Any]]) -> float:
        name, _ = options.units[task]
        return score_task(name, [line["pred"] for line in lines], [line["outputs"] for line in lines])

    def sample_scores(self, options: RulerOptions, task: str, lines: Sequence[Mapping[str, Any]]) -> list[float]:
        name, _ = options.units[task]
        per_sample = _PER_SAMPLE[metric_name(name)]
        predictions = [postprocess_prediction(line["pred"]) for line in lines]
        scores = per_sample(predictions, [line["outputs"] for line in lines])
        return [score / 100 for score in scores]

    def averages(self, options: RulerOptions, scores: Mapping[str, Any]) -> dict[str, float | None]:
        """The mean over tasks at each length (RULER's summary), only when every task at that length was
        scored."""
        averages = {}
        for length in options.lengths:
            at_length = [unit for unit, (_, unit_length) in options.units.items() if unit_length == length]
            complete = all(unit in scores for unit in at_length)
            averages[f"average ({length})"] = (
                round(average_score({unit: scores[unit] for unit in at_length}), 2) if complete else None
            )
        return averages

    def notes(self, options: RulerOptions) -> list[str]:
        protocol = (
            "the context is compressed before the question is read (kvpress's leaderboard protocol)"
            if options.protocol == "context_first" else "the whole prompt, question included, is compressed"
        )
        return [
            f"Protocol `{options.protocol}`: {protocol}. Data: {self.pipeline(options)['data']}.",
            "Scores: RULER's string_match_all (string_match_part for qa), 0-100; averages over the tasks at each "
            "length, shown when all were scored. A fractional budget is a share of the compressed tokens.",
        ]
