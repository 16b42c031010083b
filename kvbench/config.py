"""Checks of YAML values that fail with the key's path and the allowed values, shared by every benchmark's keys."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "ConfigError", "check_boolean", "check_folder", "check_integer", "check_mapping", "check_name", "check_one_of",
    "check_string", "check_string_list", "no_unknown_keys", "type_name",
]

_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class ConfigError(ValueError):
    """An experiment file with an unknown key or a bad value; the message starts with the key's path."""


def type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def check_mapping(value: Any, key: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: must be a mapping, got {type_name(value)} {value!r}")
    return value


def no_unknown_keys(mapping: Mapping[str, Any], allowed: set[str] | frozenset[str], key: str) -> None:
    unknown = sorted(str(name) for name in mapping if name not in allowed)
    if unknown:
        where = f"{key}.{unknown[0]}" if key else unknown[0]
        raise ConfigError(f"{where}: unknown key; allowed keys{' of ' + key if key else ''}: {sorted(allowed)}")


def check_string(value: Any, key: str, choices: tuple[str, ...] | None = None) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}: must be a non-empty string, got {type_name(value)} {value!r}")
    if choices is not None and value not in choices:
        raise ConfigError(f"{key}: must be one of {list(choices)}, got {value!r}")
    return value


def check_string_list(value: Any, key: str) -> list[str]:
    """A string or a non-empty list of strings, as a list."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value or not all(isinstance(item, str) for item in value):
        raise ConfigError(f"{key}: must be a string or a non-empty list of strings, got {value!r}")
    return value


def check_integer(value: Any, key: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: must be an integer, got {type_name(value)} {value!r}")
    if value < minimum:
        raise ConfigError(f"{key}: must be >= {minimum}, got {value}")
    return value


def check_boolean(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: must be true or false, got {type_name(value)} {value!r}")
    return value


def check_name(value: Any, key: str) -> str:
    name = check_string(value, key)
    if not _NAME_PATTERN.match(name):
        raise ConfigError(f"{key}: {name!r} is used as a folder name: letters, digits, '.', '_' and '-' only")
    return name


def check_one_of(value: Any, key: str, kinds: tuple[str, ...]) -> tuple[str, Any]:
    """A mapping with exactly one of ``kinds`` as its key (``data: {folder: ...}``): that key and its value."""
    section = check_mapping(value, key)
    no_unknown_keys(section, set(kinds), key)
    if len(section) != 1:
        raise ConfigError(f"{key}: give exactly one of {list(kinds)}, got {sorted(section)}")
    (kind, given), = section.items()
    return kind, given


def check_folder(value: Any, key: str, base_dir: Path) -> Path:
    """An existing folder, relative paths taken from ``base_dir`` (the config file's folder)."""
    path = (base_dir / check_string(value, key)).resolve()
    if not path.is_dir():
        raise ConfigError(f"{key}: {path} is not a folder")
    return path
