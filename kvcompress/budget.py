"""Every budget computation in one place: a budget given as slots or as a fraction of the prompt, the slots a
layer keeps, its scored area per sequence, and how far past its budget a layer may grow before it evicts.

A layer keeps ``start_size + recent_size`` window slots plus its scored area: ``intermediate_size`` slots (in
eviction units of ``unit_size``: one slot, or one page with ``strategy="per_group"``), unless the layer or a
sequence has an area of its own (``LayerState.scored_units``): a fractional budget's per-prompt area, a share of a
budget the layers split by score (``budget_allocation="global"``), a step of PyramidKV's schedule. ``BudgetPlan``
answers these questions for a session; ``budget_slots`` serves the CLI, the runners and the benchmarks as well.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .parameters import KVCacheCompressionParameters
from .selection.allocation import pyramid_scored_units
from .state import LayerState


def check_budget(budget: Any) -> None:
    """A budget is a number of slots (an integer >= 1) or a fraction of the prompt in (0, 1)."""
    valid = (isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1) or (
        isinstance(budget, float) and 0.0 < budget < 1.0
    )
    if not valid:
        raise ValueError(
            f"budget must be a number of slots (an integer >= 1) or a fraction of the prompt in (0, 1), got {budget!r}"
        )


def budget_slots(budget: int | float, prompt_tokens: int) -> int:
    """Slots per layer for one prompt: an integer budget as is, a fraction of the prompt's tokens rounded."""
    check_budget(budget)
    if isinstance(budget, float):
        return max(1, round(budget * prompt_tokens))
    return budget


class BudgetPlan:
    """The session's budgets: the parameters' (replaced when a fractional budget meets a new prompt) and the
    per-sequence areas each compressed layer starts a sequence with."""

    def __init__(self, parameters: KVCacheCompressionParameters,
                 prompt_budget: Callable[[int], int] | None = None,
                 prompt_parameters: Callable[[int], KVCacheCompressionParameters] | None = None):
        """``prompt_budget`` / ``prompt_parameters`` (a fractional budget): each new sequence's slots follow its
        prompt's real tokens, and the parameters are those of the batch's longest prompt; a shorter prompt of a
        batch keeps the same windows and a smaller scored area."""
        self.parameters = parameters
        self._prompt_budget, self._prompt_parameters = prompt_budget, prompt_parameters
        # each compressed layer's scored area per sequence where it is not the parameters', and its smallest
        # value, read from the device once per sequence
        self.sequence_units: dict[int, tuple[torch.Tensor, int]] = {}
        # (B, T) real tokens of a whole prompt that arrives in several forwards (chunked prefill): its sequence's
        # budget follows all of them, not the first forward's
        self.whole_prompt: torch.Tensor | None = None

    # ------------------------------------------------------------------ a new sequence
    def start_sequence(self, prompt_valid: torch.Tensor, layers: list[int]) -> KVCacheCompressionParameters:
        """A prompt starts a sequence (B, q real tokens): the parameters it runs with, and every layer's initial
        per-sequence area (``sequence_units``)."""
        base = None
        if self.whole_prompt is not None:
            prompt_valid = self.whole_prompt.to(prompt_valid.device)
        if self._prompt_parameters is not None:
            lengths = prompt_valid.sum(-1).tolist()
            self.parameters = params = self._prompt_parameters(max(lengths))
            windows = params.start_size + params.recent_size
            areas = [max(0, self._prompt_budget(n) - windows) // params.unit_size for n in lengths]
            base = torch.tensor(areas, device=prompt_valid.device), min(areas)
        self.sequence_units = self._initial_units(base, prompt_valid.shape[0], prompt_valid.device, layers)
        return self.parameters

    def _initial_units(self, base: tuple[torch.Tensor, int] | None, batch: int, device: torch.device,
                       layers: list[int]) -> dict[int, tuple[torch.Tensor, int]]:
        """Each layer's area per sequence and its smallest value; ``base`` (a fractional budget's per-sequence
        areas (B,) and their minimum, known on the host) or the parameters' uniform area."""
        params = self.parameters
        if params.budget_allocation != "pyramid":
            return {} if base is None else dict.fromkeys(layers, base)
        areas = base[0] if base is not None else torch.full((batch,), self.uniform_units(), dtype=torch.long,
                                                             device=device)
        shares = pyramid_scored_units(areas, len(layers), params.pyramid_beta)
        fewest = shares.min(-1).values.tolist()
        return {index: (shares[number], fewest[number]) for number, index in enumerate(layers)}

    def start_layer(self, state: LayerState, index: int) -> None:
        """A layer's state starts a sequence with its initial area, where it has one of its own."""
        if index in self.sequence_units:
            units, fewest = self.sequence_units[index]
            state.set_scored_units(units.clone(), fewest)

    # ------------------------------------------------------------------ a layer's budget
    def uniform_units(self) -> int:
        """Units of the parameters' own scored area (every layer and sequence without an area of its own)."""
        return self.parameters.intermediate_size // self.parameters.unit_size

    def slots(self, scored_units: torch.Tensor | int) -> torch.Tensor | int:
        """Slots kept for a scored area of ``scored_units`` units: the windows plus the scored slots."""
        params = self.parameters
        return params.start_size + params.recent_size + scored_units * params.unit_size

    def scored_units(self, state: LayerState) -> torch.Tensor:
        """(B,) units of the layer's scored area: its own, else the parameters'."""
        if state.scored_units is not None:
            return state.scored_units
        return torch.full(state.slot_valid.shape[:1], self.uniform_units(), dtype=torch.long,
                          device=state.slot_valid.device)

    def fewest_slots(self, state: LayerState) -> int:
        """The fewest slots any sequence of the layer keeps, with no tensor work (every layer of every decode step
        asks): the smallest area is read once per assignment."""
        fewest = state.fewest_scored_units()
        return self.slots(self.uniform_units() if fewest is None else fewest)

    def over_budget(self, live: torch.Tensor, scored_units: torch.Tensor, slack: float) -> torch.Tensor:
        """(rows,) bool: the rows whose ``live`` slots exceed the budget of ``scored_units`` by more than ``slack``."""
        return live > self.slots(scored_units) + slack

    def selects(self, live: torch.Tensor, scored_units: torch.Tensor, slack: float) -> torch.Tensor:
        """(rows,) bool: the rows an eviction selects in: those over their budget, or every row with a
        ``score_threshold`` (slots below it leave whatever the budget)."""
        if self.parameters.score_threshold is not None:
            return torch.ones_like(live, dtype=torch.bool)
        return self.over_budget(live, scored_units, slack)

    def due(self, state: LayerState, total: int, slack: float) -> bool:
        """Whether a layer now holding ``total`` slots evicts: more than ``slack`` past its fewest budget, or with
        a ``score_threshold`` more than ``slack`` slots added since its last eviction (a prompt always is). A
        folded layer, whose heads hold the counts a selection gave them, evicts once more than ``slack`` slots
        per head joined since its last eviction (a prompt always does)."""
        if self.parameters.score_threshold is not None:
            return total > state.kept_length + slack
        if state.folded_heads:
            return total > state.kept_length + slack * state.folded_heads
        return total > self.fewest_slots(state) + slack

    def slack(self, length: int, evicting: bool) -> float:
        """How far past its budget a layer may grow before it evicts: 0 after a multi-token forward, the decode
        slack (per_token) after a decode step, never while eviction is paused (``generate`` after ``prefill``)."""
        params = self.parameters
        if not evicting or (length == 1 and not params.compress_during_decoding):
            return float("inf")
        if length == 1 and params.strategy == "per_token":
            return params.decode_slack
        return 0
