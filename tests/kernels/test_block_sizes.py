"""The kernels' launches (``triton_blocks``): half precision keeps the blocks the benchmarks chose, float32 takes
blocks ptxas compiles without spills (``test_ahead_of_time.py`` compiles them all for every architecture),
``BLOCK_OVERRIDES`` wins, a folded decode step's query heads come in blocks of 16 (several programs for a larger
group), and an NVIDIA device older than compute capability 8.0 takes the torch path."""

import pytest
import torch

from kvcompress.kernels import triton_attention, triton_blocks

BENCHMARKED = dict(forward_rows=128, forward_keys=64, column_keys=128, column_rows=64, warps=8, stages=3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_keeps_the_benchmarked_blocks(dtype):
    assert triton_blocks.block_sizes(128, dtype).items() >= BENCHMARKED.items()
    assert triton_blocks.block_sizes(64, dtype) == triton_blocks.block_sizes(128, dtype)


def test_float32_takes_small_blocks():
    sizes = triton_blocks.block_sizes(128, torch.float32)
    assert sizes["forward_rows"] * sizes["forward_keys"] < BENCHMARKED["forward_rows"] * BENCHMARKED["forward_keys"]
    assert sizes["decode_keys"] < triton_blocks.block_sizes(128, torch.bfloat16)["decode_keys"]


def test_overrides_win(monkeypatch):
    monkeypatch.setattr(triton_blocks, "BLOCK_OVERRIDES", {"stages": 1})
    assert triton_blocks.block_sizes(128, torch.bfloat16)["stages"] == 1
    forward, columns = triton_blocks.scoring_launches(128, torch.bfloat16, True, True, True, False)
    assert forward.stages == columns.stages == 1


def test_a_decode_step_takes_query_heads_in_blocks_of_16():
    decode, merge = triton_blocks.decode_launches(256, torch.bfloat16, True, True)
    assert decode.constexprs["BLOCK_M"] == merge.constexprs["BLOCK_M"] == 16
    assert decode.constexprs["BLOCK_D"] == 256 and not decode.constexprs["UPCAST"]
    assert triton_blocks.decode_launches(80, torch.float32, True, True)[0].constexprs["BLOCK_D"] == 128


@pytest.mark.parametrize("capability, served", [((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_older_nvidia_devices_take_the_torch_path(monkeypatch, capability, served):
    monkeypatch.setattr(triton_attention, "_capability", lambda device: capability)
    assert triton_attention.serves(torch.device("cuda")) == served
