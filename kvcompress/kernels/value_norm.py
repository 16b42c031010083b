"""‖v·W_o‖₁ of every cached token, the value side of CriticalKV's output-perturbation bound.

A token's contribution to the attention output of query head h is its attention weight times
``u = v_{kv(h)} · W_o[:, h·d:(h+1)·d]ᵀ``; CriticalKV weighs the attention score by ``‖u‖₁``. The norm depends
only on the value, so it is computed once when a token enters the cache and kept next to its
score.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_ELEMENTS = 1 << 24


def projected_value_l1(
    values: torch.Tensor,
    o_proj_weight: torch.Tensor,
    num_key_value_groups: int,
    *,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Mean over all query heads of ``‖v_{kv(h)} · W_o,hᵀ‖₁`` for every token, in float32.

    Query head ``h`` reads KV head ``h // num_key_value_groups``. Averaging over the query heads of each GQA
    group (kvpress ``vwl1norm``) and then over the KV heads (the eviction is head-shared) is the plain mean
    over all query heads, since the groups have equal size.

    Memory: the per-head projections ``(B, H_q, t, hidden)`` are materialised for ``t`` tokens at a time, with
    ``t`` chosen so that they hold at most ``chunk_elements`` float32 numbers (default 2²⁴ = 64 MiB; at least
    one token per chunk), so long prompts cost bounded extra memory. ``o_proj_weight`` is cast to float32
    once per call.

    Args:
        values: ``(B, H_kv, T, d)`` value states as stored in the cache, any float dtype.
        o_proj_weight: ``(hidden, H_q · d)``, the attention module's ``o_proj.weight``.
        num_key_value_groups: query heads per KV head (``H_q / H_kv``).
        chunk_elements: bound on the intermediate's size (see above).

    Returns:
        ``(B, T)`` float32.
    """
    batch, kv_heads, tokens, head_dim = values.shape
    query_heads = kv_heads * num_key_value_groups
    hidden = o_proj_weight.shape[0]
    if o_proj_weight.shape[1] != query_heads * head_dim:
        raise ValueError(
            f"o_proj_weight must be (hidden, {query_heads}·{head_dim}) for {kv_heads} KV heads × "
            f"{num_key_value_groups} groups of head_dim {head_dim}, got {tuple(o_proj_weight.shape)}"
        )
    # (hidden, H_kv, G, d) -> (H_kv, G, d, hidden): the slice of W_o read by each query head, kv-major like HF.
    weight = o_proj_weight.float().view(hidden, kv_heads, num_key_value_groups, head_dim).permute(1, 2, 3, 0)
    step = max(1, chunk_elements // max(1, batch * query_heads * hidden))
    norms = []
    for start in range(0, tokens, step):
        chunk = values[:, :, start : start + step].float()
        projected = torch.einsum("bktd,kgdh->bkgth", chunk, weight)
        norms.append(projected.abs().sum(dim=-1).mean(dim=(1, 2)))
    if not norms:
        return values.new_zeros(batch, 0, dtype=torch.float32)
    return torch.cat(norms, dim=-1)
