"""The head-adaptive layout (``budget_allocation="adaptive"`` or ``"global_adaptive"``): each KV head keeps its
own number of slots.

A rectangular (B, H_kv, T, d) cache cannot hold heads of different lengths without padding every head to the
longest, which gives back much of what adaptive budgets save. So a layer whose heads were selected adaptively
*folds* its heads into one row: keys and values become (B, 1, N, d), N the sum of the heads' kept counts (the
widest sequence's, others left-filled with dead slots), head-major, and every slot records its KV head
(``CompressedLayer.slot_head``). The cache then holds exactly what is kept. Tokens that arrive later (a question, the
answer) append H_kv slots each, token-major, one per head.

Attention over a folded layer is the session's own (``folded_attention``): the queries of KV head h's group see
the live slots of head h, causally. The kernels do a per-head kernel's products (the AdaKV repository's varlen
CUDA path does the same): a decode step directly (``kernels.attention.folded_single_query``: each pair's own slots,
no mask, scores in the same pass; the compiled kernel on CPU, a split-key Triton kernel on accelerators), a longer
forward over the heads laid out as rows (``_as_head_rows``). Elsewhere (no kernel, soft-capping) it is a
multi-query attention over all N slots with a head mask, H_kv times those multiply-adds with no padding and no
copy of the cache: torch's sdpa on CPU, the eager formula on accelerators, whose products spread over the device
(sdpa gives one (batch, head) pair of a few rows to a single block).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from .kernels.attention import folded_single_query, per_head_rows_attention, per_head_rows_serve

if TYPE_CHECKING:
    from .quantization import CodedSlots

LOGIT_ELEMENTS = 1 << 25  # the most logits a folded layer's eager attention holds at once (a chunk of rows)


def fold_new_tokens(tensor: torch.Tensor) -> torch.Tensor:
    """(B, H_kv, q, d) -> (B, 1, q·H_kv, d): a forward's new slots, token-major, one per head."""
    batch, heads, length, dim = tensor.shape
    return tensor.transpose(1, 2).reshape(batch, 1, length * heads, dim)


@functools.lru_cache(maxsize=64)
def folded_head_of_new(heads: int, length: int, batch: int, device: torch.device) -> torch.Tensor:
    """(B, q·H_kv) the KV head of each new slot, in ``fold_new_tokens``' order. The same for every folded layer of
    every forward of that shape (read, never written): built once, not twice per layer and decode step."""
    return torch.arange(heads, device=device).repeat(length).expand(batch, -1)


def per_new_slot(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """A per-token field of a forward's new tokens (B, q) as one value per new slot (B, q·H_kv), in
    ``fold_new_tokens``' order: a decode step's (one token) is a view."""
    return tensor.expand(-1, heads) if tensor.shape[-1] == 1 else tensor.repeat_interleave(heads, -1)


def fold_kept(tensor: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """(B, H_kv, T, d) gathered at flat head-major indices ``source`` (B, N) into (B, H_kv·T): (B, 1, N, d)."""
    flat = tensor.flatten(1, 2)
    return flat.gather(1, source.unsqueeze(-1).expand(-1, -1, flat.shape[-1])).unsqueeze(1)


def head_grid(slot_head: torch.Tensor, slot_valid: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A folded layer's live slots per KV head: ``index`` (B, H_kv, W) of each head's slots in slot order (hence in
    token order), right-aligned with dead cells on the left as a rectangular layer's rows are, and ``valid``
    (B, H_kv, W) marking the cells that hold a slot; W is the most any head holds. Selection ranks these rows as it
    ranks a rectangular layer's heads, so a folded layer evicts per head again."""
    batch, total = slot_valid.shape
    device = slot_valid.device
    slot = torch.arange(total, device=device)
    # live slots ordered by (head, slot), dead ones last; each head's run starts where the earlier heads' end
    order = torch.where(slot_valid, slot_head * total + slot, heads * total + slot).argsort(dim=-1)
    counts = torch.zeros(batch, heads, dtype=torch.long, device=device).scatter_add_(1, slot_head, slot_valid.long())
    width = max(int(counts.max()), 1)
    cell = torch.arange(width, device=device)
    missing = (width - counts)[..., None]  # dead cells on the left of each head's row
    valid = cell >= missing
    start = (counts.cumsum(-1) - counts)[..., None]
    position = (start + cell - missing).clamp(0, max(total - 1, 0))
    index = order.gather(1, position.flatten(1)).view(batch, heads, width)
    return index, valid


def folded_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slot_valid: torch.Tensor,
    slot_head: torch.Tensor,
    kv_heads: int,
    scaling: float,
    softcap: float | None = None,
    observed: torch.Tensor | None = None,
    all_live: bool | None = None,
    coded: CodedSlots | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention output (B, q, H, d) of queries (B, H, q, d) over a folded layer's slots (B, 1, M, d), and with
    ``observed`` (B, q) the most attention any observed query gives each slot (B, 1, M) float32, else None.

    ``slot_valid`` and ``slot_head`` (B, M) cover the cached slots and this forward's new ones (the last q·H_kv,
    token-major): query head i of new token j sees the live slots of its KV head among the cached slots and the
    new tokens up to j. The queries of a KV head's group attend as one block of G·q rows, so the mask is one row
    per KV head (B, H_kv, 1, M) in a decode step. A padding query that would see nothing sees everything instead
    (finite, never read, never observed); on the kernels (compiled and Triton) an unobserved query sees its head's
    dead slots too. A slot's score is KVzip's rule on the folded layout: only the queries of
    its own KV head's group can see it, so the most attention any observed row gives it is the most its group
    gives it, as ``kernels.attention.observed_attention(reduce="max")`` scores a rectangular layer. ``all_live``:
    the caller knows every slot live (the kernel's checks are spared). ``coded``: a quantized layer's oldest slots,
    which only codes hold (``keys`` and ``values`` then hold the slots after them): a decode step's compiled kernel
    reads the codes, every other path their full-precision copy.
    """
    batch, query_heads, length, dim = query.shape
    if length == 1 and not softcap:
        step = folded_single_query(query, keys, values, slot_valid, slot_head, kv_heads, scaling, observed, all_live,
                                   coded)
        if step is not None:
            return step
    if coded is not None:
        keys, values = coded.dense()
    if length > 1 and not softcap and per_head_rows_serve(query, keys, values):
        return _as_head_rows(query, keys, values, slot_valid, slot_head, kv_heads, scaling, observed)
    group = query_heads // kv_heads
    device = query.device
    heads = torch.arange(kv_heads, device=device)
    allowed = (slot_valid[:, None, :] & (slot_head[:, None, :] == heads[None, :, None]))[:, :, None, :]
    if length > 1:  # this forward's tokens see each other causally; rows are (query head in group, token)
        total = keys.shape[-2]
        token_of_slot = torch.cat([torch.full((total - length * kv_heads,), -1, device=device),
                                   torch.arange(length, device=device).repeat_interleave(kv_heads)])
        causal = token_of_slot[None, :] <= torch.arange(length, device=device)[:, None]  # (q, M)
        allowed = allowed & causal.repeat(group, 1)
        allowed = allowed | ~allowed.any(-1, keepdim=True)
    # every query row of every head against the one row of slots, as a single-head attention of H·q rows: no
    # copy of the slots per head
    mask = allowed.expand(batch, kv_heads, group * length, -1).reshape(batch, 1, query_heads * length, -1)
    rows = query.reshape(batch, 1, query_heads * length, dim)
    scores = None
    if observed is None and _sdpa_serves(keys, softcap):
        output = torch.nn.functional.scaled_dot_product_attention(rows, keys, values, attn_mask=mask, scale=scaling)
    else:  # rows are (query head, token): a row is observed where its token is
        output, scores = _eager_attention(rows, keys, values, mask, scaling, softcap,
                                          None if observed is None else observed.repeat(1, query_heads))
    return output.view(batch, query_heads, length, dim).transpose(1, 2).contiguous(), scores


def _as_head_rows(query, keys, values, slot_valid, slot_head, kv_heads: int, scaling: float,
                  observed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A multi-token forward over a folded layer (a prompt, a chunk, a reconstruction pass) as over a rectangular
    one, on the compiled kernel or the Triton kernels: each KV head's cached slots gathered into a row
    (``head_grid``: right-aligned, dead cells on the left, masked per head), the forward's own slots after them in
    token order, so that the kernels' causal blocks and their maximum mode serve it; the scores go back to the
    folded slots. A copy of the layer per forward, against the masked attention's KV-heads times the work over
    every slot (``kernels.attention.per_head_rows_serve`` says first whether a kernel serves)."""
    batch, _, length, dim = query.shape
    cached = keys.shape[-2] - length * kv_heads
    index, live = head_grid(slot_head[:, :cached], slot_valid[:, :cached], kv_heads)  # (B, H_kv, W)
    width = index.shape[-1]

    def rows(tensor: torch.Tensor) -> torch.Tensor:  # (B, 1, M, d) -> (B, H_kv, W + q, d)
        old = tensor[:, 0].gather(1, index.flatten(1)[..., None].expand(-1, -1, dim)).view(batch, kv_heads, width, dim)
        return torch.cat([old, tensor[:, 0, cached:].view(batch, length, kv_heads, dim).transpose(1, 2)], dim=2)

    new_valid = slot_valid[:, cached:].view(batch, length, kv_heads).transpose(1, 2)
    rows_observed = observed if observed is not None else torch.ones_like(slot_valid[:, :length])
    output, scores = per_head_rows_attention(query, rows(keys), rows(values), torch.cat([live, new_valid], dim=-1),
                                             rows_observed, scaling)
    if observed is None:
        return output, None
    # a dead cell repeats a slot of its head (head_grid): it adds nothing to the maximum
    old = torch.zeros_like(slot_valid[:, :cached], dtype=scores.dtype).scatter_reduce_(
        1, index.flatten(1), torch.where(live, scores[..., :width], 0.0).flatten(1), reduce="amax")
    return output, torch.cat([old, scores[..., width:].transpose(1, 2).flatten(1)], dim=-1).unsqueeze(1)


def _sdpa_serves(keys: torch.Tensor, softcap: float | None) -> bool:
    """sdpa on CPU (a batched matmul would JIT a new oneDNN kernel for each decode step's new length), unless
    soft-capped; the eager formula elsewhere (``_eager_attention``)."""
    return keys.device.type == "cpu" and not softcap


def _eager_attention(rows, keys, values, mask, scaling: float, softcap: float | None,
                     observed_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' eager formula (soft-capping included), in chunks of rows that hold at most
    ``LOGIT_ELEMENTS`` logits, and with ``observed_rows`` (B, rows) the most attention an observed row gives each
    slot (B, 1, M). On accelerators its products spread over the slots, where a fused attention kernel given one
    (batch, head) pair of a few rows runs on a single block of the device."""
    step = max(1, LOGIT_ELEMENTS // (rows.shape[0] * keys.shape[-2]))
    chunks, scores = [], None
    for start in range(0, rows.shape[2], step):
        weights = torch.matmul(rows[:, :, start : start + step], keys.transpose(-1, -2)) * scaling
        if softcap:
            weights = softcap * torch.tanh(weights / softcap)
        weights = weights.masked_fill(~mask[:, :, start : start + step], -torch.inf).softmax(-1, dtype=torch.float32)
        if observed_rows is not None:
            seen = weights.masked_fill(~observed_rows[:, None, start : start + step, None], 0.0).amax(2)
            scores = seen if scores is None else torch.maximum(scores, seen)
        chunks.append(torch.matmul(weights.to(values.dtype), values))
    return (chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=2)), scores
