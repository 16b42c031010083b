"""Operations on per-slot tensors (a cache layer's keys and values, and its per-slot eviction state), indexed by
physical cache slot so that one gather with the kept indices compacts them all (``layer.CompressedLayer``)."""

from __future__ import annotations

import torch

# Spare slots reserved past the current length, so that decode steps (and the few slots per_token decode lets the
# cache run over budget) append in place instead of reallocating: max(MIN_RESERVE, length * RESERVE_FRACTION).
MIN_RESERVE = 64
RESERVE_FRACTION = 0.25


def capacity_for(length: int) -> int:
    """Slots a per-slot buffer holding ``length`` slots is allocated with (the reserve included)."""
    return length + max(MIN_RESERVE, int(length * RESERVE_FRACTION))


def zeros_like_with(tensor: torch.Tensor, capacity: int) -> torch.Tensor:
    """Zeros of ``tensor``'s dtype, device and leading dimensions, with ``capacity`` slots."""
    return torch.zeros(*tensor.shape[:-1], capacity, dtype=tensor.dtype, device=tensor.device)


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


def combine_scores(target: torch.Tensor, scores: torch.Tensor, combine: str) -> None:
    """Combine ``scores`` into ``target`` in place by a scorer's rule (``add``, ``max`` or ``replace``)."""
    if combine == "add":
        target += scores
    elif combine == "max":
        target.copy_(torch.maximum(target, scores))
    elif combine == "replace":
        target.copy_(scores)
    else:
        raise ValueError(f"combine must be 'add', 'max' or 'replace', got {combine!r}")
