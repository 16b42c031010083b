"""Low-bit storage of kept keys and values: each slot's channels in groups, 8 or 4 bits on a group's own range.

A slot is quantized on its own (per token: a group is ``group_size`` consecutive channels of one head of one
slot), so that everything eviction does to slots (gather a head's own, fold heads into one row, evict again while
decoding, save a context) moves codes and their scales as it moves full-precision slots, with no group across
tokens to split and requantize. A group's grid spans its own range: ``x ≈ minimum + code · scale`` with ``scale =
(max - min) / (2^bits - 1)``, both in float16 (an integer zero point, one byte less, cannot span a range away from
zero: a channel's values over a run of tokens often are, and one-signed groups of a slot occur too); a group's
ends lie within half a step of the grid, a constant group at its float16 value. Four-bit codes are packed two to
a byte. Bytes per slot and head, channels ``d``, ``g`` groups: ``d · bits / 8 + 4 g``.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class PackedSlots:
    """Quantized slots (..., T, d): ``codes`` uint8 (..., T, d · bits / 8), ``scales`` and ``minimums`` float16
    (..., T, d / group_size)."""

    codes: torch.Tensor
    scales: torch.Tensor
    minimums: torch.Tensor
    bits: int

    @property
    def slots(self) -> int:
        return self.codes.shape[-2]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.minimums.nbytes

    @property
    def group_size(self) -> int:
        """Channels per group."""
        return self.codes.shape[-1] * 8 // self.bits // self.scales.shape[-1]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "scales": self.scales, "minimums": self.minimums}

    def map(self, function) -> "PackedSlots":
        """The same slots with ``function`` applied to each tensor along the slot dimension (a gather, a cut)."""
        return PackedSlots(function(self.codes), function(self.scales), function(self.minimums), self.bits)


def check_layout(head_dim: int, bits: int, key_group_size: int, value_group_size: int) -> None:
    """Refuses group sizes the model's head size cannot take (the parameters check the rest)."""
    for name, size in (("kv_key_group_size", key_group_size), ("kv_value_group_size", value_group_size)):
        if bits != 16 and size < head_dim and head_dim % size:
            raise ValueError(f"{name} must divide the model's head size {head_dim} (or reach it: one group per head), "
                             f"got {size}")


def quantize(tensor: torch.Tensor, bits: int, group_size: int) -> PackedSlots:
    """``tensor`` (..., T, d) as ``bits``-bit codes per group of ``group_size`` channels of each slot (the whole
    head where ``group_size`` reaches ``d``)."""
    *outer, channels = tensor.shape
    group_size = min(group_size, channels)
    kernel = _compiled() if tensor.is_cpu else None
    if kernel is not None:  # the same arithmetic in one pass (kernels/quantized_slots.cpp)
        return PackedSlots(*kernel.quantize_slots(tensor.contiguous(), bits, group_size), bits)
    groups = tensor.reshape(*outer, channels // group_size, group_size).float()
    low = groups.amin(-1).to(torch.float16).float()  # the grid starts at the stored minimum
    top = (1 << bits) - 1
    scale = ((groups.amax(-1) - low) / top).to(torch.float16).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: every code 0 is exact
    codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp_(0, top).to(torch.uint8)
    codes = codes.reshape(*outer, channels)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return PackedSlots(codes, scale.to(torch.float16), low.to(torch.float16), bits)


def dequantize(packed: PackedSlots, dtype: torch.dtype) -> torch.Tensor:
    """The slots ``packed`` holds, (..., T, d) in ``dtype``."""
    codes = packed.codes
    if packed.bits == 4:
        codes = torch.stack([codes & 0x0F, codes >> 4], dim=-1).flatten(-2)
    groups = packed.scales.shape[-1]
    grouped = codes.reshape(*codes.shape[:-1], groups, codes.shape[-1] // groups).float()
    values = grouped * packed.scales[..., None].float() + packed.minimums[..., None].float()
    return values.reshape(codes.shape).to(dtype)


@dataclasses.dataclass
class QuantizedKV:
    """A layer's keys and values quantized, every physical slot of them, codes made once from each slot's own
    full-precision values when it enters the layer and moved (never requantized) by every gather after. The layer
    keeps beside them a full-precision copy of its newest ``residual`` slots at most, which attention reads instead
    of their codes (KIVI's residual: the newest tokens draw most attention)."""

    bits: int
    key_group_size: int
    value_group_size: int
    residual: int
    keys: PackedSlots | None = None
    values: PackedSlots | None = None

    @property
    def slots(self) -> int:
        return 0 if self.keys is None else self.keys.slots

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize new slots (..., q, d) onto the end."""
        new_keys, new_values = (quantize(keys, self.bits, self.key_group_size),
                                quantize(values, self.bits, self.value_group_size))
        if self.keys is None:
            self.keys, self.values = new_keys, new_values
            return
        self.keys, self.values = (PackedSlots(*(torch.cat([old, new], dim=-2) for old, new in
                                                zip(held.tensors().values(), added.tensors().values())), self.bits)
                                  for held, added in ((self.keys, new_keys), (self.values, new_values)))

    def map(self, function) -> None:
        """Apply ``function`` to every code, scale and minimum tensor along the slots (a gather, a fold, a cut)."""
        self.keys, self.values = self.keys.map(function), self.values.map(function)

    def read(self, residual_keys: torch.Tensor, residual_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot in full precision: the older ones dequantized, then the residual copies of the newest ones."""
        coded = self.coded(residual_keys, residual_values)
        return (residual_keys, residual_values) if coded is None else coded.dense()

    def coded(self, residual_keys: torch.Tensor, residual_values: torch.Tensor) -> CodedSlots | None:
        """The slots before the full-precision ``residual_keys`` / ``residual_values`` (the newest slots), which
        only codes hold, as attention reads them; None where the full-precision tensors hold every slot."""
        older = self.slots - residual_keys.shape[-2]
        return None if older == 0 else CodedSlots(self.keys, self.values, older, residual_keys, residual_values)

    def keep(self, gather, index: torch.Tensor, residual_index: torch.Tensor, from_residual: torch.Tensor,
             residual_keys: torch.Tensor, residual_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the slots ``gather(tensor, index)`` selects (``slots.gather_slots`` or ``ragged.fold_kept``), and
        return the new full-precision copies of the newest ``residual`` of them: a kept slot that had a copy
        (``from_residual``, same shape as ``index``; ``residual_index`` its place among the old copies) keeps it,
        any other one is its codes dequantized (its codes stay as they were)."""
        self.map(lambda tensor: gather(tensor, index))
        width = min(self.residual, self.slots)
        newest = (index[..., index.shape[-1] - width:], residual_index[..., index.shape[-1] - width:],
                  from_residual[..., from_residual.shape[-1] - width:])
        copied = []
        for packed, residual in ((self.keys, residual_keys), (self.values, residual_values)):
            decoded = dequantize(packed.map(lambda tensor: tensor[..., tensor.shape[-2] - width:, :]), residual.dtype)
            if residual.shape[-2] == 0:
                copied.append(decoded)
                continue
            mask = newest[2].unsqueeze(-1) if newest[2].dim() == 3 else newest[2][:, None, :, None]
            copied.append(torch.where(mask, gather(residual, newest[1]), decoded))
        return copied[0], copied[1]


@dataclasses.dataclass
class CodedSlots:
    """A quantized layer's keys and values as one attention call reads them: its oldest ``count`` slots, which only
    codes hold (the first ``count`` of ``keys`` / ``values``), then the full-precision ``held_keys`` /
    ``held_values`` (B, H_kv, T - count, d) the cache's update returned. The compiled CPU kernel and the Triton
    kernels dequantize the coded slots as they read them (``kernels/fused_attention.cpp``,
    ``kernels/triton_kernels.py``), so that no full-precision copy of the layer is made; the torch path reads
    ``dense()``, made once."""

    keys: PackedSlots
    values: PackedSlots
    count: int
    held_keys: torch.Tensor
    held_values: torch.Tensor
    _dense: tuple[torch.Tensor, torch.Tensor] | None = dataclasses.field(default=None, repr=False)

    @property
    def slots(self) -> int:
        """Every slot the call reads: the coded ones and the held ones."""
        return self.count + self.held_keys.shape[-2]

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot's keys and values in full precision (B, H_kv, T, d)."""
        if self._dense is None:
            self._dense = (_read(self.keys, self.count, self.held_keys),
                           _read(self.values, self.count, self.held_values))
        return self._dense

    def kernel_operands(self, heads: int) -> list[torch.Tensor]:
        """Codes, scales and minimums of the keys, then of the values, as the kernels take them: a folded layer's
        one row (B, 1, S, ...) expanded to ``heads`` KV heads (a view) where asked, as its keys are."""
        tensors = [*self.keys.tensors().values(), *self.values.tensors().values()]
        return [tensor.expand(-1, heads, -1, -1) if tensor.shape[1] != heads else tensor for tensor in tensors]


def _read(packed: PackedSlots, older: int, residual: torch.Tensor) -> torch.Tensor:
    """The first ``older`` slots of ``packed`` dequantized, then ``residual``, in one new tensor: on CPU by the
    compiled kernel's one pass (``kernels/quantized_slots.cpp``), elsewhere (or without a compiler) in torch."""
    kernel = _compiled() if residual.is_cpu else None
    if kernel is None:
        cut = packed.map(lambda tensor: tensor[..., :older, :])
        return torch.cat([dequantize(cut, residual.dtype), residual], dim=-2)
    out = residual.new_empty(*residual.shape[:-2], older + residual.shape[-2], residual.shape[-1])
    codes, scales, minimums = (tensor.contiguous() for tensor in packed.tensors().values())
    kernel.dequantize_slots(codes, scales, minimums, packed.bits, older, out)
    out[..., older:, :] = residual
    return out


def _compiled():
    """The compiled CPU module (``kernels/native.py``), or None (no compiler, ``KVCOMPRESS_NATIVE=0``)."""
    from .kernels import native

    return native.kernel()
