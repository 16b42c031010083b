"""KVzip's reconstruction pass where the compiled CPU kernel is not available: the output and the most attention
each prefix slot receives, on torch's flash attention and one float32 product (faster than the torch chunks of
``attention.observed_attention``)."""

from __future__ import annotations

import torch

from .attention import chunk_elements
from .flash import flash_attention

PREFIX_ROWS = 512  # query rows per product (fewer when the prefix is long)


def prefix_max_attention(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output of a multi-token forward whose queries all see the cached prefix and their own tokens
    causally, and the most softmax weight any query (of any query head of a KV group) gives each prefix slot:
    KVzip's reconstruction pass, where every slot is live and every query observed, on CPU where the compiled
    kernel is not available (faster than the torch chunks of ``observed_attention``: two fused calls and one
    product). The forward's own slots score 0 (they leave the cache after the pass).

    The work goes to torch's flash attention in the model's own dtype (``flash.py``: the prefix and the pass's own
    block, merged exactly by their log-sum-exps into the output and the row normalisers). A slot's score is
    then ``exp(max_i (q_i·k·scaling - lse_i))``: the normaliser rides on the queries as one more column, so the
    scores cost one float32 matrix product and a running maximum, no exponential per weight. The scores are the
    exact softmax weights of the given queries and keys (float32 products: computed in bfloat16 they moved a
    RULER answer).
    Shapes as ``observed_attention``: queries (B, H, q, d), keys / values (B, H_kv, T, d); returns the output
    (B, q, H, d) and the scores (B, H_kv, T) in float32.
    """
    batch, heads, length, head_dim = queries.shape
    total, kv_heads = keys.shape[-2], keys.shape[1]
    groups, base = heads // kv_heads, total - length
    output, lse = flash_attention(queries, keys, values, scaling)  # (B, H, q, d), (B, H, q) float32
    scores = torch.zeros(batch, kv_heads, total, device=keys.device)
    if base == 0:
        return output.transpose(1, 2), scores
    # (B, H_kv, base, d + 1) keys with 1 appended, against (B, H_kv, d + 1, rows) queries with -lse appended;
    # keys first, so that the maximum runs along contiguous memory
    rows = torch.cat([(queries.float() * scaling).reshape(batch, kv_heads, groups * length, head_dim),
                      -lse.reshape(batch, kv_heads, groups * length, 1)], dim=-1).transpose(-1, -2).contiguous()
    columns = torch.cat([keys[:, :, :base].float(), keys.new_ones(batch, kv_heads, base, 1, dtype=torch.float32)],
                        dim=-1)
    best = torch.full((batch, kv_heads, base), float("-inf"), device=keys.device)
    # products of at most twice the larger of observed_attention's bound and the layer's prefix keys (both
    # linear in the length), and at most PREFIX_ROWS rows
    budget = 2 * max(chunk_elements(batch, length, heads * head_dim), batch * kv_heads * base * head_dim)
    step = min(PREFIX_ROWS, max(16, budget // (batch * kv_heads * base)))
    for start in range(0, groups * length, step):
        torch.maximum(best, torch.matmul(columns, rows[..., start:start + step]).amax(-1), out=best)
    scores[..., :base] = best.exp_()
    return output.transpose(1, 2), scores
