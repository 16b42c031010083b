"""The scoring pass on GPUs: attention output and a per-key statistic in two Triton kernels per layer; the decode
step of a folded layer.

A scorer that observes attention (H2O's column sums, KVzip's column maxima) needs every query's softmax weight of
every key, which flash-style kernels never hold: a weight is only final once its row's normaliser is. So the pass
runs twice over the keys, as FlashAttention's backward does:

1. ``_forward``: one program per block of query rows, the keys in blocks, online softmax; writes the output and
   each row's log-sum-exp. Memory: the output and one float per row.
2. ``_column_statistics``: one program per block of keys, the query rows in blocks; recomputes the logits,
   turns them into final weights with the row's log-sum-exp and reduces them over the rows (sum, or maximum)
   without storing any. Memory: one float per key.

Neither holds more than a block of logits, so memory stays linear in the length, and a layer costs two launches
whatever its length (the torch implementation of ``attention.py`` runs a chain of kernels per chunk of rows).

Rows are packed by KV head (grouped-query attention): a program's rows are (token, query head) pairs of one KV
head, token-major, so the keys and values of a block are read once for the whole group and a decode step's
query heads fill one block. A row at forward index i sees the slots up to ``T - q + i`` (the forward's tokens
are the cache's last q slots); an observed row never sees a dead slot (padding), an unobserved one sees every
slot (finite output, never read) and adds nothing to the statistic.

A decode step over a folded (head-wise) layer has a kernel of its own, ``folded_decode``.

The kernels run on any device Triton compiles for, and on CPU tensors under ``TRITON_INTERPRET=1`` (how the tests
check them against a float64 reference without a GPU). Logits use base 2 (``exp2``), with log2 e folded into the
softmax scale; products accumulate in float32, and float32 inputs multiply in full float32 (no TF32), so a
float32 model keeps the tokens of its uncompressed run.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from .flash import flash_attention

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch implementation serves without Triton
    triton = tl = None

LOG2_E = 1.4426950408889634
# The output and log-sum-exp pass: "auto" (torch's flash attention for unmasked half-precision passes on CUDA, the
# Triton forward otherwise), "flash" or "triton"; KVCOMPRESS_GPU_FORWARD sets it for a measurement of both.
FORWARD = os.environ.get("KVCOMPRESS_GPU_FORWARD", "auto")
BLOCK_OVERRIDES: dict[str, int] = {}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available() -> bool:
    """Whether Triton is installed (the kernels then serve GPU tensors, and CPU tensors when interpreted)."""
    return triton is not None


def interpreted() -> bool:
    """Triton's interpreter runs the kernels on CPU tensors (``TRITON_INTERPRET=1`` before Triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def supports(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None) -> bool:
    """The kernels take half and single precision, head sizes up to 256 (keys and values alike), on a device
    Triton compiles for (CUDA, ROCm, XPU), or on CPU tensors when interpreted."""
    tensors = (queries, keys) if values is None else (queries, keys, values)
    if not available() or any(t.dtype not in _DTYPES for t in tensors):
        return False
    if values is not None and values.shape[-1] != keys.shape[-1]:
        return False
    on_device = all(t.device.type in ("cuda", "xpu") for t in tensors)
    on_cpu = interpreted() and all(t.device.type == "cpu" for t in tensors)
    return (on_device or on_cpu) and queries.shape[-1] <= 256


# Shared memory one thread block may use (the opt-in maximum), bytes: CUDA C++ Programming Guide, "Technical
# Specifications per Compute Capability", maximum amount of shared memory per thread block (163 KB on sm_80 and
# sm_87, 99 KB on sm_86, sm_89 and sm_120, 227 KB on sm_90 and sm_100). A launch that asks for more fails.
SHARED_MEMORY = {
    (8, 0): 166_912, (8, 6): 101_376, (8, 7): 166_912, (8, 9): 101_376, (9, 0): 232_448, (10, 0): 232_448,
    (12, 0): 101_376,
}
# The blocks of each kernel of the scoring pass, per precision and head width, for devices of at least a given
# shared memory, largest first (the first a device reaches serves it). Half precision keeps the blocks the
# benchmarks chose (49,152 B at head dim 128, every listed device holds them); float32 tiles take twice the
# bytes, so on smaller parts the stages drop to 2, then the blocks shrink (every entry compiled ahead of time for
# every device above with Triton 3.6 on CPU, its shared memory within the device's: docs/gpu.md has the bytes).
_GPU_BLOCKS: dict[tuple[bool, bool], list[tuple[int, dict[str, int]]]] = {
    # (half precision, head dim ≤ 128)
    (True, True): [(0, dict(forward_rows=128, forward_keys=64, column_keys=128, column_rows=64, warps=8, stages=3))],
    (True, False): [(0, dict(forward_rows=64, forward_keys=32, column_keys=64, column_rows=32, warps=8, stages=2))],
    (False, True): [
        (232_448, dict(forward_rows=128, forward_keys=64, column_keys=128, column_rows=64, warps=8, stages=3)),
        (166_912, dict(forward_rows=128, forward_keys=64, column_keys=128, column_rows=64, warps=8, stages=2)),
        (0, dict(forward_rows=64, forward_keys=32, column_keys=64, column_rows=64, warps=4, stages=2)),
    ],
    (False, False): [
        (166_912, dict(forward_rows=64, forward_keys=32, column_keys=64, column_rows=32, warps=8, stages=2)),
        (0, dict(forward_rows=32, forward_keys=16, column_keys=32, column_rows=32, warps=4, stages=2)),
    ],
}
# small blocks under the interpreter, so that the tests' short sequences cross several blocks
_INTERPRETER_BLOCKS = dict(forward_rows=32, forward_keys=16, column_keys=16, column_rows=32, warps=4, stages=1)
# the folded decode step's launch (its blocks fit every listed device in every precision: at most 86,080 B, float32
# at head dim 256) and the merge of its partials
DECODE_KEYS, DECODE_WARPS, DECODE_STAGES, MERGE_WARPS = 64, 4, 2, 4


def shared_memory(capability: tuple[int, int]) -> int:
    """The shared memory per block of a device of compute capability ``capability``; an unlisted one (a newer or
    an older part, a ROCm device's reported capability) gets the smallest listed, whose blocks fit the most."""
    return SHARED_MEMORY.get(tuple(capability), min(SHARED_MEMORY.values()))


def block_sizes(head_dim: int, dtype: torch.dtype, capability: tuple[int, int]) -> dict[str, int]:
    """Rows and keys per program, warps and pipeline stages of the scoring pass for ``dtype`` inputs of
    ``head_dim`` on a device of compute capability ``capability``: the largest blocks whose shared memory fits
    the device's (large blocks for the tensor cores: the column pass holds its keys while the query rows stream
    past, so more keys per program read the queries fewer times; stages overlap the loads with the products).
    ``BLOCK_OVERRIDES`` replaces any of them (``benchmarks/gpu/kernels.py`` measures the choices)."""
    limit = shared_memory(capability)
    choices = _GPU_BLOCKS[(dtype != torch.float32, head_dim <= 128)]
    sizes = next(sizes for least, sizes in choices if limit >= least)
    return sizes | BLOCK_OVERRIDES


def _launch_sizes(head_dim: int, dtype: torch.dtype, device: torch.device) -> dict[str, int]:
    """The blocks of this launch: the device's, or the interpreter's small ones."""
    if interpreted():
        return _INTERPRETER_BLOCKS | BLOCK_OVERRIDES
    return block_sizes(head_dim, dtype, _capability(device))


@functools.lru_cache(maxsize=8)
def _capability(device: torch.device) -> tuple[int, int]:
    """The device's compute capability (asked once per device); (0, 0), the smallest blocks, off NVIDIA's CUDA."""
    if device.type == "cuda" and torch.version.hip is None:
        return torch.cuda.get_device_capability(device)
    return (0, 0)


def fused_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor | None,
    scaling: float,
    slot_valid: torch.Tensor | None = None,
    observed: torch.Tensor | None = None,
    maximum: bool = False,
    row_block: int | None = None,
    key_block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scores (B, H_kv, T) float32 and, given ``values``, the attention output (B, q, H, d) in the queries' dtype.

    ``queries`` (B, H, q, d) post-RoPE, ``keys`` / ``values`` (B, H_kv, T, d) the cache after this forward's
    update; ``slot_valid`` (B, T) bool marks live slots (or (B, H_kv, T), each KV head's own: a folded layer's
    heads laid out as rows, ``ragged.folded_attention``) and ``observed`` (B, q) bool the rows whose weights count
    (None: all). A score is the sum over the observed rows and the query heads of the slot's KV group of the
    softmax weights (``maximum``: their largest). ``row_block`` / ``key_block`` override the block sizes (tests).
    """
    batch, heads, length, head_dim = queries.shape
    kv_heads, total = keys.shape[1], keys.shape[2]
    groups = heads // kv_heads
    sizes = _launch_sizes(head_dim, queries.dtype, queries.device)
    forward_rows, column_rows = (row_block,) * 2 if row_block else (sizes["forward_rows"], sizes["column_rows"])
    forward_keys, column_keys = (key_block,) * 2 if key_block else (sizes["forward_keys"], sizes["column_keys"])
    dim_block = max(16, triton.next_power_of_2(head_dim))
    device = queries.device
    queries, keys = _unit_stride(queries), _unit_stride(keys)
    need_output = values is not None
    values = _unit_stride(values) if need_output else keys
    lse = torch.empty(batch, heads, length, device=device, dtype=torch.float32)
    scores = torch.empty(batch, kv_heads, total, device=device, dtype=torch.float32)
    valid = (slot_valid.to(device=device, dtype=torch.int8).contiguous() if slot_valid is not None
             else torch.empty(0, device=device, dtype=torch.int8))
    rows_seen = (observed.to(device=device, dtype=torch.int8).contiguous() if observed is not None
                 else torch.empty(0, device=device, dtype=torch.int8))
    # where a sequence's, and a KV head's, validity starts: one row for every head, or one each
    valid_strides = (valid.stride(0), valid.stride(1) if valid.dim() == 3 else 0) if slot_valid is not None else (0, 0)
    common = dict(
        HAS_VALID=slot_valid is not None, HAS_OBSERVED=observed is not None, BLOCK_D=dim_block,
        UPCAST=interpreted() or queries.dtype == torch.float32, num_warps=sizes["warps"],
        num_stages=sizes["stages"],
    )
    flashed = None
    if need_output and slot_valid is None and observed is None and _flash_serves(queries):
        flashed = _flash_forward(queries, keys, values, scaling)
    if flashed is not None:
        output, lse = flashed
    else:
        output = queries.new_empty(batch, length, heads, head_dim) if need_output else queries.new_empty(0)
        _forward[(triton.cdiv(groups * length, forward_rows), batch * kv_heads)](
            queries, keys, values, output, lse, valid, rows_seen,
            *queries.stride()[:3], *keys.stride()[:3], *values.stride()[:3],
            *(output.stride()[:3] if need_output else (0, 0, 0)), *valid_strides,
            kv_heads, groups, length, total, head_dim, scaling * LOG2_E,
            NEED_OUTPUT=need_output, BLOCK_M=forward_rows, BLOCK_N=forward_keys, **common,
        )
    _column_statistics[(triton.cdiv(total, column_keys), batch * kv_heads)](
        queries, keys, lse, scores, valid, rows_seen,
        *queries.stride()[:3], *keys.stride()[:3], *valid_strides,
        kv_heads, groups, length, total, head_dim, scaling * LOG2_E,
        MAXIMUM=maximum, BLOCK_M=column_rows, BLOCK_N=column_keys, **common,
    )
    return scores, (output if need_output else None)


def folded_decode(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot_valid: torch.Tensor,
                  slot_head: torch.Tensor, kv_heads: int, scaling: float, observed: torch.Tensor | None = None,
                  all_live: bool | None = None, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A decode step over a folded layer (``kvcompress/ragged.py``): the output (B, 1, H, d) in the queries' dtype
    and, with ``observed`` (B, 1), the most attention the step's query heads give each slot (B, 1, M) float32, else
    None. ``queries`` (B, H, 1, d); ``keys`` / ``values`` (B, 1, M, d), the heads' slots in one row; ``slot_valid``
    and ``slot_head`` (B, M) say which slots are live and whose they are; ``all_live`` spares the validity loads.

    Split-key (flash-decoding): a program takes one (sequence, KV head) pair and a chunk of ``chunk`` slots (sized
    so that the device's processors all have work), multiplies the group's query heads by the slots of its own head
    only and keeps a partial softmax; a second launch merges the partials by their maxima. A block of
    slots that holds none of the pair's is skipped after reading the slots' heads (a fold leaves each head's slots
    in one stretch), so the keys and values are read once in all, as a per-head cache's decode step reads them: the
    masked multi-query attention it replaces read them once too, but wrote, masked and normalised a float32 logit
    for every query head and slot of every head, and built a mask, in every layer of every step. The scores use
    the logits the kernel stores for its own slots and each row's final log-sum-exp."""
    batch, heads, _, head_dim = queries.shape
    total = keys.shape[-2]
    groups = heads // kv_heads
    device = queries.device
    queries, keys, values = (_unit_stride(t) for t in (queries, keys, values))
    block_keys = 16 if interpreted() else DECODE_KEYS
    blocks = dict(BLOCK_M=max(16, triton.next_power_of_2(groups)), BLOCK_D=max(16, triton.next_power_of_2(head_dim)))
    if chunk is None:
        chunk = _decode_chunk(total, batch, device, block_keys)
    splits = triton.cdiv(total, chunk)
    part_max = torch.empty(batch * kv_heads, splits, groups, device=device, dtype=torch.float32)
    part_sum = torch.empty_like(part_max)
    part_output = torch.empty(batch * kv_heads, splits, groups, head_dim, device=device, dtype=torch.float32)
    logits = (torch.empty(batch, groups, total, device=device, dtype=torch.float32) if observed is not None
              else part_max.new_empty(0))
    valid = (slot_valid.to(torch.int8).contiguous() if not all_live
             else torch.empty(0, device=device, dtype=torch.int8))
    _folded_decode[(splits, batch * kv_heads)](
        queries, keys, values, slot_head.contiguous(), valid, part_max, part_sum, part_output, logits,
        queries.stride(0), queries.stride(1), keys.stride(0), keys.stride(2), values.stride(0), values.stride(2),
        kv_heads, groups, total, head_dim, chunk, splits, scaling * LOG2_E,
        HAS_VALID=not all_live, SCORES=observed is not None, UPCAST=interpreted() or queries.dtype == torch.float32,
        BLOCK_N=block_keys, num_warps=DECODE_WARPS, num_stages=DECODE_STAGES, **blocks,
    )
    output = queries.new_empty(batch, 1, heads, head_dim)
    lse = torch.empty(batch, heads, device=device, dtype=torch.float32)
    _merge_splits[(batch * kv_heads,)](part_max, part_sum, part_output, output, lse, groups, head_dim, splits,
                                       num_warps=MERGE_WARPS, **blocks)
    if observed is None:
        return output, None
    # a slot's score: the most any query head of its group gives it, 2^(logit - the row's log-sum-exp)
    own_lse = lse.view(batch, kv_heads, groups).gather(1, slot_head.unsqueeze(-1).expand(-1, -1, groups))  # (B, M, G)
    scores = torch.exp2(logits.transpose(1, 2) - own_lse).amax(-1)
    scores = torch.where(slot_valid & observed, scores, 0.0)
    return output, scores.unsqueeze(1)


def _decode_chunk(total: int, batch: int, device: torch.device, block_keys: int) -> int:
    """Slots per program of a folded decode step: about two programs with work per processor (a chunk inside one
    head's stretch has work for one of the KV heads' programs only), at least one block of keys; under the
    interpreter two blocks, so that the tests' short rows cross several chunks."""
    if interpreted():
        return 2 * block_keys
    chunk = triton.cdiv(total * batch, 2 * _processors(device))
    return max(block_keys, triton.cdiv(chunk, block_keys) * block_keys)


@functools.lru_cache(maxsize=8)
def _processors(device: torch.device) -> int:
    """The device's streaming multiprocessors (asked once per device, not in every layer of every step)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 64


def _flash_serves(queries: torch.Tensor) -> bool:
    """torch's flash attention computes the output and the log-sum-exp (``FORWARD="flash"``, or ``"auto"`` on CUDA
    in half precision); the Triton forward serves masks, float32 (in full precision) and the interpreter."""
    if FORWARD != "auto":
        return FORWARD == "flash"
    return queries.device.type == "cuda" and queries.dtype != torch.float32 and queries.shape[-1] <= 256


def _flash_forward(queries, keys, values, scaling: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Output (B, q, H, d) and base-2 log-sum-exp (B, H, q) from torch's flash attention: the forward's own tokens
    as a square causal block and, after a cached prefix, the prefix with no mask, merged by their log-sum-exps
    (flash's causal mask is not aligned to the end of a longer key sequence in every torch). None where this
    device's torch has no flash attention for these inputs (the Triton forward then serves, from then on)."""
    global _flash_failed
    if _flash_failed:
        return None
    try:
        output, lse = flash_attention(queries, keys, values, scaling)
        return output.transpose(1, 2).contiguous(), lse * LOG2_E
    except RuntimeError as error:  # an older GPU, an unsupported head size
        _flash_failed = True
        warnings.warn(f"kvcompress: torch's flash attention is unavailable here ({error}); the Triton forward "
                      "computes the scoring pass's output", RuntimeWarning, stacklevel=3)
        return None


_flash_failed = False


def _unit_stride(tensor: torch.Tensor) -> torch.Tensor:
    """The kernels address rows and heads by stride, the head dimension contiguously."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


if triton is not None:

    @triton.jit
    def _dot(a, b, UPCAST: tl.constexpr):
        """a @ b with float32 accumulation. UPCAST: in float32 precision (float32 inputs: no TF32; under the
        interpreter, whose half-precision products are not reliable, exact products of the half inputs)."""
        if UPCAST:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _load_rows(Q, q_batch, stride_qh, stride_qm, kv_head, groups, length, row, dims, head_dim):
        """The queries of packed rows ``row`` (token-major: row = token · groups + head in group) (M, D)."""
        token = row // groups
        head = kv_head * groups + row % groups
        pointers = Q + q_batch + head[:, None] * stride_qh + token[:, None] * stride_qm + dims[None, :]
        return tl.load(pointers, mask=(token < length)[:, None] & (dims < head_dim)[None, :], other=0.0)

    # lengths, and the strides that follow them, change from call to call: compiled once, not per value
    _VARYING = ["stride_qb", "stride_qh", "stride_kb", "stride_kh", "stride_validb", "stride_validh", "length", "total"]

    @triton.jit(do_not_specialize=[*_VARYING, "stride_vb", "stride_vh", "stride_ob", "stride_om"])
    def _forward(
        Q, K, V, OUT, LSE, VALID, OBSERVED,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
        stride_ob, stride_om, stride_oh, stride_validb, stride_validh,
        kv_heads, groups, length, total, head_dim, scale,
        HAS_VALID: tl.constexpr, HAS_OBSERVED: tl.constexpr, NEED_OUTPUT: tl.constexpr, UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        block, pair = tl.program_id(0), tl.program_id(1)
        batch, kv_head = pair // kv_heads, pair % kv_heads
        base = total - length
        row = block * BLOCK_M + tl.arange(0, BLOCK_M)
        token = row // groups
        real = token < length
        dims = tl.arange(0, BLOCK_D)
        q = _load_rows(Q, batch.to(tl.int64) * stride_qb, stride_qh, stride_qm, kv_head, groups, length, row, dims,
                       head_dim)
        if HAS_OBSERVED:
            observed = tl.load(OBSERVED + batch * length + token, mask=real, other=0) != 0
        else:
            observed = real
        k_base = K + batch.to(tl.int64) * stride_kb + kv_head * stride_kh
        v_base = V + batch.to(tl.int64) * stride_vb + kv_head * stride_vh
        valid_base = VALID + batch.to(tl.int64) * stride_validb + kv_head * stride_validh
        tokens_seen = (block * BLOCK_M + BLOCK_M - 1) // groups + 1
        if tokens_seen > length:
            tokens_seen = length
        end = base + tokens_seen  # the block's last row sees no slot past this
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(0, end, BLOCK_N):
            slot = start + tl.arange(0, BLOCK_N)
            inside = slot < total
            k = tl.load(k_base + slot[None, :] * stride_kn + dims[:, None],
                        mask=inside[None, :] & (dims < head_dim)[:, None], other=0.0)
            logits = _dot(q, k, UPCAST) * scale
            allowed = inside[None, :] & (slot[None, :] <= base + token[:, None])
            if HAS_VALID:
                live = tl.load(valid_base + slot, mask=inside, other=0) != 0
                allowed = allowed & (live[None, :] | ~observed[:, None])
            logits = tl.where(allowed, logits, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(logits, 1))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no live slot yet
            p = tl.exp2(logits - shift[:, None])
            alpha = tl.exp2(m_i - shift)
            l_i = l_i * alpha + tl.sum(p, 1)
            if NEED_OUTPUT:
                v = tl.load(v_base + slot[:, None] * stride_vn + dims[None, :],
                            mask=inside[:, None] & (dims < head_dim)[None, :], other=0.0)
                acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
            m_i = m_new
        head = kv_head * groups + row % groups
        tl.store(LSE + (batch * kv_heads * groups + head) * length + token, m_i + tl.log2(l_i), mask=real)
        if NEED_OUTPUT:
            out = acc / l_i[:, None]
            pointers = (OUT + batch.to(tl.int64) * stride_ob + token[:, None] * stride_om + head[:, None] * stride_oh
                        + dims[None, :])
            tl.store(pointers, out.to(OUT.dtype.element_ty), mask=real[:, None] & (dims < head_dim)[None, :])

    @triton.jit(do_not_specialize=_VARYING)
    def _column_statistics(
        Q, K, LSE, SCORES, VALID, OBSERVED,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_validb, stride_validh,
        kv_heads, groups, length, total, head_dim, scale,
        HAS_VALID: tl.constexpr, HAS_OBSERVED: tl.constexpr, MAXIMUM: tl.constexpr, UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        block, pair = tl.program_id(0), tl.program_id(1)
        batch, kv_head = pair // kv_heads, pair % kv_heads
        base = total - length
        slot = block * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = slot < total
        dims = tl.arange(0, BLOCK_D)
        k_base = K + batch.to(tl.int64) * stride_kb + kv_head * stride_kh
        k = tl.load(k_base + slot[None, :] * stride_kn + dims[:, None],
                    mask=inside[None, :] & (dims < head_dim)[:, None], other=0.0)
        counted = inside
        if HAS_VALID:
            valid_base = VALID + batch.to(tl.int64) * stride_validb + kv_head * stride_validh
            counted = counted & (tl.load(valid_base + slot, mask=inside, other=0) != 0)
        if MAXIMUM:
            acc = tl.full([BLOCK_N], float("-inf"), tl.float32)
        else:
            acc = tl.zeros([BLOCK_N], tl.float32)
        rows = groups * length
        first_token = block * BLOCK_N - base  # earlier rows see none of these slots
        if first_token < 0:
            first_token = 0
        for start in range(first_token * groups // BLOCK_M * BLOCK_M, rows, BLOCK_M):
            row = start + tl.arange(0, BLOCK_M)
            token = row // groups
            real = token < length
            q = _load_rows(Q, batch.to(tl.int64) * stride_qb, stride_qh, stride_qm, kv_head, groups, length, row, dims,
                           head_dim)
            head = kv_head * groups + row % groups
            lse = tl.load(LSE + (batch * kv_heads * groups + head) * length + token, mask=real, other=0.0)
            if HAS_OBSERVED:
                real = real & (tl.load(OBSERVED + batch * length + token, mask=real, other=0) != 0)
            logits = _dot(q, k, UPCAST) * scale - lse[:, None]
            allowed = real[:, None] & counted[None, :] & (slot[None, :] <= base + token[:, None])
            if MAXIMUM:
                acc = tl.maximum(acc, tl.max(tl.where(allowed, logits, float("-inf")), 0))
            else:
                acc += tl.sum(tl.where(allowed, tl.exp2(logits), 0.0), 0)
        if MAXIMUM:
            acc = tl.exp2(acc)
        tl.store(SCORES + pair * total + slot, acc, mask=inside)

    @triton.jit(do_not_specialize=["splits"])
    def _merge_splits(PART_MAX, PART_SUM, PART_OUTPUT, OUT, LSE, groups, head_dim, splits,
                      BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """One (sequence, KV head) pair's output rows (B, 1, H, d), contiguous, from its chunks' partial softmaxes
        (a chunk with none of the pair's slots has maximum -inf and weighs 0), and each row's base-2 log-sum-exp."""
        pair = tl.program_id(0)
        row = tl.arange(0, BLOCK_M)
        real = row < groups
        dims = tl.arange(0, BLOCK_D)
        in_head = real[:, None] & (dims < head_dim)[None, :]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for split in range(0, splits):
            part = (pair * splits + split) * groups + row
            m_split = tl.load(PART_MAX + part, mask=real, other=float("-inf"))
            m_new = tl.maximum(m_i, m_split)
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha, weight = tl.exp2(m_i - shift), tl.exp2(m_split - shift)
            l_i = l_i * alpha + tl.load(PART_SUM + part, mask=real, other=0.0) * weight
            partial = tl.load(PART_OUTPUT + part[:, None] * head_dim + dims[None, :], mask=in_head, other=0.0)
            acc = acc * alpha[:, None] + partial * weight[:, None]
            m_i = m_new
        head = pair * groups + row  # sequence · H + KV head · G + row: the row's query head, counted over the batch
        l_i = tl.where(real, l_i, 1.0)  # the block's rows past the group hold nothing
        tl.store(LSE + head, m_i + tl.log2(l_i), mask=real)
        tl.store(OUT + head[:, None] * head_dim + dims[None, :], (acc / l_i[:, None]).to(OUT.dtype.element_ty),
                 mask=in_head)

    @triton.jit(do_not_specialize=["stride_qb", "stride_kb", "stride_vb", "total", "chunk", "splits"])
    def _folded_decode(
        Q, K, V, SLOT_HEAD, VALID, PART_MAX, PART_SUM, PART_OUTPUT, LOGITS,
        stride_qb, stride_qh, stride_kb, stride_kn, stride_vb, stride_vn,
        kv_heads, groups, total, head_dim, chunk, splits, scale,
        HAS_VALID: tl.constexpr, SCORES: tl.constexpr, UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        split, pair = tl.program_id(0), tl.program_id(1)
        batch, kv_head = pair // kv_heads, pair % kv_heads
        row = tl.arange(0, BLOCK_M)  # the group's query heads
        real = row < groups
        dims = tl.arange(0, BLOCK_D)
        in_head = dims < head_dim
        q = tl.load(Q + batch.to(tl.int64) * stride_qb + (kv_head * groups + row)[:, None] * stride_qh + dims[None, :],
                    mask=real[:, None] & in_head[None, :], other=0.0)
        k_base = K + batch.to(tl.int64) * stride_kb
        v_base = V + batch.to(tl.int64) * stride_vb
        slot_base = batch.to(tl.int64) * total
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        begin = split * chunk
        end = begin + chunk
        if end > total:
            end = total
        for start in range(begin, end, BLOCK_N):
            slot = start + tl.arange(0, BLOCK_N)
            inside = slot < end
            mine = inside & (tl.load(SLOT_HEAD + slot_base + slot, mask=inside, other=-1) == kv_head)
            if HAS_VALID:
                mine = mine & (tl.load(VALID + slot_base + slot, mask=inside, other=0) != 0)
            if tl.max(mine.to(tl.int32), 0) > 0:  # another head's stretch: nothing to read
                k = tl.load(k_base + slot[None, :] * stride_kn + dims[:, None], mask=mine[None, :] & in_head[:, None],
                            other=0.0)
                logits = tl.where(mine[None, :], _dot(q, k, UPCAST) * scale, float("-inf"))
                if SCORES:
                    tl.store(LOGITS + (batch * groups + row[:, None]).to(tl.int64) * total + slot[None, :], logits,
                             mask=real[:, None] & mine[None, :])
                m_new = tl.maximum(m_i, tl.max(logits, 1))
                shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp2(logits - shift[:, None])
                alpha = tl.exp2(m_i - shift)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(v_base + slot[:, None] * stride_vn + dims[None, :], mask=mine[:, None] & in_head[None, :],
                            other=0.0)
                acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
                m_i = m_new
        part = (pair * splits + split) * groups + row
        tl.store(PART_MAX + part, m_i, mask=real)
        tl.store(PART_SUM + part, l_i, mask=real)
        tl.store(PART_OUTPUT + part[:, None] * head_dim + dims[None, :], acc, mask=real[:, None] & in_head[None, :])
