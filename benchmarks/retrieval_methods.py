"""The compression methods the retrieval benchmark compares, each a function from a slot budget to parameters.

A method only decides how a total per-layer budget is spent; every method gets the same budget (a fraction of
the prompt) and the same start area, so accuracy differences come from what is kept in the middle. To add a
method, add one entry to ``METHODS``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from kvcompress import KVCacheCompressionParameters
from kvcompress.presets import STREAMING_LLM, preset

MakeParameters = Callable[[int], KVCacheCompressionParameters]


def start_recent(budget: int) -> KVCacheCompressionParameters:
    """StreamingLLM-like floor with the scored methods' start area (not 4 sinks): everything else recent, so
    the comparison isolates what the middle keeps."""
    return preset(STREAMING_LLM, budget, start_size=preset("snapkv", budget).start_size)


def refined(budget: int, method: str, refined_algorithm: str) -> KVCacheCompressionParameters:
    """A quarter of the intermediate area chosen by the refined selector, the rest by the coarse top-k."""
    return preset(method, budget, refined_algorithm=refined_algorithm,
                  refined_size=preset(method, budget).intermediate_size // 4)


METHODS: dict[str, MakeParameters] = {
    "start+recent": start_recent,
    "h2o-sum": partial(preset, "h2o", score_aggregation="sum"),
    "h2o-norm_sum": partial(preset, "h2o", score_aggregation="norm_sum"),
    "snapkv-sum": partial(preset, "snapkv", score_aggregation="sum"),
    "snapkv-norm_sum": partial(preset, "snapkv", score_aggregation="norm_sum"),
    "snapkv-kvcrush": partial(refined, algorithm="snapkv", refined_algorithm="kvcrush"),
    "snapkv-criticalkv": partial(refined, algorithm="snapkv", refined_algorithm="criticalkv"),
}

# snapkv-sum is left out by default: at prefill every slot outside the window has been observed by the same
# number of queries, so sum and norm_sum rank identically, and short answers end before decoding evicts anything.
DEFAULT_METHODS = ("start+recent", "h2o-sum", "h2o-norm_sum", "snapkv-norm_sum")


def method_parameters(name: str, budget: int) -> KVCacheCompressionParameters:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; allowed: {', '.join(METHODS)}")
    return METHODS[name](budget)
