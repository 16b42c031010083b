"""The cache of every compressed layer is cut to the budget and stays bounded while decoding."""

import pytest
import torch

from kvcompress import KVCacheCompressionParameters, KVCacheCompressor
from tiny_models import random_tokens, tiny_model


@pytest.mark.parametrize("method", ["snapkv", "h2o"])
@pytest.mark.parametrize("aggregation", ["sum", "norm_sum"])
def test_prefill_keeps_exactly_the_budget_with_both_windows(method, aggregation):
    model = tiny_model("llama")
    params = KVCacheCompressionParameters(
        method=method, start_size=32, intermediate_size=128, recent_size=64, score_aggregation=aggregation,
        window_size=8 if method == "snapkv" else None,
    )
    ids = random_tokens(1000)
    with KVCacheCompressor(params)(model) as session, torch.no_grad():
        out = model(ids, use_cache=True)
        for index, layer in enumerate(out.past_key_values.layers):
            assert layer.keys.shape[-2] == 224 and layer.values.shape[-2] == 224
            kept = session.layers[index].true_positions[0].tolist()
            assert kept == sorted(set(kept))
            assert kept[:32] == list(range(32)) and kept[-64:] == list(range(936, 1000))
        cache = out.past_key_values
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(200):
            step = model(token, cache=cache, use_cache=True)
            token = step.logits[:, -1:].argmax(-1)
            for layer in cache.layers:
                assert layer.keys.shape[-2] <= params.max_cache_size + params.decode_slack
        assert session.cache.get_seq_length() == 1200
        for state in session.layers.values():
            positions = state.true_positions[0].tolist()
            assert positions[:32] == list(range(32)) and positions[-64:] == list(range(1200 - 64, 1200))


def test_decode_without_slack_holds_budget_every_step():
    model = tiny_model("llama")
    params = KVCacheCompressionParameters(start_size=4, intermediate_size=16, recent_size=8, decode_slack=0)
    with KVCacheCompressor(params)(model):
        out = model.generate(random_tokens(50), max_new_tokens=30, min_new_tokens=30, do_sample=False,
                             return_dict_in_generate=True)
    assert [layer.keys.shape[-2] for layer in out.past_key_values.layers] == [28, 28]


def test_compress_during_decoding_false_only_compresses_the_prompt():
    model = tiny_model("llama")
    params = KVCacheCompressionParameters(start_size=4, intermediate_size=16, recent_size=8,
                                          compress_during_decoding=False)
    with KVCacheCompressor(params)(model):
        out = model.generate(random_tokens(50), max_new_tokens=30, min_new_tokens=30, do_sample=False,
                             return_dict_in_generate=True)
    assert [layer.keys.shape[-2] for layer in out.past_key_values.layers] == [28 + 29] * 2
