"""Every budget computation in one place: a budget given as slots or as a fraction of what a sequence has seen, the
slots a layer keeps, its windows and scored area per sequence, and how far past its budget a layer may grow before
it evicts.

A layer keeps ``start_size + recent_size`` window slots plus its scored area: ``intermediate_size`` slots (in
eviction units of ``unit_size``: one slot, or one page with ``strategy="per_group"``), unless the layer or a
sequence has an area of its own (``CompressedLayer.scored_units``): a fractional budget's per-sequence area, a share of
a budget the layers split by score (``budget_allocation="global"``), a step of PyramidKV's schedule. A fractional
budget also gives each sequence its own windows: every sequence of a batch keeps what it would keep alone.
``BudgetPlan`` answers these questions for a session; ``budget_slots`` serves the CLI, the runners and the
benchmarks as well.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

import torch

from .parameters import KVCacheCompressionParameters
from .selection.allocation import pyramid_scored_units
from .selection.windows import SequenceWindows

if TYPE_CHECKING:
    from .layer import CompressedLayer

BUDGET_FORMS = "a number of slots (an integer >= 1, e.g. 512) or a fraction of the sequence in (0, 1] (0.2 or '20%')"


def parse_budget(budget: Any) -> int | float:
    """A budget in any of the forms the library and the command line take: an integer number of slots (``512`` or
    ``"512"``), or a fraction of the sequence in (0, 1] (``0.2``, ``"0.2"`` or ``"20%"``; ``1.0`` keeps everything a
    prompt brings). Raises ValueError naming ``budget`` and the forms otherwise."""
    value = budget
    if isinstance(budget, str):
        text = budget.strip()
        try:
            if text.endswith("%"):
                value = float(text[:-1]) / 100
            elif text.isdigit():
                value = int(text)
            else:
                value = float(text)
        except ValueError:
            value = None
    valid = (isinstance(value, int) and not isinstance(value, bool) and value >= 1) or (
        isinstance(value, float) and 0.0 < value <= 1.0
    )
    if not valid:
        raise ValueError(f"budget must be {BUDGET_FORMS}, got {budget!r}")
    return value


def budget_slots(budget: int | float | str, tokens: int) -> int:
    """Slots per layer for a sequence of ``tokens`` tokens: an integer budget as is, a fraction of the tokens
    rounded (at least one slot)."""
    budget = parse_budget(budget)
    if isinstance(budget, float):
        return max(1, round(budget * tokens))
    return budget


@dataclasses.dataclass(frozen=True)
class FractionalBudget:
    """A budget that is a ``fraction`` of everything a sequence has seen: ``parameters_for(slots)`` gives the
    method's parameters at a number of slots (its preset), and ``minimum`` is the fewest slots they accept (a
    preset's windows need room), which a short sequence is raised to."""

    fraction: float
    parameters_for: Callable[[int], KVCacheCompressionParameters]
    minimum: int = 1

    @classmethod
    def of(cls, fraction: float, parameters_for: Callable[[int], KVCacheCompressionParameters]) -> "FractionalBudget":
        """The budget of ``fraction`` with the fewest slots ``parameters_for`` accepts found once (by bisection:
        a preset that accepts a budget accepts every larger one); a nominal sequence's parameters are built first,
        so a bad method or override fails here with its own message."""
        low, high = 1, 1024
        parameters_for(high)
        while low < high:
            middle = (low + high) // 2
            try:
                parameters_for(middle)
                high = middle
            except ValueError:
                low = middle + 1
        return cls(fraction, parameters_for, low)

    def slots(self, tokens: int) -> int:
        return max(self.minimum, budget_slots(self.fraction, tokens))


class BudgetPlan:
    """The session's budgets: the parameters in force (a fractional budget's follow each sequence's length), and the
    per-sequence windows and areas each compressed layer works with."""

    def __init__(self, parameters: KVCacheCompressionParameters, fraction: FractionalBudget | None = None):
        """``fraction`` (``kvcompress.compress`` with a fractional budget): each sequence keeps that fraction of
        everything it has seen, resolved again at every prompt forward (a chat's turn) and, where budgets are fixed
        before any score, as decoding goes on (``follow``); the parameters are those of the batch's longest
        sequence, and each sequence gets the windows and scored area of its own length."""
        self.parameters = parameters
        self.fraction = fraction
        # each compressed layer's scored area per sequence where it is not the parameters', and its smallest
        # value, read from the device once per resolution
        self.sequence_units: dict[int, tuple[torch.Tensor, int]] = {}
        self.windows: SequenceWindows | None = None  # each sequence's windows, where a fraction sizes them
        # (B, T) real tokens of a whole prompt that arrives in several forwards (chunked prefill): its sequence's
        # budget follows all of them, not the first forward's
        self.whole_prompt: torch.Tensor | None = None
        # a fraction's last resolution: real tokens seen per sequence, the cache length it was made at (a decode step
        # adds one token to every sequence), and the slots it gave each sequence
        self._resolved: tuple[list[int], int, list[int]] | None = None

    # ------------------------------------------------------------------ a sequence and what it has seen
    def start_sequence(self, prompt_valid: torch.Tensor, layers: list[int]) -> None:
        """A prompt starts a sequence (B, q real tokens): the parameters it runs with (a fraction's), and every
        layer's initial per-sequence area (``sequence_units``)."""
        if self.whole_prompt is not None:
            prompt_valid = self.whole_prompt.to(prompt_valid.device)
        self._resolved = None
        base = None
        if self.fraction is not None:
            base = self._resolve(prompt_valid.sum(-1).tolist(), prompt_valid.shape[-1], prompt_valid.device)
        self.sequence_units = self._initial_units(base, prompt_valid.shape[0], prompt_valid.device, layers)

    def follow(self, mask: torch.Tensor | None, batch: int, length: int, seen: int,
               layers: dict[int, CompressedLayer], device: torch.device) -> None:
        """A fractional budget follows a sequence that goes on (``length`` new tokens after a cache of ``seen``,
        padding included; ``mask`` the forward's 2-D attention mask, or None): resolved again on the real tokens
        seen so far at every prompt forward (a chat's next turn; the chunks of one prompt keep the whole prompt's
        budget) and, with ``compress_during_decoding``, at decode steps.

        Every layer's area then grows by the growth of the sequence's area: the shares a scored allocation gave
        the layers (``"global"``) or their heads (``head_units``) grow alike, so the layers hold the new total
        together and a prompt's allocation shares it out again by score; PyramidKV's schedule is laid anew."""
        if self.fraction is None or self.whole_prompt is not None:
            return
        if length == 1:
            if self._resolved is None or not self.parameters.compress_during_decoding:
                return
            tokens, at, _ = self._resolved
            tokens = [count + seen + 1 - at for count in tokens]
        else:
            tokens = mask.sum(-1).tolist() if mask is not None else [seen + length] * batch
        previous = self.sequence_units
        base = self._resolve(tokens, seen + length, device)
        if base is None:
            return
        self.sequence_units = self._initial_units(base, batch, device, list(layers))
        for index, layer in layers.items():
            if not layer.started:
                continue
            if self.parameters.budget_allocation == "pyramid" or layer.scored_units is None or index not in previous:
                self.start_layer(layer, index)
                continue
            growth = base[0] - previous[index][0]
            layer.set_scored_units((layer.scored_units + growth).clamp(min=0))
            if layer.head_units is not None:
                layer.head_units = (layer.head_units + growth[:, None]).clamp(min=0)

    def _resolve(self, tokens: list[int], cache_length: int,
                 device: torch.device) -> tuple[torch.Tensor, int] | None:
        """The fraction over each sequence's ``tokens``: the parameters (the longest sequence's), every sequence's
        windows, and its scored area (B,) with their minimum; None where no sequence's slots changed."""
        slots = [self.fraction.slots(count) for count in tokens]
        unchanged = self._resolved is not None and self._resolved[2] == slots
        self._resolved = tokens, cache_length, slots
        if unchanged:
            return None
        by_slots = {count: self.fraction.parameters_for(count) for count in set(slots)}
        per_sequence = [by_slots[count] for count in slots]
        self.parameters = by_slots[max(slots)]
        windows = [(params.start_size, params.recent_size) for params in per_sequence]
        start, recent = torch.tensor(windows, dtype=torch.long, device=device).unbind(-1)
        self.windows = SequenceWindows(start, recent, min(first + last for first, last in windows))
        areas = [params.intermediate_size // params.unit_size for params in per_sequence]
        return torch.tensor(areas, device=device), min(areas)

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

    def start_layer(self, layer: CompressedLayer, index: int) -> None:
        """A layer starting a sequence takes its area for the sequence, where it has one of its own."""
        if index in self.sequence_units:
            units, fewest = self.sequence_units[index]
            layer.set_scored_units(units.clone(), fewest)

    # ------------------------------------------------------------------ what a stored context holds of the plan
    def saved(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The sequence the plan follows as tensors and JSON facts (the parameters in force, each layer's area,
        the windows, a fraction's last resolution): what ``restore`` continues from, as if never stored."""
        tensors = {f"sequence_units.{index}": units for index, (units, _) in self.sequence_units.items()}
        facts: dict[str, Any] = {
            "parameters": self.parameters.to_dict(),
            "fewest_units": {str(index): fewest for index, (_, fewest) in self.sequence_units.items()},
            "resolved": None if self._resolved is None else list(self._resolved),
            "windows_fewest": None if self.windows is None else self.windows.fewest,
        }
        if self.windows is not None:
            tensors.update({"windows.start": self.windows.start, "windows.recent": self.windows.recent})
        return tensors, facts

    def restore(self, tensors: dict[str, torch.Tensor], facts: dict[str, Any]) -> None:
        """Continue the sequence ``saved`` described (tensors on the plan's device)."""
        self.parameters = KVCacheCompressionParameters.from_dict(facts["parameters"])
        self.sequence_units = {int(index): (tensors[f"sequence_units.{index}"], fewest)
                               for index, fewest in facts["fewest_units"].items()}
        self._resolved = None if facts["resolved"] is None else tuple(facts["resolved"])
        self.windows = None
        if facts["windows_fewest"] is not None:
            self.windows = SequenceWindows(tensors["windows.start"], tensors["windows.recent"],
                                           facts["windows_fewest"])

    # ------------------------------------------------------------------ a layer's budget
    def uniform_units(self) -> int:
        """Units of the parameters' own scored area (every layer and sequence without an area of its own)."""
        return self.parameters.intermediate_size // self.parameters.unit_size

    def window_rows(self, rows: int) -> SequenceWindows | None:
        """The windows of ``rows`` rows stacked layer-major, where sequences have windows of their own; else None
        (the parameters')."""
        return None if self.windows is None else self.windows.rows(rows)

    def slots(self, scored_units: torch.Tensor | int) -> torch.Tensor | int:
        """Slots kept for a scored area of ``scored_units`` units (one per row stacked layer-major, or the fewest of
        a layer): the windows plus the scored slots."""
        params = self.parameters
        scored = scored_units * params.unit_size
        if self.windows is None:
            return params.start_size + params.recent_size + scored
        if isinstance(scored_units, int):
            return self.windows.fewest + scored
        windows = self.windows.rows(scored_units.shape[0])
        return windows.start + windows.recent + scored

    def scored_units(self, layer: CompressedLayer) -> torch.Tensor:
        """(B,) units of the layer's scored area: its own, else the parameters'."""
        if layer.scored_units is not None:
            return layer.scored_units
        return torch.full(layer.slot_valid.shape[:1], self.uniform_units(), dtype=torch.long,
                          device=layer.slot_valid.device)

    def fewest_slots(self, layer: CompressedLayer) -> int:
        """The fewest slots any sequence of the layer keeps, with no tensor work (every layer of every decode step
        asks): the smallest area is read once per assignment."""
        fewest = layer.fewest_scored_units()
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

    def due(self, layer: CompressedLayer, total: int, slack: float) -> bool:
        """Whether a layer now holding ``total`` slots evicts: more than ``slack`` past its fewest budget, or with
        a ``score_threshold`` more than ``slack`` slots added since its last eviction (a prompt always is). A
        folded layer, whose heads hold the counts a selection gave them, evicts once more than ``slack`` slots
        per head joined since its last eviction (a prompt always does)."""
        if self.parameters.score_threshold is not None:
            return total > layer.kept_length + slack
        if layer.folded_heads:
            return total > layer.kept_length + slack * layer.folded_heads
        return total > self.fewest_slots(layer) + slack

    def slack(self, length: int, evicting: bool) -> float:
        """How far past its budget a layer may grow before it evicts: 0 after a multi-token forward, the decode
        slack (per_token) after a decode step, never while eviction is paused (``generate`` after ``prefill``)."""
        params = self.parameters
        if not evicting or (length == 1 and not params.compress_during_decoding):
            return float("inf")
        if length == 1 and params.strategy == "per_token":
            return params.decode_slack
        return 0
