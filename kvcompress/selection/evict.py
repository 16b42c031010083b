"""Eviction: one selection for a set of compressed layers, then each layer keeps its selected slots.

The session calls ``evict`` once per eviction (a prefill's layer, or every due layer at the end of a forward);
the budgets come from its ``BudgetPlan``, the ranking from the scorer, the choice of slots from
``windows.select_keep_mask`` (or its head-wise allocations), and the layer itself compacts its keys, values and
state (``CompressedLayer.keep`` / ``keep_per_head`` / ``rerotate_to_compact``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..ragged import head_grid
from .windows import adaptive_scored_units, global_scored_units, left_aligned_indices, select_keep_mask

if TYPE_CHECKING:
    from ..budget import BudgetPlan
    from ..layer import CompressedLayer
    from ..scoring.base import Scorer


def evict(layers: list[tuple[nn.Module, CompressedLayer]], scorer: Scorer, plan: BudgetPlan, slack: float,
          allocate: bool = False, inv_freq: torch.Tensor | None = None,
          timings: dict[str, float] | None = None, decoding: bool = False) -> None:
    """Compact ``layers`` (module, cache layer) with one selection for all of them, ranked by ``scorer``'s
    eviction scores, to ``plan``'s budgets (a layer over its budget by at most ``slack`` keeps everything).

    Selection treats every (layer, sequence) row independently, so stacking the layers' rows (their layouts
    left-padded to the longest with dead slots) gives each layer exactly what it would get alone, for the
    cost of one call instead of one per layer. ``allocate``: the layers first share their scored areas'
    total by score (``budget_allocation="global"``), and each keeps its share from then on; with
    ``"global_adaptive"`` every (layer, head) of a sequence competes for the total instead. ``inv_freq``: the
    rotary frequencies, where the parameters rerotate kept keys to compact positions. ``timings`` collects the
    seconds of selection and compaction. ``decoding`` (a decode step's eviction): with head-wise allocations each
    head keeps the scored area the last prompt's competition gave it (``CompressedLayer.head_units``), so a long
    generation holds the prompt's budget, split as the prompt split it.
    """
    timings = timings if timings is not None else {}
    parameters = plan.parameters
    started = time.perf_counter()
    states = [layer for _, layer in layers]
    scores = [scorer.eviction_scores(layer, *layer.full_keys_values(), layer.slot_valid) for layer in states]
    adaptive = parameters.heads_share_budget
    # a folded layer's slots as per-head rows (ragged.head_grid); every other layer's rows are its slots
    grids = [head_grid(state.slot_head, state.slot_valid, state.folded_heads) if state.folded_heads else None
             for state in states]
    scores = [layer_scores if grid is None else layer_scores[:, 0].gather(1, grid[0].flatten(1)).view(grid[0].shape)
              for layer_scores, grid in zip(scores, grids)]
    widths = [layer_scores.shape[-1] for layer_scores in scores]
    width = max(widths)

    def rows(tensors: list[torch.Tensor], fill) -> torch.Tensor:  # left-pad the slot axis to ``width``
        return torch.cat([torch.nn.functional.pad(t, (width - t.shape[-1], 0), value=fill) for t in tensors])

    scores = rows(scores, 0.0)
    batch = scores.shape[0] // len(layers)
    heads = scores.shape[1]
    if adaptive:  # per (layer, sequence, head) rows of live slots, and a row's live slots per head on average
        head_rows = rows([state.slot_valid[:, None].expand(-1, heads, -1) if grid is None else grid[1]
                          for state, grid in zip(states, grids)], False)
        live = -(-head_rows.sum((1, 2)) // heads)
    else:
        slot_rows = rows([state.slot_valid for state in states], False)
        live = slot_rows.sum(-1)
    value_norms = rows([state.value_norms for state in states], 0.0) if states[0].value_norms is not None else None
    units = torch.cat([plan.scored_units(state) for state in states])
    windows = plan.window_rows(units.shape[0])  # each sequence's own windows (a fraction's), else None
    if allocate and not adaptive:  # only the sequences that evict now take their share, as each would alone
        totals = units.view(len(layers), batch).sum(0)  # per sequence, what the layers hold together
        shares = global_scored_units(scores, slot_rows, parameters, totals, windows)
        units = torch.where(plan.over_budget(live, units, slack), shares, units)
        for number, state in enumerate(states):
            state.scored_units = units[number * batch : (number + 1) * batch]
    if allocate and adaptive:  # the layers of a sequence hold one budget together: all select, or none
        summed = live.view(len(layers), batch).sum(0)
        over = plan.selects(summed, units.view(len(layers), batch).sum(0), slack * len(layers)).repeat(len(layers))
    else:
        over = plan.selects(live, units, slack)
    if parameters.head_selection == "per_head":  # every (layer, sequence, head) row selects alone
        head_units = units.repeat_interleave(heads)
        if not adaptive:
            head_rows = slot_rows[:, None].expand(-1, heads, -1)
        elif decoding:  # each head keeps its share of the last prompt (uniform before any prompt evicted)
            head_units = torch.cat([units[number * batch : (number + 1) * batch, None].expand(-1, heads)
                                    if state.head_units is None else state.head_units
                                    for number, state in enumerate(states)]).reshape(-1)
        else:  # the heads of a (layer, sequence), or of every layer, share the scored areas by score
            layers_compete = len(layers) if allocate else 1
            head_units = adaptive_scored_units(scores, head_rows, parameters, units, layers_compete, windows)
            head_units = torch.where(over[:, None], head_units, units[:, None]).reshape(-1)  # others: uniform
            for number, state in enumerate(states):
                state.head_units = head_units.view(len(layers), batch, heads)[number]
        keep = select_keep_mask(scores.reshape(-1, 1, width), head_rows.reshape(-1, width), parameters, None,
                                head_units, None if windows is None else windows.per_head(heads))
        keep = torch.where(over[:, None, None], keep.view(-1, heads, width), head_rows)
    else:
        keep = select_keep_mask(scores, slot_rows, parameters, value_norms, units, windows)
        # Each sequence evicts on its own schedule (as it would alone); padding only makes the batch wider.
        keep = torch.where(over[:, None], keep, slot_rows)
    timings["selection"] = timings.get("selection", 0.0) + time.perf_counter() - started
    started = time.perf_counter()
    for number, ((module, layer), grid, layer_width) in enumerate(zip(layers, grids, widths)):
        layer_keep = keep[number * batch : (number + 1) * batch, ..., width - layer_width :]
        if grid is not None:  # a folded layer keeps the slots its heads' rows kept, and stays folded
            layer.keep_folded(layer_keep, *grid)
            continue
        if adaptive:  # heads of different lengths: the layer folds them into one row
            layer.keep_per_head(layer_keep)
            continue
        index, valid = left_aligned_indices(layer_keep)
        if index.dim() == 3:  # per head: the same count per head, so one layout for all of them
            valid = valid[:, 0]
        layer.keep(index, valid)  # filler slots (a row that keeps fewer than the widest) are dead
        if parameters.rerotate_keys:
            layer.rerotate_to_compact(module, inv_freq)
    timings["compaction"] = timings.get("compaction", 0.0) + time.perf_counter() - started
