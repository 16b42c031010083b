"""Property-based checks of the selection invariants over random lengths, budgets, pages and scores."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress import KVCacheCompressionParameters
from kvcompress.selection.windows import left_aligned_indices, select_keep_mask


@st.composite
def cases(draw):
    group = draw(st.sampled_from([1, 1, 2, 4]))
    start, middle, recent = (draw(st.integers(0, 4)) * group for _ in range(3))
    if start + middle + recent == 0:
        middle = group
    refined = draw(st.sampled_from([None, "kvcrush", "criticalkv"]))
    refined_size = draw(st.integers(0, middle // group)) * group if refined else 0
    params = KVCacheCompressionParameters(
        strategy="per_group" if group > 1 else "per_token", group_size=max(group, 1), start_size=start,
        intermediate_size=middle, recent_size=recent, refined_algorithm=refined, refined_size=refined_size,
    )
    batch, total = draw(st.integers(1, 3)), draw(st.integers(1, 60))
    pads = [draw(st.integers(0, total - 1)) for _ in range(batch)]
    seed = draw(st.integers(0, 2**16))
    return params, total, pads, seed


@settings(max_examples=150, deadline=None)
@given(cases())
def test_selection_invariants(case):
    params, total, pads, seed = case
    generator = torch.Generator().manual_seed(seed)
    head_scores = torch.rand(len(pads), 2, total, generator=generator)
    valid = torch.arange(total)[None, :] >= torch.tensor(pads)[:, None]
    keep = select_keep_mask(head_scores, valid, params, value_norms=torch.rand(len(pads), total, generator=generator))
    index, index_valid = left_aligned_indices(keep)
    assert not (keep & ~valid).any()
    for row in range(len(pads)):
        live = int(valid[row].sum())
        kept = keep[row].nonzero().flatten().tolist()
        indices = index[row][index_valid[row]].tolist()
        assert indices == sorted(set(indices)) == kept
        first = pads[row]
        assert set(range(first, first + min(params.start_size, live))) <= set(kept)
        if live <= params.max_cache_size:
            assert len(kept) == live
            continue
        unit = params.unit_size
        pages = -(-(live - params.start_size) // unit)
        partial = int((live - params.start_size) % unit != 0)
        recent_pages = max(params.recent_size // unit, partial)
        recent_from = first + params.start_size + max(0, pages - recent_pages) * unit
        assert set(range(recent_from, total)) <= set(kept)
        recent_count = total - recent_from
        assert len(kept) == params.start_size + params.intermediate_size + recent_count
        if unit == 1:
            assert len(kept) == params.max_cache_size
