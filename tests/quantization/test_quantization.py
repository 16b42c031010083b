"""The quantizer (``kvcompress/quantization.py``) against a float64 definition of the same affine grid: codes,
packing (two 4-bit codes a byte), the error bound, constant groups, and the bytes per slot."""

import pytest
import torch

from kvcompress.quantization import PackedSlots, check_layout, dequantize, quantize


def _reference(tensor: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """The dequantized tensor by the definition, in float64, one group at a time."""
    top = 2**bits - 1
    out = torch.empty_like(tensor, dtype=torch.float64)
    flat, result = tensor.double().reshape(-1, group_size), out.view(-1, group_size)
    half = lambda x: float(torch.tensor(x, dtype=torch.float16))  # noqa: E731 - as stored
    for row, group in enumerate(flat):
        low = half(group.min().item())
        scale = half((group.max().item() - low) / top) or 1.0
        result[row] = low + torch.clamp(torch.round((group - low) / scale), 0, top) * scale
    return out


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_matches_the_float64_definition(bits, dtype):
    generator = torch.Generator().manual_seed(0)
    tensor = (torch.randn(2, 3, 17, 64, generator=generator) * 3 + 1).to(dtype)
    tensor[0, 0, :, :32] += 40  # one-signed groups, far from zero (as a channel over tokens often is)
    packed = quantize(tensor, bits, 32)
    assert packed.codes.dtype == torch.uint8 and packed.codes.shape == (2, 3, 17, 64 * bits // 8)
    assert packed.scales.shape == packed.minimums.shape == (2, 3, 17, 2)
    restored = dequantize(packed, torch.float32).double()
    expected = _reference(tensor, bits, 32)
    torch.testing.assert_close(restored, expected, rtol=0, atol=1e-4)
    step = (tensor.double().reshape(-1, 32).amax(-1) - tensor.double().reshape(-1, 32).amin(-1)) / (2**bits - 1)
    error = (restored - tensor.double()).abs().reshape(-1, 32).amax(-1)
    low = tensor.double().reshape(-1, 32).amin(-1).abs()
    assert (error <= step * 0.51 + low * 2**-11 + 1e-5).all()  # half a step, and the minimum's float16 rounding


def test_constant_groups_are_exact_and_packing_keeps_every_code():
    tensor = torch.tensor([-0.75, 0.0, 2.5]).repeat_interleave(8).view(1, 3, 1, 8)
    for bits in (8, 4):
        assert torch.equal(dequantize(quantize(tensor, bits, 8), torch.float32), tensor)
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)
    packed = PackedSlots((codes[0::2] | (codes[1::2] << 4)).view(1, 16), torch.ones(1, 1, dtype=torch.float16),
                         torch.zeros(1, 1, dtype=torch.float16), 4)
    assert dequantize(packed, torch.float32).flatten().tolist() == codes.float().tolist()


def test_gathering_packed_slots_equals_gathering_the_slots():
    tensor = torch.randn(2, 2, 10, 16)
    index = torch.tensor([[0, 3, 7], [9, 1, 2]])
    packed = quantize(tensor, 4, 8)
    gathered = packed.map(lambda t: t.gather(2, index[:, None, :, None].expand(-1, 2, -1, t.shape[-1])))
    direct = dequantize(packed, torch.float32).gather(2, index[:, None, :, None].expand(-1, 2, -1, 16))
    assert torch.equal(dequantize(gathered, torch.float32), direct)


def test_bytes_per_slot_and_the_checks():
    assert quantize(torch.randn(1, 1, 5, 64), 8, 64).nbytes == 5 * 68  # codes, a float16 scale and minimum
    assert quantize(torch.randn(1, 1, 5, 64), 4, 32).nbytes == 5 * (32 + 2 * 4)
    with pytest.raises(ValueError, match="kv_value_group_size must divide the model's head size 64"):
        check_layout(64, 8, 32, 48)
    check_layout(64, 16, 48, 48)  # 16 bits: no groups
    check_layout(64, 4, 64, 128)  # at least the head: one group per head
    assert quantize(torch.randn(1, 1, 3, 16), 4, 64).scales.shape == (1, 1, 3, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
def test_the_compiled_read_equals_torch_s(monkeypatch, dtype, bits):
    """``QuantizedKV.read`` on the compiled kernel (``kernels/quantized_slots.cpp``) and in torch: the same tensors,
    bit for bit (the same two roundings per element), on a folded layer's shape with one group per head for keys."""
    from kvcompress.kernels import native
    from kvcompress.quantization import QuantizedKV

    assert native.kernel() is not None
    keys, values = (torch.randn(2, 1, 37, 48, generator=torch.Generator().manual_seed(seed)).to(dtype) * 4 - 1
                    for seed in (1, 2))
    held = QuantizedKV(bits, 48, 16, residual=5)
    held.append(keys, values)
    compiled = held.read(keys[..., -5:, :], values[..., -5:, :])
    monkeypatch.setattr(native, "kernel", lambda: None)
    plain = held.read(keys[..., -5:, :], values[..., -5:, :])
    assert all(torch.equal(a, b) for a, b in zip(compiled, plain))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits, group", [(8, 16), (4, 8), (4, 48)])
def test_the_compiled_quantizer_equals_torch_s(monkeypatch, dtype, bits, group):
    """``quantize`` on the compiled kernel and in torch: the same codes, scales and minimums, bit for bit (constant
    and one-signed groups included)."""
    from kvcompress.kernels import native

    assert native.kernel() is not None
    tensor = (torch.randn(2, 3, 21, 48, generator=torch.Generator().manual_seed(4)) * 4 - 1).to(dtype)
    tensor[0, 0, :, :16] = 2.5
    tensor[1, 2, :, 16:32] += 30
    compiled = quantize(tensor, bits, group)
    monkeypatch.setattr(native, "kernel", lambda: None)
    plain = quantize(tensor, bits, group)
    assert all(torch.equal(a, b) for a, b in zip(compiled.tensors().values(), plain.tensors().values()))
