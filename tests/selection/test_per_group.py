"""Per-group eviction keeps whole pages aligned at start_size and keeps the cache within one page of the budget."""

import pytest
import torch

from kvcompress import KVCacheCompressionParameters, KVCacheCompressor
from tiny_models import random_tokens, tiny_model

GROUP = 8
PARAMS = KVCacheCompressionParameters(strategy="per_group", group_size=GROUP, start_size=8, intermediate_size=32,
                                      recent_size=16)


def _assert_complete_pages(true_positions, seen):
    """Kept intermediate slots form complete pages of GROUP positions aligned at start_size."""
    start = PARAMS.start_size
    pages = (seen - start + GROUP - 1) // GROUP
    recent_from = start + (pages - PARAMS.recent_size // GROUP) * GROUP
    assert true_positions[:start] == list(range(start))
    assert true_positions[-(seen - recent_from):] == list(range(recent_from, seen))
    middle = [p for p in true_positions if start <= p < recent_from]
    kept_pages = {(p - start) // GROUP for p in middle}
    assert len(kept_pages) == PARAMS.intermediate_size // GROUP
    assert sorted(middle) == sorted(start + page * GROUP + j for page in kept_pages for j in range(GROUP))


@pytest.mark.parametrize("method", ["snapkv", "h2o"])
def test_pages_and_bounds_during_decoding(method):
    model = tiny_model("llama")
    params = KVCacheCompressionParameters(**{**PARAMS.to_dict(), "method": method,
                                             "window_size": 8 if method == "snapkv" else None})
    budget = params.max_cache_size
    with KVCacheCompressor(params)(model) as session, torch.no_grad():
        out = model(random_tokens(203), use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for step in range(60):
            seen = session.cache.get_seq_length()
            for state in session.layers.values():
                if session.evictions and seen > budget:
                    length = state.tracked_slots
                    assert budget - GROUP + 1 <= length <= budget + 1, (step, length)
                    if length <= budget:  # right after an eviction
                        _assert_complete_pages(state.true_positions[0].tolist(), seen)
            out = model(token, cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        assert session.evictions >= 1 + 60 // GROUP - 1


def test_prefill_cut_matches_contrib_rule():
    """After a prefill of n tokens the recent area is the last recent_size/group pages, the last one partial."""
    model = tiny_model("llama")
    with KVCacheCompressor(PARAMS)(model) as session, torch.no_grad():
        model(random_tokens(203), use_cache=True)
        partial = (203 - PARAMS.start_size) % GROUP or GROUP
        for state in session.layers.values():
            assert state.tracked_slots == PARAMS.max_cache_size - GROUP + partial
            _assert_complete_pages(state.true_positions[0].tolist(), 203)
