"""Attention of observed queries over the cached keys, recomputed inside the hook.

sdpa and flash attention never return their weights and eager materialises B·H·L² of them, so the hook
recomputes only what a method observes: the last ``window_size`` queries for SnapKV, every query for H2O
(in query chunks, so memory stays linear in the length). The result is summed over the observed queries and
the query heads of each KV group, in float32: (B, H_kv, T).

What keeps this cheap (it runs inside every forward of every compressed layer):

* A chunk of queries only multiplies the keys it can see (causal): the chunk of rows [s, e) stops at slot
  T - q + e, so an H2O prefill does half the QK work of the full matrix, and only the c × c triangle on the
  chunk's diagonal needs a mask.
* The query heads of a KV group are stacked as rows of one matrix product against that KV head's keys: the
  keys are neither repeated per query head nor copied or upcast.
* The logits held at once are bounded by ``CHUNK_FACTOR`` × the size of the forward's hidden states
  (B · q · hidden), so the transient memory is linear in the length and no larger than activations the
  forward allocates anyway.
* Masks for dead slots (padding) and weights for unobserved queries are applied only when there are any
  (known without a device synchronisation on CPU, or once per layer per multi-token forward elsewhere); a
  decode step (one query) takes a short path with no host-device synchronisation at all.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..adapters import project_queries

# Float32 logits held at once while scoring a chunk of queries, as a multiple of the forward's hidden states
# (B · q · hidden elements); MIN/MAX keep chunks sensible for tiny models and huge batches.
CHUNK_FACTOR = 1
MIN_CHUNK_ELEMENTS = 1 << 16
MAX_CHUNK_ELEMENTS = 1 << 25
LOG2_E = 1.4426950408889634


def chunk_elements(batch: int, length: int, hidden_size: int) -> int:
    """How many float32 logits a chunk may hold: linear in the forward's length."""
    return int(min(MAX_CHUNK_ELEMENTS, max(MIN_CHUNK_ELEMENTS, CHUNK_FACTOR * batch * length * hidden_size)))


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
    total, kv_heads = keys.shape[-2], keys.shape[1]
    groups = module.config.num_attention_heads // kv_heads
    per_head = pool_kernel is not None and pool_kernel > 1
    if length == 1 and not per_head:
        return _single_query(module, hidden_states, position_embeddings, keys, slot_valid, observed)

    summed = torch.zeros(batch, kv_heads, groups if per_head else 1, total, device=keys.device)
    rows = observed.any(0).nonzero().flatten()
    if rows.numel() == 0:
        return summed.sum(2)
    first = int(rows[0])
    base = total - length  # slot of the forward's first token
    padded = not bool(slot_valid.all())
    partial = not bool(observed[:, first:].all())
    keys_t = keys.transpose(-1, -2)  # (B, H_kv, d, T): a view
    cos, sin = position_embeddings
    budget = chunk_elements(batch, length, hidden_states.shape[-1]) // (batch * kv_heads * groups)
    diagonal = None
    start = first
    while start < length:
        stop = min(length, start + _chunk_rows(budget, base + start))
        rows_in_chunk, visible = stop - start, base + stop
        logits = _logits(  # (B, H_kv, G·c, visible) float32, base 2
            module, hidden_states[:, start:stop], (cos[:, start:stop], sin[:, start:stop]), keys_t[..., :visible], True
        )
        logits5 = logits.view(batch, kv_heads, groups, rows_in_chunk, visible)
        if diagonal is None or diagonal.shape[0] < rows_in_chunk:
            diagonal = torch.ones(rows_in_chunk, rows_in_chunk, dtype=torch.bool, device=keys.device).triu_(1)
        logits5[..., base + start :].masked_fill_(diagonal[:rows_in_chunk, :rows_in_chunk], float("-inf"))
        chunk_observed = observed[:, start:stop]
        if padded:  # dead slots never count; unobserved rows stay unmasked (finite) and get weight 0 below
            dead = ~slot_valid[:, None, :visible] & chunk_observed[:, :, None]
            logits5.masked_fill_(dead[:, None, None], float("-inf"))
        # Softmax in place (base 2), its normalisation folded into the sum over rows: the column sums are
        # (observed_i / sum_t exp_it) @ exp, one matrix-vector product, and no second chunk-sized tensor.
        maxima = logits5.amax(-1, keepdim=True)
        if padded:  # a row with no live slot: 2^(-inf - finite) = 0, then weight 0
            maxima.clamp_(min=torch.finfo(maxima.dtype).min)
        logits.sub_(maxima.view(batch, kv_heads, groups * rows_in_chunk, 1)).exp2_()
        sums = logits.sum(-1)  # (B, H_kv, G·c)
        if padded or partial:
            observed_rows = chunk_observed.to(sums.dtype).repeat(1, groups)[:, None, :]  # (B, 1, G·c)
            row_weights = torch.where(sums > 0, observed_rows / sums, 0.0)
        else:
            row_weights = sums.reciprocal_()
        if per_head:  # keep the query heads apart for SnapKV's pooling: (B, H_kv, G, 1, c) @ (B, H_kv, G, c, T)
            contribution = torch.matmul(
                row_weights.view(batch, kv_heads, groups, 1, rows_in_chunk), logits5
            ).squeeze(-2)
        else:  # (B, H_kv, 1, G·c) @ (B, H_kv, G·c, T): every row of the group at once
            contribution = torch.matmul(row_weights.unsqueeze(-2), logits)
        summed[..., :visible] += contribution
        del logits, logits5, contribution
        start = stop
    if per_head:
        flat = summed.flatten(0, 2).unsqueeze(1)
        pooled = torch.nn.functional.max_pool1d(flat, pool_kernel, stride=1, padding=pool_kernel // 2)
        summed = pooled.view_as(summed)
    return summed.sum(dim=2)


def _chunk_rows(budget_per_head: int, preceding: int) -> int:
    """Rows c whose causal logits fit: c · (preceding + c) <= budget (at least one row)."""
    rows = (math.isqrt(preceding * preceding + 4 * budget_per_head) - preceding) // 2
    return max(1, rows)


def _logits(module: nn.Module, hidden_states, position_embeddings, keys_t, base2: bool = False) -> torch.Tensor:
    """Float32 logits (B, H_kv, G·c, T) of c queries: the rows of every query head of a KV group stacked.

    The product runs in the model's dtype (keys are neither repeated nor upcast). With ``base2`` the logits are
    in units of log2 (multiplied by log2 e), so ``exp2`` (several times faster than ``exp`` on CPU) gives the
    same softmax; the factor rides on the queries unless the model soft-caps its logits.
    """
    queries = project_queries(module, hidden_states, position_embeddings)  # (B, H_q, c, d)
    batch, heads, length, head_dim = queries.shape
    kv_heads = keys_t.shape[1]
    softcap = getattr(module, "attn_logit_softcapping", None)
    queries = queries * (module.scaling * (LOG2_E if base2 and not softcap else 1.0))
    queries = queries.reshape(batch, kv_heads, (heads // kv_heads) * length, head_dim)
    logits = torch.matmul(queries, keys_t)
    if logits.dtype != torch.float32:
        logits = logits.float()
    if softcap:
        logits = torch.tanh(logits / softcap) * (softcap * (LOG2_E if base2 else 1.0))
    return logits


def _single_query(module, hidden_states, position_embeddings, keys, slot_valid, observed) -> torch.Tensor:
    """A decode step: one attention row per query head, no chunking, no host-device synchronisation.

    The query sees every slot (it is the last one), so only dead slots need a mask; on CPU it is skipped when
    every slot is live, elsewhere it is always applied (cheaper than asking the device).
    """
    logits = _logits(module, hidden_states, position_embeddings, keys.transpose(-1, -2))  # (B, H_kv, G, T)
    on_cpu = keys.device.type == "cpu"
    if not (on_cpu and bool(slot_valid.all())):
        dead = ~slot_valid & observed  # an unobserved (padding) query keeps finite logits and weight 0
        logits.masked_fill_(dead[:, None, None, :], float("-inf"))
    weights = torch.softmax(logits, dim=-1).sum(2)  # (B, H_kv, T)
    if not (on_cpu and bool(observed.all())):
        weights = weights.nan_to_num_(0.0) * observed[:, :, None]
    return weights


def observation_counts(observed: torch.Tensor, total: int) -> torch.Tensor:
    """How many observed queries of this forward can see each slot (B, T), for norm_sum.

    Old slots are seen by every observed query; a new slot at forward index k by the observed queries at
    index >= k (causal). This gives the counters of the reference: L..1 for an H2O prefill, w..w, w-1..1 for
    a SnapKV window, +1 per decode step.
    """
    length = observed.shape[-1]
    if length == 1:
        return observed.float().expand(-1, total)
    observed = observed.float()
    new = observed.flip(-1).cumsum(-1).flip(-1)
    old = observed.sum(-1, keepdim=True).expand(-1, total - length)
    return torch.cat([old, new], dim=-1)
