"""Attention of observed queries over the cached keys, recomputed inside the hook.

sdpa and flash attention never return their weights and eager materialises B·H·L² of them, so the hook
recomputes only what a method observes: the last ``window_size`` queries for SnapKV, every query for H2O
(in query chunks, so memory stays linear in the length). The result is summed over the observed queries and
the query heads of each KV group, in float32: (B, H_kv, T).
"""

from __future__ import annotations

import torch
from torch import nn

from ..adapters import attention_logits, project_queries

# Upper bound on float32 logits held at once while scoring a chunk of queries (elements, ~128 MiB).
CHUNK_ELEMENTS = 1 << 25


def observed_attention(
    module: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    keys: torch.Tensor,
    slot_valid: torch.Tensor,
    observed: torch.Tensor,
    pool_kernel: int | None = None,
) -> torch.Tensor:
    """Summed softmax attention of the observed queries of this forward.

    ``hidden_states`` (B, q, D) are the forward's inputs to the module, ``keys`` (B, H_kv, T, d) the cache after
    its update (the last q slots are this forward's tokens), ``slot_valid`` (B, T) marks live slots and
    ``observed`` (B, q) the queries whose attention counts (real tokens inside the method's window). A query at
    forward index i sees slots up to T - q + i, exactly as the model's causal mask allows.
    ``pool_kernel`` applies SnapKV's centred max-pool along the slots, per query head, before the head sum.
    """
    batch, length = hidden_states.shape[:2]
    total = keys.shape[-2]
    num_q_heads = module.config.num_attention_heads
    rows = observed.any(0).nonzero().flatten()
    first = int(rows[0]) if rows.numel() else length
    chunk = max(1, CHUNK_ELEMENTS // max(1, batch * num_q_heads * total))
    slot_index = torch.arange(total, device=keys.device)
    summed = torch.zeros(batch, keys.shape[1], num_q_heads // keys.shape[1], total, device=keys.device)
    cos, sin = position_embeddings
    for start in range(first, length, chunk):
        stop = min(start + chunk, length)
        queries = project_queries(module, hidden_states[:, start:stop], (cos[:, start:stop], sin[:, start:stop]))
        logits = attention_logits(module, queries, keys)  # (B, H_kv, G, c, T)
        query_slot = total - length + torch.arange(start, stop, device=keys.device)
        visible = (slot_index[None, :] <= query_slot[:, None])[None] & slot_valid[:, None, :]  # (B, c, T)
        logits = logits.masked_fill(~visible[:, None, None], float("-inf"))
        weights = torch.softmax(logits, dim=-1).nan_to_num_(0.0)
        weights = weights * observed[:, None, None, start:stop, None]
        summed += weights.sum(dim=-2)
    if pool_kernel is not None and pool_kernel > 1:
        flat = summed.flatten(0, 2).unsqueeze(1)
        pooled = torch.nn.functional.max_pool1d(flat, pool_kernel, stride=1, padding=pool_kernel // 2)
        summed = pooled.view_as(summed)
    return summed.sum(dim=2)


def observation_counts(observed: torch.Tensor, total: int) -> torch.Tensor:
    """How many observed queries of this forward can see each slot (B, T), for norm_sum.

    Old slots are seen by every observed query; a new slot at forward index k by the observed queries at
    index >= k (causal). This gives the counters of the reference: L..1 for an H2O prefill, w..w, w-1..1 for
    a SnapKV window, +1 per decode step.
    """
    length = observed.shape[-1]
    observed = observed.float()
    new = observed.flip(-1).cumsum(-1).flip(-1)
    old = observed.sum(-1, keepdim=True).expand(-1, total - length)
    return torch.cat([old, new], dim=-1)
