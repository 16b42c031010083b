"""How a budget is spread over the layers before any score is known (PyramidKV's schedule).

Budgets that follow the scores (``budget_allocation="global"``: the layers' scored areas compete for one total)
are chosen at eviction, in ``windows.global_scored_units``.
"""

from __future__ import annotations

import torch


def pyramid_scored_units(base: torch.Tensor, layers: int, beta: float) -> torch.Tensor:
    """PyramidKV's per-layer scored areas (L, B) for sequences whose uniform area is ``base`` (B,) units.

    Layer l gets ``high − l·(high − low)/(L − 1)`` with ``low = base/β`` and ``high = 2·base − low``: the first
    layer, whose attention is spread widely, keeps the most, the last the least, and the mean stays ``base``.
    Rounding hands the remainder to the largest fractional parts (ties: the lower layer), so every sequence's
    layers sum to exactly ``L·base``: the same memory as the uniform budget.
    """
    if layers == 1:
        return base[None].clone()
    low = base.double() / beta
    high = 2 * base.double() - low
    steps = torch.arange(layers, dtype=torch.float64, device=base.device)[:, None]
    ideal = high[None] - steps * ((high - low) / (layers - 1))[None]  # (L, B)
    floor = ideal.floor()
    remainder = layers * base - floor.sum(0).long()  # (B,) units still to hand out, in [0, L)
    order = torch.sort(ideal - floor, dim=0, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(0, order, steps.long().expand_as(order))
    return floor.long() + (rank < remainder[None]).long()
