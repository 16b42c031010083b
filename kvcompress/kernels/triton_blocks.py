"""How every Triton kernel is launched on a device: its constexprs (flags and blocks), warps and stages.

A launch that asks for more shared memory per block than its device has fails at its first call
(``OutOfResources``), which Triton's interpreter, the suite's way of running the kernels, never sees. The blocks
are chosen to fit every architecture of ``SHARED_MEMORY``, and both the launch wrappers (``triton_attention.py``)
and the ahead-of-time check (``ahead_of_time.py``, which compiles every launch described here for each of those
architectures on CPU) take their launches from ``scoring_launches`` and ``decode_launches``: what is checked is
what runs. Pure Python: nothing here needs Triton.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Shared memory one thread block may use (the opt-in maximum), bytes: CUDA C++ Programming Guide, "Technical
# Specifications per Compute Capability", maximum amount of shared memory per thread block (163 KB on sm_80 and
# sm_87, 99 KB on sm_86, sm_89 and sm_120, 227 KB on sm_90 and sm_100). A launch that asks for more fails. The
# kernels serve compute capability 8.0 and above (Triton's NVIDIA support; a T4's 64 KB holds no half-precision
# block of the table), and the ahead-of-time test holds every launch to each of these limits.
SHARED_MEMORY = {
    (8, 0): 166_912, (8, 6): 101_376, (8, 7): 166_912, (8, 9): 101_376, (9, 0): 232_448, (10, 0): 232_448,
    (12, 0): 101_376,
}
OLDEST = (8, 0)
# The blocks of the scoring pass and of the folded decode step, per precision and head width; one table fits every
# architecture above (``results/gpu/compile_report.md`` has each launch's bytes, registers and spills). Half
# precision keeps the blocks the benchmarks chose (tensor cores; 98,304 B at head dim 128, within the 99 KB parts'
# 101,376). Float32 multiplies in full precision, which has no tensor-core path: at those blocks ptxas spilled
# tens of kilobytes per thread, at these nothing on any architecture.
_FLOAT32_BLOCKS = dict(forward_rows=16, forward_keys=16, column_keys=32, column_rows=16, warps=4, stages=1,
                       decode_keys=16)
_GPU_BLOCKS: dict[tuple[bool, bool], dict[str, int]] = {  # (half precision, head dim ≤ 128)
    (True, True): dict(forward_rows=128, forward_keys=64, column_keys=128, column_rows=64, warps=8, stages=3,
                       decode_keys=64),
    (True, False): dict(forward_rows=64, forward_keys=32, column_keys=64, column_rows=32, warps=8, stages=2,
                        decode_keys=64),
    (False, True): _FLOAT32_BLOCKS,
    (False, False): _FLOAT32_BLOCKS,
}
# The folded decode step takes a KV group's query heads 16 at a time (the least ``tl.dot`` takes; a larger group,
# as in multi-query models, takes several programs, each reading its KV head's keys once); the merge of its
# partials.
DECODE_ROWS, DECODE_WARPS, DECODE_STAGES = 16, 4, 2
MERGE_WARPS, MERGE_STAGES = 4, 3  # Triton's default stages
# under the interpreter: small blocks, so that the tests' short sequences cross several
_INTERPRETER_BLOCKS = dict(forward_rows=32, forward_keys=16, column_keys=16, column_rows=32, warps=4, stages=1,
                           decode_keys=16)
BLOCK_OVERRIDES: dict[str, int] = {}  # replaces any block size (``benchmarks/gpu/kernel_timing.py`` measures some)


@dataclass(frozen=True)
class Launch:
    """One kernel's launch: the kernel's name in ``triton_kernels``, its compile-time arguments and options."""

    kernel: str
    constexprs: dict[str, int | bool] = field(hash=False)
    warps: int
    stages: int


def shared_memory(capability: tuple[int, int]) -> int:
    """The shared memory per block of a device of compute capability ``capability``; an unlisted one gets the
    smallest listed."""
    return SHARED_MEMORY.get(tuple(capability), min(SHARED_MEMORY.values()))


def block_sizes(head_dim: int, dtype: torch.dtype, interpreted: bool = False) -> dict[str, int]:
    """Rows and keys per program, warps and pipeline stages for ``dtype`` inputs of ``head_dim`` (large blocks for
    the tensor cores: the column pass holds its keys while the query rows stream past, so more keys per program
    read the queries fewer times; stages overlap the loads with the products)."""
    if interpreted:
        return _INTERPRETER_BLOCKS | BLOCK_OVERRIDES
    return _GPU_BLOCKS[(dtype != torch.float32, head_dim <= 128)] | BLOCK_OVERRIDES


def dim_block(head_dim: int) -> int:
    """The head dimension's block: a power of two, at least 16 (``tl.dot``'s smallest)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def _upcast(dtype: torch.dtype, interpreted: bool) -> bool:
    """Products in full float32: float32 inputs (no TF32), and the interpreter (its half-precision products are
    not reliable)."""
    return interpreted or dtype == torch.float32


def _codes(head_dim: int, bits: int, key_group: int, value_group: int) -> dict[str, int]:
    """A quantized layer's codes as the kernels read them: ``bits`` 8 or 4 in groups of ``key_group`` and
    ``value_group`` channels (at most the head's); 16, none."""
    if bits == 16:
        return dict(BITS=16, KEY_GROUP=1, VALUE_GROUP=1)
    return dict(BITS=bits, KEY_GROUP=min(key_group, head_dim), VALUE_GROUP=min(value_group, head_dim))


def scoring_launches(head_dim: int, dtype: torch.dtype, has_valid: bool, has_observed: bool, need_output: bool,
                     maximum: bool, interpreted: bool = False, bits: int = 16, key_group: int = 0,
                     value_group: int = 0) -> tuple[Launch, Launch]:
    """The scoring pass's two launches, ``_forward`` then ``_column_statistics``, for these inputs (``bits`` 8 or
    4: a quantized layer's codes, ``_codes``)."""
    sizes = block_sizes(head_dim, dtype, interpreted)
    codes = _codes(head_dim, bits, key_group, value_group)
    common = dict(HAS_VALID=has_valid, HAS_OBSERVED=has_observed, UPCAST=_upcast(dtype, interpreted),
                  BITS=codes["BITS"], KEY_GROUP=codes["KEY_GROUP"], BLOCK_D=dim_block(head_dim))
    forward = common | dict(NEED_OUTPUT=need_output, VALUE_GROUP=codes["VALUE_GROUP"], BLOCK_M=sizes["forward_rows"],
                            BLOCK_N=sizes["forward_keys"])
    columns = common | dict(MAXIMUM=maximum, BLOCK_M=sizes["column_rows"], BLOCK_N=sizes["column_keys"])
    # codes and their scales add tiles to each of the forward's pipelined stages: one stage fewer keeps it within
    # the 99 KB parts (head dim 128, half precision: 147,456 B at three stages, 98,304 at two)
    forward_stages = sizes["stages"] if bits == 16 else max(1, sizes["stages"] - 1)
    return (Launch("_forward", forward, sizes["warps"], forward_stages),
            Launch("_column_statistics", columns, sizes["warps"], sizes["stages"]))


def decode_launches(head_dim: int, dtype: torch.dtype, has_valid: bool, scores: bool, interpreted: bool = False,
                    bits: int = 16, key_group: int = 0, value_group: int = 0) -> tuple[Launch, Launch]:
    """A folded decode step's two launches, ``_folded_decode`` then ``_merge_splits`` (``bits`` 8 or 4: a quantized
    layer's codes, ``_codes``)."""
    sizes = block_sizes(head_dim, dtype, interpreted)
    blocks = dict(BLOCK_M=DECODE_ROWS, BLOCK_D=dim_block(head_dim))
    decode = blocks | dict(HAS_VALID=has_valid, SCORES=scores, UPCAST=_upcast(dtype, interpreted),
                           **_codes(head_dim, bits, key_group, value_group), BLOCK_N=sizes["decode_keys"])
    return (Launch("_folded_decode", decode, DECODE_WARPS, DECODE_STAGES),
            Launch("_merge_splits", blocks, MERGE_WARPS, MERGE_STAGES))
