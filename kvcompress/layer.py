"""The compressed cache layer: one object that owns everything a compressed full-attention layer keeps.

A ``CompressedLayer`` stores a chosen subset of the tokens it has seen, in their original order, and beside its keys
and values every slot's eviction state, indexed by physical slot like them, so that one gather with the kept
indices compacts the cache and its bookkeeping together (as transformers' own cache layers keep their per-slot
tensors). Like transformers' ``DynamicSlidingWindowLayer``, whose window also holds fewer tokens than were seen, it
reports the true number of tokens seen (``get_seq_length``), so ``generate`` slices a resumed prompt and numbers
positions exactly as for an uncompressed cache, and it answers the mask sizes of its physical layout:
``kv_offset`` maps its slots onto the end of the sequence, so the newest slots (this forward's tokens) line up with
their queries and every kept slot, being older, stays visible.

Each layer owns its slot layout (``slot_valid``): slots that hold no live token of a sequence (left padding, or
filler when a sequence keeps fewer tokens than the widest one in the batch) sit at the left, exactly like left
padding. With the same budget in every layer all layers share one layout, so one 2-D attention mask describes them
and transformers' own mask code stays correct after eviction (the session writes it, ``masks.py``); layers with
budgets of their own (``budget_allocation="global"``) each get their own mask from the session's attention
function. Being the one owner, the layer is also what a stored context saves and loads (``saved`` /
``from_saved``): what it means and what is written cannot drift apart.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from .quantization import CodedSlots, PackedSlots, QuantizedKV
from .ragged import fold_kept, fold_new_tokens, folded_attention, folded_head_of_new, per_new_slot
from .rerotation import rotate_keys
from .selection.windows import left_aligned_indices
from .slots import capacity_for, combine_scores, gather_slots, zeros_like_with


class CompressedLayer(DynamicLayer):
    """A full-attention cache layer that keeps a subset of the tokens seen, and owns their eviction state.

    Beside ``keys`` and ``values`` (B, H_kv, T, d), the per-slot fields are views of the first ``tracked_slots``
    slots of buffers with spare capacity (so a decode step appends in place):

    * ``head_scores`` (B, H_kv, T) float32: the scorer's combined scores per KV head (summed attention for H2O
      and SnapKV, the most attention received for KVzip, the newest observation for TOVA);
    * ``counts`` (B, T) float32: how many observed queries could see the slot (the norm_sum divisor);
    * ``rope_positions`` (B, T) int64: the position the cached key is currently rotated to;
    * ``true_positions`` (B, T) int64: the slot's position in the full sequence;
    * ``slot_valid`` (B, T) bool: the slot holds a live token of the sequence (the layer's layout);
    * ``value_norms`` (B, T) float32 or None: mean over heads of ||v W_o||_1 (CriticalKV);
    * ``slot_head`` (B, T) int64 or None: the KV head of each slot of a folded layer (``keep_per_head``).

    With ``head_selection="per_head"`` every KV head keeps its own slots: ``counts`` and both positions are
    (B, H_kv, T), each head's slot t holding its own token. Every head of a sequence keeps the same number of
    slots, so the layout ``slot_valid`` stays (B, T), one for all heads, and one 2-D mask still describes it.

    After a head-wise selection (``budget_allocation="adaptive"`` or ``"global_adaptive"``: heads of different
    lengths) the layer folds its heads into one row (``kvcompress/ragged.py``): keys, values and every field cover
    the N kept (head, token) slots, ``head_scores`` (B, 1, N), and ``slot_head`` says whose each slot is; each new
    token gets one slot per head, and an eviction selects per head again (``ragged.head_grid``).

    ``scored_units`` (B,) int64, or None for the parameters' ``intermediate_size``, is the layer's own scored
    area per sequence in eviction units, set when layers compete for one budget (``budget_allocation="global"``).
    ``head_units`` (B, H_kv) int64, or None, is each KV head's scored area that a head-wise selection gave it at
    the last prompt: what a decode step's eviction keeps it to (``compress_during_decoding``). ``statistics``
    holds what a scorer keeps per sequence rather than per slot (tensors with the batch first, e.g. Expected
    Attention's query mean and covariance): eviction leaves it alone, beam search reorders it.
    """

    is_croppable = False
    SLOT_FIELDS = ("head_scores", "counts", "rope_positions", "true_positions", "slot_valid", "value_norms",
                   "slot_head")

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.cumulative_length = 0  # tokens seen, padding included: the length of generate's 2-D mask
        # with ``kv_bits`` below 16: every slot's codes; ``keys`` / ``values`` then hold copies of the newest only
        self.quantized: QuantizedKV | None = None
        # set by a session for its forwards, whose attention reads the codes (``coded_slots``): ``update`` then
        # returns only the slots held in full precision; any other caller gets every slot, dequantized
        self.attention_reads_codes = False
        self._clear_slots()

    def _clear_slots(self) -> None:
        self._buffers: dict[str, torch.Tensor | None] = {}  # empty until the layer's first forward under a session
        self._tracked = 0
        self._capacity = 0
        self.statistics: dict[str, torch.Tensor] = {}
        self._scored_units: torch.Tensor | None = None
        self._fewest_units: int | None = None
        self.head_units: torch.Tensor | None = None
        self.folded_heads: int | None = None  # KV heads folded into one row (``keep_per_head``), else None
        self.kept_length = 0  # slots the last eviction kept (a score threshold evicts again once it grew past)

    def start_slots(self, batch: int, kv_heads: int, device: torch.device, per_head: bool = False) -> None:
        """Start tracking slots (a sequence's first forward under a session), each head its own with ``per_head``."""
        self._clear_slots()
        slots = (batch, kv_heads, 0) if per_head else (batch, 0)
        fields = (torch.zeros(batch, kv_heads, 0, device=device), torch.zeros(slots, device=device),
                  torch.zeros(slots, dtype=torch.long, device=device), torch.zeros(slots, dtype=torch.long,
                                                                                   device=device),
                  torch.zeros(batch, 0, dtype=torch.bool, device=device), None, None)
        self._capacity = capacity_for(0)
        self._buffers = {name: None if tensor is None else zeros_like_with(tensor, self._capacity)
                         for name, tensor in zip(self.SLOT_FIELDS, fields)}

    @property
    def started(self) -> bool:
        """Whether the layer tracks its slots (it ran a forward under a session since it was last reset)."""
        return bool(self._buffers)

    @property
    def tracked_slots(self) -> int:
        """Slots the per-slot fields cover (the cached slots, before a forward appends its own)."""
        return self._tracked

    @property
    def physical_length(self) -> int:
        if self.quantized is not None:
            return self.quantized.slots
        return 0 if self.keys is None else self.keys.shape[-2]

    def start_quantization(self, bits: int, key_group_size: int, value_group_size: int, residual: int) -> None:
        """Hold the slots as ``bits``-bit codes from now on (``kv_bits``), the ones held so far included (the
        first forward's, from their own full-precision values), with copies of the newest ``residual``."""
        if bits == 16 or self.quantized is not None:
            return
        self.quantized = QuantizedKV(bits, key_group_size, value_group_size, residual)
        self.quantized.append(self.keys, self.values)

    def full_keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot's keys and values in full precision (dequantized where the layer holds codes)."""
        if self.quantized is None:
            return self.keys, self.values
        return self.quantized.read(self.keys, self.values)

    def coded_slots(self, keys: torch.Tensor, values: torch.Tensor) -> CodedSlots | None:
        """The slots before ``keys`` / ``values`` (what ``update`` returned) that only codes hold, as attention
        reads them; None where those hold every slot."""
        return None if self.quantized is None else self.quantized.coded(keys, values)

    @property
    def live(self) -> torch.Tensor:
        """(B,) int64: live slots per sequence."""
        return self.slot_valid.sum(-1)

    @property
    def per_head(self) -> bool:
        """Each KV head keeps its own slots (``head_selection="per_head"``)."""
        return self._buffers["rope_positions"].dim() == 3

    @property
    def shares_layout(self) -> bool:
        """Whether the layer's slots form one (B, T) layout for all heads, as the decoder's 2-D mask describes
        (a folded layer's slots are per head)."""
        return self.folded_heads is None

    # ------------------------------------------------------------------ transformers' cache layer API
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        tokens = key_states.shape[-2]
        if self.folded_heads is not None:
            key_states, value_states = fold_new_tokens(key_states), fold_new_tokens(value_states)
        if self.quantized is not None:
            self.quantized.append(key_states, value_states)
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        self.cumulative_length += tokens
        if self.quantized is None:
            return keys, values
        if not self.attention_reads_codes:
            keys, values = self.quantized.read(keys, values)
        excess = self.keys.shape[-2] - self.quantized.residual
        if tokens == 1 and excess > 0:  # a decode step: slots older than the residual keep their codes only (a
            # prompt stays in full precision until its eviction, which its scores and reconstruction passes decide)
            self.keys, self.values = (tensor[..., excess:, :].contiguous() for tensor in (self.keys, self.values))
        return keys, values

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset): the physical slots plus the new tokens, mapped onto the sequence's end."""
        physical = self.physical_length
        if self.folded_heads is not None:  # the session attends itself and ignores this mask (ragged.py)
            return physical + query_length, 0
        return physical + query_length, self.cumulative_length - physical

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "kvcompress: a compressed cache cannot be cropped (assisted / speculative decoding and cache cropping "
            "assume every token is still cached)"
        )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.started:
            rows = torch.arange(self.slot_valid.shape[0], device=self.slot_valid.device)
            self._select_rows(rows.repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._select_rows(torch.as_tensor(indices))

    def reset(self) -> None:
        super().reset()
        self.quantized = None
        self._clear_slots()

    @property
    def bytes_per_token(self) -> int:
        """Key and value bytes one token takes in this layer uncompressed (every head's slot of it, folded or not,
        in the model's dtype)."""
        per_slot = sum(tensor.shape[0] * tensor.shape[1] * tensor.shape[-1] * tensor.element_size()
                       for tensor in (self.keys, self.values))
        return per_slot * (self.folded_heads or 1)

    @property
    def kv_nbytes(self) -> int:
        """Bytes the layer's keys and values take: codes, scales and full-precision copies where quantized."""
        held = self.keys.nbytes + self.values.nbytes
        return held + (self.quantized.nbytes if self.quantized is not None else 0)

    @property
    def state_nbytes(self) -> int:
        """Bytes of the eviction state beside the keys and values (buffers, spare capacity included, and the
        scorer's statistics)."""
        tensors = [buffer for buffer in self._buffers.values() if buffer is not None]
        tensors += list(self.statistics.values())
        tensors += [units for units in (self._scored_units, self.head_units) if units is not None]
        return sum(tensor.nbytes for tensor in tensors)

    # ------------------------------------------------------------------ a forward's scores
    def append_slots(
        self, step_head_scores, step_counts, rope_positions, true_positions, new_valid, value_norms=None,
        combine: str = "add",
    ) -> None:
        """Add one forward's observations: old slots combine with them, new slots are appended.

        ``step_head_scores`` (B, H_kv, T') and ``step_counts`` (B, T') cover the old slots and the new ones
        (T' = tracked + q), or the new slots only (B, H_kv, q) when ``combine="once"``; positions, validity and
        value norms (B, q) cover the new slots only. Scores and counts may be None when nothing reads them (no
        scored area, or a method that scores at eviction): the new slots then start at zero without any work.
        ``combine`` is the scorer's (``add``, ``max``, ``replace`` or ``once``).
        """
        if self.folded_heads is not None:  # one slot per head and token, token-major (ragged.fold_new_tokens)
            rope_positions, true_positions, new_valid = (per_new_slot(tensor, self.folded_heads)
                                                         for tensor in (rope_positions, true_positions, new_valid))
        old = self._tracked
        added = rope_positions.shape[-1]
        new = old + added
        self._reserve(new)
        buffers = self._buffers
        # narrow + copy_ rather than slice assignment: the same writes, without parsing an index in every layer of
        # every decode step
        if step_head_scores is not None and combine == "once":  # scores of the new slots only
            buffers["head_scores"].narrow(-1, old, added).copy_(step_head_scores)
        elif step_head_scores is not None:  # the slots past ``old`` are zero: this combines and appends at once
            combine_scores(buffers["head_scores"].narrow(-1, 0, new), step_head_scores, combine)
        if step_counts is not None:
            buffers["counts"].narrow(-1, 0, new).add_(_like(buffers["counts"], step_counts))
        buffers["rope_positions"].narrow(-1, old, added).copy_(_like(buffers["rope_positions"], rope_positions))
        buffers["true_positions"].narrow(-1, old, added).copy_(_like(buffers["true_positions"], true_positions))
        buffers["slot_valid"].narrow(-1, old, added).copy_(new_valid)
        if value_norms is not None:
            if buffers["value_norms"] is None:
                buffers["value_norms"] = zeros_like_with(value_norms, self._capacity)
            buffers["value_norms"].narrow(-1, old, added).copy_(value_norms)
        if self.folded_heads is not None:
            buffers["slot_head"].narrow(-1, old, added).copy_(folded_head_of_new(
                self.folded_heads, added // self.folded_heads, new_valid.shape[0], new_valid.device))
        self._tracked = new

    def merge_scores(self, scores: torch.Tensor, combine: str) -> None:
        """Combine scores (B, H_kv, T) for the cached slots without appending any (a reconstruction pass)."""
        combine_scores(self._buffers["head_scores"][..., : self._tracked], scores[..., : self._tracked], combine)

    def forward_layout(self, new_valid: torch.Tensor) -> torch.Tensor:
        """The layer's slot layout in a forward whose tokens' validity is ``new_valid`` (B, q): its cached slots,
        then the new ones (a folded layer's: one per head and token, ``ragged.fold_new_tokens``' order)."""
        if self.folded_heads is not None:
            new_valid = per_new_slot(new_valid, self.folded_heads)
        return torch.cat([self.slot_valid, new_valid], dim=-1)

    def new_slots(self, tokens: int) -> int:
        """Slots a forward of ``tokens`` tokens appends (one per head and token in a folded layer)."""
        return tokens * (self.folded_heads or 1)

    def own_attention(self, query, key, value, layout: torch.Tensor, scaling: float, softcap: float | None,
                      observed: torch.Tensor | None = None, all_live: bool | None = None,
                      coded: CodedSlots | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The attention output of a layer whose layout the model's attention cannot take (a folded one:
        ``ragged.folded_attention`` over its per-head slots, ``layout`` its slots' validity this forward, and
        ``all_live`` whether the caller knows them all live, ``coded`` the oldest slots only codes hold), with the
        most attention the ``observed`` queries give each slot (B, 1, M) where asked; None for any other layer (the
        scorer's pass or the model's own function computes it)."""
        if self.folded_heads is None:
            return None
        batch, _, length, _ = query.shape
        heads = torch.cat([self.slot_head, folded_head_of_new(self.folded_heads, length, batch, query.device)], dim=-1)
        return folded_attention(query, key, value, layout, heads, self.folded_heads, scaling, softcap, observed,
                                all_live, coded)

    # ------------------------------------------------------------------ the layer's budget
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

    # ------------------------------------------------------------------ eviction: keys, values and state at once
    def keep(self, index: torch.Tensor, valid: torch.Tensor) -> None:
        """Keep only the slots ``index`` (B, K), or (B, H_kv, K) per head, in that order; ``valid`` (B, K) marks
        which hold live tokens (per-head selection keeps one layout for the heads)."""
        if self.quantized is not None:
            first = self.quantized.slots - self.keys.shape[-2]  # the first slot with a full-precision copy
            self.keys, self.values = self.quantized.keep(gather_slots, index, (index - first).clamp(min=0),
                                                         index >= first, self.keys, self.values)
        else:
            self.keys = gather_slots(self.keys, index)
            self.values = gather_slots(self.values, index)
        width = index.shape[-1]
        self._capacity = capacity_for(width)
        for name, buffer in self._buffers.items():
            if buffer is None:
                continue
            kept = zeros_like_with(buffer, self._capacity)
            rows = index[:, 0] if index.dim() == 3 and buffer.dim() == 2 else index
            kept[..., :width] = gather_slots(buffer[..., : self._tracked], rows, dim=-1)
            self._buffers[name] = kept
        self._tracked = self.kept_length = width
        self.slot_valid = valid

    def rerotate_to_compact(self, module, inv_freq: torch.Tensor) -> None:
        """Rotate the live keys to compact positions 0, 1, ... in slot order (``rerotate_keys``), after ``keep``:
        the keys and their recorded RoPE positions change together."""
        valid = self.slot_valid
        kept, compact = valid, (valid.long().cumsum(-1) - 1).clamp(min=0)
        if self.per_head:  # (B, 1, K) against each head's own positions
            kept, compact = kept[:, None], compact[:, None]
        delta = torch.where(kept, compact - self.rope_positions, 0)
        self.keys = rotate_keys(module, self.keys, delta, inv_freq)
        self.rope_positions = torch.where(kept, compact, self.rope_positions)

    def keep_per_head(self, keep: torch.Tensor) -> None:
        """Keep each KV head's own slots ``keep`` (B, H_kv, T) bool, whatever their count per head: the layer folds
        its heads into one row that holds exactly the kept (head, token) slots (``ragged.py``)."""
        source, valid = left_aligned_indices(keep.flatten(1))
        heads, total = self._buffers["rope_positions"].shape[1], self._tracked
        if self.quantized is not None:
            copies = self.keys.shape[-2]
            first, token = total - copies, source % total
            self.keys, self.values = self.quantized.keep(
                fold_kept, source, source // total * copies + (token - first).clamp(min=0), token >= first,
                self.keys, self.values)
        else:
            self.keys = fold_kept(self.keys, source)
            self.values = fold_kept(self.values, source)
        width = source.shape[-1]
        self._capacity = capacity_for(width)
        for name, buffer in self._buffers.items():
            if buffer is None:
                continue
            view = buffer[..., :total]
            folded = view.flatten(1).gather(1, source) if view.dim() == 3 else view.gather(1, source % total)
            kept = zeros_like_with(folded, self._capacity)
            kept[..., :width] = folded
            self._buffers[name] = kept.unsqueeze(1) if name == "head_scores" else kept
        self._tracked = self.kept_length = width
        self.slot_valid = valid
        self.slot_head = torch.div(source, total, rounding_mode="floor")
        self.folded_heads = heads

    def keep_folded(self, keep: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> None:
        """Keep the slots of a folded layer that its heads' rows (``ragged.head_grid``'s ``index`` and ``valid``,
        (B, H_kv, W)) kept (``keep``, same shape), in slot order: the layer stays folded."""
        kept = torch.zeros_like(self.slot_valid, dtype=torch.long)
        kept.scatter_add_(1, index.flatten(1), (keep & valid).flatten(1).long())  # dead cells repeat a slot
        self.keep(*left_aligned_indices(kept > 0))

    def drop_newest(self, tokens: int) -> None:
        """Forget the last ``tokens`` tokens' slots (one per head in a folded layer), as if never seen (a
        context-reconstruction pass's own tokens, which the per-slot fields never tracked)."""
        dropped = self.new_slots(tokens)
        self.keys, self.values = (tensor[..., : tensor.shape[-2] - dropped, :].contiguous()
                                  for tensor in (self.keys, self.values))
        if self.quantized is not None:
            self.quantized.map(lambda tensor: tensor[..., : tensor.shape[-2] - dropped, :])
        self.cumulative_length -= tokens

    # ------------------------------------------------------------------ what a stored context holds of the layer
    def saved(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The layer as tensors (keys, values, the per-slot fields without spare capacity, the per-sequence ones)
        and the facts beside them (JSON): what ``from_saved`` rebuilds the same layer from."""
        tensors = {"keys": self.keys, "values": self.values}
        if self.started:
            tensors.update({name: getattr(self, name) for name in self.SLOT_FIELDS if getattr(self, name) is not None})
            tensors.update({f"statistics.{name}": tensor for name, tensor in self.statistics.items()})
            tensors.update({name: tensor for name, tensor in (("scored_units", self._scored_units),
                                                                ("head_units", self.head_units)) if tensor is not None})
        quantized = self.quantized
        if quantized is not None:
            tensors.update({f"quantized.{part}.{name}": tensor for part, packed in (("keys", quantized.keys),
                                                                                    ("values", quantized.values))
                            for name, tensor in packed.tensors().items()})
        facts = {"cumulative_length": self.cumulative_length, "started": self.started,
                 "folded_heads": self.folded_heads, "kept_length": self.kept_length,
                 "fewest_units": self._fewest_units,
                 "quantization": None if quantized is None else [quantized.bits, quantized.key_group_size,
                                                                 quantized.value_group_size, quantized.residual]}
        return tensors, facts

    @classmethod
    def from_saved(cls, tensors: dict[str, torch.Tensor], facts: dict[str, Any]) -> "CompressedLayer":
        """The layer ``saved`` described (its tensors already on the device and in the dtype wanted)."""
        layer = cls()
        layer.lazy_initialization(tensors["keys"], tensors["values"])
        layer.keys, layer.values = tensors["keys"], tensors["values"]
        layer.cumulative_length = int(facts["cumulative_length"])
        if facts.get("quantization"):
            bits, key_group_size, value_group_size, residual = facts["quantization"]
            layer.quantized = QuantizedKV(bits, key_group_size, value_group_size, residual, *(
                PackedSlots(*(tensors[f"quantized.{part}.{name}"] for name in ("codes", "scales", "minimums")), bits)
                for part in ("keys", "values")))
        if not facts["started"]:
            return layer
        layer._tracked = tensors["slot_valid"].shape[-1]
        layer._capacity = capacity_for(layer._tracked)
        for name in cls.SLOT_FIELDS:
            setattr(layer, name, tensors.get(name))  # into a buffer with spare room (``_assign``)
        layer.statistics = {name.split(".", 1)[1]: tensor for name, tensor in tensors.items()
                            if name.startswith("statistics.")}
        layer.set_scored_units(tensors.get("scored_units"), facts["fewest_units"])
        layer.head_units = tensors.get("head_units")
        layer.folded_heads = facts["folded_heads"]
        layer.kept_length = int(facts["kept_length"])
        return layer

    # ------------------------------------------------------------------ storage
    def _view(self, name: str) -> torch.Tensor | None:
        buffer = self._buffers[name]
        return None if buffer is None else buffer[..., : self._tracked]

    def _assign(self, name: str, tensor: torch.Tensor | None) -> None:
        if tensor is None:
            self._buffers[name] = None
            return
        if tensor.shape[-1] != self._tracked:
            raise ValueError(f"{name} covers {tensor.shape[-1]} slots, the layer tracks {self._tracked}")
        buffer = zeros_like_with(tensor, self._capacity)
        buffer[..., : self._tracked] = tensor
        self._buffers[name] = buffer

    def _reserve(self, length: int) -> None:
        """Make every buffer hold at least ``length`` slots; the spare slots stay zero."""
        if length <= self._capacity:
            return
        self._capacity = capacity_for(length)
        for name, buffer in self._buffers.items():
            if buffer is not None:
                grown = zeros_like_with(buffer, self._capacity)
                grown[..., : self._tracked] = buffer[..., : self._tracked]
                self._buffers[name] = grown

    def _select_rows(self, rows: torch.Tensor) -> None:
        """Follow a batch reordering of the cache (beam search) in every per-slot and per-sequence tensor."""
        if not self.started:
            return
        for name in self.SLOT_FIELDS:
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, tensor.index_select(0, rows.to(tensor.device)))
        for name, tensor in self.statistics.items():
            self.statistics[name] = tensor.index_select(0, rows.to(tensor.device))
        if self._scored_units is not None:
            self.scored_units = self._scored_units.index_select(0, rows.to(self._scored_units.device))
        if self.head_units is not None:
            self.head_units = self.head_units.index_select(0, rows.to(self.head_units.device))
        if self.quantized is not None:
            self.quantized.map(lambda tensor: tensor.index_select(0, rows.to(tensor.device)))


def _like(buffer: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """A shared per-slot value (B, T) for a per-head buffer (B, H_kv, T): the same for every head."""
    return tensor.unsqueeze(-2) if buffer.dim() == 3 and tensor.dim() == 2 else tensor


def _field(name: str) -> property:
    return property(lambda self: self._view(name), lambda self, tensor: self._assign(name, tensor))


for _name in CompressedLayer.SLOT_FIELDS:
    setattr(CompressedLayer, _name, _field(_name))
del _name
