"""The compressed cache, in transformers' own cache API, and measuring caches.

A compressed full-attention layer (``CompressedLayer``) stores a chosen subset of the tokens it has seen, in their
original order, together with their eviction state (``LayerState``: scores, counters, positions, slot validity).
Like transformers' ``DynamicSlidingWindowLayer``, whose window also holds fewer tokens than were seen, it reports
the true number of tokens seen (``get_seq_length``), so ``generate`` slices a resumed prompt and numbers positions
exactly as for an uncompressed cache, and it answers the mask sizes of its physical layout: ``kv_offset`` maps its
slots onto the end of the sequence, so the newest slots (this forward's tokens) line up with their queries and
every kept slot, being older, stays visible. Which kept slots hold live tokens (left padding) is the layer's
``state.slot_valid``; the session turns it into the 2-D mask transformers reads (see ``masks.py``).

Sliding-window layers keep transformers' own class: they are bounded already. A ``DynamicCache`` passed in empty
is adopted (its full-attention layers become compressed layers). The session does the scoring and eviction, and
writes the layout into the mask; outside a session the layers behave as plain dynamic layers over the kept slots.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from .ragged import fold_kept, fold_new_tokens, folded_attention, folded_head_of_new
from .rerotation import rotate_keys
from .selection.windows import left_aligned_indices
from .state import LayerState, gather_slots


class CompressedLayer(DynamicLayer):
    """A full-attention cache layer that keeps a subset of the tokens seen, and owns their eviction state."""

    is_croppable = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.cumulative_length = 0  # tokens seen, padding included: the length of generate's 2-D mask
        self.state: LayerState | None = None  # None until the layer's first forward under a session

    @property
    def physical_length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    @property
    def folded_heads(self) -> int | None:
        """The KV heads folded into one row after a head-wise selection (``ragged.py``), else None."""
        return None if self.state is None else self.state.folded_heads

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        tokens = key_states.shape[-2]
        if self.folded_heads is not None:
            key_states, value_states = fold_new_tokens(key_states), fold_new_tokens(value_states)
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        self.cumulative_length += tokens
        return keys, values

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset): the physical slots plus the new tokens, mapped onto the sequence's end."""
        physical = self.physical_length
        if self.folded_heads is not None:  # the session attends itself and ignores this mask (ragged.py)
            return physical + query_length, 0
        return physical + query_length, self.cumulative_length - physical

    @property
    def bytes_per_token(self) -> int:
        """Key and value bytes one token takes in this layer (every head's slot of it, folded or not)."""
        return (self.keys[..., :1, :].nbytes + self.values[..., :1, :].nbytes) * (self.folded_heads or 1)

    def own_attention(self, query, key, value, layout: torch.Tensor, scaling: float, softcap: float | None,
                      observed: torch.Tensor | None = None,
                      all_live: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The attention output of a layer whose layout the model's attention cannot take (a folded one:
        ``ragged.folded_attention`` over its per-head slots, ``layout`` its slots' validity this forward, and
        ``all_live`` whether the caller knows them all live), with the most attention the ``observed`` queries
        give each slot (B, 1, M) where asked; None for any other layer (the scorer's pass or the model's own
        function computes it)."""
        if self.folded_heads is None:
            return None
        batch, _, length, _ = query.shape
        heads = torch.cat([self.state.slot_head, folded_head_of_new(self.folded_heads, length, batch, query.device)],
                          dim=-1)
        return folded_attention(query, key, value, layout, heads, self.folded_heads, scaling, softcap, observed,
                                all_live)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "kvcompress: a compressed cache cannot be cropped (assisted / speculative decoding and cache cropping "
            "assume every token is still cached)"
        )

    def keep(self, index: torch.Tensor, valid: torch.Tensor) -> None:
        """Keep only the slots ``index`` (B, K), in that order; ``valid`` (B, K) marks which hold live tokens."""
        self.keys = gather_slots(self.keys, index)
        self.values = gather_slots(self.values, index)
        self.state.gather(index)
        self.state.slot_valid = valid

    def rerotate_to_compact(self, module, inv_freq: torch.Tensor) -> None:
        """Rotate the live keys to compact positions 0, 1, ... in slot order (``rerotate_keys``), after ``keep``:
        the keys and their recorded RoPE positions change together."""
        state, valid = self.state, self.state.slot_valid
        kept, compact = valid, (valid.long().cumsum(-1) - 1).clamp(min=0)
        if state.per_head:  # (B, 1, K) against each head's own positions
            kept, compact = kept[:, None], compact[:, None]
        delta = torch.where(kept, compact - state.rope_positions, 0)
        self.keys = rotate_keys(module, self.keys, delta, inv_freq)
        state.rope_positions = torch.where(kept, compact, state.rope_positions)

    def keep_per_head(self, keep: torch.Tensor) -> None:
        """Keep each KV head's own slots ``keep`` (B, H_kv, T) bool, whatever their count per head: the layer folds
        its heads into one row that holds exactly the kept (head, token) slots (``ragged.py``)."""
        source, valid = left_aligned_indices(keep.flatten(1))
        self.keys = fold_kept(self.keys, source)
        self.values = fold_kept(self.values, source)
        self.state.fold_heads(source, valid)

    def keep_folded(self, keep: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> None:
        """Keep the slots of a folded layer that its heads' rows (``ragged.head_grid``'s ``index`` and ``valid``,
        (B, H_kv, W)) kept (``keep``, same shape), in slot order: the layer stays folded."""
        kept = torch.zeros_like(self.state.slot_valid, dtype=torch.long)
        kept.scatter_add_(1, index.flatten(1), (keep & valid).flatten(1).long())  # dead cells repeat a slot
        self.keep(*left_aligned_indices(kept > 0))

    def drop_newest(self, tokens: int) -> None:
        """Forget the last ``tokens`` tokens' slots (one per head in a folded layer), as if never seen (a
        context-reconstruction pass's own tokens)."""
        kept = self.physical_length - tokens * (self.folded_heads or 1)
        self.keys = self.keys[..., :kept, :].contiguous()
        self.values = self.values[..., :kept, :].contiguous()
        self.cumulative_length -= tokens

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.state is not None:
            rows = torch.arange(self.state.slot_valid.shape[0], device=self.state.slot_valid.device)
            self._select_rows(rows.repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._select_rows(torch.as_tensor(indices))

    def _select_rows(self, rows: torch.Tensor) -> None:
        if self.state is not None:
            self.state.reorder(rows)

    def reset(self) -> None:
        super().reset()
        self.state = None


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
    return [layer for layer in cache.layers if getattr(layer, "keys", None) is not None and layer.keys.numel()]


def kv_cache_bytes(cache: Cache) -> int:
    """Bytes held by the keys and values of every layer."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in _filled_layers(cache))


def state_bytes(cache: Cache) -> int:
    """Bytes of the eviction state the compressed layers keep beside their keys and values (scores, positions,
    slot layout): what a compressed sequence costs on top of ``kv_cache_bytes``."""
    return sum(layer.state.nbytes for layer in cache.layers if getattr(layer, "state", None) is not None)


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
    lengths = [layer.keys.shape[-2] / (getattr(layer, "folded_heads", None) or 1)
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
