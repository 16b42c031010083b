"""kvcrush_select: a hand-computed example, the documented rules, and a slow per-row reference."""

from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress.selection.kvcrush import KVCRUSH_ANCHORS, head_signatures, kvcrush_anchor_bits, kvcrush_select

# The 12-unit example. Units 3 and 8 are not candidates (n = 10). Head h's score of candidate u is
# bit + 0.01·u with the bit from the signature table below, so the top half (5 of 10) of every head is exactly
# its bit-1 units (every head has five). Units 3 and 8 score 5.0 in every head: if non-candidates took part in
# the ranking they would take two top-half places in every head and change the signatures.
SIGNATURES = {
    0: "1111", 1: "0010", 2: "1110", 4: "0001", 5: "1100", 6: "0011", 7: "1000", 9: "0101", 10: "0110", 11: "1001"
}
NON_CANDIDATES = (3, 8)


def example() -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.full((1, 4, 12), 5.0)
    for unit, bits in SIGNATURES.items():
        for head, bit in enumerate(bits):
            scores[0, head, unit] = int(bit) + 0.01 * unit
    candidates = torch.ones(1, 12, dtype=torch.bool)
    candidates[0, list(NON_CANDIDATES)] = False
    return scores, candidates


def chosen(head_scores, candidates, num_select, anchor, seed=0) -> list[list[int]]:
    mask = kvcrush_select(head_scores, candidates, torch.tensor(num_select), anchor, seed)
    return [torch.nonzero(row).flatten().tolist() for row in mask]


# Hamming distances to the anchor and the distance-sorted list (ties by unit index), with n = 10:
#   alternate 0101: u0 2, u1 3, u2 3, u4 1, u5 2, u6 2, u7 3, u9 0, u10 2, u11 2
#                   -> [9, 4, 0, 5, 6, 10, 11, 1, 2, 7]
#   zeros 0000:     u0 4, u1 1, u2 3, u4 1, u5 2, u6 2, u7 1, u9 2, u10 2, u11 2
#                   -> [1, 4, 7, 5, 6, 9, 10, 11, 2, 0]
#   ones 1111:      u0 0, u1 3, u2 1, u4 3, u5 2, u6 2, u7 3, u9 2, u10 2, u11 2
#                   -> [0, 2, 5, 6, 9, 10, 11, 1, 4, 7]
# k = 4 takes positions floor(i·10/4) = 0, 2, 5, 7; k = 3 takes floor(i·10/3) = 0, 3, 6.
@pytest.mark.parametrize(
    ("anchor", "k", "expected"),
    [
        ("alternate", 4, [9, 0, 10, 1]),
        ("alternate", 3, [9, 5, 11]),
        ("zeros", 4, [1, 7, 9, 11]),
        ("ones", 4, [0, 5, 10, 1]),
        # mean: every head has 5 ones of 10 -> anchor (.5, .5, .5, .5), every L1 distance is 2, so the order is
        # the index order [0, 1, 2, 4, 5, 6, 7, 9, 10, 11] and positions 0, 2, 5, 7 pick 0, 2, 6, 9.
        ("mean", 4, [0, 2, 6, 9]),
    ],
)
def test_hand_computed_twelve_unit_example(anchor: str, k: int, expected: list[int]) -> None:
    scores, candidates = example()
    signatures = head_signatures(scores, candidates)
    for unit, bits in SIGNATURES.items():
        assert "".join(str(int(b)) for b in signatures[0, :, unit]) == bits
    assert chosen(scores, candidates, [k], anchor) == [sorted(expected)]


def test_signature_ties_and_odd_counts() -> None:
    # One head per case, all units candidates.
    scores = torch.tensor([[[3.0, 2.0, 2.0, 1.0]], [[2.0, 2.0, 2.0, 2.0]]])
    everything = torch.ones(2, 4, dtype=torch.bool)
    # Row 0: the unit ranked floor(4/2) = 2 scores 2.0; only 3.0 is strictly above, both tied 2.0s get 0.
    # Row 1: all equal -> nothing is strictly above -> all 0.
    assert head_signatures(scores, everything)[:, 0].int().tolist() == [[1, 0, 0, 0], [0, 0, 0, 0]]
    odd = torch.tensor([[[5.0, 1.0, 4.0, 2.0, 3.0]]])
    # n = 5: top floor(5/2) = 2 get 1 (5.0 and 4.0); the middle unit (3.0) gets 0.
    assert head_signatures(odd, torch.ones(1, 5, dtype=torch.bool))[0, 0].int().tolist() == [1, 0, 1, 0, 0]


def test_equal_distances_are_spread_in_index_order() -> None:
    # All scores equal -> all signatures 0000 -> distance 0 to "zeros" for every candidate; the candidates in index
    # order are [0, 2, 3, 4, 5, 6, 7, 8, 9] (n = 9, unit 1 excluded); k = 3 takes positions 0, 3, 6 -> 0, 4, 7.
    candidates = torch.ones(1, 10, dtype=torch.bool)
    candidates[0, 1] = False
    assert chosen(torch.ones(1, 4, 10), candidates, [3], "zeros") == [[0, 4, 7]]


def test_anchor_bits() -> None:
    scores, candidates = example()
    signatures = head_signatures(scores, candidates)
    bits = {
        name: kvcrush_anchor_bits(name, signatures, candidates, seed=0)[0].int().tolist() for name in KVCRUSH_ANCHORS
    }
    assert bits["zeros"] == [0, 0, 0, 0]
    assert bits["ones"] == [1, 1, 1, 1]
    assert bits["alternate"] == [0, 1, 0, 1]
    assert bits["random"] == torch.randint(0, 2, (4,), generator=torch.Generator().manual_seed(0)).tolist()
    assert kvcrush_anchor_bits("mean", signatures, candidates)[0].tolist() == [0.5, 0.5, 0.5, 0.5]
    # mean is the per-head fraction of ones: forcing head 2's bit on units 0, 1, 2, 4, 5, 6 (with unit 10 already
    # set: 7 of 10 candidates) moves that head only.
    forced = signatures.clone()
    forced[0, 2, [0, 1, 2, 4, 5, 6]] = True
    assert kvcrush_anchor_bits("mean", forced, candidates)[0].tolist() == pytest.approx([0.5, 0.5, 0.7, 0.5])


def test_random_anchor_is_reproducible_and_seeded() -> None:
    torch.manual_seed(3)
    scores = torch.rand(2, 8, 40)
    candidates = torch.rand(2, 40) > 0.3
    k = torch.tensor([7, 9])
    first = kvcrush_select(scores, candidates, k, "random", seed=11)
    torch.manual_seed(99)  # the global RNG must not matter
    assert torch.equal(first, kvcrush_select(scores, candidates, k, "random", seed=11))
    signatures = head_signatures(scores, candidates)
    assert not torch.equal(
        kvcrush_anchor_bits("random", signatures, candidates, seed=0),
        kvcrush_anchor_bits("random", signatures, candidates, seed=1),
    )


def test_edge_counts() -> None:
    scores, candidates = example()
    assert chosen(scores, candidates, [0], "alternate") == [[]]
    assert chosen(scores, candidates, [10], "alternate") == [sorted(SIGNATURES)]
    with pytest.raises(ValueError, match="num_select"):
        chosen(scores, candidates, [11], "alternate")


def test_rejects_unknown_anchor() -> None:
    scores, candidates = example()
    with pytest.raises(ValueError, match=r"kvcrush_anchor.*'random', 'zeros', 'ones', 'mean', 'alternate'"):
        chosen(scores, candidates, [2], "median")


def test_batch_rows_are_independent() -> None:
    torch.manual_seed(0)
    scores = torch.rand(4, 6, 50)
    candidates = torch.rand(4, 50) > 0.4
    candidates[3] = False  # a row without candidates
    k = torch.minimum(torch.tensor([5, 0, 13, 0]), candidates.sum(-1))
    for anchor in KVCRUSH_ANCHORS:
        together = kvcrush_select(scores, candidates, k, anchor, seed=5)
        for b in range(4):
            alone = kvcrush_select(scores[b : b + 1], candidates[b : b + 1], k[b : b + 1], anchor, seed=5)
            assert torch.equal(together[b : b + 1], alone)


def slow_reference(scores: list[list[float]], candidates: list[bool], k: int, anchor: str, seed: int) -> list[int]:
    """One row in plain Python, following the module docstring's rules."""
    pool = [u for u, c in enumerate(candidates) if c]
    n, heads = len(pool), len(scores)
    signature = {u: [] for u in pool}
    for h in range(heads):
        ranked = sorted(pool, key=lambda u: (-scores[h][u], u))
        threshold = scores[h][ranked[n // 2]] if n else 0.0
        for u in pool:
            signature[u].append(int(scores[h][u] > threshold))
    if anchor == "zeros":
        anchor_bits = [0] * heads
    elif anchor == "ones":
        anchor_bits = [1] * heads
    elif anchor == "alternate":
        anchor_bits = [h % 2 for h in range(heads)]
    elif anchor == "mean":  # exact fractions: equal distances must tie, as they do in the integer implementation
        anchor_bits = [Fraction(sum(signature[u][h] for u in pool), max(n, 1)) for h in range(heads)]
    else:
        anchor_bits = torch.randint(0, 2, (heads,), generator=torch.Generator().manual_seed(seed)).tolist()
    order = sorted(pool, key=lambda u: (sum(abs(a - b) for a, b in zip(signature[u], anchor_bits)), u))
    return sorted(order[i * n // k] for i in range(k))


@st.composite
def rows(draw):
    batch, heads, units = draw(st.integers(1, 3)), draw(st.integers(1, 5)), draw(st.integers(1, 14))
    value = st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0])  # few values: ties are common
    scores = draw(
        st.lists(
            st.lists(st.lists(value, min_size=units, max_size=units), min_size=heads, max_size=heads),
            min_size=batch,
            max_size=batch,
        )
    )
    candidates = draw(
        st.lists(st.lists(st.booleans(), min_size=units, max_size=units), min_size=batch, max_size=batch)
    )
    num_select = [draw(st.integers(0, sum(row))) for row in candidates]
    return scores, candidates, num_select


@settings(max_examples=80, deadline=None)
@given(rows(), st.sampled_from(KVCRUSH_ANCHORS), st.integers(0, 3))
def test_matches_slow_reference(case, anchor: str, seed: int) -> None:
    scores, candidates, num_select = case
    got = chosen(torch.tensor(scores), torch.tensor(candidates), num_select, anchor, seed)
    expected = [slow_reference(s, c, k, anchor, seed) for s, c, k in zip(scores, candidates, num_select)]
    assert got == expected
    assert [len(row) for row in got] == num_select
