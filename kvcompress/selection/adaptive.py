"""Adaptive refined budget and the masked ranking shared by the refined selectors.

The refined selectors (KVCrush, CriticalKV) and the adaptive rule all need "the candidates of each row, best
score first" with a tie rule that does not depend on the device or on the sort kernel. ``descending_order``
provides that once: candidates first, by descending value, equal values by ascending unit index.
"""

from __future__ import annotations

import torch


def descending_order(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per row, the unit indices with the ``mask`` units first, by descending value, ties by lower index.

    ``values`` and ``mask`` are ``(..., U)``; the result is ``(..., U)`` int64. The first ``mask.sum(-1)``
    entries of each row are exactly the masked units; the order of the unmasked units after them is unspecified.
    Masking is done by a second stable sort rather than by filling with ``-inf`` so that a candidate whose own
    score is ``-inf`` still ranks ahead of every non-candidate.
    """
    by_value = torch.sort(values, dim=-1, descending=True, stable=True).indices
    outside = ~mask.gather(-1, by_value)
    return by_value.gather(-1, torch.sort(outside, dim=-1, stable=True).indices)


def descending_rank(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per row, each unit's 0-based position in ``descending_order``: mask units get ranks ``0 .. n-1``."""
    order = descending_order(values, mask)
    positions = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, positions)


def check_num_select(num_select: torch.Tensor, candidates: torch.Tensor) -> None:
    """Reject a ``(B,)`` request for more units than a row has candidates, or for a negative count.

    One host synchronisation per call (not per row): a wrong count would otherwise silently select fewer units
    than the budget and desynchronise the cache lengths of the layers.
    """
    if num_select.shape != candidates.shape[:-1]:
        raise ValueError(
            f"num_select must have shape {tuple(candidates.shape[:-1])} (one count per row), "
            f"got {tuple(num_select.shape)}"
        )
    available = candidates.sum(dim=-1)
    if bool(((num_select < 0) | (num_select > available)).any()):
        raise ValueError(
            f"num_select must be in [0, number of candidates] per row, got {num_select.tolist()} "
            f"for {available.tolist()} candidates"
        )


def adaptive_refined_count(
    unit_scores: torch.Tensor, candidates: torch.Tensor, budget_units: int, mass: float = 0.9
) -> torch.Tensor:
    """How many of ``budget_units`` the refined selector gets when ``refined_size=0``.

    The coarse top-k keeps the fewest best-scored candidates that together hold ``mass`` of the row's candidate
    score (``k_min``: the smallest count whose descending cumulative sum reaches ``mass × total``); the refined
    selector fills the rest of the budget: ``refined = clamp(budget_units − k_min, 0, budget_units)``.

    A row whose candidates carry no score at all (total ≤ 0, including a row without candidates) gets
    ``refined = 0``: with no attention signal there is nothing for the refined method to refine, so the row
    falls back to the base method. (contrib's ``_set_balanced_refined_size`` would give ``budget − 1`` there,
    an artefact of its ``cutoff[0] + 1``.) For total > 0 the rule is contrib's exactly. The total is taken
    as the last cumulative sum so that ``mass = 1`` is reached despite float rounding.

    Args:
        unit_scores: ``(B, U)`` non-negative scores of the units.
        candidates: ``(B, U)`` bool, the units of the evictable area.
        budget_units: the intermediate budget in units (tokens or pages).
        mass: share of the candidate score the coarse part must cover, in ``(0, 1]``.

    Returns:
        ``(B,)`` int64 refined counts.
    """
    if not 0.0 < mass <= 1.0:
        raise ValueError(f"mass must be in (0, 1], got {mass}")
    if budget_units < 0:
        raise ValueError(f"budget_units must be >= 0, got {budget_units}")
    if unit_scores.shape[-1] == 0:
        return torch.zeros(unit_scores.shape[:-1], dtype=torch.int64, device=unit_scores.device)
    order = descending_order(unit_scores, candidates)
    ranked = torch.where(candidates.gather(-1, order), unit_scores.gather(-1, order), 0.0).float()
    cumulative = ranked.cumsum(dim=-1)
    total = cumulative[..., -1:]
    reached = cumulative >= mass * total
    k_min = reached.int().argmax(dim=-1) + 1
    refined = (budget_units - k_min).clamp(0, budget_units)
    return torch.where(total.squeeze(-1) > 0, refined, torch.zeros_like(refined))
