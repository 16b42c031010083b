"""The scoring pass's blocks per architecture (``triton_attention.block_sizes``): half precision keeps the blocks
the benchmarks chose on every device, float32 gets blocks that fit each device's shared memory (the bytes, compiled
ahead of time, are in docs/gpu.md), an unknown device the smallest, and ``BLOCK_OVERRIDES`` wins."""

import pytest
import torch

from kvcompress.kernels import triton_attention

BENCHMARKED = dict(forward_rows=128, forward_keys=64, column_keys=128, column_rows=64, warps=8, stages=3)


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_keeps_the_benchmarked_blocks(capability, dtype):
    assert triton_attention.block_sizes(128, dtype, capability) == BENCHMARKED


def test_float32_blocks_shrink_with_the_shared_memory():
    hopper, ampere, ada = (triton_attention.block_sizes(128, torch.float32, capability)
                           for capability in ((9, 0), (8, 0), (8, 9)))
    assert hopper == BENCHMARKED
    assert ampere == BENCHMARKED | dict(stages=2)  # 229,888 B at 3 stages: over the A100's 166,912
    assert ada["forward_rows"] * ada["forward_keys"] < ampere["forward_rows"] * ampere["forward_keys"]
    unknown = triton_attention.block_sizes(128, torch.float32, (7, 5))
    assert unknown == ada and triton_attention.shared_memory((7, 5)) == min(triton_attention.SHARED_MEMORY.values())


def test_overrides_win(monkeypatch):
    monkeypatch.setattr(triton_attention, "BLOCK_OVERRIDES", {"stages": 1})
    assert triton_attention.block_sizes(128, torch.float32, (9, 0))["stages"] == 1
