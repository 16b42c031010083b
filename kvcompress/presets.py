"""Method presets: a method name and a budget give the parameters, the same for the user, the LongBench and
RULER runners and the benchmarks.

A method is a registered scorer (``snapkv``, ``h2o``, ``kvzip``, ``expected_attention``, ``tova``, ``keydiff``,
``knorm`` and any registered later), ``streaming_llm`` (4 attention sinks and the most recent tokens, nothing
scored) or ``none`` (the full cache). A budget is a number of slots per layer, or a fraction in (0, 1] of what a
sequence has seen (``kvcompress.budget.budget_slots`` resolves it to slots). Scored methods split the budget as
``KVCacheCompressionParameters.from_budget`` does (start = min(32, budget / 8), recent = min(64, budget / 4),
the rest scored) unless the method's reference selects otherwise (``Scorer.reference_selection``: KVzip keeps 4
sinks and nothing else outside its scores), and allocate it as the reference does (``Scorer.allocation``: KVzip
lets every KV head of every layer share one budget by score); any parameter can be overridden.
"""

from __future__ import annotations

from typing import Any

from .parameters import HEAD_SHARED_ALLOCATIONS, KVCacheCompressionParameters, renamed, window_unit
from .scoring.registry import SCORERS, scorer_class

__all__ = ["NONE", "STREAMING_LLM", "STREAMING_LLM_SINKS", "method_names", "preset"]

NONE = "none"
STREAMING_LLM = "streaming_llm"
STREAMING_LLM_SINKS = 4  # StreamingLLM's attention sinks (KVCache-Factory: window = budget - 4)


def method_names() -> list[str]:
    """Every method ``kvcompress.compress`` takes: ``streaming_llm`` and the registered scorers. ``none`` (the full
    cache, which ``preset`` maps to None) is not one: it is no compression, and the runners that accept it add it."""
    return [STREAMING_LLM, *SCORERS]


def preset(method: str, budget: int, **overrides: Any) -> KVCacheCompressionParameters | None:
    """The parameters of ``method`` at ``budget`` slots per layer (None for ``none``, the full cache).

    With ``strategy="per_group"`` the budget is rounded down to whole pages of ``group_size`` slots (at least one
    page), and so are the windows, so every budget a page-free method accepts is accepted with pages too;
    StreamingLLM's sinks then fill one page (none in a budget of one page).
    """
    if method == NONE:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(
            f"preset() takes a budget in slots (an integer >= 1); resolve a fraction with "
            f"kvcompress.budget.budget_slots() first, got {budget!r}"
        )
    overrides = renamed(overrides)  # ``algorithm``, method's old name, meets the checks below as ``method``
    unit = window_unit(overrides)
    budget = max(unit, budget // unit * unit)
    if method == STREAMING_LLM:
        for fixed in ("intermediate_size", "recent_size", "method"):
            if fixed in overrides:
                raise ValueError(f"{fixed}: streaming_llm keeps start + recent = budget; set start_size only")
        # whole pages: the sinks fill one page where a second one holds recent tokens, else there are none
        start = overrides.pop("start_size", STREAMING_LLM_SINKS if unit == 1 else unit if budget > unit else 0)
        if budget <= start:
            raise ValueError(f"budget: streaming_llm needs a budget above start_size ({start}), got {budget}")
        return KVCacheCompressionParameters.from_budget(budget, start_size=start, recent_size=budget - start,
                                                        **overrides)
    if method not in SCORERS:
        raise ValueError(f"method must be one of {', '.join(map(repr, method_names()))}, got {method!r}")
    if overrides.get("method", method) != method:
        raise ValueError(f"method: {overrides['method']!r} contradicts the preset's method {method!r}")
    overrides.pop("method", None)
    scorer = scorer_class(method)
    overrides.setdefault("budget_allocation", scorer.allocation)
    for name, value in scorer.reference_selection.items():
        is_window = name in ("start_size", "recent_size")
        overrides.setdefault(name, min(value, budget) // unit * unit if is_window else value)
    # per-head counts: heads of different lengths, evicted at prompts (a decode step's eviction would re-share a
    # layer's heads without the competition that set their counts)
    if overrides["budget_allocation"] in HEAD_SHARED_ALLOCATIONS:
        overrides.setdefault("head_selection", "per_head")
        overrides.setdefault("compress_during_decoding", False)
    return KVCacheCompressionParameters.from_budget(budget, method=method, **overrides)
