"""YAML experiments: one model, a sweep of compression settings, a task list, a data source, an output folder.

Everything is validated before a model is loaded: a typo in a key or a wrong value fails in a second with the
key's path (``compression[2].budgets[0]``) and the allowed values, instead of after an hour of generation.
Relative paths (``data``, ``output_dir``) are resolved against the config file's folder, so a config runs the
same from any working directory; ``model.path`` keeps Hugging Face semantics (a local folder or a Hub id).
"""

from __future__ import annotations

import dataclasses
import re
from importlib import metadata
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from .data import DataSource
from .metrics import METRIC_FIXES
from .tasks import TASK_GROUPS, TASKS, resolve_tasks

__all__ = [
    "ConfigError", "ModelSpec", "CompressionSetting", "Experiment", "load_experiment", "parse_experiment",
    "pipeline_record",
]

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
STREAMINGLLM = "streamingllm"  # this runner's name for kvcompress's streaming_llm preset (KVCache-Factory's)
DEFAULT_MODEL = "default"  # the embedded SmolLM2-135M-Instruct of kvcompress.models
_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class ConfigError(ValueError):
    """An experiment file with an unknown key or a bad value; the message starts with the key's path."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    path: str
    dtype: str = "auto"
    attn_implementation: str = "sdpa"
    device_map: str | dict[str, Any] | None = None
    chat_template: bool = True


@dataclasses.dataclass(frozen=True)
class CompressionSetting:
    """One column of the results: a named compression configuration, or the full cache (``parameters=None``)."""

    name: str
    method: str
    budget: int | None
    parameters: Any = None  # a kvcompress KVCacheCompressionParameters, or None for the full cache

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name, "method": self.method, "budget": self.budget,
            "parameters": None if self.parameters is None else self.parameters.to_dict(),
        }


@dataclasses.dataclass(frozen=True)
class Experiment:
    model: ModelSpec
    settings: tuple[CompressionSetting, ...]
    tasks: tuple[str, ...]
    data: DataSource
    max_length: int
    output_dir: Path
    limit: int | None = None
    seed: int = 42
    max_new_tokens: int | None = None
    min_one_new_token: bool = False
    metric_fixes: frozenset[str] = frozenset()
    shard_timeout: float = 1800.0
    name: str | None = None

    def select_settings(self, names: list[str] | None) -> list[CompressionSetting]:
        """The settings named on the command line (all when ``names`` is None), in config order."""
        if names is None:
            return list(self.settings)
        known = {setting.name for setting in self.settings}
        unknown = [name for name in names if name not in known]
        if unknown:
            raise ConfigError(f"--settings: unknown setting(s) {unknown}; this experiment has {sorted(known)}")
        return [setting for setting in self.settings if setting.name in names]


# ---------------------------------------------------------------------------------------------- value checks
def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _mapping(value: Any, key: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: must be a mapping, got {_type_name(value)} {value!r}")
    return value


def _no_unknown_keys(mapping: Mapping[str, Any], allowed: set[str] | frozenset[str], key: str) -> None:
    unknown = sorted(str(name) for name in mapping if name not in allowed)
    if unknown:
        where = f"{key}.{unknown[0]}" if key else unknown[0]
        raise ConfigError(f"{where}: unknown key; allowed keys{' of ' + key if key else ''}: {sorted(allowed)}")


def _string(value: Any, key: str, choices: tuple[str, ...] | None = None) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}: must be a non-empty string, got {_type_name(value)} {value!r}")
    if choices is not None and value not in choices:
        raise ConfigError(f"{key}: must be one of {list(choices)}, got {value!r}")
    return value


def _integer(value: Any, key: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: must be an integer, got {_type_name(value)} {value!r}")
    if value < minimum:
        raise ConfigError(f"{key}: must be >= {minimum}, got {value}")
    return value


def _boolean(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: must be true or false, got {_type_name(value)} {value!r}")
    return value


def _name(value: Any, key: str) -> str:
    name = _string(value, key)
    if not _NAME_PATTERN.match(name):
        raise ConfigError(f"{key}: {name!r} is used as a folder name: letters, digits, '.', '_' and '-' only")
    return name


# ---------------------------------------------------------------------------------------------- sections
def _parse_model(value: Any) -> ModelSpec:
    if isinstance(value, str):
        return ModelSpec(path=_string(value, "model"))
    section = _mapping(value, "model")
    _no_unknown_keys(section, {field.name for field in dataclasses.fields(ModelSpec)}, "model")
    if "path" not in section:
        raise ConfigError(f"model.path: required (a local folder, a Hub id, or {DEFAULT_MODEL!r})")
    device_map = section.get("device_map")
    if device_map is not None and not isinstance(device_map, (str, Mapping)):
        raise ConfigError(
            f"model.device_map: must be null, a string ('auto', 'cuda:0', ...) or a mapping, got {device_map!r}"
        )
    return ModelSpec(
        path=_string(section["path"], "model.path"),
        dtype=_string(section.get("dtype", "auto"), "model.dtype", DTYPES),
        attn_implementation=_string(
            section.get("attn_implementation", "sdpa"), "model.attn_implementation", ATTN_IMPLEMENTATIONS
        ),
        device_map=dict(device_map) if isinstance(device_map, Mapping) else device_map,
        chat_template=_boolean(section.get("chat_template", True), "model.chat_template"),
    )


def _parameter_fields() -> frozenset[str]:
    from kvcompress.parameters import KVCacheCompressionParameters

    return frozenset(field.name for field in dataclasses.fields(KVCacheCompressionParameters))


def _methods() -> tuple[str, ...]:
    """``none``, ``streamingllm`` and every kvcompress preset (the registered scorers)."""
    from kvcompress.presets import NONE, STREAMING_LLM, method_names

    return (NONE, STREAMINGLLM, *(m for m in method_names() if m not in (NONE, STREAMING_LLM)))


def _build_parameters(method: str, budget: int | None, fields: dict[str, Any], key: str) -> Any:
    """kvcompress's preset when a budget is given, else the explicit fields; kvcompress's own errors get the
    key prefixed (``key.field`` when they name one)."""
    from kvcompress.parameters import KVCacheCompressionParameters
    from kvcompress.presets import STREAMING_LLM, preset

    try:
        if budget is not None:
            return preset(STREAMING_LLM if method == STREAMINGLLM else method, budget, **fields)
        if fields.get("algorithm", method) != method:
            raise ValueError(f"algorithm: {fields['algorithm']!r} contradicts method {method!r}")
        return KVCacheCompressionParameters.from_dict({**fields, "algorithm": method})
    except (TypeError, ValueError) as error:
        field = str(error).split(":")[0]
        named = field in _parameter_fields() or field == "budget"
        raise ConfigError(f"{key}.{error}" if named else f"{key}: {error}") from None


def _parse_setting(entry: Any, key: str) -> list[CompressionSetting]:
    if entry in ("none", "full"):
        return [CompressionSetting("full", "none", None)]
    section = dict(_mapping(entry, key))
    parameter_fields = _parameter_fields()
    _no_unknown_keys(section, {"name", "method", "budget", "budgets"} | parameter_fields, key)
    if "method" in section:
        method = _string(section.pop("method"), f"{key}.method", _methods())
    else:  # explicit fields: the algorithm names the method (kvcompress's default algorithm when absent)
        method = _string(section.get("algorithm", "snapkv"), f"{key}.algorithm", ("snapkv", "h2o"))
    name = _name(section.pop("name"), f"{key}.name") if "name" in section else None
    if method == "none":
        if section:
            raise ConfigError(f"{key}.{sorted(section)[0]}: method 'none' (the full cache) takes only a name")
        return [CompressionSetting(name or "full", "none", None)]
    if "budget" in section and "budgets" in section:
        raise ConfigError(f"{key}: give either budget or budgets, not both")
    if "budgets" in section:
        budgets = section.pop("budgets")
        if not isinstance(budgets, list) or not budgets:
            raise ConfigError(f"{key}.budgets: must be a non-empty list of integers, got {budgets!r}")
        budgets = [_integer(value, f"{key}.budgets[{index}]", 1) for index, value in enumerate(budgets)]
    elif "budget" in section:
        budgets = [_integer(section.pop("budget"), f"{key}.budget", 1)]
    elif method == "streamingllm":
        raise ConfigError(f"{key}.budget: required for method 'streamingllm'")
    else:
        budgets = [None]
    settings = []
    for budget in budgets:
        parameters = _build_parameters(method, budget, dict(section), key)
        size = parameters.max_cache_size
        # a sweep's settings are <name or method>-<budget>; a single setting keeps the name it was given
        label = name if name is not None and "budgets" not in entry else f"{name or method}-{size}"
        settings.append(CompressionSetting(label, method, size, parameters))
    return settings


def _parse_settings(value: Any) -> tuple[CompressionSetting, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"compression: must be a non-empty list of settings, got {value!r}")
    settings: list[CompressionSetting] = []
    for index, entry in enumerate(value):
        for setting in _parse_setting(entry, f"compression[{index}]"):
            if any(other.name == setting.name for other in settings):
                raise ConfigError(f"compression[{index}]: setting name {setting.name!r} is used twice")
            settings.append(setting)
    return tuple(settings)


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
    section = _mapping(value, "data")
    kinds = ("folder", "zip", "hub")
    _no_unknown_keys(section, set(kinds), "data")
    if len(section) != 1:
        raise ConfigError(f"data: give exactly one of {list(kinds)}, got {sorted(section)}")
    (kind, location), = section.items()
    location = _string(location, f"data.{kind}")
    if kind == "hub":
        return DataSource("hub", location)
    path = (base_dir / location).resolve()
    if kind == "folder" and not path.is_dir():
        raise ConfigError(f"data.folder: {path} is not a folder")
    if kind == "zip" and not path.is_file():
        raise ConfigError(f"data.zip: {path} is not a file")
    return DataSource(kind, str(path))


_TOP_LEVEL = {
    "name", "model", "compression", "tasks", "data", "max_length", "output_dir", "limit", "seed", "max_new_tokens",
    "min_one_new_token", "metric_fixes", "shard_timeout",
}
_REQUIRED = {
    "model": "model: required (path, dtype, attn_implementation, device_map, chat_template)",
    "compression": "compression: required (a list of settings; 'none' is the full cache)",
    "tasks": f"tasks: required ({sorted(TASK_GROUPS)} or task names)",
    "data": "data: required (one of folder, zip, hub)",
    "max_length": (
        "max_length: required, the prompt truncation cap in tokens (context window - ~500: 31500 for "
        "Mistral-7B-Instruct-v0.2 as in SnapKV/AdaKV, 7950 for Llama-3-8B-Instruct as in PyramidKV)"
    ),
    "output_dir": "output_dir: required (relative paths are relative to the config file)",
}


def parse_experiment(config: Any, base_dir: Path) -> Experiment:
    """Builds an experiment from the parsed YAML; ``base_dir`` anchors relative paths."""
    config = _mapping(config, "the experiment file")
    _no_unknown_keys(config, _TOP_LEVEL, "")
    for key, message in _REQUIRED.items():
        if key not in config:
            raise ConfigError(message)
    fixes = config.get("metric_fixes", [])
    if not isinstance(fixes, list) or any(fix not in METRIC_FIXES for fix in fixes):
        raise ConfigError(f"metric_fixes: must be a list drawn from {sorted(METRIC_FIXES)}, got {fixes!r}")
    limit, max_new_tokens = config.get("limit"), config.get("max_new_tokens")
    timeout = config.get("shard_timeout", 1800)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigError(f"shard_timeout: must be a positive number of seconds, got {timeout!r}")
    return Experiment(
        name=None if config.get("name") is None else _string(config["name"], "name"),
        model=_parse_model(config["model"]),
        settings=_parse_settings(config["compression"]),
        tasks=_parse_tasks(config["tasks"]),
        data=_parse_data(config["data"], base_dir),
        max_length=_integer(config["max_length"], "max_length", 2),
        output_dir=(base_dir / _string(config["output_dir"], "output_dir")).resolve(),
        limit=None if limit is None else _integer(limit, "limit", 1),
        seed=_integer(config.get("seed", 42), "seed", 0),
        max_new_tokens=None if max_new_tokens is None else _integer(max_new_tokens, "max_new_tokens", 1),
        min_one_new_token=_boolean(config.get("min_one_new_token", False), "min_one_new_token"),
        metric_fixes=frozenset(fixes),
        shard_timeout=float(timeout),
    )


def load_experiment(path: str | Path) -> Experiment:
    path = Path(path)
    try:
        with path.open(encoding="utf-8") as handle:
            config = yaml.safe_load(handle)
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML ({error})") from None
    return parse_experiment(config, path.resolve().parent)


def pipeline_record(experiment: Experiment, setting: CompressionSetting) -> dict[str, Any]:
    """What produces a setting's predictions, written next to them (papers differ exactly here: chat template,
    truncation cap, min length). ``generation`` must not change while a setting's files are resumed."""
    model = experiment.model
    versions = {}
    for package in ("kvcompress", "transformers", "torch"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "generation": {
            "model": model.path, "dtype": model.dtype, "attn_implementation": model.attn_implementation,
            "chat_template": model.chat_template, "max_length": experiment.max_length,
            "max_new_tokens": experiment.max_new_tokens,  # null: the official length of each task
            "min_one_new_token": experiment.min_one_new_token, "seed": experiment.seed,
            "compression": setting.describe(),
        },
        "versions": versions,
    }
