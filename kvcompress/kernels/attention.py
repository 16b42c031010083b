"""Attention of observed queries over the cached keys, and (when asked) the layer's attention output with it.

The session's attention function (``kvcompress/attention_function.py``) hands over the module's own post-RoPE
queries, so nothing is re-projected. sdpa and flash attention never return their weights and eager materialises
B·H·L² of them; this module computes only what a method observes: the last ``window_size`` queries for SnapKV,
every query for H2O (in query chunks, so memory stays linear in the length). Scores are summed over the
observed queries and the query heads of each KV group, in float32: (B, H_kv, T). Given the values, the same
chunks also produce the attention output, so H2O and decode steps run attention once instead of twice.
Which implementation runs a fused pass (output and scores together):

* CPU tensors in float32 and bfloat16: the compiled kernel of ``native.py`` (flash-style blocks that stay in the
  core's cache; its speed against sdpa is measured by ``benchmarks/attention_kernel.py``);
* accelerators, multi-token forwards and a folded layer's decode steps: the Triton kernels of
  ``triton_attention.py`` (two launches per layer, or one and a merge);
* everything else (soft-capping, SnapKV's pooled window, a rectangular decode step on an accelerator, no
  compiler; float16 on CPU through float32 copies): the torch chunks below, which are also the test reference
  of the others.

What keeps this cheap (it runs inside every forward of every compressed layer):

* A chunk of queries only multiplies the keys it can see (causal): the chunk of rows [s, e) stops at slot
  T - q + e, so an H2O prefill does half the QK work of the full matrix, and only the c × c triangle on the
  chunk's diagonal needs a mask.
* The query heads of a KV group are stacked as rows of one matrix product against that KV head's keys: the
  keys are neither repeated per query head nor copied or upcast.
* On CPU, chunks of ``ROW_BLOCK`` query rows keep the logits close to the core's cache (faster than chunks sized
  by memory alone); on accelerators, where every chunk costs kernel launches, chunks are as large as memory
  allows. Never more logits than ``CHUNK_FACTOR`` × the forward's hidden states, so the
  transient memory stays linear in the length.
* Softmax in place in base 2 (``exp2`` is several times faster than ``exp`` on CPU; log2 e rides on the queries),
  its normalisation folded into one matrix-vector product for the column sums and a (rows × d) scaling of the
  output: no second chunk-sized tensor.
* Masks for dead slots (padding) and weights for unobserved queries are applied only when there are any
  (known without a device synchronisation on CPU, or once per layer per multi-token forward elsewhere); a
  decode step (one query) takes a short path with no host-device synchronisation at all.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from kvcompress.kernels import native, triton_attention

if TYPE_CHECKING:
    from kvcompress.quantization import CodedSlots

# Query rows per chunk (see the module docstring), and the bound on float32 logits held at once as a multiple of
# the forward's hidden states (B · q · H · d elements); MIN/MAX keep chunks sensible for tiny models and huge
# batches.
ROW_BLOCK = 32
CHUNK_FACTOR = 1
MIN_CHUNK_ELEMENTS = 1 << 16
MAX_CHUNK_ELEMENTS = 1 << 25
LOG2_E = 1.4426950408889634
TRITON_ON_CPU = False  # run the accelerator path on CPU tensors too (tests, under TRITON_INTERPRET=1)
# SnapKV's pools: its reference code offers both (the paper's LongBench runs max-pool, kvpress averages), applied to
# scores padded at the ends: -inf for the maximum, zeros for the average, which counts them (as both references do)
POOLS = {"max": torch.nn.functional.max_pool1d, "avg": torch.nn.functional.avg_pool1d}


def chunk_elements(batch: int, length: int, hidden_size: int) -> int:
    """How many float32 logits a chunk may hold: linear in the forward's length."""
    return int(min(MAX_CHUNK_ELEMENTS, max(MIN_CHUNK_ELEMENTS, CHUNK_FACTOR * batch * length * hidden_size)))


def observed_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    slot_valid: torch.Tensor,
    observed: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
    pooling: tuple[str, int, str] | None = None,
    values: torch.Tensor | None = None,
    all_live: bool | None = None,
    reduce: str = "sum",
    first_row: int = 0,
    coded: CodedSlots | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax attention of the observed queries of this forward, reduced over them and the query heads of each
    KV group (``reduce="sum"``, the column sums; ``"max"``, the most any of them gives each slot), and the
    attention output if ``values``.

    ``queries`` (B, H, q, d) are the module's post-RoPE queries, ``keys`` / ``values`` (B, H_kv, T, d) the cache
    after its update (the last q slots are this forward's tokens), ``slot_valid`` (B, T) marks live slots and
    ``observed`` (B, q) the queries whose attention counts (real tokens inside the method's window). A query at
    forward index i sees slots up to T - q + i, exactly as the model's causal mask allows; an unobserved query
    (padding) sees every slot, so its output stays finite. ``pooling`` (``"max"`` or ``"avg"``, kernel,
    ``"centred"`` or ``"forward"``) smooths SnapKV's scores along the slots, per query head, before the head sum:
    a centred pool, or one over each slot and the kernel - 1 slots before it (a high score carried forward). The output
    is laid out as transformers' attention functions return it: (B, q, H, d). ``all_live`` (every slot live,
    hence every token real), when the caller knows it, spares the per-layer checks. ``first_row``: no query
    before it is observed (a bound the caller knows, such as SnapKV's window), so that a pass without output
    starts there. ``coded``: a quantized layer's oldest slots, which only codes hold (``keys`` and ``values`` then
    hold the slots after them): the compiled kernel and the Triton kernels read the codes, the torch path their
    full-precision copy.
    """
    batch, heads, length, head_dim = queries.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    per_head = pooling is not None and pooling[1] > 1
    if reduce not in ("sum", "max"):
        raise ValueError(f"reduce must be 'sum' or 'max', got {reduce!r}")
    maximum = reduce == "max"
    fused = values is not None and not per_head and not softcap
    kernel = native.kernel() if fused and native.supports(queries, keys, values) else None
    if kernel is not None:
        return _native_fused(kernel, queries, keys, values, slot_valid, observed, scaling, all_live, maximum,
                             coded=coded)
    if fused and length > 1 and triton_serves(queries, keys, values):
        return _triton_fused(queries, keys, values, slot_valid, observed, scaling, all_live, maximum, coded)
    if coded is not None:
        keys, dense_values = coded.dense()
        values = None if values is None else dense_values
    total = keys.shape[-2]
    if length == 1 and not per_head:
        return _single_query(queries, keys, values, slot_valid, observed, scaling, softcap, all_live, maximum)

    summed = torch.zeros(batch, kv_heads, groups if per_head else 1, total, device=keys.device)
    output = None
    first = first_row if values is None else 0  # every row's output is needed
    if values is not None:
        output = values.new_empty(batch, length, kv_heads, groups, head_dim)
    base = total - length  # slot of the forward's first token
    # float32 values, once: multiplying the float32 probabilities by them beats rounding every chunk to bf16
    values_f32 = values.float() if values is not None else None
    padded, partial = _irregular(slot_valid, observed[:, first:], all_live)
    keys_t = keys.transpose(-1, -2)  # (B, H_kv, d, T): a view
    grouped = _scaled(queries[:, :, first:], scaling, softcap, base2=True).reshape(  # only the rows scored
        batch, kv_heads, groups, length - first, head_dim
    )
    budget = chunk_elements(batch, length, heads * head_dim) // (batch * heads)
    row_block = ROW_BLOCK if keys.device.type == "cpu" else length  # accelerators: fewer, larger kernels
    diagonal = None
    start = first
    while start < length:
        stop = min(length, start + min(row_block, _chunk_rows(budget, base + start)))
        rows_in_chunk, visible = stop - start, base + stop
        chunk_queries = grouped[:, :, :, start - first : stop - first].reshape(
            batch, kv_heads, groups * rows_in_chunk, head_dim
        )
        logits = _logits(chunk_queries, keys_t[..., :visible], softcap, base2=True)  # (B, H_kv, G·c, visible)
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
        # Every row keeps at least its own slot (diagonal; an observed row's own slot is live), so sums > 0.
        maxima = logits5.amax(-1, keepdim=True)
        logits.sub_(maxima.view(batch, kv_heads, groups * rows_in_chunk, 1)).exp2_()
        inverse = logits.sum(-1).reciprocal_()  # (B, H_kv, G·c)
        if maximum:  # the reduction needs each row's probabilities: normalise in place, the output then needs none
            logits.mul_(inverse.unsqueeze(-1))
            inverse = torch.ones_like(inverse)
        if output is not None:
            chunk_output = torch.matmul(logits, values_f32[..., :visible, :])
            if not maximum:
                chunk_output.mul_(inverse.unsqueeze(-1))  # both float32 now: no rounding of the normaliser
            output[:, start:stop] = chunk_output.to(values.dtype).view(
                batch, kv_heads, groups, rows_in_chunk, head_dim
            ).permute(0, 3, 1, 2, 4)
        row_weights = inverse
        if padded or partial:
            row_weights = inverse * chunk_observed.to(inverse.dtype).repeat(1, groups)[:, None, :]
        if maximum:  # (B, H_kv, G·c, visible) -> (B, H_kv, 1, visible); unobserved rows count as zero
            chunk_max = (logits * row_weights.unsqueeze(-1)).amax(-2, keepdim=True) if padded or partial else (
                logits.amax(-2, keepdim=True))
            summed[..., :visible] = torch.maximum(summed[..., :visible], chunk_max)
        elif per_head:  # keep the query heads apart for SnapKV's pooling: (B, H_kv, G, 1, c) @ (B, H_kv, G, c, T)
            contribution = torch.matmul(
                row_weights.view(batch, kv_heads, groups, 1, rows_in_chunk), logits5
            ).squeeze(-2)
        else:  # (B, H_kv, 1, G·c) @ (B, H_kv, G·c, T): every row of the group at once
            contribution = torch.matmul(row_weights.unsqueeze(-2), logits)
        if not maximum:
            summed[..., :visible] += contribution
            del contribution
        del logits, logits5
        start = stop
    if per_head:
        flat = summed.flatten(0, 2).unsqueeze(1)
        mode, kernel, direction = pooling
        before = kernel - 1 if direction == "forward" else kernel // 2  # slots each window reaches back
        edge = float("-inf") if mode == "max" else 0.0
        flat = torch.nn.functional.pad(flat, (before, kernel - 1 - before), value=edge)
        summed = POOLS[mode](flat, kernel, stride=1).view_as(summed)
    if output is not None:
        output = output.view(batch, length, heads, head_dim)
    return summed.sum(dim=2), output


def _irregular(slot_valid: torch.Tensor, observed: torch.Tensor, all_live: bool | None) -> tuple[bool, bool]:
    """Whether some slot is dead (padding) and whether some of the given rows are unobserved."""
    if all_live:  # every token is real, and every row is observed
        return False, False
    if slot_valid.device.type != "cpu":  # asking an accelerator would wait for it; the masks are always correct
        return True, True
    return not bool(slot_valid.all()), not bool(observed.all())


def _native_fused(kernel, queries, keys, values, slot_valid, observed, scaling, all_live, maximum,
                  folded: tuple[torch.Tensor, int] | None = None, coded: CodedSlots | None = None):
    """Output and column sums (or maxima) of every row from the compiled kernel (``native.py``), which takes the dead
    slots as an additive bias and the observed rows as weights, and only when there are any; bfloat16 inputs as
    they are where the kernel multiplies them natively (``native.input_dtype``), float32 copies otherwise.
    ``folded`` (a folded layer's decode step, ``folded_single_query``): each slot's KV head (B, T) and the count of
    KV heads, whose pairs all read the one row of keys and values (B, 1, T, d): expanded, a view with no copy.
    ``coded``: a quantized layer's oldest slots, which the kernel dequantizes as it reads them (``keys`` and
    ``values`` then hold the slots after them)."""
    padded, partial = _irregular(slot_valid, observed, all_live)
    none = queries.new_empty(0)
    key_bias = torch.zeros(slot_valid.shape).masked_fill_(~slot_valid, float("-inf")) if padded else none
    row_weight = observed.to(torch.float32).contiguous() if padded or partial else none
    dtype = queries.dtype
    compute = native.input_dtype(kernel, dtype)
    queries, keys, values = (t.to(compute) if t.stride(-1) == 1 else t.to(compute).contiguous()
                             for t in (queries, keys, values))
    slot_head = none
    kv_heads = keys.shape[1]
    if folded is not None:
        slot_head, kv_heads = folded[0].contiguous(), folded[1]
        keys, values = (t.expand(-1, kv_heads, -1, -1) for t in (keys, values))
    summed, output = kernel.fused_attention(
        queries, keys, values, scaling, key_bias, row_weight, maximum, native.ROW_BLOCK, native.KEY_BLOCK, slot_head,
        [] if coded is None else coded.kernel_operands(kv_heads), 0 if coded is None else coded.count,
    )
    return summed, output.to(dtype)


def folded_single_query(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot_valid: torch.Tensor,
                        slot_head: torch.Tensor, kv_heads: int, scaling: float,
                        observed: torch.Tensor | None, all_live: bool | None = None,
                        coded: CodedSlots | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A decode step over a folded layer (``kvcompress/ragged.py``) on the compiled kernel (CPU) or the Triton
    kernel (accelerators, ``triton_attention.folded_decode``): the output (B, 1, H, d) and, with ``observed``
    (B, 1), the most attention the step's query heads give each slot (B, 1, T), else None; None where neither
    serves (no compiler, no Triton). ``all_live``: every slot is known live (the checks are spared). ``coded``: as
    ``observed_attention`` takes it (the compiled kernel reads the codes).

    On the compiled kernel each (sequence, KV head) pair picks its own slots out of the row, copies them contiguous
    and multiplies only them (the Triton kernel skips the blocks without them): a per-head kernel's products, in one
    pass with no mask built per step (the masked sdpa and eager formula it replaces multiplied every query by every
    head's slots and built a (B, H_kv, T) mask and several logit-sized tensors in every layer of every step). A
    slot's score is the most attention its own group gives it, as ``observed_attention(reduce="max")`` scores a
    rectangular layer.
    """
    kernel = native.kernel() if native.supports(queries, keys, values) else None
    if kernel is None:
        if triton_serves(queries, keys, values):
            return triton_attention.folded_decode(queries, keys, values, slot_valid, slot_head, kv_heads, scaling,
                                                  observed, all_live, coded)
        return None
    rows = observed if observed is not None else torch.ones_like(slot_valid[:, :1])
    summed, output = _native_fused(kernel, queries, keys, values, slot_valid, rows, scaling, all_live, True,
                                   folded=(slot_head, kv_heads), coded=coded)
    return output, None if observed is None else summed


def per_head_rows_serve(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether a kernel computes ``per_head_rows_attention`` for tensors like these: the compiled one (CPU) or the
    Triton kernels (accelerators). Asked before the rows are laid out, which copies the layer."""
    return (native.supports(queries, keys, values) and native.kernel() is not None) or triton_serves(
        queries, keys, values)


def per_head_rows_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                             key_valid: torch.Tensor, observed: torch.Tensor,
                             scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (B, q, H, d) and the most attention an observed query of each KV head's group gives each slot
    (B, H_kv, T) of a forward over keys whose live slots differ per KV head: ``key_valid`` (B, H_kv, T) (a folded
    layer's heads laid out as rows, ``ragged.folded_attention``), on the compiled kernel (CPU) or the Triton
    kernels (accelerators), where ``per_head_rows_serve`` says one does."""
    kernel = native.kernel() if native.supports(queries, keys, values) else None
    if kernel is not None:
        return _native_fused(kernel, queries, keys, values, key_valid, observed, scaling, None, True)[::-1]
    scores, output = triton_attention.fused_attention(queries, keys, values, scaling, key_valid, observed,
                                                      maximum=True)
    return output, scores


def triton_serves(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """The Triton kernels take a multi-token fused pass and a folded layer's decode step on accelerators (on CPU
    only when ``TRITON_ON_CPU`` is set, under Triton's interpreter: the tests' way to run the accelerator path); a
    rectangular layer's decode step keeps the torch path, a handful of kernels with no host-device
    synchronisation."""
    if keys.device.type == "cpu" and not TRITON_ON_CPU:
        return False
    return triton_attention.supports(queries, keys, values)


def _triton_fused(queries, keys, values, slot_valid, observed, scaling, all_live, maximum, coded=None):
    """Output and column sums (or maxima) from the Triton kernels; the masks are handed over unless every slot
    is known live (asking the device whether they are would synchronise)."""
    masks = (None, None) if all_live else (slot_valid, observed)
    return triton_attention.fused_attention(queries, keys, values, scaling, *masks, maximum=maximum, coded=coded)


def _chunk_rows(budget_per_head: int, preceding: int) -> int:
    """Rows c whose causal logits fit: c · (preceding + c) <= budget (at least one row)."""
    rows = (math.isqrt(preceding * preceding + 4 * budget_per_head) - preceding) // 2
    return max(1, rows)


def _scaled(queries: torch.Tensor, scaling: float, softcap: float | None, base2: bool) -> torch.Tensor:
    """Queries times the softmax scale and, for base-2 logits without soft-capping, log2 e (so that ``exp2``,
    several times faster than ``exp`` on CPU, gives the same softmax)."""
    return queries * (scaling * (LOG2_E if base2 and not softcap else 1.0))


def _logits(grouped_queries: torch.Tensor, keys_t: torch.Tensor, softcap: float | None, base2: bool) -> torch.Tensor:
    """Float32 logits (B, H_kv, G·c, T) from scaled queries whose group rows are stacked.

    The product runs in the model's dtype (keys are neither repeated nor upcast).
    """
    logits = torch.matmul(grouped_queries, keys_t)
    if logits.dtype != torch.float32:
        logits = logits.float()
    if softcap:
        logits = torch.tanh(logits / softcap) * (softcap * (LOG2_E if base2 else 1.0))
    return logits


def _single_query(queries, keys, values, slot_valid, observed, scaling, softcap, all_live, maximum=False):
    """A decode step: one attention row per query head, no chunking, no host-device synchronisation.

    The query sees every slot (it is the last one), so only dead slots need a mask: skipped when the caller
    knows every slot is live, or on CPU finds so; on accelerators otherwise always applied (cheaper than asking
    the device). On CPU in half precision the products run in float32: a bfloat16 product sets up a oneDNN kernel
    for each new shape, and each decode step gives every layer a new length (one shape per layer once layers keep
    budgets of their own): 12-13 tok/s against 16.3 on the demo prompt with KVzip's shared budget, while float32
    products need no set-up (uniform budgets: 16.7 tok/s either way).
    """
    batch, heads, _, head_dim = queries.shape
    kv_heads = keys.shape[1]
    output_dtype = queries.dtype
    if keys.device.type == "cpu" and keys.dtype != torch.float32:  # see the docstring
        queries, keys = queries.float(), keys.float()
        values = values.float() if values is not None else None
    grouped = _scaled(queries, scaling, softcap, base2=False).reshape(batch, kv_heads, heads // kv_heads, head_dim)
    logits = _logits(grouped, keys.transpose(-1, -2), softcap, base2=False)  # (B, H_kv, G, T)
    if all_live is None and keys.device.type == "cpu":
        all_live = bool(slot_valid.all()) and bool(observed.all())
    if not all_live:
        dead = ~slot_valid & observed  # an unobserved (padding) query keeps finite logits and weight 0
        logits.masked_fill_(dead[:, None, None, :], float("-inf"))
    probabilities = torch.softmax(logits, dim=-1)
    output = None
    if values is not None:
        output = torch.matmul(probabilities.to(values.dtype), values).view(batch, 1, heads, head_dim)
        output = output.to(output_dtype)
    weights = probabilities.amax(2) if maximum else probabilities.sum(2)  # (B, H_kv, T)
    if not all_live:
        weights = weights * observed[:, :, None]
    return weights, output


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
