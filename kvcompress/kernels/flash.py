"""Attention output with its log-sum-exp from torch's own flash attention, for a forward whose queries see a cached
prefix and their own tokens causally: the scoring passes that derive scores from the row normalisers (KVzip's
reconstruction on CPU without the compiled kernel, the accelerators' first pass) share it.

The forward's own tokens go in as one square causal block and the prefix, which every query sees whole, without a
mask; the two merge exactly by their log-sum-exps (flash's causal mask is not aligned to the end of a longer key
sequence in every torch). Keys and values are repeated per query head only where the flash op does not take
grouped heads itself (asked once per device type).
"""

from __future__ import annotations

import torch

_gqa_in_flash: dict[str, bool] = {}  # per device type: whether torch's flash op takes fewer key / value heads


def flash_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (B, H, q, d) in the queries' dtype and natural log-sum-exp (B, H, q) float32 of queries (B, H, q, d)
    over keys / values (B, H_kv, T, d) whose last q slots are the queries' own tokens; the merged output is
    rounded to the model's dtype once, as its own sdpa call would round it."""
    base = keys.shape[2] - queries.shape[2]
    own_output, own_lse = _flash(queries, keys[:, :, base:], values[:, :, base:], scaling, causal=True)
    if base == 0:
        return own_output, own_lse
    prefix_output, prefix_lse = _flash(queries, keys[:, :, :base], values[:, :, :base], scaling, causal=False)
    lse = torch.logaddexp(prefix_lse, own_lse)
    output = (prefix_output.float() * (prefix_lse - lse).exp().unsqueeze(-1)
              + own_output.float() * (own_lse - lse).exp().unsqueeze(-1)).to(queries.dtype)
    return output, lse


def _flash(queries, keys, values, scaling: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One flash call: (B, H, q, d) output and natural log-sum-exp (B, H, q) float32 (torch's CPU flash op for CPU
    tensors, its CUDA one elsewhere)."""
    device = queries.device.type
    if device == "cpu":
        def flash(q, k, v):
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scaling)
    else:
        def flash(q, k, v):
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scaling)
    groups = queries.shape[1] // keys.shape[1]
    if groups > 1 and _gqa_in_flash.get(device, True):
        try:
            output, lse = flash(queries, keys, values)[:2]
            _gqa_in_flash[device] = True
            return output, lse[..., : queries.shape[2]].contiguous()
        except RuntimeError:
            _gqa_in_flash[device] = False
    if groups > 1:
        keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    output, lse = flash(queries, keys, values)[:2]
    return output, lse[..., : queries.shape[2]].contiguous()
