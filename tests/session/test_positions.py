"""Positions after eviction: plain forward calls get true positions without being told."""

import pytest
import torch

from kvcompress import KVCacheCompressionParameters, KVCacheCompressor
from tiny_models import random_tokens, tiny_model

PARAMS = KVCacheCompressionParameters(start_size=4, intermediate_size=16, recent_size=8)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])
def test_second_call_without_position_ids_matches_explicit_true_positions(arch):
    model = tiny_model(arch)
    ids = random_tokens(100)
    follow = random_tokens(5, seed=1)
    results = []
    for explicit in (False, True):
        with KVCacheCompressor(PARAMS)(model), torch.no_grad():
            first = model(ids, use_cache=True)
            assert first.past_key_values.layers[0].keys.shape[-2] == 28
            kwargs = {"position_ids": torch.arange(100, 105)[None]} if explicit else {}
            results.append(model(follow, cache=first.past_key_values, use_cache=True, **kwargs).logits)
    torch.testing.assert_close(results[0], results[1], atol=0, rtol=0)


def test_physical_positions_would_differ():
    """Guards the test above: compact positions give different logits, so the check can fail."""
    model = tiny_model("llama")
    ids, follow = random_tokens(100), random_tokens(5, seed=1)
    outputs = []
    for positions in (torch.arange(100, 105), torch.arange(28, 33)):
        with KVCacheCompressor(PARAMS)(model), torch.no_grad():
            cache = model(ids, use_cache=True).past_key_values
            outputs.append(model(follow, cache=cache, position_ids=positions[None]).logits)
    assert not torch.allclose(outputs[0], outputs[1], atol=1e-4)


@pytest.mark.parametrize("method", ["snapkv", "h2o"])
def test_decode_after_eviction_equals_full_cache_with_evicted_tokens_masked(method):
    """Independent reference: a one-layer model with the full cache, where a 2-D mask hides exactly the slots
    the compressor evicted (true positions kept), must give the same logits as the compressed cache."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).eval()
    params = KVCacheCompressionParameters(method=method, start_size=4, intermediate_size=16, recent_size=8,
                                          decode_slack=0, window_size=8 if method == "snapkv" else None)
    ids = random_tokens(80)
    steps = random_tokens(12, seed=3)
    with torch.no_grad():
        with KVCacheCompressor(params)(model) as session:
            cache = model(ids, use_cache=True).past_key_values
            compressed, kept_sets = [], []
            for i in range(steps.shape[1]):
                kept_sets.append(session.layers[0].true_positions[0].tolist())
                out = model(steps[:, i : i + 1], cache=cache, use_cache=True)
                compressed.append(out.logits)
        full_cache = model(ids, use_cache=True).past_key_values
        for i in range(steps.shape[1]):
            mask = torch.zeros(1, 80 + i + 1, dtype=torch.long)
            mask[0, kept_sets[i]] = 1
            mask[0, -1] = 1
            out = model(steps[:, i : i + 1], cache=full_cache, attention_mask=mask,
                        position_ids=torch.tensor([[80 + i]]), use_cache=True)
            torch.testing.assert_close(out.logits, compressed[i], atol=1e-5, rtol=0)
