"""Every supported architecture: full-attention layers bounded, sliding layers untouched; every dtype finite."""

import pytest
import torch

from kvcompress import KVCacheCompressionParameters, KVCacheCompressor
from kvcompress.scoring.registry import SCORERS
from tiny_models import TINY_CONFIGS, TinyTokenizer, random_tokens, scorer_parameters, tiny_model

PARAMS = KVCacheCompressionParameters(start_size=4, intermediate_size=16, recent_size=8)


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("method", list(SCORERS))
def test_full_layers_bounded_sliding_layers_untouched(arch, method):
    model = tiny_model(arch)
    params = scorer_parameters(method, arch, start_size=4, intermediate_size=16, recent_size=8)
    ids = random_tokens(100)
    with torch.no_grad():
        reference = model(ids, use_cache=True).past_key_values
        with KVCacheCompressor(params, tokenizer=TinyTokenizer())(model):
            # After the prompt every layer saw the same inputs (eviction follows each layer's attention; H2O's
            # fused attention differs from sdpa by rounding only; KVzip's reconstruction passes leave the
            # sliding layers as they were), so sliding layers must hold the same window and full layers be cut
            # to the budget.
            prefilled = model(ids, use_cache=True).past_key_values
            generated = model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False,
                                       return_dict_in_generate=True).past_key_values
    for ref_layer, layer, after_decode in zip(reference.layers, prefilled.layers, generated.layers):
        if getattr(layer, "is_sliding", False):
            torch.testing.assert_close(layer.keys, ref_layer.keys, rtol=0, atol=1e-5)
            torch.testing.assert_close(layer.values, ref_layer.values, rtol=0, atol=1e-5)
            assert after_decode.keys.shape == ref_layer.keys.shape  # the window's own bound, not ours
        else:
            assert ref_layer.keys.shape[-2] == 100 and layer.keys.shape[-2] == params.max_cache_size
            assert after_decode.keys.shape[-2] <= params.max_cache_size + params.decode_slack


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("method", ["snapkv", "h2o"])
def test_scores_are_finite_float32_in_every_dtype(dtype, method):
    model = tiny_model("llama", dtype=dtype)
    params = KVCacheCompressionParameters(**{**PARAMS.to_dict(), "method": method,
                                             "window_size": 8 if method == "snapkv" else None})
    with KVCacheCompressor(params)(model) as session:
        out = model.generate(random_tokens(100), max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
        for state in session.layers.values():
            assert state.head_scores.dtype == torch.float32
            assert torch.isfinite(state.head_scores).all() and state.head_scores.sum() > 0
    assert out.past_key_values.layers[0].keys.dtype == dtype


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_runs_on_cuda():
    model = tiny_model("llama").cuda()
    with KVCacheCompressor(PARAMS)(model) as session:
        out = model.generate(random_tokens(100).cuda(), max_new_tokens=10, do_sample=False)
        assert all(state.head_scores.is_cuda for state in session.layers.values())
    assert out.is_cuda
