"""With a budget that is never exceeded the compressor must be invisible: same tokens, same logits."""

import pytest
import torch

from kvcompress import KVCacheCompressionParameters, KVCacheCompressor
from tiny_models import TINY_CONFIGS, random_tokens, tiny_model

LARGE = dict(start_size=32, intermediate_size=512, recent_size=64)


def _generate(model, ids, **kwargs):
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, min_new_tokens=20, do_sample=False,
        output_logits=True, return_dict_in_generate=True, **kwargs,
    )


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("method", ["snapkv", "h2o"])
def test_budget_above_length_is_exact(arch, method):
    model = tiny_model(arch)
    ids = random_tokens(120)
    reference = _generate(model, ids)
    window = 8 if method == "snapkv" else None
    params = KVCacheCompressionParameters(method=method, window_size=window, **LARGE)
    with KVCacheCompressor(params)(model):
        compressed = _generate(model, ids)
    assert torch.equal(reference.sequences, compressed.sequences)
    for ref, got in zip(reference.logits, compressed.logits):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_plain_forward_calls_are_exact(arch):
    model = tiny_model(arch)
    ids = random_tokens(60)
    with torch.no_grad():
        full = model(ids).logits
        with KVCacheCompressor(KVCacheCompressionParameters(**LARGE))(model):
            first = model(ids[:, :40], use_cache=True)
            second = model(ids[:, 40:], cache=first.past_key_values)
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), full, atol=1e-5, rtol=0)
