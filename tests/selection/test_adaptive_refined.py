"""adaptive_refined_count and the shared masked ordering, on hand-computed cases."""

import pytest
import torch

from kvcompress.selection.adaptive import adaptive_refined_count, check_num_select, descending_order, descending_rank


def counts(scores, candidates, budget, mass=0.9):
    return adaptive_refined_count(
        torch.tensor(scores, dtype=torch.float32), torch.tensor(candidates), budget, mass
    ).tolist()


def test_hand_computed_mass_cutoffs() -> None:
    # Candidate scores sorted: 8, 4, 2, 1, 1 (total 16), cumulative 8, 12, 14, 15, 16.
    # mass 0.9 -> target 14.4 -> first reached at count 4; mass 0.75 -> 12 -> count 2; mass 0.5 -> 8 -> count 1.
    scores = [[1.0, 8.0, 2.0, 1.0, 4.0]]
    everything = [[True] * 5]
    assert counts(scores, everything, budget=5, mass=0.9) == [1]  # 5 - 4
    assert counts(scores, everything, budget=5, mass=0.75) == [3]  # 5 - 2
    assert counts(scores, everything, budget=5, mass=0.5) == [4]  # 5 - 1
    assert counts(scores, everything, budget=3, mass=0.9) == [0]  # max(0, 3 - 4)
    assert counts(scores, everything, budget=5, mass=1.0) == [0]  # all 5 needed


def test_non_candidates_do_not_count() -> None:
    # Unit 0 (score 100) is protected, not a candidate. Candidates 8, 4, 4 (total 16): mass 0.75 -> 12 -> count 2.
    # Were unit 0 counted, the total would be 116 and the single unit 0 would already cover 75 %.
    assert counts([[100.0, 4.0, 8.0, 4.0]], [[False, True, True, True]], budget=3, mass=0.75) == [1]


def test_trailing_zero_scores_are_not_needed_for_full_mass() -> None:
    # Sorted 8, 4, 0, 0: the whole mass is reached after 2 units even with mass 1.0.
    assert counts([[0.0, 4.0, 0.0, 8.0]], [[True] * 4], budget=4, mass=1.0) == [2]


def test_zero_mass_rows_fall_back_to_the_base_method() -> None:
    # Row 0: ordinary (8, 4, 2, 1, 1 as above -> 5 - 4); row 1: all-zero candidates; row 2: no candidate at all.
    scores = [[1.0, 8.0, 2.0, 1.0, 4.0], [0.0] * 5, [3.0] * 5]
    candidates = [[True] * 5, [True] * 5, [False] * 5]
    assert counts(scores, candidates, budget=5) == [1, 0, 0]


def test_rows_are_independent_and_dtype_is_int64() -> None:
    scores = torch.tensor([[1.0, 8.0, 2.0, 1.0, 4.0], [5.0, 5.0, 5.0, 5.0, 0.0]])
    out = adaptive_refined_count(scores, torch.ones(2, 5, dtype=torch.bool), 5, 0.75)
    # Row 1: sorted 5, 5, 5, 5, 0 (total 20): target 15 -> count 3 -> refined 2.
    assert out.dtype == torch.int64 and out.tolist() == [3, 2]


@pytest.mark.parametrize("mass", [0.0, -0.1, 1.5])
def test_rejects_mass_outside_unit_interval(mass: float) -> None:
    with pytest.raises(ValueError, match="mass"):
        adaptive_refined_count(torch.ones(1, 3), torch.ones(1, 3, dtype=torch.bool), 2, mass)


def test_descending_order_ties_by_index_and_candidates_first() -> None:
    values = torch.tensor([[2.0, 5.0, 2.0, float("-inf"), 9.0, 2.0]])
    mask = torch.tensor([[True, True, True, True, False, True]])
    # Candidates by descending value, equal values by index: 1 (5.0), 0, 2, 5 (2.0), 3 (-inf); then 4 (excluded).
    assert descending_order(values, mask).tolist() == [[1, 0, 2, 5, 3, 4]]
    assert descending_rank(values, mask).tolist() == [[1, 0, 2, 4, 5, 3]]


def test_check_num_select() -> None:
    candidates = torch.tensor([[True, False, True], [False, False, True]])
    check_num_select(torch.tensor([2, 1]), candidates)
    for bad in ([3, 1], [2, 2], [-1, 0]):
        with pytest.raises(ValueError, match="num_select"):
            check_num_select(torch.tensor(bad), candidates)
    with pytest.raises(ValueError, match="shape"):
        check_num_select(torch.tensor([1]), candidates)
