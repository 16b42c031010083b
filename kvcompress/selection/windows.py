"""Which slots survive an eviction: start window, best of the intermediate area, recent window.

Everything is counted on the live tokens of each sequence (its "rank"), not on physical slots, so left padding
and earlier filler never shift a sequence's windows. Per-group eviction is the same computation on units of
``group_size`` consecutive ranks aligned at ``start_size`` (per-token is ``group_size = 1``): the trailing,
possibly partial unit belongs to the recent area (even when ``recent_size`` is 0), so only complete pages
are ever evicted.
"""

from __future__ import annotations

import dataclasses

import torch

from ..parameters import KVCacheCompressionParameters
from .adaptive import adaptive_refined_count, descending_order
from .criticalkv import criticalkv_select
from .kvcrush import kvcrush_select


@dataclasses.dataclass(frozen=True)
class SequenceWindows:
    """Each sequence's own windows (B,) in slots, where a fractional budget sizes them by the sequence's length."""

    start: torch.Tensor
    recent: torch.Tensor
    fewest: int  # the smallest start + recent, known on the host

    def rows(self, count: int) -> "SequenceWindows":
        """The windows of ``count`` rows stacked layer-major (row = l·B + b)."""
        repeats = count // self.start.shape[0]
        return SequenceWindows(self.start.repeat(repeats), self.recent.repeat(repeats), self.fewest)

    def per_head(self, heads: int) -> "SequenceWindows":
        """The windows of rows split into ``heads`` head rows each (row = r·H + h)."""
        return SequenceWindows(self.start.repeat_interleave(heads), self.recent.repeat_interleave(heads), self.fewest)


def select_keep_mask(
    head_scores: torch.Tensor,
    slot_valid: torch.Tensor,
    params: KVCacheCompressionParameters,
    value_norms: torch.Tensor | None = None,
    scored_units: torch.Tensor | None = None,
    windows: SequenceWindows | None = None,
) -> torch.Tensor:
    """Slots to keep (B, T) bool, from per-KV-head eviction scores (B, H, T) and the live-slot mask (B, T).

    A sequence whose live tokens fit in the budget keeps all of them; otherwise it keeps exactly its start
    window, ``intermediate_size`` slots (``intermediate_size / group_size`` pages; per row ``scored_units``
    (B,) units where rows have budgets of their own) and its recent window; with ``score_threshold`` the scored
    part keeps only the units at or above it, at most that many. Dead slots (padding) are never kept. ``windows``:
    each row's own start and recent windows (a fractional budget's), else the parameters'.
    """
    units = _units(head_scores, slot_valid, params, params.score_threshold, windows)
    if scored_units is None:
        scored_units = torch.full_like(units.candidates[:, 0], params.intermediate_size // params.unit_size,
                                       dtype=torch.long)
    chosen = _choose_units(units.scores, units.head_scores, units.candidates, params, scored_units,
                           _unit_means(value_norms, units.in_units, units.scatter_to, units.candidates.shape[-1]))
    kept_units = chosen.gather(-1, units.scatter_to) & units.in_units
    return units.protected | kept_units


def global_scored_units(
    head_scores: torch.Tensor, slot_valid: torch.Tensor, params: KVCacheCompressionParameters, totals: torch.Tensor,
    windows: SequenceWindows | None = None,
) -> torch.Tensor:
    """Scored units per row when the layers share one budget (rows stacked layer-major: row = l·B + b).

    Per sequence b, the candidates of every layer compete for ``totals[b]`` units by score (KVzip's global
    selection); a layer gets as many units as it has among the winners, so layers whose scores are high
    everywhere keep much and layers that attend narrowly keep little. Ties go to the earlier layer and unit.
    Returns (L·B,) int64.
    """
    units = _units(head_scores, slot_valid, params, windows=windows)
    batch, count = totals.shape[0], units.candidates.shape[-1]
    layers = head_scores.shape[0] // batch

    def by_sequence(tensor: torch.Tensor) -> torch.Tensor:  # (L·B, U) -> (B, L·U)
        return tensor.view(layers, batch, count).transpose(0, 1).reshape(batch, layers * count)

    winners = _top_k_mask(by_sequence(units.scores), by_sequence(units.candidates), totals)
    return winners.view(batch, layers, count).sum(-1).transpose(0, 1).reshape(-1)


def adaptive_scored_units(
    head_scores: torch.Tensor, head_valid: torch.Tensor, params: KVCacheCompressionParameters,
    scored_units: torch.Tensor,
    layers: int = 1,
    windows: SequenceWindows | None = None,
) -> torch.Tensor:
    """Scored units per KV head (R, H) when KV heads share the scored areas (AdaKV's "floor, then compete"), from
    per-KV-head scores and live slots (R, H, T) (a folded layer's heads hold different slots).

    Per row r (a layer's sequence), every head first keeps its own best ``⌊adaptive_floor · scored_units[r]⌋``
    units; then the remaining candidates of the competing heads go by score to the rest of their areas' total:
    a layer's heads (``H · scored_units[r]``), or with ``layers`` > 1 (rows stacked layer-major, r = l·B + b;
    ``budget_allocation="global_adaptive"``, KVzip's own selection) every head of every layer of sequence b
    (``H · Σ_l scored_units[l·B + b]``). A head gets as many units as it has among the winners, and selection then
    keeps each head's own best that many, so the kept sets are the tops of the heads' own rankings and the total
    is exact (fewer only where heads have fewer candidates). ``adaptive_floor`` 1 is uniform per head, 0 a pure
    top-k over the competing heads. Ties go to the lower layer, then head, then the older unit.
    """
    rows, heads, total = head_scores.shape
    units = _units(head_scores.reshape(rows * heads, 1, total), head_valid.reshape(rows * heads, total), params,
                   params.score_threshold, None if windows is None else windows.per_head(heads))
    count = units.candidates.shape[-1]
    floor = torch.floor(params.adaptive_floor * scored_units.double()).long()
    safe = _top_k_mask(units.scores, units.candidates, floor.repeat_interleave(heads))
    boosted = torch.where(safe, torch.inf, units.scores)
    batch = rows // layers

    def by_sequence(tensor: torch.Tensor) -> torch.Tensor:  # (L·B·H, U) -> (B, L·H·U)
        return tensor.view(layers, batch, heads * count).transpose(0, 1).reshape(batch, layers * heads * count)

    totals = heads * scored_units.view(layers, batch).sum(0)
    winners = _top_k_mask(by_sequence(boosted), by_sequence(units.candidates), totals)
    return winners.view(batch, layers, heads, count).sum(-1).transpose(0, 1).reshape(rows, heads)


@dataclasses.dataclass
class _Units:
    """The eviction units of each row (B, U), and which slots (B, T) are always kept or belong to a unit."""

    scores: torch.Tensor  # summed over KV heads
    head_scores: torch.Tensor  # (B, H, U)
    candidates: torch.Tensor  # units of the scored area
    protected: torch.Tensor  # slots of the start and recent windows
    in_units: torch.Tensor
    scatter_to: torch.Tensor  # each slot's unit


def _units(head_scores: torch.Tensor, slot_valid: torch.Tensor, params: KVCacheCompressionParameters,
           threshold: float | None = None, windows: SequenceWindows | None = None) -> _Units:
    """The rows' units; with a ``threshold`` only the units whose best head scores at least that much per slot are
    candidates (``score_threshold``: the others leave whatever the budget). ``windows``: each row's own (B,)."""
    unit = params.unit_size
    batch, _, total = head_scores.shape
    if windows is None:
        start = torch.full((batch, 1), params.start_size, dtype=torch.long, device=head_scores.device)
        recent_units = torch.full((batch,), params.recent_size // unit, dtype=torch.long, device=head_scores.device)
    else:
        start, recent_units = windows.start[:, None], windows.recent // unit
    rank = slot_valid.long().cumsum(-1) - 1
    live = slot_valid.sum(-1)
    unit_of_slot = torch.div(rank - start, unit, rounding_mode="floor")
    num_units = torch.div(live - start[:, 0] + unit - 1, unit, rounding_mode="floor").clamp(min=0)
    max_units = -(-total // unit)
    in_units = slot_valid & (rank >= start)
    # A partial trailing page is never a candidate, even with recent_size 0: only complete pages are evicted.
    partial = ((live - start[:, 0]).clamp(min=0) % unit != 0).long()
    recent_units = torch.maximum(partial, recent_units)
    recent = in_units & (unit_of_slot >= (num_units - recent_units)[:, None])
    protected = slot_valid & ((rank < start) | recent)

    unit_index = torch.arange(max_units, device=head_scores.device)
    candidates = unit_index[None, :] < (num_units - recent_units)[:, None]
    scatter_to = torch.where(in_units, unit_of_slot, 0)
    unit_head_scores = torch.zeros(batch, head_scores.shape[1], max_units, device=head_scores.device)
    unit_head_scores.scatter_add_(-1, scatter_to.unsqueeze(1).expand_as(head_scores), head_scores * in_units[:, None])
    if threshold is not None:
        candidates = candidates & (unit_head_scores.amax(1) >= threshold * unit)
    return _Units(scores=unit_head_scores.sum(1), head_scores=unit_head_scores, candidates=candidates,
                  protected=protected, in_units=in_units, scatter_to=scatter_to)


def _unit_means(values, in_units, scatter_to, max_units):
    if values is None:
        return None
    sums = torch.zeros(values.shape[0], max_units, device=values.device).scatter_add_(-1, scatter_to, values * in_units)
    sizes = torch.zeros_like(sums).scatter_add_(-1, scatter_to, in_units.float())
    return sums / sizes.clamp(min=1.0)


def _choose_units(unit_scores, unit_head_scores, candidates, params, budget_units, unit_value_norms) -> torch.Tensor:
    """Coarse top-k by score, then the refined selector among what the coarse step left out.

    ``budget_units`` (B,) is each row's scored area; refined selection works on the parameters' uniform one.
    """
    if params.refined_algorithm is None:
        refined = torch.zeros(unit_scores.shape[0], dtype=torch.long, device=unit_scores.device)
    elif params.refined_size:
        refined = torch.full_like(candidates[:, 0], params.refined_size // params.unit_size, dtype=torch.long)
    else:
        refined = adaptive_refined_count(unit_scores, candidates, params.intermediate_size // params.unit_size)
    coarse = _top_k_mask(unit_scores, candidates, budget_units - refined)
    if params.refined_algorithm is not None:
        remaining = candidates & ~coarse
        count = torch.minimum(refined, remaining.sum(-1))
        if params.refined_algorithm == "kvcrush":
            coarse |= kvcrush_select(unit_head_scores, remaining, count, params.kvcrush_anchor, params.kvcrush_seed)
        else:
            coarse |= criticalkv_select(
                unit_scores, unit_value_norms, remaining, count,
                params.criticalkv_first_stage_ratio, params.criticalkv_epsilon,
            )
    return coarse


def _top_k_mask(scores: torch.Tensor, candidates: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The ``k[b]`` best candidates of each row (all of them where fewer exist).

    Ties (SnapKV's max-pool makes many exact ones) go to the older unit, so a sequence selects the same slots
    whatever padding or filler precedes it in a batch.
    """
    order = descending_order(scores, candidates)
    take = torch.arange(order.shape[-1], device=scores.device)[None, :] < torch.minimum(k, candidates.sum(-1))[:, None]
    return torch.zeros_like(candidates).scatter(-1, order, take)


def left_aligned_indices(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather indices (..., K) that put each row's kept slots (..., T), in order, at the right end of K slots.

    K is the widest row's count; narrower rows are filled on the left with slots they did not keep, which are
    then marked dead (returned validity (..., K)), exactly like left padding.
    """
    total = keep.shape[-1]
    width = int(keep.sum(-1).max())
    slot = torch.arange(total, device=keep.device)
    order = torch.where(keep, slot + total, slot).argsort(dim=-1)[..., total - width :]
    valid = keep.gather(-1, order)
    return order, valid
