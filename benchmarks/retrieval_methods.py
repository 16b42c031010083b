"""The compression methods the retrieval benchmark compares, each a function from a slot budget to parameters.

A method only decides how a total per-layer budget is spent; every method gets the same budget (a fraction of
the prompt) and the same start area, so accuracy differences come from what is kept in the middle. To add a
method, add one entry to ``METHODS``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from kvcompress import KVCacheCompressionParameters

MakeParameters = Callable[[int], KVCacheCompressionParameters]


def start_recent(budget: int) -> KVCacheCompressionParameters:
    """StreamingLLM-like floor: the scored methods' start area, everything else recent, nothing chosen by score."""
    start = KVCacheCompressionParameters.from_budget(budget).start_size
    return KVCacheCompressionParameters.from_budget(budget, start_size=start, recent_size=budget - start)


def refined(budget: int, algorithm: str, refined_algorithm: str) -> KVCacheCompressionParameters:
    """A quarter of the intermediate area chosen by the refined selector, the rest by the coarse top-k."""
    base = KVCacheCompressionParameters.from_budget(budget, algorithm=algorithm)
    return KVCacheCompressionParameters.from_budget(
        budget, algorithm=algorithm, refined_algorithm=refined_algorithm, refined_size=base.intermediate_size // 4
    )


METHODS: dict[str, MakeParameters] = {
    "start+recent": start_recent,
    "h2o-sum": partial(KVCacheCompressionParameters.from_budget, algorithm="h2o", score_aggregation="sum"),
    "h2o-norm_sum": partial(KVCacheCompressionParameters.from_budget, algorithm="h2o", score_aggregation="norm_sum"),
    "snapkv-sum": partial(KVCacheCompressionParameters.from_budget, algorithm="snapkv", score_aggregation="sum"),
    "snapkv-norm_sum": partial(
        KVCacheCompressionParameters.from_budget, algorithm="snapkv", score_aggregation="norm_sum"
    ),
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
