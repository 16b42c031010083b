"""YAML experiments: one benchmark, one model, a sweep of compression settings, the benchmark's tasks, an output
folder.

Everything is validated before a model is loaded: a typo in a key or a wrong value fails in a second with the
key's path (``compression[2].budgets[0]``) and the allowed values, instead of after an hour of generation.
Relative paths (``output_dir`` and the benchmark's data paths) are resolved against the config file's folder, so a
config runs the same from any working directory; ``model.path`` keeps Hugging Face semantics (a local folder or a
Hub id), and ``run`` / ``predict`` check that it can be loaded before any record is read or made
(``check_model_path``). The keys shared by every benchmark are parsed here; ``benchmark`` (default ``longbench``)
names the module that parses the rest (``tasks``, ``data``, ...).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from .benchmark import BENCHMARKS, Benchmark, get_benchmark
from .config import (
    DEFAULT_MODEL,
    ConfigError,
    check_boolean,
    check_integer,
    check_mapping,
    check_model_path,
    check_string,
    no_unknown_keys,
)
from .settings import CompressionSetting, parse_settings

__all__ = [
    "ConfigError", "ModelSpec", "Experiment", "OtherBenchmarkError",
    "load_experiment", "parse_experiment", "pipeline_record",
]

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
DEFAULT_BENCHMARK = "longbench"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    path: str
    dtype: str = "auto"
    attn_implementation: str = "sdpa"
    device_map: str | dict[str, Any] | None = None
    chat_template: bool = True


@dataclasses.dataclass(frozen=True)
class Experiment:
    benchmark: Benchmark
    options: Any  # what the benchmark's parse_options returned; options.tasks are the tasks run
    model: ModelSpec
    settings: tuple[CompressionSetting, ...]
    output_dir: Path
    limit: int | None = None
    seed: int = 42
    max_new_tokens: int | None = None
    shard_timeout: float = 1800.0
    name: str | None = None

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(self.options.tasks)

    def select_settings(self, names: list[str] | None) -> list[CompressionSetting]:
        """The settings named on the command line (all when ``names`` is None), in config order."""
        if names is None:
            return list(self.settings)
        known = {setting.name for setting in self.settings}
        unknown = [name for name in names if name not in known]
        if unknown:
            raise ConfigError(f"--settings: unknown setting(s) {unknown}; this experiment has {sorted(known)}")
        return [setting for setting in self.settings if setting.name in names]

    def select_tasks(self, names: list[str] | None) -> list[str]:
        """The tasks named on the command line (all when ``names`` is None), in config order: a sweep over the
        tasks the full cache solves need not predict the others. A name is one of the runner's tasks, or a task as
        the file's ``tasks`` names it where the runner runs it at several lengths (RULER's ``niah_single_1`` is
        ``niah_single_1_4096``, ...): it selects every length."""
        if names is None:
            return list(self.tasks)
        chosen = {name: [task for task in self.tasks if task == name or _at_a_length(task, name)] for name in names}
        unknown = [name for name, tasks in chosen.items() if not tasks]
        if unknown:
            file_names = list(dict.fromkeys(_LENGTH_SUFFIX.sub("", task) for task in self.tasks))
            at_lengths = "" if file_names == list(self.tasks) else f", or one at a length: {list(self.tasks)}"
            raise ConfigError(f"--tasks: unknown task(s) {unknown}; this experiment has {file_names}{at_lengths}")
        selected = {task for tasks in chosen.values() for task in tasks}
        return [task for task in self.tasks if task in selected]


_LENGTH_SUFFIX = re.compile(r"_\d+$")  # a task run at a length is named <task>_<length> (RULER's units)


def _at_a_length(task: str, name: str) -> bool:
    return _LENGTH_SUFFIX.sub("", task) == name and task != name


# ---------------------------------------------------------------------------------------------- sections
def _parse_model(value: Any) -> ModelSpec:
    if isinstance(value, str):
        return ModelSpec(path=check_string(value, "model"))
    section = check_mapping(value, "model")
    no_unknown_keys(section, {field.name for field in dataclasses.fields(ModelSpec)}, "model")
    if "path" not in section:
        raise ConfigError(
            f"model.path: required (a local folder, a Hub id, {DEFAULT_MODEL!r} or an embedded model's name)"
        )
    device_map = section.get("device_map")
    if device_map is not None and not isinstance(device_map, (str, Mapping)):
        raise ConfigError(
            f"model.device_map: must be null, a string ('auto', 'cuda:0', ...) or a mapping, got {device_map!r}"
        )
    return ModelSpec(
        path=check_string(section["path"], "model.path"),
        dtype=check_string(section.get("dtype", "auto"), "model.dtype", DTYPES),
        attn_implementation=check_string(
            section.get("attn_implementation", "sdpa"), "model.attn_implementation", ATTN_IMPLEMENTATIONS
        ),
        device_map=dict(device_map) if isinstance(device_map, Mapping) else device_map,
        chat_template=check_boolean(section.get("chat_template", True), "model.chat_template"),
    )


_SHARED = {
    "name", "benchmark", "model", "compression", "output_dir", "limit", "seed", "max_new_tokens", "shard_timeout",
}
_REQUIRED = {
    "model": "model: required (path, dtype, attn_implementation, device_map, chat_template)",
    "compression": "compression: required (a list of settings; 'none' is the full cache)",
    "output_dir": "output_dir: required (relative paths are relative to the config file)",
}


class OtherBenchmarkError(ConfigError):
    """An experiment file of another benchmark than the one asked for; ``benchmark`` names the file's, so that
    the command line can name the command that runs it."""

    def __init__(self, message: str, benchmark: str) -> None:
        super().__init__(message)
        self.benchmark = benchmark


def _benchmark(config: Mapping[str, Any], default_benchmark: str, exclusive: bool) -> Benchmark:
    """The file's benchmark: its ``benchmark`` key, else ``default_benchmark``. A file of another benchmark than
    an ``exclusive`` caller runs, or one without the key whose keys are another benchmark's, raises
    ``OtherBenchmarkError``: read as the wrong benchmark it would fail on "unknown key" with no hint."""
    name = check_string(config.get("benchmark", default_benchmark), "benchmark", tuple(BENCHMARKS))
    benchmark = get_benchmark(name)
    if exclusive and name != default_benchmark:
        expected = get_benchmark(default_benchmark).title
        raise OtherBenchmarkError(
            f"benchmark: this is a {benchmark.title} experiment file (benchmark: {name}), not a {expected} one", name
        )
    if "benchmark" in config:
        return benchmark
    unknown = set(config) - _SHARED - set(benchmark.keys)
    for other_name in BENCHMARKS:
        other = get_benchmark(other_name)
        foreign = sorted(unknown & (set(other.keys) - set(benchmark.keys)))
        if foreign:
            raise OtherBenchmarkError(
                f"{foreign[0]}: not a {benchmark.title} key; without a `benchmark` key this file reads as "
                f"{benchmark.title}, but its keys {foreign} are {other.title}'s: a {other.title} experiment file",
                other_name,
            )
    return benchmark


def parse_experiment(config: Any, base_dir: Path, default_benchmark: str = DEFAULT_BENCHMARK, *,
                     exclusive: bool = False, check_model: bool = False) -> Experiment:
    """Builds an experiment from the parsed YAML; ``base_dir`` anchors relative paths. ``default_benchmark``
    applies when the file has no ``benchmark`` key; with ``exclusive`` (``kvcompress-longbench``,
    ``kvcompress-ruler``) a file of another benchmark is refused (``OtherBenchmarkError``). ``check_model`` also
    checks that ``model.path`` can be loaded (``check_model_path``: a folder, an embedded model, a reachable Hub
    id) and the benchmark's data sources (``Benchmark.source_problems``), all reported at once: what ``run`` and
    ``predict`` need, and parsing alone does not."""
    config = check_mapping(config, "the experiment file")
    benchmark = _benchmark(config, default_benchmark, exclusive)
    no_unknown_keys(config, _SHARED | set(benchmark.keys), "")
    for key, message in {**_REQUIRED, **benchmark.keys}.items():
        if key not in config and (key in _REQUIRED or key in benchmark.required):
            raise ConfigError(message)
    limit, max_new_tokens = config.get("limit"), config.get("max_new_tokens")
    timeout = config.get("shard_timeout", 1800)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigError(f"shard_timeout: must be a positive number of seconds, got {timeout!r}")
    model = _parse_model(config["model"])
    problems = []  # what cannot be loaded: every source at once, before the sections that import torch
    if check_model:
        try:
            check_model_path(model.path)
        except ConfigError as error:
            problems.append(str(error))
    options = benchmark.parse_options(config, base_dir, model.path)
    if check_model:
        problems += benchmark.source_problems(options)
    if problems:
        raise ConfigError("\n".join(problems))
    return Experiment(
        benchmark=benchmark,
        options=options,
        name=None if config.get("name") is None else check_string(config["name"], "name"),
        model=model,
        settings=parse_settings(config["compression"], base_dir),
        output_dir=(base_dir / check_string(config["output_dir"], "output_dir")).resolve(),
        limit=None if limit is None else check_integer(limit, "limit", 1),
        seed=check_integer(config.get("seed", 42), "seed", 0),
        max_new_tokens=None if max_new_tokens is None else check_integer(max_new_tokens, "max_new_tokens", 1),
        shard_timeout=float(timeout),
    )


def load_experiment(path: str | Path, default_benchmark: str = DEFAULT_BENCHMARK, *, exclusive: bool = False,
                    check_model: bool = False) -> Experiment:
    """Reads and parses an experiment file (``parse_experiment`` says what the keywords do)."""
    path = Path(path)
    try:
        with path.open(encoding="utf-8") as handle:
            config = yaml.safe_load(handle)
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML ({error})") from None
    return parse_experiment(config, path.resolve().parent, default_benchmark, exclusive=exclusive,
                            check_model=check_model)


def pipeline_record(experiment: Experiment, setting: CompressionSetting, computed_dtype: str,
                    scorer_weights: str | None = None) -> dict[str, Any]:
    """What produces a setting's predictions, written next to them (papers differ exactly here: chat template,
    truncation cap, protocol). ``generation`` must not change while a setting's files are resumed.
    ``computed_dtype`` is the dtype the model computes in (``auto`` resolved: an embedded model's depends on the
    machine), so that predictions made in bfloat16 are not resumed in float32; ``scorer_weights`` the checksum of
    a learned scorer's weights (``CompressionSetting.scorer_weights``), so that a retrained file does not continue
    predictions its predecessor started under the same setting name. A setting with a fractional budget records
    the parameters it gives a 100,000-token prompt (long enough for any window it sets): predictions of a preset
    changed since are not resumed."""
    model = experiment.model
    resolved = setting.parameters_for(100_000)
    versions = {}
    for package in ("kvcompress", "transformers", "torch"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "generation": {
            "benchmark": experiment.benchmark.name,
            "model": model.path, "dtype": model.dtype, "computed_dtype": computed_dtype,
            "attn_implementation": model.attn_implementation,
            "chat_template": model.chat_template,
            "max_new_tokens": experiment.max_new_tokens,  # null: the benchmark's own length per task
            "seed": experiment.seed,
            **experiment.benchmark.pipeline(experiment.options),
            "compression": setting.describe(),
            **({} if scorer_weights is None else {"scorer_weights": scorer_weights}),
            **({} if resolved is None else {"parameters_at_100k_tokens": resolved}),
        },
        "versions": versions,
    }
