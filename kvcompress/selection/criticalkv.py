"""CriticalKV two-stage selection (kvpress ``CriticalKVPress``).

Evicting a unit perturbs the attention output by roughly its attention weight times ``‖v·W_o‖₁``, and the
renormalisation over the kept units costs more the less attention mass survives. So the selection first
secures attention mass (stage 1: top by score) and then keeps the units whose output contribution is largest
(stage 2: top by ``(score + ε) · ‖v·W_o‖₁``).
"""

from __future__ import annotations

import torch

from kvcompress.selection.adaptive import check_num_select, descending_rank


def first_stage_count(num_select: torch.Tensor, first_stage_ratio: float) -> torch.Tensor:
    """``k1 = floor(first_stage_ratio · k)``, raised to 1 when the ratio and ``k`` are positive (kvpress #277).

    Without the guard a short context floors ``k1`` to 0 and silently drops stage 1, i.e. the attention-mass
    safeguard the method depends on. The product is taken in float64, the precision of kvpress's Python
    ``int(k * ratio)``.
    """
    k1 = (num_select.double() * first_stage_ratio).floor().long()
    if first_stage_ratio > 0:
        k1 = torch.where(num_select > 0, k1.clamp(min=1), k1)
    return torch.minimum(k1, num_select)


def criticalkv_select(
    scores: torch.Tensor,
    value_norms: torch.Tensor,
    candidates: torch.Tensor,
    num_select: torch.Tensor,
    first_stage_ratio: float = 0.5,
    epsilon: float = 1e-4,
) -> torch.Tensor:
    """Pick ``num_select[b]`` candidates per row: ``k1`` by score, then ``k − k1`` by ``(score + ε)·value_norm``.

    Ties in either stage go to the lower unit index. With ``first_stage_ratio = 1`` this is plain top-k by
    score; with 0 it is top-k by the product alone.

    Args:
        scores: ``(B, U)`` eviction scores (aggregated sum or norm_sum).
        value_norms: ``(B, U)`` mean over heads of ``‖v·W_o‖₁`` (see ``kvcompress.kernels.value_norm``).
        candidates: ``(B, U)`` bool, the units this step may choose from.
        num_select: ``(B,)`` int64, at most the number of candidates of the row.
        first_stage_ratio: share of ``k`` chosen by score alone, in ``[0, 1]``.
        epsilon: keeps a unit with zero score comparable by its value norm (kvpress default 1e-4).

    Returns:
        ``(B, U)`` bool, exactly ``num_select[b]`` True per row, all among the candidates.
    """
    if not 0.0 <= first_stage_ratio <= 1.0:
        raise ValueError(f"criticalkv_first_stage_ratio must be in [0, 1], got {first_stage_ratio}")
    check_num_select(num_select, candidates)
    k1 = first_stage_count(num_select, first_stage_ratio)
    stage1 = candidates & (descending_rank(scores, candidates) < k1[:, None])
    remaining = candidates & ~stage1
    product = (scores.float() + epsilon) * value_norms.float()
    stage2 = remaining & (descending_rank(product, remaining) < (num_select - k1)[:, None])
    return stage1 | stage2
