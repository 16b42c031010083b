"""Attention over a quantized layer reads its codes: the compiled kernel dequantizes the coded slots as it reads
them (``kernels/fused_attention.cpp``), with no full-precision copy of the layer, and so do the Triton kernels
(the multi-query pass and the folded decode step); the torch path reads the dequantized tensors. Each path on
codes is held to attention on the dequantized tensors (the same values) and to a float64 eager reference, for
decode steps (one chunk per pair, several, a folded layer's) and multi-query forwards (direct products, and
oneDNN's packed bfloat16 products where the CPU has them).
"""

import pytest
import torch

from kvcompress import compress
from kvcompress.kernels import attention, native, triton_attention
from kvcompress.quantization import CodedSlots, dequantize, quantize
from kvcompress.ragged import folded_attention
from tiny_models import random_tokens, tiny_model

kernel = native.kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no compiler for the fused CPU kernel")


def _layer(dtype, bits, slots=150, coded=120, kv_heads=2, dim=32, seed=0):
    """A quantized layer's keys and values: codes of every slot, full-precision copies of the newest; returns the
    call's ``CodedSlots`` and the same slots dequantized (B, H_kv, T, d)."""
    generator = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(2, kv_heads, slots, dim, generator=generator).to(dtype) for _ in range(2))
    packed_keys, packed_values = quantize(keys, bits, 16), quantize(values, bits, dim)
    held_keys, held_values = keys[..., coded:, :], values[..., coded:, :]
    dense = tuple(torch.cat([dequantize(packed, dtype)[..., :coded, :], held], dim=-2)
                  for packed, held in ((packed_keys, held_keys), (packed_values, held_values)))
    return CodedSlots(packed_keys, packed_values, coded, held_keys, held_values), dense


def _reference(queries, keys, values, valid, scaling):
    """Causal attention and the column sums of its weights in float64 (B, q, H, d), (B, H_kv, T)."""
    batch, heads, length, _ = queries.shape
    groups, total = heads // keys.shape[1], keys.shape[-2]
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (keys, values))
    logits = queries.double() @ k.transpose(-1, -2) * scaling
    causal = torch.arange(total)[None, :] <= torch.arange(total - length, total)[:, None]
    logits = logits.masked_fill(~(causal & valid[:, None, None, :]), float("-inf"))
    weights = logits.softmax(-1)
    sums = weights.sum(2).view(batch, keys.shape[1], groups, total).sum(2)
    return (weights @ v).transpose(1, 2), sums


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2], ids=["one-chunk", "chunks"])
@pytest.mark.parametrize("length", [1, 9, 70], ids=["decode", "prompt", "long-prompt"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
def test_the_kernel_on_codes_equals_the_kernel_on_the_dequantized_slots(bits, dtype, length, threads):
    if dtype == torch.bfloat16 and native.input_dtype(kernel, dtype) != dtype:
        pytest.skip("this build multiplies bfloat16 as float32 copies")
    coded, (keys, values) = _layer(dtype, bits)
    queries = torch.randn(2, 4, length, 32).to(dtype)
    valid = torch.ones(2, coded.slots, dtype=torch.bool)
    valid[1, :7] = False  # dead slots among the coded ones (a padded batch)
    observed = torch.ones(2, length, dtype=torch.bool)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        on_codes = attention.observed_attention(queries, coded.held_keys, valid, observed, 0.3,
                                                values=coded.held_values, coded=coded)
        on_dense = attention.observed_attention(queries, keys, valid, observed, 0.3, values=values)
    finally:
        torch.set_num_threads(previous)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for got, expected in zip(on_codes, on_dense):
        torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)
    output, sums = _reference(queries, keys, values, valid, 0.3)
    torch.testing.assert_close(on_codes[1].double(), output, rtol=tolerance, atol=tolerance * 2)
    torch.testing.assert_close(on_codes[0].double(), sums, rtol=tolerance, atol=tolerance * 4)


@needs_kernel
@pytest.mark.parametrize("bits", [8, 4])
def test_a_folded_decode_step_reads_its_codes(bits):
    """A folded layer: every KV head's slots in one row (B, 1, M, d), coded ones among the long stretches the
    kernel multiplies where they lie and among the scattered ones it gathers."""
    kv_heads, slots, coded_count = 2, 140, 100
    coded, (keys, values) = _layer(torch.float32, bits, slots=slots, coded=coded_count, kv_heads=1)
    heads = torch.zeros(2, slots, dtype=torch.long)
    heads[:, 40:90] = 1
    heads[:, 95:slots:2] = 1  # decoded tokens: one slot per head each, alternating
    valid = torch.ones(2, slots, dtype=torch.bool)
    query = torch.randn(2, 4, 1, 32)
    observed = torch.ones(2, 1, dtype=torch.bool)
    on_codes = folded_attention(query, coded.held_keys, coded.held_values, valid, heads, kv_heads, 0.3,
                                observed=observed, coded=coded)
    on_dense = folded_attention(query, keys, values, valid, heads, kv_heads, 0.3, observed=observed)
    for got, expected in zip(on_codes, on_dense):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not triton_attention.supports(torch.ones(1), torch.ones(1), None),
                    reason="Triton's kernels serve no device here (uninstalled, or not interpreted)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
def test_the_triton_folded_decode_reads_its_codes(bits, dtype):
    """The accelerators' folded decode kernel (interpreted on CPU): the coded slots dequantized in the kernel's
    tiles, a block of slots holding both coded and held ones, against the kernel on the dequantized slots."""
    coded, (keys, values) = _layer(dtype, bits, slots=70, coded=41, kv_heads=1)
    heads = torch.zeros(2, 70, dtype=torch.long)
    heads[:, 20:45] = 1
    heads[:, 50::2] = 1
    valid = torch.ones(2, 70, dtype=torch.bool)
    valid[0, 3] = False
    query = torch.randn(2, 4, 1, 32).to(dtype)
    observed = torch.ones(2, 1, dtype=torch.bool)
    on_codes = triton_attention.folded_decode(query, coded.held_keys, coded.held_values, valid, heads, 2, 0.3,
                                              observed, coded=coded)
    on_dense = triton_attention.folded_decode(query, keys, values, valid, heads, 2, 0.3, observed)
    # bfloat16: the kernel rounds its dequantized tiles as Triton's conversion does (the interpreter's, here), the
    # read-back as torch does: an output may differ by its rounding
    tolerance = 1e-5 if dtype == torch.float32 else 0.03
    for got, expected in zip(on_codes, on_dense):
        torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.skipif(not triton_attention.supports(torch.ones(1), torch.ones(1), None),
                    reason="Triton's kernels serve no device here (uninstalled, or not interpreted)")
@pytest.mark.parametrize("reduce", ["sum", "max"])
@pytest.mark.parametrize("bits", [8, 4])
def test_the_triton_scoring_pass_reads_its_codes(bits, reduce):
    """The accelerators' multi-query pass (interpreted on CPU): its forward and its column pass both read the
    codes, against the same kernels on the dequantized slots and float64."""
    coded, (keys, values) = _layer(torch.float32, bits, slots=90, coded=61)
    queries = torch.randn(2, 4, 9, 32)
    valid = torch.ones(2, 90, dtype=torch.bool)
    valid[1, :5] = False
    observed = torch.ones(2, 9, dtype=torch.bool)
    on_codes = triton_attention.fused_attention(queries, coded.held_keys, coded.held_values, 0.3, valid, observed,
                                                maximum=reduce == "max", coded=coded)
    on_dense = triton_attention.fused_attention(queries, keys, values, 0.3, valid, observed, maximum=reduce == "max")
    for got, expected in zip(on_codes, on_dense):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    output, _ = _reference(queries, keys, values, valid, 0.3)
    torch.testing.assert_close(on_codes[1].double(), output, rtol=1e-5, atol=1e-5)


def test_the_torch_path_reads_the_dequantized_slots(monkeypatch):
    monkeypatch.setattr(native, "kernel", lambda: None)
    coded, (keys, values) = _layer(torch.float32, 4)
    queries = torch.randn(2, 4, 1, 32)
    valid = torch.ones(2, coded.slots, dtype=torch.bool)
    observed = torch.ones(2, 1, dtype=torch.bool)
    on_codes = attention.observed_attention(queries, coded.held_keys, valid, observed, 0.3, values=coded.held_values,
                                            coded=coded)
    output, sums = _reference(queries, keys, values, valid, 0.3)
    torch.testing.assert_close(on_codes[1].double(), output, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(on_codes[0].double(), sums, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("method, overrides",
                         [("kvzip", {}), ("h2o", {}), ("snapkv", {"budget_allocation": "pyramid"})],
                         ids=["kvzip-head-wise", "h2o", "snapkv"])
def test_decoding_on_codes_equals_decoding_on_the_dequantized_layer(method, overrides, monkeypatch):
    """A session's forwards hand their attention the codes (``layer.attention_reads_codes``); with that switched
    off every layer's update returns the dequantized slots instead: the same tokens and logits."""
    from kvcompress import session as session_module
    from tiny_models import TinyTokenizer

    model = tiny_model("llama")
    ids = random_tokens(100)

    def run():
        with compress(model, method=method, budget=30, kv_bits=4, kv_key_group_size=8, kv_value_group_size=16,
                      kv_residual=4, tokenizer=TinyTokenizer(), **overrides):
            return model.generate(ids, max_new_tokens=5, do_sample=False, output_scores=True,
                                  return_dict_in_generate=True)

    read_codes = []
    operands = CodedSlots.kernel_operands
    monkeypatch.setattr(CodedSlots, "kernel_operands",
                        lambda self, heads: read_codes.append(1) or operands(self, heads))
    on_codes = run()
    assert read_codes  # the kernel was handed codes
    reading = []
    original = session_module.CompressionSession._read_codes_in
    monkeypatch.setattr(session_module.CompressionSession, "_read_codes_in",
                        lambda self, layers: (reading.append(len(layers)), original(self, []))[1])
    on_dense = run()
    assert any(reading)  # the forwards asked for codes, and were given the dequantized slots
    assert torch.equal(on_codes.sequences, on_dense.sequences)
    for got, expected in zip(on_codes.scores, on_dense.scores):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
