"""What a compressed cache layer remembers per slot (its eviction state).

Every per-slot tensor of a layer is indexed by physical cache slot, so one gather with the kept indices compacts
the cache and its bookkeeping together.

Each compressed layer owns its slot layout (``LayerState.slot_valid``): slots that hold no live token of a
sequence (left padding, or filler when a sequence keeps fewer tokens than the widest one in the batch) sit at the
left, exactly like left padding. With the same budget in every layer all layers share one layout, so one 2-D
attention mask describes them and transformers' own mask code stays correct after eviction; layers with budgets
of their own (``budget_allocation="global"``) each get their own mask from the session's attention function.
"""

from __future__ import annotations

import torch

from .ragged import folded_head_of_new, per_new_slot


def gather_slots(tensor: torch.Tensor, keep: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """Select slots ``keep`` along ``dim`` of a (B, ..., T, ...) tensor: (B, K) for every head alike, or
    (B, H_kv, K) per KV head (then the tensor is (B, H_kv, T) or (B, H_kv, T, d), the slots at dim 2).

    One sequence takes ``index_select`` (faster on CPU than ``gather`` with an expanded index); a batch, whose
    rows keep different slots, takes ``gather``.
    """
    if keep.dim() == 3:
        index = keep if tensor.dim() == 3 else keep.unsqueeze(-1).expand(*keep.shape, tensor.shape[-1])
        return tensor.gather(2, index)
    if keep.shape[0] == 1:
        return tensor.index_select(dim, keep[0])
    dim = dim % tensor.dim()
    shape = [1] * tensor.dim()
    shape[0], shape[dim] = keep.shape
    return tensor.gather(dim, keep.view(shape).expand(*tensor.shape[:dim], -1, *tensor.shape[dim + 1 :]))


def by_head(tensor: torch.Tensor) -> torch.Tensor:
    """A per-slot field as (B, H_kv, T) or (B, 1, T): per-head fields as they are, shared ones broadcastable."""
    return tensor if tensor.dim() == 3 else tensor.unsqueeze(1)


# Spare slots reserved past the current length, so that decode steps (and the few slots per_token decode lets the
# cache run over budget) append in place instead of reallocating: max(MIN_RESERVE, length * RESERVE_FRACTION).
MIN_RESERVE = 64
RESERVE_FRACTION = 0.25


class LayerState:
    """Accumulated importance of every slot of one layer.

    The five per-slot tensors are views of the first ``length`` slots of buffers with spare capacity:

    * ``head_scores`` (B, H_kv, T) float32: the scorer's combined scores per KV head (summed attention for H2O
      and SnapKV, the most attention received for KVzip, the newest observation for TOVA);
    * ``counts`` (B, T) float32: how many observed queries could see the slot (the norm_sum divisor);
    * ``rope_positions`` (B, T) int64: the position the cached key is currently rotated to;
    * ``true_positions`` (B, T) int64: the slot's position in the full sequence;
    * ``slot_valid`` (B, T) bool: the slot holds a live token of the sequence (the layer's layout);
    * ``value_norms`` (B, T) float32 or None: mean over heads of ||v W_o||_1 (CriticalKV);
    * ``slot_head`` (B, T) int64 or None: the KV head of each slot of a folded layer (``fold_heads``).

    With ``head_selection="per_head"`` every KV head keeps its own slots: ``counts`` and both positions are
    (B, H_kv, T), each head's slot t holding its own token. Every head of a sequence keeps the same number of
    slots, so the layout ``slot_valid`` stays (B, T), one for all heads, and one 2-D mask still describes it.

    After a head-wise selection (``budget_allocation="adaptive"`` or ``"global_adaptive"``: heads of different
    lengths) the layer folds its heads into one row (``kvcompress/ragged.py``): every field becomes (B, N) over
    the N kept (head, token) slots, ``head_scores`` (B, 1, N), and ``slot_head`` says whose each slot is; ``append``
    gives each new token one slot per head, and an eviction selects per head again (``ragged.head_grid``).

    ``scored_units`` (B,) int64, or None for the parameters' ``intermediate_size``, is the layer's own scored
    area per sequence in eviction units, set when layers compete for one budget (``budget_allocation="global"``).
    ``head_units`` (B, H_kv) int64, or None, is each KV head's scored area that a head-wise selection gave it at
    the last prompt: what a decode step's eviction keeps it to (``compress_during_decoding``).

    ``append`` combines a forward's scores in place (the spare slots are kept at zero), so a decode step neither
    reallocates nor copies the state; assigning an attribute replaces its buffer. ``statistics`` holds what a
    scorer keeps per sequence rather than per slot (tensors with the batch first, e.g. Expected Attention's query
    mean and covariance): eviction leaves it alone, beam search reorders it.
    """

    _FIELDS = ("head_scores", "counts", "rope_positions", "true_positions", "slot_valid", "value_norms", "slot_head")

    def __init__(self, head_scores, counts, rope_positions, true_positions, slot_valid, value_norms=None):
        self._length = counts.shape[-1]
        self._capacity = self._capacity_for(self._length)
        self._buffers: dict[str, torch.Tensor | None] = {}
        self.statistics: dict[str, torch.Tensor] = {}
        self.scored_units = None
        self.head_units: torch.Tensor | None = None
        self.folded_heads: int | None = None  # KV heads folded into one row (``fold_heads``), else None
        self.kept_length = 0  # slots the last eviction kept (a score threshold evicts again once it grew past)
        for name, tensor in zip(self._FIELDS, (head_scores, counts, rope_positions, true_positions, slot_valid,
                                               value_norms, None)):
            setattr(self, name, tensor)

    @property
    def length(self) -> int:
        return self._length

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def live(self) -> torch.Tensor:
        """(B,) int64: live slots per sequence."""
        return self.slot_valid.sum(-1)

    def __repr__(self) -> str:
        return f"LayerState(length={self._length}, capacity={self._capacity})"

    # ------------------------------------------------------------------ storage
    def _view(self, name: str) -> torch.Tensor | None:
        buffer = self._buffers[name]
        return None if buffer is None else buffer[..., : self._length]

    def _assign(self, name: str, tensor: torch.Tensor | None) -> None:
        if tensor is None:
            self._buffers[name] = None
            return
        if tensor.shape[-1] != self._length:
            raise ValueError(f"{name} covers {tensor.shape[-1]} slots, the layer state {self._length}")
        buffer = self._allocate_like(tensor, self._capacity)
        buffer[..., : self._length] = tensor
        self._buffers[name] = buffer

    @staticmethod
    def _capacity_for(length: int) -> int:
        return length + max(MIN_RESERVE, int(length * RESERVE_FRACTION))

    @staticmethod
    def _allocate_like(tensor: torch.Tensor, capacity: int) -> torch.Tensor:
        return torch.zeros(*tensor.shape[:-1], capacity, dtype=tensor.dtype, device=tensor.device)

    def _reserve(self, length: int) -> None:
        """Make every buffer hold at least ``length`` slots; the spare slots stay zero."""
        if length <= self._capacity:
            return
        self._capacity = self._capacity_for(length)
        for name, buffer in self._buffers.items():
            if buffer is not None:
                grown = self._allocate_like(buffer, self._capacity)
                grown[..., : self._length] = buffer[..., : self._length]
                self._buffers[name] = grown

    # ------------------------------------------------------------------ the protocol the compressor uses
    def append(
        self, step_head_scores, step_counts, rope_positions, true_positions, new_valid, value_norms=None,
        combine: str = "add",
    ) -> None:
        """Add one forward's observations: old slots combine with them, new slots are appended.

        ``step_head_scores`` (B, H_kv, T') and ``step_counts`` (B, T') cover the old slots and the new ones
        (T' = length + q), or the new slots only (B, H_kv, q) when ``combine="once"``; positions, validity and
        value norms (B, q) cover the new slots only. Scores and counts may be
        None when nothing reads them (no scored area, or a method that scores at eviction): the new slots then
        start at zero without any work. ``combine`` is the scorer's (``add``, ``max``, ``replace`` or ``once``).
        """
        if self.folded_heads is not None:  # one slot per head and token, token-major (ragged.fold_new_tokens)
            rope_positions, true_positions, new_valid = (per_new_slot(tensor, self.folded_heads)
                                                         for tensor in (rope_positions, true_positions, new_valid))
        old = self._length
        added = rope_positions.shape[-1]
        new = old + added
        self._reserve(new)
        buffers = self._buffers
        # narrow + copy_ rather than slice assignment: the same writes, without parsing an index in every layer of
        # every decode step
        if step_head_scores is not None and combine == "once":  # scores of the new slots only
            buffers["head_scores"].narrow(-1, old, added).copy_(step_head_scores)
        elif step_head_scores is not None:  # the slots past ``old`` are zero: this combines and appends at once
            _combine(buffers["head_scores"].narrow(-1, 0, new), step_head_scores, combine)
        if step_counts is not None:
            buffers["counts"].narrow(-1, 0, new).add_(_like(buffers["counts"], step_counts))
        buffers["rope_positions"].narrow(-1, old, added).copy_(_like(buffers["rope_positions"], rope_positions))
        buffers["true_positions"].narrow(-1, old, added).copy_(_like(buffers["true_positions"], true_positions))
        buffers["slot_valid"].narrow(-1, old, added).copy_(new_valid)
        if value_norms is not None:
            if buffers["value_norms"] is None:
                buffers["value_norms"] = self._allocate_like(value_norms, self._capacity)
            buffers["value_norms"].narrow(-1, old, added).copy_(value_norms)
        if self.folded_heads is not None:
            buffers["slot_head"].narrow(-1, old, added).copy_(folded_head_of_new(
                self.folded_heads, added // self.folded_heads, new_valid.shape[0], new_valid.device))
        self._length = new

    def merge(self, scores: torch.Tensor, combine: str) -> None:
        """Combine scores (B, H_kv, T) for the cached slots without appending any (a reconstruction pass)."""
        _combine(self._buffers["head_scores"][..., : self._length], scores[..., : self._length], combine)

    def reorder(self, rows: torch.Tensor) -> None:
        """Follow a batch reordering of the cache (beam search)."""
        for name in self._FIELDS:
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, tensor.index_select(0, rows.to(tensor.device)))
        for name, tensor in self.statistics.items():
            self.statistics[name] = tensor.index_select(0, rows.to(tensor.device))
        if self.scored_units is not None:
            self.scored_units = self.scored_units.index_select(0, rows.to(self.scored_units.device))
        if self.head_units is not None:
            self.head_units = self.head_units.index_select(0, rows.to(self.head_units.device))

    def gather(self, keep: torch.Tensor) -> None:
        """Keep only the slots ``keep``, in that order: (B, K), or (B, H_kv, K) per head (the caller then sets
        ``slot_valid``, which per-head selection keeps common to the heads)."""
        width = keep.shape[-1]
        self._capacity = self._capacity_for(width)
        for name, buffer in self._buffers.items():
            if buffer is None:
                continue
            kept = self._allocate_like(buffer, self._capacity)
            index = keep[:, 0] if keep.dim() == 3 and buffer.dim() == 2 else keep
            kept[..., :width] = gather_slots(buffer[..., : self._length], index, dim=-1)
            self._buffers[name] = kept
        self._length = self.kept_length = width

    def fold_heads(self, source: torch.Tensor, valid: torch.Tensor) -> None:
        """Fold a per-head state (B, H_kv, T) into one row: keep the flat head-major slots ``source`` (B, N) of
        (B, H_kv·T), ``valid`` (B, N) marking the live ones (``CompressedLayer.keep_per_head``)."""
        heads, total = self._buffers["rope_positions"].shape[1], self._length
        width = source.shape[-1]
        self._capacity = self._capacity_for(width)
        for name, buffer in self._buffers.items():
            if buffer is None:
                continue
            view = buffer[..., :total]
            folded = view.flatten(1).gather(1, source) if view.dim() == 3 else view.gather(1, source % total)
            kept = self._allocate_like(folded, self._capacity)
            kept[..., :width] = folded
            self._buffers[name] = kept.unsqueeze(1) if name == "head_scores" else kept
        self._length = self.kept_length = width
        self.slot_valid = valid
        self.slot_head = torch.div(source, total, rounding_mode="floor")
        self.folded_heads = heads

    @property
    def scored_units(self) -> torch.Tensor | None:
        return self._scored_units

    @scored_units.setter
    def scored_units(self, units: torch.Tensor | None) -> None:
        self.set_scored_units(units)

    def set_scored_units(self, units: torch.Tensor | None, fewest: int | None = None) -> None:
        """The layer's own scored area per sequence (B,), and its smallest value where the caller knows it."""
        self._scored_units = units
        self._fewest_units = fewest

    def fewest_scored_units(self) -> int | None:
        """The smallest scored area of any sequence (None: the parameters'), read from the device once per
        assignment rather than at every decode step of every layer (each read waits for an accelerator)."""
        if self._scored_units is not None and self._fewest_units is None:
            self._fewest_units = int(self._scored_units.min())
        return self._fewest_units

    @property
    def shares_layout(self) -> bool:
        """Whether the layer's slots form one (B, T) layout for all heads, as the decoder's 2-D mask describes
        (a folded layer's slots are per head)."""
        return self.folded_heads is None

    def forward_layout(self, new_valid: torch.Tensor) -> torch.Tensor:
        """The layer's slot layout in a forward whose tokens' validity is ``new_valid`` (B, q): its cached slots,
        then the new ones (a folded layer's: one per head and token, ``ragged.fold_new_tokens``' order)."""
        if self.folded_heads is not None:
            new_valid = per_new_slot(new_valid, self.folded_heads)
        return torch.cat([self.slot_valid, new_valid], dim=-1)

    def new_slots(self, tokens: int) -> int:
        """Slots a forward of ``tokens`` tokens appends (one per head and token in a folded layer)."""
        return tokens * (self.folded_heads or 1)

    @property
    def nbytes(self) -> int:
        """Bytes the state holds (its buffers, spare capacity included, and the scorer's statistics)."""
        tensors = [buffer for buffer in self._buffers.values() if buffer is not None]
        tensors += list(self.statistics.values())
        tensors += [units for units in (self._scored_units, self.head_units) if units is not None]
        return sum(tensor.nbytes for tensor in tensors)

    @property
    def per_head(self) -> bool:
        """Each KV head keeps its own slots (``head_selection="per_head"``)."""
        return self._buffers["rope_positions"].dim() == 3

    @classmethod
    def empty(cls, batch: int, kv_heads: int, device: torch.device, per_head: bool = False) -> "LayerState":
        slots = (batch, kv_heads, 0) if per_head else (batch, 0)
        return cls(
            head_scores=torch.zeros(batch, kv_heads, 0, device=device),
            counts=torch.zeros(slots, device=device),
            rope_positions=torch.zeros(slots, dtype=torch.long, device=device),
            true_positions=torch.zeros(slots, dtype=torch.long, device=device),
            slot_valid=torch.zeros(batch, 0, dtype=torch.bool, device=device),
        )


def _like(buffer: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """A shared per-slot value (B, T) for a per-head buffer (B, H_kv, T): the same for every head."""
    return tensor.unsqueeze(-2) if buffer.dim() == 3 and tensor.dim() == 2 else tensor


def _combine(target: torch.Tensor, scores: torch.Tensor, combine: str) -> None:
    if combine == "add":
        target += scores
    elif combine == "max":
        target.copy_(torch.maximum(target, scores))
    elif combine == "replace":
        target.copy_(scores)
    else:
        raise ValueError(f"combine must be 'add', 'max' or 'replace', got {combine!r}")


def _field(name: str) -> property:
    return property(lambda self: self._view(name), lambda self, tensor: self._assign(name, tensor))


for _name in LayerState._FIELDS:
    setattr(LayerState, _name, _field(_name))
del _name
