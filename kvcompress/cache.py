"""The compressed cache, in transformers' own cache API, and measuring caches.

A ``DynamicCache`` passed in empty is adopted: its full-attention layers become compressed layers
(``layer.CompressedLayer``, which own their kept slots and those slots' eviction state); sliding-window layers keep
transformers' own class, being bounded already. The session does the scoring and eviction, and writes the layout
into the mask; outside a session the layers behave as plain dynamic layers over the kept slots. The meters here
measure any cache, compressed or not, against the uncompressed cache of the same tokens.
"""

from __future__ import annotations

import dataclasses

from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from .layer import CompressedLayer


def adopt_cache(cache: object, compressed_layers: list[int], num_layers: int) -> None:
    """Make ``cache``'s full-attention layers compressed layers, or refuse a cache that cannot be compressed.

    A layer already compressed stays as it is (a cache resumed from an earlier forward or session); an empty
    ``DynamicLayer`` is replaced; a filled one was filled without scores, and is refused.
    """
    if not isinstance(cache, DynamicCache) or getattr(cache, "offloading", False):
        kind = type(cache).__name__ + (" with offloading" if getattr(cache, "offloading", False) else "")
        raise ValueError(
            f"kvcompress needs a transformers DynamicCache (the default of generate), got {kind}: static, "
            "quantized and offloaded caches cannot be compacted in place. Pass no cache (or "
            "past_key_values=DynamicCache(config=model.config)) and leave cache_implementation unset."
        )
    if cache.layer_class_to_replicate is not None:  # built without a config: its layers appear lazily
        if any(layer.get_seq_length() for layer in cache.layers):
            raise ValueError(_FILLED_OUTSIDE)
        cache.layers[:] = [DynamicLayer() for _ in range(num_layers)]
        cache.layer_class_to_replicate = None
    for index in compressed_layers:
        layer = cache.layers[index]
        if isinstance(layer, CompressedLayer):
            continue
        if type(layer) is not DynamicLayer:
            raise ValueError(f"kvcompress cannot compress a {type(layer).__name__} cache layer; use a DynamicCache")
        if layer.get_seq_length():
            raise ValueError(_FILLED_OUTSIDE)
        cache.layers[index] = CompressedLayer()


_FILLED_OUTSIDE = (
    "kvcompress: this cache was filled outside the compressor, so nothing scored its tokens; start generation inside "
    "the `with compressor(model):` block with an empty cache (or none)"
)


def _filled_layers(cache: Cache):
    return [layer for layer in cache.layers if getattr(layer, "keys", None) is not None and _slots(layer)]


def _slots(layer) -> int:
    """Physical slots of a layer (a compressed layer's quantized ones included)."""
    return layer.physical_length if isinstance(layer, CompressedLayer) else layer.keys.shape[-2]


def layer_kv_bytes(layer) -> int:
    """Bytes held by a layer's keys and values (codes, scales and full-precision copies where a compressed layer
    holds them quantized)."""
    return layer.kv_nbytes if isinstance(layer, CompressedLayer) else layer.keys.nbytes + layer.values.nbytes


def kv_cache_bytes(cache: Cache) -> int:
    """Bytes held by the keys and values of every layer."""
    return sum(layer_kv_bytes(layer) for layer in _filled_layers(cache))


def state_bytes(cache: Cache) -> int:
    """Bytes of the eviction state the compressed layers keep beside their keys and values (scores, positions,
    slot layout): what a compressed sequence costs on top of ``kv_cache_bytes``."""
    return sum(layer.state_nbytes for layer in cache.layers if isinstance(layer, CompressedLayer))


def full_cache_bytes(cache: Cache, tokens: int) -> int:
    """Bytes the uncompressed cache holds for the first ``tokens`` tokens of a batch of one: a compressed layer,
    or one that keeps every token, its bytes per token times the tokens; a sliding window what it holds, or its
    bytes per token times the tokens where they are fewer. Read from an uncompressed cache later on (the runner's
    full cache, measured over its context once the answer is generated), nothing having been evicted since, this
    is what it held after those tokens."""
    total = 0
    for layer in _filled_layers(cache):
        if isinstance(layer, CompressedLayer):
            total += layer.bytes_per_token * tokens
            continue
        held = layer.keys.shape[-2]
        per_token = (layer.keys.nbytes + layer.values.nbytes) // held
        total += per_token * (min(held, tokens) if getattr(layer, "is_sliding", False) else tokens)
    return total


def kept_fraction(cache: Cache) -> float:
    """The share of the uncompressed cache's key and value bytes the cache holds for the tokens it has seen: what a
    budget or a ``score_threshold`` kept (every layer counted; sliding layers as they are)."""
    return kv_cache_bytes(cache) / full_cache_bytes(cache, cache.get_seq_length())


def kv_cache_length(cache: Cache) -> int:
    """Physical slots per full-attention layer (what compression bounds), averaged over those layers and rounded:
    their common length, unless the layers have budgets of their own (``budget_allocation="global"``); a folded
    layer (``budget_allocation="adaptive"`` or ``"global_adaptive"``) counts its slots per head."""
    lengths = [_slots(layer) / (getattr(layer, "folded_heads", None) or 1)
               for layer in _filled_layers(cache) if not getattr(layer, "is_sliding", False)]
    return round(sum(lengths) / len(lengths)) if lengths else 0


TOTALS = ("prefill", "decode")  # the timings that cover whole forwards, beside those of compression's parts


@dataclasses.dataclass(frozen=True)
class CacheReport:
    """A cache against the full cache for the tokens it has seen (``CompressionSession.report``)."""

    tokens: int  # tokens seen per sequence (padding included)
    kv_bytes: int  # what the keys and values hold
    full_kv_bytes: int  # what the uncompressed cache would hold for the same tokens
    state_bytes: int  # the eviction state beside them (scores, positions, layout)
    timings: dict[str, float]  # seconds: compression's parts, and the "prefill" and "decode" totals

    @property
    def kept_fraction(self) -> float:
        return self.kv_bytes / self.full_kv_bytes if self.full_kv_bytes else 1.0

    @property
    def compression_seconds(self) -> float:
        """Seconds spent compressing: every part but the forwards' totals."""
        return sum(seconds for part, seconds in self.timings.items() if part not in TOTALS)

    def __str__(self) -> str:
        parts = ", ".join(f"{part} {seconds:.2f} s" for part, seconds in sorted(self.timings.items()))
        return (f"{self.tokens:,} tokens seen; KV cache {_mib(self.kv_bytes)} of {_mib(self.full_kv_bytes)} "
                f"({self.kept_fraction:.1%}), state {_mib(self.state_bytes)}; {parts or 'no timings'}")


def _mib(count: int) -> str:
    return f"{count / 2**20:.2f} MiB"


def cache_report(cache: Cache, timings: dict[str, float] | None = None) -> CacheReport:
    """``cache``'s bytes against the full cache for the tokens it has seen, with ``timings``."""
    tokens = cache.get_seq_length()
    return CacheReport(tokens, kv_cache_bytes(cache), full_cache_bytes(cache, tokens), state_bytes(cache),
                       dict(timings or {}))
