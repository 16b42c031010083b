"""criticalkv_select against hand-built cases and a slow per-row reference."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress.selection.criticalkv import criticalkv_select, first_stage_count


def select(scores, norms, candidates, num_select, **kwargs) -> list[list[int]]:
    mask = criticalkv_select(
        torch.tensor(scores, dtype=torch.float32),
        torch.tensor(norms, dtype=torch.float32),
        torch.tensor(candidates),
        torch.tensor(num_select),
        **kwargs,
    )
    return [torch.nonzero(row).flatten().tolist() for row in mask]


def slow_reference(scores, norms, candidates, k, ratio, eps) -> list[int]:
    """One row with Python sorts: (−key, index) order, the kvpress two-stage rule with the ≥1 guard."""
    pool = [u for u in range(len(scores)) if candidates[u]]
    k1 = min(k, max(1, math.floor(k * ratio)) if ratio > 0 and k > 0 else math.floor(k * ratio))
    first = sorted(pool, key=lambda u: (-scores[u], u))[:k1]
    rest = [u for u in pool if u not in first]
    product = ((torch.tensor(scores) + eps) * torch.tensor(norms)).tolist()  # float32, as the selector
    second = sorted(rest, key=lambda u: (-product[u], u))[: k - k1]
    return sorted(first + second)


def test_tiny_score_huge_value_norm_is_kept_only_by_criticalkv() -> None:
    # k = 2, ratio 0.5 -> k1 = 1: stage 1 keeps unit 0 (score 0.30). Stage 2 products (score + 1e-4) * norm:
    # unit 1: 0.2501, unit 2: 0.2001, unit 3: 0.1501, unit 4: 0.0002 * 10000 = 2.0, unit 5: 0.0901 -> unit 4.
    scores = [[0.30, 0.25, 0.20, 0.15, 0.0001, 0.09]]
    norms = [[1.0, 1.0, 1.0, 1.0, 10000.0, 1.0]]
    everything = [[True] * 6]
    assert select(scores, norms, everything, [2]) == [[0, 4]]
    assert select(scores, norms, everything, [2], first_stage_ratio=1.0) == [[0, 1]]  # plain top-k drops unit 4


def test_first_stage_guard_keeps_one_unit_by_score() -> None:
    # k = 1, ratio 0.5: floor(0.5) = 0 would skip stage 1 and pick unit 2 (largest product 0.0201 * 100);
    # the guard raises k1 to 1, so the top-score unit 0 is kept.
    scores, norms = [[0.5, 0.01, 0.02]], [[1.0, 100.0, 100.0]]
    assert select(scores, norms, [[True] * 3], [1]) == [[0]]
    assert select(scores, norms, [[True] * 3], [1], first_stage_ratio=0.0) == [[2]]
    assert first_stage_count(torch.tensor([0, 1, 3, 10]), 0.1).tolist() == [0, 1, 1, 1]
    assert first_stage_count(torch.tensor([0, 1, 3, 10]), 0.0).tolist() == [0, 0, 0, 0]
    assert first_stage_count(torch.tensor([4, 5]), 0.5).tolist() == [2, 2]


def test_only_candidates_are_chosen_and_rows_are_independent() -> None:
    scores = [[9.0, 1.0, 2.0, 3.0, 0.1], [0.1, 0.2, 0.3, 0.4, 0.5]]
    norms = [[1.0, 1.0, 1.0, 1.0, 1000.0], [5.0, 4.0, 3.0, 2.0, 1.0]]
    candidates = [[False, True, True, True, True], [True, True, True, False, True]]
    # Row 0: k = 2, k1 = 1 -> unit 3 (3.0); products of 1, 2, 4: 1.0001, 2.0001, 100.1 -> unit 4.
    # Row 1: k = 3, k1 = 1 -> unit 4 (0.5); products of 0, 1, 2: 0.5005, 0.8004, 0.9003 -> units 2 and 1.
    assert select(scores, norms, candidates, [2, 3]) == [[3, 4], [1, 2, 4]]
    assert select(scores[1:], norms[1:], candidates[1:], [3]) == [[1, 2, 4]]


def test_edge_counts() -> None:
    scores, norms, candidates = [[0.3, 0.2, 0.1]], [[1.0, 2.0, 3.0]], [[True, False, True]]
    assert select(scores, norms, candidates, [0]) == [[]]
    assert select(scores, norms, candidates, [2]) == [[0, 2]]
    with pytest.raises(ValueError, match="num_select"):
        select(scores, norms, candidates, [3])
    with pytest.raises(ValueError, match="first_stage_ratio"):
        select(scores, norms, candidates, [1], first_stage_ratio=1.5)


@st.composite
def rows(draw):
    batch = draw(st.integers(1, 3))
    units = draw(st.integers(1, 12))
    # Few distinct values so that ties are common.
    value = st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0, 3.0])
    scores = draw(st.lists(st.lists(value, min_size=units, max_size=units), min_size=batch, max_size=batch))
    norms = draw(st.lists(st.lists(value, min_size=units, max_size=units), min_size=batch, max_size=batch))
    candidates = draw(
        st.lists(st.lists(st.booleans(), min_size=units, max_size=units), min_size=batch, max_size=batch)
    )
    num_select = [draw(st.integers(0, sum(row))) for row in candidates]
    return scores, norms, candidates, num_select


@settings(max_examples=60, deadline=None)
@given(rows(), st.sampled_from([0.0, 0.1, 0.5, 0.7, 1.0]))
def test_matches_slow_reference(case, ratio: float) -> None:
    scores, norms, candidates, num_select = case
    got = select(scores, norms, candidates, num_select, first_stage_ratio=ratio)
    expected = [slow_reference(s, n, c, k, ratio, 1e-4) for s, n, c, k in zip(scores, norms, candidates, num_select)]
    assert got == expected


@settings(max_examples=60, deadline=None)
@given(rows())
def test_ratio_one_is_plain_top_k(case) -> None:
    scores, norms, candidates, num_select = case
    got = select(scores, norms, candidates, num_select, first_stage_ratio=1.0)
    top_k = [
        sorted(sorted((u for u in range(len(s)) if c[u]), key=lambda u: (-s[u], u))[:k])
        for s, c, k in zip(scores, candidates, num_select)
    ]
    assert got == top_k
