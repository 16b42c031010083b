"""The fused path (attention output and scores in one pass) against a plain float64 softmax attention.

The reference is written out directly from the definition: causal mask (a query at forward index i sees
slots up to T - q + i), dead slots masked for real queries, softmax, weights @ values. Both implementations run
(the compiled CPU kernel and the torch chunks), with blocks forced down to a few rows so the block loops, the
diagonal mask and the padding masks all run.
"""

import pytest
import torch

from kvcompress.kernels import attention, native, reconstruction, triton_attention
from tiny_models import torch_threads

NONE = torch.empty(0, dtype=torch.long)  # slot_head of a layer that is not folded

HEADS, KV_HEADS, DIM, CACHED, NEW = 6, 2, 16, 13, 37


def _inputs(dtype=torch.float32, length=NEW, cached=CACHED, dim=DIM, value_dim=DIM):
    generator = torch.Generator().manual_seed(0)
    total = cached + length
    queries = torch.randn(2, HEADS, length, dim, generator=generator).to(dtype)
    keys = torch.randn(2, KV_HEADS, total, dim, generator=generator).to(dtype)
    values = torch.randn(2, KV_HEADS, total, value_dim, generator=generator).to(dtype)
    slot_valid = torch.ones(2, total, dtype=torch.bool)
    observed = torch.ones(2, length, dtype=torch.bool)
    slot_valid[1, :4] = False  # sequence 1: 4 dead cached slots
    if length > 1:
        slot_valid[1, cached : cached + 3] = False  # ... and 3 padding tokens at the start of this forward
        observed[1, :3] = False
    return queries, keys, values, slot_valid, observed


def _reference(queries, keys, values, slot_valid, observed, scaling, softcap=None, reduce="sum"):
    q, k, v = queries.double(), keys.double(), values.double()
    groups = HEADS // KV_HEADS
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    logits = q @ k.transpose(-1, -2) * scaling
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    length, total = q.shape[2], k.shape[2]
    causal = torch.arange(total)[None, :] <= (total - length + torch.arange(length))[:, None]
    allowed = causal[None] & (slot_valid[:, None, :] | ~observed[:, :, None])
    logits = logits.masked_fill(~allowed[:, None], float("-inf"))
    weights = logits.softmax(-1)
    output = (weights @ v).transpose(1, 2)  # (B, q, H, d)
    observed_weights = (weights * observed[:, None, :, None]).view(2, KV_HEADS, groups, length, total)
    if reduce == "max":  # the most any observed row of any query head of the group gives the slot (KVzip)
        return observed_weights.amax((2, 3)), output
    return observed_weights.sum((2, 3)), output


@pytest.fixture(params=["native", "torch", "triton"])
def backend(request, monkeypatch):
    """Every implementation of the fused pass: the compiled kernel (blocks forced down to a few rows and keys,
    so that a row's first key block is all dead slots and later blocks raise its running maximum), the torch
    chunks (also forced small) and the accelerators' Triton kernels, interpreted on CPU (blocks of 32 rows and 16
    keys; decode steps and soft-capping take the torch chunks there too)."""
    if request.param == "triton":
        monkeypatch.setenv("KVCOMPRESS_NATIVE", "0")
        monkeypatch.setattr(attention, "TRITON_ON_CPU", True)
    elif request.param == "native":
        if native.kernel() is None:
            pytest.fail("the fused CPU kernel did not build on this machine (see the warning)")
        monkeypatch.setattr(native, "ROW_BLOCK", 5)
        monkeypatch.setattr(native, "KEY_BLOCK", 4)
    else:
        monkeypatch.setenv("KVCOMPRESS_NATIVE", "0")
        monkeypatch.setattr(attention, "ROW_BLOCK", 5)
    return request.param


@pytest.mark.parametrize("reduce", ["sum", "max"])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("length", [NEW, 1], ids=["prefill", "decode"])
def test_fused_output_and_scores_match_plain_attention(backend, length, softcap, reduce):
    queries, keys, values, slot_valid, observed = _inputs(length=length)
    scores, output = attention.observed_attention(queries, keys, slot_valid, observed, 0.3, softcap, values=values,
                                                  reduce=reduce)
    expected_scores, expected_output = _reference(queries, keys, values, slot_valid, observed, 0.3, softcap, reduce)
    real = observed[:, :, None, None].expand_as(output)
    assert torch.isfinite(output).all()  # padding rows too: their values feed later layers' masked slots
    torch.testing.assert_close(output[real].double(), expected_output[real], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scores.double(), expected_scores, rtol=1e-5, atol=1e-6)
    side_scores, none = attention.observed_attention(queries, keys, slot_valid, observed, 0.3, softcap, reduce=reduce)
    assert none is None
    torch.testing.assert_close(side_scores, scores, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("reduce", ["sum", "max"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("length", [NEW, 1], ids=["prefill", "decode"])
def test_native_kernel_matches_plain_attention_on_every_thread_count(monkeypatch, threads, length, reduce):
    """The kernel hands its tasks ((sequence, head, row block) in a prefill, each thread summing into its own column
    buffer; (sequence, KV head) in a decode step) to the threads as they come free: the result must not depend
    on which thread took which."""
    monkeypatch.setattr(native, "ROW_BLOCK", 3)
    monkeypatch.setattr(native, "KEY_BLOCK", 8)
    queries, keys, values, slot_valid, observed = _inputs(length=length)
    kernel = native.kernel()
    assert kernel is not None and native.supports(queries, keys, values)
    with torch_threads(threads):
        assert kernel.parallel_threads() == threads  # the split really happens (the build has OpenMP)
        scores, output = attention.observed_attention(queries, keys, slot_valid, observed, 0.3, values=values,
                                                      reduce=reduce)
    expected_scores, expected_output = _reference(queries, keys, values, slot_valid, observed, 0.3, reduce=reduce)
    real = observed[:, :, None, None].expand_as(output)
    torch.testing.assert_close(output[real].double(), expected_output[real], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scores.double(), expected_scores, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduce", ["sum", "max"])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_decode_step_split_over_the_slots_matches_plain_attention(threads, reduce, dtype):
    """A decode step whose (sequence, KV head) pairs are fewer than the threads want cuts each pair's slots into
    chunks of at least the key block (here 8 slots: 2 chunks of 31 on 2 threads, none on 1), rescaled to the pair's
    maximum afterwards; sequence 1's first chunk is all dead slots. Output and scores against float64."""
    kernel = native.kernel()
    assert kernel is not None
    if dtype == torch.bfloat16 and not kernel.bfloat16_products():
        pytest.skip("this build's BLAS has no bfloat16 GEMM: bfloat16 inputs take float32 copies")
    queries, keys, values, slot_valid, observed = _inputs(dtype, length=1, cached=60)
    slot_valid[1, :31] = False
    key_bias = torch.zeros(slot_valid.shape).masked_fill_(~slot_valid, float("-inf"))
    with torch_threads(threads):
        scores, output = kernel.fused_attention(queries, keys, values, 0.3, key_bias, observed.float(),
                                                reduce == "max", 3, 8, NONE, [], 0)
    expected_scores, expected_output = _reference(queries, keys, values, slot_valid, observed, 0.3, reduce=reduce)
    output_tolerance = 1e-6 if dtype == torch.float32 else 0.02
    torch.testing.assert_close(scores.double(), expected_scores, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(output.double(), expected_output, rtol=output_tolerance, atol=output_tolerance)


def test_fused_output_in_bfloat16_is_close_to_float64():
    queries, keys, values, slot_valid, observed = _inputs(torch.bfloat16)
    scores, output = attention.observed_attention(queries, keys, slot_valid, observed, 0.25, values=values)
    expected_scores, expected_output = _reference(queries, keys, values, slot_valid, observed, 0.25)
    assert output.dtype == torch.bfloat16 and scores.dtype == torch.float32
    real = observed[:, :, None, None].expand_as(output)
    torch.testing.assert_close(output[real].double(), expected_output[real], rtol=0.05, atol=0.05)
    torch.testing.assert_close(scores.double(), expected_scores, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("reduce", ["sum", "max"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("length", [NEW, 1], ids=["prefill", "decode"])
def test_native_kernel_on_bfloat16_inputs_scores_as_exactly_as_float32(monkeypatch, threads, length, reduce):
    """The kernel's bfloat16 branch (MKL's bfloat16 GEMM, float32 accumulation), called directly so that it runs
    on any CPU: the logits of bfloat16 queries and keys are exact in float32, so the scores match the float64
    definition as closely as the float32 branch does (measured: 5e-7 relative); only the output carries the
    rounding of the probabilities and of its own bfloat16 result."""
    kernel = native.kernel()
    assert kernel is not None
    if not kernel.bfloat16_products():
        pytest.skip("this build's BLAS has no bfloat16 GEMM: bfloat16 inputs take float32 copies")
    queries, keys, values, slot_valid, observed = _inputs(torch.bfloat16, length=length)
    key_bias = torch.zeros(slot_valid.shape).masked_fill_(~slot_valid, float("-inf"))
    with torch_threads(threads):
        scores, output = kernel.fused_attention(queries, keys, values, 0.25, key_bias, observed.float(),
                                                reduce == "max", 3, 8, NONE, [], 0)
    expected_scores, expected_output = _reference(queries, keys, values, slot_valid, observed, 0.25, reduce=reduce)
    real = observed[:, :, None, None].expand_as(output)
    assert scores.dtype == output.dtype == torch.float32
    torch.testing.assert_close(scores.double(), expected_scores, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(output[real].double(), expected_output[real], rtol=0.02, atol=0.02)


@pytest.mark.parametrize("reduce", ["sum", "max"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dim, value_dim, row_block", [(64, 64, 64), (32, 48, 7)])
def test_native_kernel_on_packed_bfloat16_products_matches_float64(threads, reduce, dim, value_dim, row_block):
    """The bfloat16 prefill on oneDNN's products (keys and values copied once into the layout they multiply, key
    blocks taken in chunks of 64 columns): 143 slots (not a multiple of the chunk, so the last chunk reads the
    zero padding), the row blocks' diagonal blocks ending anywhere in a chunk, dead slots and padded rows. Same
    tolerances as MKL's bfloat16 branch above: the scores are float32 products of bfloat16 operands."""
    kernel = native.kernel()
    assert kernel is not None
    if not kernel.bfloat16_packed_products():
        pytest.skip("oneDNN packs no bfloat16 products on this CPU: bfloat16 prefills take MKL's GEMM")
    queries, keys, values, slot_valid, observed = _inputs(torch.bfloat16, length=110, cached=33, dim=dim,
                                                          value_dim=value_dim)
    key_bias = torch.zeros(slot_valid.shape).masked_fill_(~slot_valid, float("-inf"))
    with torch_threads(threads):
        scores, output = kernel.fused_attention(queries, keys, values, 0.25, key_bias, observed.float(),
                                                reduce == "max", row_block, 64, NONE, [], 0)
    expected_scores, expected_output = _reference(queries, keys, values, slot_valid, observed, 0.25, reduce=reduce)
    real = observed[:, :, None, None].expand_as(output)
    torch.testing.assert_close(scores.double(), expected_scores, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(output[real].double(), expected_output[real], rtol=0.02, atol=0.02)


def _reference_prefix_max(queries, keys, values, scaling):
    """KVzip's reconstruction pass by definition: causal softmax of every query over the prefix and its own
    tokens, weights @ values, and per KV head the most weight any of its query heads' queries gives each slot."""
    q, k, v = queries.double(), keys.double(), values.double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    length, total = q.shape[2], k.shape[2]
    causal = torch.arange(total)[None, :] <= (total - length + torch.arange(length))[:, None]
    weights = (q @ k.transpose(-1, -2) * scaling).masked_fill(~causal, float("-inf")).softmax(-1)
    batch, kv_heads = keys.shape[:2]
    scores = weights.view(batch, kv_heads, groups * length, total).amax(2)
    scores[..., total - length:] = 0  # the pass's own slots leave the cache: not scored
    return scores, (weights @ v).transpose(1, 2)


@pytest.mark.parametrize("dtype, tolerance, score_tolerance", [(torch.float32, 1e-5, 1e-5),
                                                              (torch.bfloat16, 0.03, 1e-4)])
@pytest.mark.parametrize("cached", [CACHED, 0], ids=["after a prefix", "no prefix"])
def test_reconstruction_pass_matches_its_definition(monkeypatch, dtype, tolerance, score_tolerance, cached):
    """prefix_max_attention (KVzip on CPU): flash attention on the prefix and on the pass's own block, merged by
    their log-sum-exps, and the scores from one product with -lse appended; row products forced small so that
    the running maximum spans several of them. Scores are float32 products in every dtype, so they stay within
    1e-4 of the definition even for bfloat16 inputs (flash's bfloat16 log-sum-exp adds ~2e-5); the output is
    rounded to bfloat16."""
    monkeypatch.setattr(reconstruction, "PREFIX_ROWS", 16)
    generator = torch.Generator().manual_seed(1)
    queries = torch.randn(2, HEADS, NEW, DIM, generator=generator).to(dtype)
    keys = torch.randn(2, KV_HEADS, cached + NEW, DIM, generator=generator).to(dtype)
    values = torch.randn(2, KV_HEADS, cached + NEW, DIM, generator=generator).to(dtype)
    output, scores = reconstruction.prefix_max_attention(queries, keys, values, 0.25)
    expected_scores, expected_output = _reference_prefix_max(queries, keys, values, 0.25)
    assert output.dtype == dtype and scores.dtype == torch.float32 and output.shape == (2, NEW, HEADS, DIM)
    torch.testing.assert_close(scores.double(), expected_scores, rtol=score_tolerance, atol=1e-7)
    torch.testing.assert_close(output.double(), expected_output, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(
    "dtype, length, cached, dim, window, masks, reduce",
    [(torch.float32, NEW, CACHED, 24, None, True, "sum"), (torch.float32, NEW, CACHED, 24, None, True, "max"),
     (torch.bfloat16, NEW, CACHED, DIM, None, True, "max"), (torch.float32, NEW, 0, DIM, 5, True, "sum"),
     (torch.float32, 1, 40, DIM, None, True, "max"), (torch.bfloat16, NEW, CACHED, DIM, None, False, "sum")],
    ids=["float32-head24-sum", "float32-head24-max", "bfloat16-max", "no-prefix-window-sum", "decode-max",
         "bfloat16-all-live-sum"],
)
def test_triton_kernels_match_float64(dtype, length, cached, dim, window, masks, reduce):
    """The accelerators' two kernels (output with log-sum-exp, then the column statistic) on CPU tensors under
    Triton's interpreter, against the float64 definition: a head size that is not a power of two (padded lanes),
    a pass with no cached prefix whose observed rows are only a window (SnapKV-like), a decode step (one row
    per query head: a block holds the whole KV group), bfloat16 with and without masks; lengths that end inside
    blocks. Scores are float32 products of the inputs in every dtype (1e-5); bfloat16 outputs carry the rounding
    of the probabilities and of the result."""
    queries, keys, values, slot_valid, observed = _inputs(dtype, length=length, cached=cached, dim=dim,
                                                          value_dim=dim)
    if window is not None:
        observed &= torch.arange(length) >= length - window
    if not masks:
        slot_valid, observed = torch.ones_like(slot_valid), torch.ones_like(observed)
    scores, output = triton_attention.fused_attention(queries, keys, values, 0.3, slot_valid if masks else None,
                                                      observed if masks else None, maximum=reduce == "max")
    expected_scores, expected_output = _reference(queries, keys, values, slot_valid, observed, 0.3, reduce=reduce)
    real = observed[:, :, None, None].expand_as(output)
    tolerance = 1e-5 if dtype == torch.float32 else 0.03
    assert output.dtype == dtype and scores.dtype == torch.float32 and torch.isfinite(output).all()
    torch.testing.assert_close(scores.double(), expected_scores, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(output[real].double(), expected_output[real], rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype, cached", [(torch.bfloat16, CACHED), (torch.float32, 0)],
                         ids=["bfloat16-after-a-prefix", "float32-no-prefix"])
def test_flash_forward_then_triton_columns_match_float64(monkeypatch, dtype, cached):
    """The accelerators' other forward: torch's flash attention (its CPU op here) on the pass's own block and, after
    a prefix, on the prefix, merged by their log-sum-exps, whose base-2 values the column pass then reads (sums
    and maxima both), on a pass with no masks."""
    monkeypatch.setattr(triton_attention, "FORWARD", "flash")
    queries, keys, values, _, _ = _inputs(dtype, cached=cached)
    every_slot, every_row = torch.ones(2, cached + NEW, dtype=torch.bool), torch.ones(2, NEW, dtype=torch.bool)
    tolerance = 1e-5 if dtype == torch.float32 else 0.03
    for reduce in ("sum", "max"):
        scores, output = triton_attention.fused_attention(queries, keys, values, 0.3, maximum=reduce == "max")
        expected_scores, expected_output = _reference(queries, keys, values, every_slot, every_row, 0.3,
                                                      reduce=reduce)
        # the log-sum-exp is flash's (measured within 5e-5 of the definition in bfloat16, 1e-6 in float32)
        torch.testing.assert_close(scores.double(), expected_scores, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(output.double(), expected_output, rtol=tolerance, atol=tolerance)


def test_folded_decode_of_a_large_group_matches_float64():
    """The folded decode kernel with 20 query heads per KV head (multi-query-like): two programs per (sequence,
    KV head) pair take 16 heads and 4, each reading the pair's slots; outputs and the most attention a group gives
    each of its slots against float64, per head over its own live slots."""
    generator = torch.Generator().manual_seed(3)
    batch, kv_heads, groups, total, dim = 2, 2, 20, 45, 16
    queries = torch.randn(batch, kv_heads * groups, 1, dim, generator=generator)
    keys, values = (torch.randn(batch, 1, total, dim, generator=generator) for _ in range(2))
    slot_head = torch.randint(0, kv_heads, (batch, total), generator=generator).sort(-1).values
    slot_valid = torch.rand(batch, total, generator=generator) > 0.2
    output, scores = triton_attention.folded_decode(queries, keys, values, slot_valid, slot_head, kv_heads, 0.3,
                                                    observed=torch.ones(batch, 1, dtype=torch.bool))
    expected_scores = torch.zeros(batch, total, dtype=torch.float64)
    for b in range(batch):
        for head in range(kv_heads * groups):
            own = (slot_head[b] == head // groups) & slot_valid[b]
            weights = (keys[b, 0, own].double() @ queries[b, head, 0].double() * 0.3).softmax(-1)
            torch.testing.assert_close(output[b, 0, head].double(), weights @ values[b, 0, own].double(),
                                       rtol=1e-5, atol=1e-6)
            expected_scores[b, own] = torch.maximum(expected_scores[b, own], weights)
    torch.testing.assert_close(scores[:, 0].double(), expected_scores, rtol=1e-5, atol=1e-7)
