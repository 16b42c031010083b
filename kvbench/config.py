"""Checks of YAML values that fail with the key's path and the allowed values, shared by every benchmark's keys,
whether the Hub can serve a repository that a value names (``hub_problem``), and whether ``model.path`` can be
loaded (``check_model_path``)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_MODEL", "HUB_TIMEOUT", "ConfigError", "check_boolean", "check_folder", "check_integer", "check_mapping",
    "check_model_path", "check_name", "check_one_of", "check_string", "check_string_list", "hub_problem",
    "no_unknown_keys", "type_name",
]

HUB_TIMEOUT = 5.0  # seconds the Hub may take to answer whether it has a repository
DEFAULT_MODEL = "default"  # the embedded default model of kvcompress.models (any of model_names() works too)

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


def hub_problem(repo_id: str, repo_type: str) -> str | None:
    """Why the Hugging Face Hub cannot serve ``repo_id`` (a ``model`` or ``dataset``) from this machine now, or None
    when it answers for it.

    One request, ``HUB_TIMEOUT`` seconds at most, no retries: on a machine without network the Hub clients retry
    for about 30 s and then fail deep inside ``datasets`` or ``transformers``, where a run should stop at once and
    say what to use instead. The reason completes "``repo_id`` ..." and names the offline switch where it is on.
    """
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HFValidationError, OfflineModeIsEnabled, RepositoryNotFoundError

    try:
        HfApi().repo_info(repo_id, repo_type=repo_type, timeout=HUB_TIMEOUT)
    except HFValidationError:
        return "is not a Hub id (namespace/name)"
    except OfflineModeIsEnabled:
        return "cannot be fetched: offline mode is on (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE is set)"
    except RepositoryNotFoundError:
        return f"is not a {repo_type} on the Hub (or a private one: log in with `hf auth login`)"
    except Exception as error:  # the HTTP client's own errors, whose classes change with huggingface_hub's version
        return f"cannot be fetched: the Hub does not answer ({type(error).__name__}: {error})"
    return None


def check_model_path(path: str) -> None:
    """Fails with a ``ConfigError`` naming ``model.path`` unless the model can be loaded from here: a folder that
    exists, an embedded model's name, or a Hub id in the local Hugging Face cache or on a Hub that answers.

    Loading is the last step before generation: without this check a missing model surfaces after the records
    are made (minutes for RULER's generators), as a traceback from inside transformers. Torch is imported only for
    a bare name, which may be an embedded model's, so that a missing folder or Hub id fails within a second.
    """
    if path == DEFAULT_MODEL or Path(path).expanduser().is_dir():
        return
    embedded = f"{DEFAULT_MODEL!r} or another embedded model's name"
    if "/" not in path:  # an embedded model's name, or a Hub id without namespace (gpt2)
        from kvcompress.models import model_names

        if path in model_names():
            return
        embedded = f"{DEFAULT_MODEL!r} or an embedded model's name {model_names()}"
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError:
        why = f"not a folder ({Path(path).expanduser().resolve()} does not exist), an embedded model or a Hub id"
    else:
        if isinstance(try_to_load_from_cache(path, "config.json"), str):
            return
        problem = hub_problem(path, "model")
        if problem is None:
            return
        why = f"not a folder, and as a Hub id not in the local cache ({HF_HUB_CACHE}) and {problem.removeprefix('is ')}"
    raise ConfigError(
        f"model.path: {path!r} is {why}. Give a folder that exists, {embedded}, or a Hub id downloaded beforehand "
        "(huggingface_hub.snapshot_download(ID) on a machine with network)"
    )
