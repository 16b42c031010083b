"""Compression parameters: one frozen dataclass, validated on construction, loadable from dicts and YAML.

Names follow the NNCF ``KVCacheCompressionParameters`` proposal so that configs written for NNCF / OpenVINO
contrib read the same here, except ``method`` (NNCF's ``algorithm``, still read under that name with a warning), the
word every entry point and runner uses; the extra fields are documented in the README's parameter table.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import warnings
from pathlib import Path
from typing import Any, Collection, Mapping

from .scoring.catalogue import SCORERS, scorer_class

STRATEGIES = ("per_token", "per_group")
AGGREGATIONS = ("sum", "norm_sum")
REFINED_ALGORITHMS = ("kvcrush", "criticalkv")
KVCRUSH_ANCHORS = ("random", "zeros", "ones", "mean", "alternate")
BUDGET_ALLOCATIONS = ("uniform", "global", "pyramid", "adaptive", "global_adaptive")
LAYER_SHARED_ALLOCATIONS = ("global", "global_adaptive")  # the layers' scored areas compete by score
HEAD_SHARED_ALLOCATIONS = ("adaptive", "global_adaptive")  # KV heads keep counts of their own, by score
DEFAULT_ADAPTIVE_FLOOR = 0.2  # AdaKV's LongBench runs and kvpress's AdaKVPress (alpha_safeguard)
HEAD_SELECTIONS = ("shared", "per_head")
DEFAULT_SNAPKV_WINDOW = 8
KV_BITS = (16, 8, 4)  # bits per kept key and value element (kvcompress/quantization.py)
RENAMED_KEYS = {"algorithm": "method"}  # old spelling -> field; still read (constructor, dicts, YAML), with a warning
RENAMED_METHODS = {"streamingllm": "streaming_llm"}  # old spelling -> method name (the runners' configs)


def renamed(data: Mapping[str, Any], where: str = "") -> dict[str, Any]:
    """``data`` with the old spellings of keys and method names replaced, warning once per old spelling: old
    configs keep working while they are updated. ``where`` prefixes the names in messages (a config path)."""
    data = _renamed_keys(data, where, stacklevel=4)
    method = data.get("method")
    if isinstance(method, str) and method in RENAMED_METHODS:
        warnings.warn(f"{where}method {method!r} is deprecated: write {RENAMED_METHODS[method]!r}", FutureWarning,
                      stacklevel=3)
        data["method"] = RENAMED_METHODS[method]
    return data


def _renamed_keys(data: Mapping[str, Any], where: str, stacklevel: int) -> dict[str, Any]:
    """``data`` with the old spellings of keys replaced (the constructor's keywords take these, not old method
    names); ``stacklevel`` points the warning at the caller's caller (the line to update)."""
    data = dict(data)
    for old, new in RENAMED_KEYS.items():
        if old not in data:
            continue
        value = data.pop(old)
        if new in data and data[new] != value:
            raise ValueError(f"{where}{old}: {value!r} contradicts {new} {data[new]!r} ({old} is {new}'s old name)")
        warnings.warn(f"{where}{old} is deprecated: write {new}: {value!r}", FutureWarning, stacklevel=stacklevel)
        data[new] = value
    return data


def _unknown_parameters(names: list[Any], known: Collection[str]) -> str:
    """The message refusing keys ``names`` that are not in ``known``: each with its closest parameter, as a
    misspelt override is the usual cause, and the accepted ones, so that the fix needs no look-up."""
    guesses = []
    for name in names:
        close = difflib.get_close_matches(str(name), sorted(known), n=1)
        guesses.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    noun = "parameter" if len(names) == 1 else "parameters"
    return f"unknown compression {noun} {', '.join(guesses)}; accepted: {', '.join(sorted(known))}"


def _allowed(values) -> str:
    return ", ".join(repr(v) for v in values)


def _field_names(cls: type) -> frozenset[str]:
    return frozenset(field.name for field in dataclasses.fields(cls))


def _checked_keywords(cls: type) -> type:
    """Wrap the dataclass's ``__init__`` so that every way in (the constructor, ``from_dict``, ``from_budget``,
    ``preset``, ``kvcompress.compress``'s overrides, ``dataclasses.replace``) reads ``method``'s old name
    ``algorithm`` with a warning and refuses a misspelt keyword with its closest parameter, instead of Python's
    bare "unexpected keyword argument"."""
    init = cls.__init__
    known = _field_names(cls)

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs = _renamed_keys(kwargs, "", stacklevel=3)
        unknown = [key for key in kwargs if key not in known]
        if unknown:
            raise ValueError(_unknown_parameters(unknown, known))
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


@_checked_keywords
@dataclasses.dataclass(frozen=True)
class KVCacheCompressionParameters:
    """What to keep in the KV cache of every full-attention layer.

    The cache of each layer is split into three areas: the first ``start_size`` slots (attention sinks) and the
    last ``recent_size`` slots always survive; of everything in between only the ``intermediate_size`` best
    scored slots survive. The layer budget is their sum (``max_cache_size``). With ``score_threshold`` the
    middle keeps only slots whose best KV head scores at least the threshold, at most ``intermediate_size``: the
    budget bounds memory, the threshold lets content decide how much less is kept.
    """

    method: str = "snapkv"
    strategy: str = "per_token"
    group_size: int = 32
    start_size: int = 32
    intermediate_size: int = 128
    recent_size: int = 64
    window_size: int | None = None
    snapkv_kernel_size: int = 7
    score_aggregation: str = "norm_sum"
    compress_during_decoding: bool = True
    decode_slack: int = 16
    refined_algorithm: str | None = None
    refined_size: int = 0
    kvcrush_anchor: str = "alternate"
    kvcrush_seed: int = 0
    criticalkv_first_stage_ratio: float = 0.5
    criticalkv_epsilon: float = 1e-4
    rerotate_keys: bool = False
    budget_allocation: str = "uniform"
    pyramid_beta: float = 20.0
    adaptive_floor: float = DEFAULT_ADAPTIVE_FLOOR
    head_selection: str = "shared"
    score_threshold: float | None = None
    kv_bits: int = 16
    kv_key_group_size: int = 32
    kv_value_group_size: int = 64
    kv_residual: int = 32
    scorer_options: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        self._check_types()
        scorer = scorer_class(self.method)
        if not isinstance(self.scorer_options, Mapping):
            raise TypeError(f"scorer_options must be a mapping, got {type(self.scorer_options).__name__}")
        scorer.check_options(dict(self.scorer_options))
        object.__setattr__(self, "scorer_options", dict(self.scorer_options))
        if scorer.uses_window and self.window_size is None:
            object.__setattr__(self, "window_size", DEFAULT_SNAPKV_WINDOW)
        if not scorer.uses_window and self.window_size is not None:
            windowed = [name for name, cls in SCORERS.items() if cls.uses_window]
            raise ValueError(
                f"window_size is only allowed with method={' or '.join(map(repr, windowed))} (the methods that "
                f"observe a window); got window_size={self.window_size} with method={self.method!r}"
            )
        self._check_values()

    @property
    def scorer(self) -> type:
        """The registered class of ``method`` (``kvcompress.scoring.base.Scorer``)."""
        return scorer_class(self.method)

    @property
    def algorithm(self) -> str:
        """``method``'s old name, kept readable for old code."""
        warnings.warn("KVCacheCompressionParameters.algorithm is deprecated: read .method", FutureWarning,
                      stacklevel=2)
        return self.method

    # ------------------------------------------------------------------ validation
    def _check_types(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None and field.name in _OPTIONAL_FIELDS:
                continue
            if field.name in _INT_FIELDS and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{field.name} must be an integer, got {value!r} ({type(value).__name__})")
            if field.name in _BOOL_FIELDS and not isinstance(value, bool):
                raise TypeError(f"{field.name} must be true or false, got {value!r} ({type(value).__name__})")
            if field.name in _FLOAT_FIELDS and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise TypeError(f"{field.name} must be a number, got {value!r} ({type(value).__name__})")
            if field.name in _STR_FIELDS and not isinstance(value, str):
                raise TypeError(f"{field.name} must be a string, got {value!r} ({type(value).__name__})")

    def _check_values(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {_allowed(STRATEGIES)}, got {self.strategy!r}")
        if self.score_aggregation not in AGGREGATIONS:
            raise ValueError(
                f"score_aggregation must be one of {_allowed(AGGREGATIONS)}, got {self.score_aggregation!r}"
            )
        for name in ("start_size", "intermediate_size", "recent_size", "refined_size", "decode_slack"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_cache_size <= 0:
            raise ValueError(
                "start_size + intermediate_size + recent_size must be > 0 (the layer budget), got "
                f"{self.start_size} + {self.intermediate_size} + {self.recent_size}"
            )
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.strategy == "per_group":
            for name in ("start_size", "intermediate_size", "recent_size", "refined_size"):
                if getattr(self, name) % self.group_size:
                    raise ValueError(
                        f"{name} must be a multiple of group_size={self.group_size} with strategy='per_group', "
                        f"got {getattr(self, name)}"
                    )
        if self.window_size is not None and self.window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {self.window_size}")
        if self.snapkv_kernel_size < 1 or self.snapkv_kernel_size % 2 == 0:
            raise ValueError(
                f"snapkv_kernel_size must be a positive odd integer (a centred pool), got {self.snapkv_kernel_size}"
            )
        if self.refined_algorithm is not None and self.refined_algorithm not in REFINED_ALGORITHMS:
            raise ValueError(
                f"refined_algorithm must be None or one of {_allowed(REFINED_ALGORITHMS)}, "
                f"got {self.refined_algorithm!r}"
            )
        if self.refined_size > self.intermediate_size:
            raise ValueError(
                f"refined_size must be <= intermediate_size ({self.intermediate_size}), got {self.refined_size}"
            )
        if self.refined_algorithm is None and self.refined_size:
            raise ValueError("refined_size needs a refined_algorithm ('kvcrush' or 'criticalkv'); got None")
        if self.kvcrush_anchor not in KVCRUSH_ANCHORS:
            raise ValueError(f"kvcrush_anchor must be one of {_allowed(KVCRUSH_ANCHORS)}, got {self.kvcrush_anchor!r}")
        if self.budget_allocation not in BUDGET_ALLOCATIONS:
            raise ValueError(
                f"budget_allocation must be one of {_allowed(BUDGET_ALLOCATIONS)}, got {self.budget_allocation!r}"
            )
        if self.budget_allocation != "uniform":
            if self.rerotate_keys:
                raise ValueError(
                    f"budget_allocation={self.budget_allocation!r} gives layers (or heads) different lengths, "
                    "which rerotate_keys=True cannot serve (one set of compact positions for every layer); use "
                    "budget_allocation='uniform'"
                )
            if self.refined_algorithm is not None:
                raise ValueError(
                    f"budget_allocation={self.budget_allocation!r} is not combined with a refined_algorithm (KVCrush "
                    "and CriticalKV refine one layer's uniform budget); use budget_allocation='uniform'"
                )
        if not 0.0 <= self.adaptive_floor <= 1.0:
            raise ValueError(
                f"adaptive_floor must be in [0, 1] (the share of each head's scored area it keeps whatever the other "
                f"heads score; 1 is uniform per head), got {self.adaptive_floor}"
            )
        if self.heads_share_budget:
            if self.head_selection != "per_head":
                raise ValueError(
                    f"budget_allocation={self.budget_allocation!r} spreads budgets over KV heads, which needs "
                    f"head_selection='per_head', got head_selection={self.head_selection!r} (for layers alone, "
                    "budget_allocation='global')"
                )
            if self.compress_during_decoding and not scorer_class(self.method).scores_folded_layers:
                raise ValueError(
                    f"budget_allocation={self.budget_allocation!r} with method={self.method!r} compresses prompts "
                    "only (as AdaKV and kvpress do: decode tokens are appended to the heads' kept slots); set "
                    "compress_during_decoding=False, or use a method that scores head-wise (folded) layers while "
                    "decoding ('kvzip', 'kvzap')"
                )
        if self.pyramid_beta < 1:
            raise ValueError(
                f"pyramid_beta must be >= 1 (the top layer keeps 1/beta of the mean), got {self.pyramid_beta}"
            )
        if self.head_selection not in HEAD_SELECTIONS:
            raise ValueError(f"head_selection must be one of {_allowed(HEAD_SELECTIONS)}, got {self.head_selection!r}")
        if self.head_selection == "per_head" and self.refined_algorithm is not None:
            raise ValueError(
                "head_selection='per_head' is not combined with a refined_algorithm (KVCrush's signatures and "
                "CriticalKV's value norms span the heads of a layer); use head_selection='shared'"
            )
        if not 0.0 <= self.criticalkv_first_stage_ratio <= 1.0:
            raise ValueError(
                f"criticalkv_first_stage_ratio must be in [0, 1], got {self.criticalkv_first_stage_ratio}"
            )
        if self.criticalkv_epsilon < 0:
            raise ValueError(f"criticalkv_epsilon must be >= 0, got {self.criticalkv_epsilon}")
        if self.score_threshold is not None and not math.isfinite(self.score_threshold):
            raise ValueError(f"score_threshold must be a finite number or None, got {self.score_threshold}")
        if self.score_threshold is not None and self.head_selection == "per_head" and not self.heads_share_budget:
            raise ValueError(
                "score_threshold with head_selection='per_head' needs budget_allocation 'adaptive' or "
                f"'global_adaptive' (each head then keeps its own count); got {self.budget_allocation!r}"
            )
        if self.kv_bits not in KV_BITS:
            raise ValueError(f"kv_bits must be one of {_allowed(KV_BITS)} (16: the model's dtype), got {self.kv_bits}")
        for name in ("kv_key_group_size", "kv_value_group_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_residual < 0:
            raise ValueError(f"kv_residual must be >= 0, got {self.kv_residual}")
        if self.kv_bits != 16 and self.rerotate_keys:
            raise ValueError(f"kv_bits={self.kv_bits} is not combined with rerotate_keys=True (rotating quantized keys "
                             "would quantize them again); use one of them")

    # ------------------------------------------------------------------ derived
    @property
    def max_cache_size(self) -> int:
        """The per-layer budget in slots: start + intermediate + recent."""
        return self.start_size + self.intermediate_size + self.recent_size

    @property
    def layers_share_budget(self) -> bool:
        """The layers' scored areas compete by score (``"global"``, ``"global_adaptive"``)."""
        return self.budget_allocation in LAYER_SHARED_ALLOCATIONS

    @property
    def heads_share_budget(self) -> bool:
        """KV heads keep counts of their own, by score (``"adaptive"``, ``"global_adaptive"``)."""
        return self.budget_allocation in HEAD_SHARED_ALLOCATIONS

    @property
    def unit_size(self) -> int:
        """Slots per eviction unit: 1 per token, ``group_size`` per page."""
        return self.group_size if self.strategy == "per_group" else 1

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["scorer_options"] = dict(self.scorer_options)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "KVCacheCompressionParameters":
        if not isinstance(data, Mapping):
            raise TypeError(f"compression parameters must be a mapping, got {type(data).__name__}")
        data = renamed(data)
        unknown = [key for key in data if not isinstance(key, str)]  # a YAML key such as 1: refused alike
        if unknown:
            raise ValueError(_unknown_parameters(unknown, _field_names(cls)))
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "KVCacheCompressionParameters":
        import yaml

        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
        if data is None:
            data = {}
        return cls.from_dict(data)

    @classmethod
    def from_budget(
        cls,
        budget: int,
        *,
        start_size: int | None = None,
        recent_size: int | None = None,
        **overrides: Any,
    ) -> "KVCacheCompressionParameters":
        """Split a total per-layer budget into the three areas.

        Defaults: start = min(32, budget // 8), recent = min(64, budget // 4), the rest intermediate; with
        ``strategy='per_group'`` start and recent are rounded down to multiples of ``group_size``. Passing
        ``start_size=4, recent_size=budget - 4`` gives the StreamingLLM floor (nothing scored is kept).
        """
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise ValueError(f"budget must be a positive integer, got {budget!r}")
        unit = window_unit(overrides)
        if start_size is None:
            start_size = min(32, budget // 8) // unit * unit
        if recent_size is None:
            recent_size = min(64, budget // 4) // unit * unit
        intermediate = budget - start_size - recent_size
        if intermediate < 0:
            raise ValueError(
                f"start_size + recent_size ({start_size} + {recent_size}) exceed the budget {budget}"
            )
        return cls(start_size=start_size, recent_size=recent_size, intermediate_size=intermediate, **overrides)


def window_unit(fields: Mapping[str, Any]) -> int:
    """What the start and recent windows are multiples of, given the parameters' ``fields``: whole pages with
    ``strategy='per_group'``, single slots otherwise."""
    return fields.get("group_size", 32) if fields.get("strategy") == "per_group" else 1


_INT_FIELDS = {
    "group_size", "start_size", "intermediate_size", "recent_size", "window_size", "snapkv_kernel_size",
    "decode_slack", "refined_size", "kvcrush_seed", "kv_bits", "kv_key_group_size", "kv_value_group_size",
    "kv_residual",
}
_BOOL_FIELDS = {"compress_during_decoding", "rerotate_keys"}
_FLOAT_FIELDS = {
    "criticalkv_first_stage_ratio", "criticalkv_epsilon", "pyramid_beta", "adaptive_floor", "score_threshold",
}
_STR_FIELDS = {
    "budget_allocation", "head_selection", "strategy", "score_aggregation", "refined_algorithm", "kvcrush_anchor",
}
_OPTIONAL_FIELDS = {"window_size", "refined_algorithm", "score_threshold"}  # None: unset
