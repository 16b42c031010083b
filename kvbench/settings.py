"""A YAML experiment's compression sweep: each setting (a column of the results) and its parsing, checked against
kvcompress's own parameters and presets before any model loads."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .config import ConfigError, check_integer, check_mapping, check_name, check_string, no_unknown_keys, type_name

__all__ = ["CompressionSetting", "budget_label", "parse_settings"]


@dataclasses.dataclass(frozen=True)
class CompressionSetting:
    """One column of the results: a named compression configuration, or the full cache (``method='none'``).

    ``budget`` is the slots per layer (an integer), a fraction in (0, 1) of each prompt's compressed tokens, or
    None (the full cache, or explicit parameters). ``parameters`` are kvcompress's parameters when they do not
    depend on the prompt (an integer budget or explicit fields), else None; ``overrides`` are the fields the
    setting gives on top of the method's preset. ``prefill_chunk_size`` feeds the compressed tokens that many at a
    time, back to the budget after each chunk (``session.prefill(..., chunk_size=)``). ``context_store`` (a folder
    or fsspec URL; the context-first protocol): each record's context is compressed once into that
    ``kvcompress.ContextStore`` and every question is answered from a fresh load of it, as a service that stores
    contexts would; the predictions are those of the setting without it, so it is not part of the pipeline record.
    """

    name: str
    method: str
    budget: int | float | None
    parameters: Any = None  # a kvcompress KVCacheCompressionParameters, or None
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    prefill_chunk_size: int | None = None
    context_store: str | None = None

    @property
    def is_full_cache(self) -> bool:
        return self.method == "none"

    def compression(self, model: Any, tokenizer: Any) -> Any:
        """The kvcompress session that applies this setting to ``model`` (a context manager)."""
        from kvcompress import compress
        from kvcompress.session import CompressionSession

        if self.is_full_cache:
            raise ValueError(f"setting {self.name!r} is the full cache: nothing to attach")
        if self.parameters is not None:
            return CompressionSession(model, self.parameters, tokenizer)
        return compress(model, self.method, self.budget, tokenizer, **self.overrides)

    def stored_context(self, model: Any, tokenizer: Any, context_ids: Any) -> Any:
        """A session holding ``context_ids`` compressed by this setting, loaded afresh from its ``context_store``
        (compressed into it first where it is missing)."""
        from kvcompress import ContextStore

        return ContextStore(self.context_store).get_or_compress(
            model, context_ids, self.method, self.budget, tokenizer, self.prefill_chunk_size, **self.overrides)

    def parameters_for(self, prompt_tokens: int) -> dict[str, Any] | None:
        """The parameters a fractional budget gives a prompt of ``prompt_tokens`` (None for a setting whose
        parameters do not depend on the prompt): what the method's preset meant when the predictions were made,
        for a later preset may split or allocate the budget otherwise."""
        if self.is_full_cache or self.parameters is not None or not isinstance(self.budget, float):
            return None
        from kvcompress import preset
        from kvcompress.budget import budget_slots

        return preset(self.method, budget_slots(self.budget, prompt_tokens), **self.overrides).to_dict()

    def scorer_weights(self, model: Any) -> str | None:
        """The checksum of the learned weights this setting scores with on ``model`` (KVzap's), None for the full
        cache and the methods that learn nothing: the setting names a file (or the shipped one) that can be trained
        again."""
        from kvcompress.scoring.registry import SCORERS

        if self.is_full_cache:
            return None
        method = self.method if self.parameters is None else self.parameters.method
        options = self.overrides.get("scorer_options") if self.parameters is None else self.parameters.scorer_options
        scorer = SCORERS.get(method)  # streaming_llm scores nothing
        return None if scorer is None else scorer.weights_checksum(model, options or {})

    def describe(self) -> dict[str, Any]:
        described = {
            "name": self.name, "method": self.method, "budget": self.budget,
            "parameters": None if self.parameters is None else self.parameters.to_dict(),
            "overrides": dict(self.overrides),
        }
        if self.prefill_chunk_size is not None:  # absent otherwise: older results' pipeline records stay valid
            described["prefill_chunk_size"] = self.prefill_chunk_size
        return described


def _parameter_fields() -> frozenset[str]:
    from kvcompress.parameters import KVCacheCompressionParameters

    return frozenset(field.name for field in dataclasses.fields(KVCacheCompressionParameters))


def _methods() -> tuple[str, ...]:
    """``none``, ``streaming_llm`` and every kvcompress preset (the registered scorers)."""
    from kvcompress.presets import NONE, method_names

    return (NONE, *method_names())


def _build_parameters(method: str, budget: int | float | None, fields: dict[str, Any], key: str) -> Any:
    """kvcompress's preset when a budget is given (a fraction is checked on a 1,024-token prompt), else the
    explicit fields; kvcompress's own errors get the key prefixed (``key.field`` when they name one)."""
    from kvcompress.budget import budget_slots
    from kvcompress.parameters import KVCacheCompressionParameters
    from kvcompress.presets import preset

    try:
        if budget is not None:
            return preset(method, budget_slots(budget, 1024), **fields)
        return KVCacheCompressionParameters.from_dict({**fields, "method": method})
    except (TypeError, ValueError) as error:
        field = str(error).split(":")[0]
        named = field in _parameter_fields() or field == "budget"
        raise ConfigError(f"{key}.{error}" if named else f"{key}: {error}") from None


def _budget(value: Any, key: str) -> int | float:
    if isinstance(value, float) and 0.0 < value < 1.0:
        return value
    if isinstance(value, float):
        raise ConfigError(f"{key}: a fractional budget must lie in (0, 1), got {value!r}")
    try:
        return check_integer(value, key, 1)
    except ConfigError:
        raise ConfigError(
            f"{key}: must be an integer (slots per layer) or a fraction in (0, 1) of the prompt, got "
            f"{type_name(value)} {value!r}"
        ) from None


def budget_label(budget: int | float) -> str:
    return str(budget) if isinstance(budget, int) else f"{budget:g}"


def _parse_setting(entry: Any, key: str, base_dir: Path) -> list[CompressionSetting]:
    if entry in ("none", "full"):
        return [CompressionSetting("full", "none", None)]
    from kvcompress.parameters import RENAMED_KEYS, renamed

    section = check_mapping(entry, key)
    no_unknown_keys(section, {"name", "budget", "budgets", "prefill_chunk_size", "context_store", *RENAMED_KEYS}
                    | _parameter_fields(), key)
    try:
        section = renamed(section, f"{key}.")
    except ValueError as error:
        raise ConfigError(str(error)) from None
    method = check_string(section.pop("method", "snapkv"), f"{key}.method", _methods())
    name = check_name(section.pop("name"), f"{key}.name") if "name" in section else None
    chunk = section.pop("prefill_chunk_size", None)
    chunk = None if chunk is None else check_integer(chunk, f"{key}.prefill_chunk_size", 1)
    store = section.pop("context_store", None)
    if store is not None:
        store = check_string(store, f"{key}.context_store")
        store = store if "://" in store else str(base_dir / store)  # a folder: relative to the config, as others
    if method == "none":
        if section or store is not None:
            extra = sorted(section)[0] if section else "context_store"
            raise ConfigError(f"{key}.{extra}: method 'none' (the full cache) takes only a name")
        return [CompressionSetting(name or "full", "none", None)]
    if store is not None and "budget" not in section and "budgets" not in section:
        raise ConfigError(f"{key}.context_store: needs a budget (a store compresses by method and budget)")
    if "budget" in section and "budgets" in section:
        raise ConfigError(f"{key}: give either budget or budgets, not both")
    if "budgets" in section:
        budgets = section.pop("budgets")
        if not isinstance(budgets, list) or not budgets:
            raise ConfigError(f"{key}.budgets: must be a non-empty list of budgets, got {budgets!r}")
        budgets = [_budget(value, f"{key}.budgets[{index}]") for index, value in enumerate(budgets)]
    elif "budget" in section:
        budgets = [_budget(section.pop("budget"), f"{key}.budget")]
    elif method == "streaming_llm":
        raise ConfigError(f"{key}.budget: required for method 'streaming_llm'")
    else:
        budgets = [None]
    settings = []
    for budget in budgets:
        parameters = _build_parameters(method, budget, dict(section), key)
        size = parameters.max_cache_size if budget is None else budget
        # a sweep's settings are <name or method[-chunkN]>-<budget>; a single setting keeps the name it was given
        stem = name or (method if chunk is None else f"{method}-chunk{chunk}")
        label = name if name is not None and "budgets" not in entry else f"{stem}-{budget_label(size)}"
        fixed = parameters if not isinstance(budget, float) else None  # a fraction is resolved per prompt
        settings.append(CompressionSetting(label, method, size, fixed, dict(section), chunk, store))
    return settings


def parse_settings(value: Any, base_dir: Path = Path(".")) -> tuple[CompressionSetting, ...]:
    """The ``compression`` list of a config; ``base_dir``: the config's folder, which relative paths start from."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"compression: must be a non-empty list of settings, got {value!r}")
    settings: list[CompressionSetting] = []
    for index, entry in enumerate(value):
        for setting in _parse_setting(entry, f"compression[{index}]", base_dir):
            if any(other.name == setting.name for other in settings):
                raise ConfigError(f"compression[{index}]: setting name {setting.name!r} is used twice")
            settings.append(setting)
    return tuple(settings)
