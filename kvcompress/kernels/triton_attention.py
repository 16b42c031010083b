"""The Triton kernels' launches on accelerators (and on CPU tensors under ``TRITON_INTERPRET=1``, how the tests
check them against a float64 reference without a GPU): the scoring pass (``fused_attention``: the attention
output and a per-key statistic, two kernels per layer, or torch's flash attention and one) and the decode step of
a folded (head-wise) layer (``folded_decode``). The kernels are in ``triton_kernels.py``; their blocks, warps and
stages per device in ``triton_blocks.py``.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import TYPE_CHECKING

import torch

from . import triton_blocks, triton_kernels
from .flash import flash_attention
from .triton_kernels import triton

if TYPE_CHECKING:
    from ..quantization import CodedSlots

LOG2_E = 1.4426950408889634
# The output and log-sum-exp pass: "auto" (torch's flash attention for unmasked half-precision passes on CUDA, the
# Triton forward otherwise), "flash" or "triton"; KVCOMPRESS_GPU_FORWARD sets it for a measurement of both.
FORWARD = os.environ.get("KVCOMPRESS_GPU_FORWARD", "auto")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available() -> bool:
    """Whether Triton is installed (the kernels then serve GPU tensors, and CPU tensors when interpreted)."""
    return triton is not None


def interpreted() -> bool:
    """Triton's interpreter runs the kernels on CPU tensors (``TRITON_INTERPRET=1`` before Triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def supports(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None) -> bool:
    """The kernels take half and single precision, head sizes up to 256 (keys and values alike), on one device
    that ``serves``."""
    tensors = (queries, keys) if values is None else (queries, keys, values)
    if not available() or any(t.dtype not in _DTYPES for t in tensors):
        return False
    if values is not None and values.shape[-1] != keys.shape[-1]:
        return False
    devices = {t.device for t in tensors}
    return len(devices) == 1 and serves(devices.pop()) and queries.shape[-1] <= 256


def serves(device: torch.device) -> bool:
    """A device Triton compiles the kernels for: ROCm, XPU, NVIDIA from compute capability 8.0
    (``triton_blocks.OLDEST``; an older one takes the torch path), or the CPU when interpreted."""
    if device.type == "cpu":
        return interpreted()
    return device.type in ("cuda", "xpu") and _capability(device) >= triton_blocks.OLDEST


def launch(kernel: triton_blocks.Launch, grid: tuple[int, ...], *arguments) -> None:
    """Runs one of ``triton_kernels``'s kernels as ``kernel`` describes it."""
    getattr(triton_kernels, kernel.kernel)[grid](*arguments, **kernel.constexprs, num_warps=kernel.warps,
                                                 num_stages=kernel.stages)


def fused_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor | None,
    scaling: float,
    slot_valid: torch.Tensor | None = None,
    observed: torch.Tensor | None = None,
    maximum: bool = False,
    coded: CodedSlots | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scores (B, H_kv, T) float32 and, given ``values``, the attention output (B, q, H, d) in the queries' dtype.

    ``queries`` (B, H, q, d) post-RoPE, ``keys`` / ``values`` (B, H_kv, T, d) the cache after this forward's
    update; ``slot_valid`` (B, T) bool marks live slots (or (B, H_kv, T), each KV head's own: a folded layer's
    heads laid out as rows, ``ragged.folded_attention``) and ``observed`` (B, q) bool the rows whose weights count
    (None: all). A score is the sum over the observed rows and the query heads of the slot's KV group of the
    softmax weights (``maximum``: their largest). ``coded``: a quantized layer's oldest slots, which the kernels
    dequantize as they read them (``keys`` and ``values`` then hold the slots after them).
    """
    batch, heads, length, head_dim = queries.shape
    kv_heads = keys.shape[1]
    total = keys.shape[2] if coded is None else coded.slots
    groups = heads // kv_heads
    device = queries.device
    queries, keys = _unit_stride(queries), _unit_stride(keys)
    need_output = values is not None
    values = _unit_stride(values) if need_output else keys
    packed, code_settings = _code_operands(coded, kv_heads, device)
    forward, columns = triton_blocks.scoring_launches(head_dim, queries.dtype, slot_valid is not None,
                                                      observed is not None, need_output, maximum, interpreted(),
                                                      **code_settings)
    code_strides = [*packed[0].stride()[:3], *packed[1].stride()[:3]]  # codes, key scales: (B, H_kv, S)
    lse = torch.empty(batch, heads, length, device=device, dtype=torch.float32)
    scores = torch.empty(batch, kv_heads, total, device=device, dtype=torch.float32)
    valid = (slot_valid.to(device=device, dtype=torch.int8).contiguous() if slot_valid is not None
             else torch.empty(0, device=device, dtype=torch.int8))
    rows_seen = (observed.to(device=device, dtype=torch.int8).contiguous() if observed is not None
                 else torch.empty(0, device=device, dtype=torch.int8))
    # where a sequence's, and a KV head's, validity starts: one row for every head, or one each
    valid_strides = (valid.stride(0), valid.stride(1) if valid.dim() == 3 else 0) if slot_valid is not None else (0, 0)
    flashed = None
    if need_output and slot_valid is None and observed is None and coded is None and _flash_serves(queries):
        flashed = _flash_forward(queries, keys, values, scaling)
    if flashed is not None:
        output, lse = flashed
    else:
        output = queries.new_empty(batch, length, heads, head_dim) if need_output else queries.new_empty(0)
        launch(forward, (triton.cdiv(groups * length, forward.constexprs["BLOCK_M"]), batch * kv_heads),
               queries, keys, values, *packed, output, lse, valid, rows_seen,
               *queries.stride()[:3], *keys.stride()[:3], *values.stride()[:3], *code_strides,
               *packed[4].stride()[:3], *(output.stride()[:3] if need_output else (0, 0, 0)), *valid_strides,
               kv_heads, groups, length, total, _coded_count(coded), head_dim, scaling * LOG2_E)
    launch(columns, (triton.cdiv(total, columns.constexprs["BLOCK_N"]), batch * kv_heads),
           queries, keys, *packed[:3], lse, scores, valid, rows_seen, *queries.stride()[:3], *keys.stride()[:3],
           *code_strides, *valid_strides, kv_heads, groups, length, total, _coded_count(coded), head_dim,
           scaling * LOG2_E)
    return scores, (output if need_output else None)


def folded_decode(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot_valid: torch.Tensor,
                  slot_head: torch.Tensor, kv_heads: int, scaling: float, observed: torch.Tensor | None = None,
                  all_live: bool | None = None,
                  coded: CodedSlots | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A decode step over a folded layer (``kvcompress/ragged.py``): the output (B, 1, H, d) in the queries' dtype
    and, with ``observed`` (B, 1), the most attention the step's query heads give each slot (B, 1, M) float32, else
    None. ``queries`` (B, H, 1, d); ``keys`` / ``values`` (B, 1, M, d), the heads' slots in one row; ``slot_valid``
    and ``slot_head`` (B, M) say which slots are live and whose they are; ``all_live`` spares the validity loads.
    ``coded``: a quantized layer's oldest slots, which the kernel dequantizes as it reads them (``keys`` and
    ``values`` then hold the slots after them).

    Split-key (flash-decoding): a program takes one (sequence, KV head) pair, a block of its group's query heads
    and a chunk of slots (sized so that the device's processors all have work), multiplies the query heads by the
    slots of its own head only and keeps a partial softmax; a second launch merges the partials by their maxima. A
    block of slots that holds none of the pair's is skipped after reading the slots' heads (a fold leaves each
    head's slots in one stretch), so the keys and values are read once per block of query heads, as a per-head
    cache's decode step reads them: the masked multi-query attention it replaces wrote, masked and normalised a
    float32 logit for every query head and slot of every head, and built a mask, in every layer of every step. The
    scores use the logits the kernel stores for its own slots and each row's final log-sum-exp."""
    batch, heads, _, head_dim = queries.shape
    total = keys.shape[-2] if coded is None else coded.slots
    groups = heads // kv_heads
    device = queries.device
    queries, keys, values = (_unit_stride(t) for t in (queries, keys, values))
    packed, code_settings = _code_operands(coded, 1, device)  # the folded layer's one row
    decode, merge = triton_blocks.decode_launches(head_dim, queries.dtype, not all_live, observed is not None,
                                                  interpreted(), **code_settings)
    chunk = _decode_chunk(total, batch, device, decode.constexprs["BLOCK_N"])
    splits, row_blocks = triton.cdiv(total, chunk), triton.cdiv(groups, decode.constexprs["BLOCK_M"])
    part_max = torch.empty(batch * kv_heads, splits, groups, device=device, dtype=torch.float32)
    part_sum = torch.empty_like(part_max)
    part_output = torch.empty(batch * kv_heads, splits, groups, head_dim, device=device, dtype=torch.float32)
    logits = (torch.empty(batch, groups, total, device=device, dtype=torch.float32) if observed is not None
              else part_max.new_empty(0))
    valid = (slot_valid.to(torch.int8).contiguous() if not all_live
             else torch.empty(0, device=device, dtype=torch.int8))
    launch(decode, (splits, batch * kv_heads, row_blocks),
           queries, keys, values, *packed, slot_head.contiguous(), valid, part_max, part_sum, part_output, logits,
           queries.stride(0), queries.stride(1), keys.stride(0), keys.stride(2), values.stride(0), values.stride(2),
           packed[0].stride(0), packed[0].stride(2), packed[1].stride(0), packed[1].stride(2), packed[4].stride(0),
           packed[4].stride(2), kv_heads, groups, total, _coded_count(coded), head_dim, chunk, splits, scaling * LOG2_E)
    output = queries.new_empty(batch, 1, heads, head_dim)
    lse = torch.empty(batch, heads, device=device, dtype=torch.float32)
    launch(merge, (batch * kv_heads, row_blocks), part_max, part_sum, part_output, output, lse, groups, head_dim,
           splits)
    if observed is None:
        return output, None
    # a slot's score: the most any query head of its group gives it, 2^(logit - the row's log-sum-exp)
    own_lse = lse.view(batch, kv_heads, groups).gather(1, slot_head.unsqueeze(-1).expand(-1, -1, groups))  # (B, M, G)
    scores = torch.exp2(logits.transpose(1, 2) - own_lse).amax(-1)
    scores = torch.where(slot_valid & observed, scores, 0.0)
    return output, scores.unsqueeze(1)


def _code_operands(coded: CodedSlots | None, heads: int,
                   device: torch.device) -> tuple[list[torch.Tensor], dict[str, int]]:
    """A quantized layer's codes, scales and minimums, its keys' then its values', (B, ``heads``, S, ...) as the
    kernels read them, and the launches' settings for them; for a layer without codes, placeholders the kernels
    never read."""
    if coded is None:
        return ([torch.empty(0, 1, 1, 1, device=device, dtype=dtype)
                 for dtype in (torch.uint8, torch.float16, torch.float16) * 2], dict(bits=16))
    return ([_unit_stride(tensor) for tensor in coded.kernel_operands(heads)],
            dict(bits=coded.keys.bits, key_group=coded.keys.group_size, value_group=coded.values.group_size))


def _coded_count(coded: CodedSlots | None) -> int:
    return 0 if coded is None else coded.count


@functools.lru_cache(maxsize=8)
def _capability(device: torch.device) -> tuple[int, int]:
    """An NVIDIA device's compute capability (asked once per device); ROCm's and XPU's count as supported."""
    if device.type == "cuda" and torch.version.hip is None:
        return torch.cuda.get_device_capability(device)
    return triton_blocks.OLDEST


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
