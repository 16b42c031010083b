"""Inputs at the edges: tiny or empty prompts, areas of size zero."""

import re

import pytest
import torch

from kvcompress import KVCacheCompressionParameters, KVCacheCompressor, compress
from tiny_models import random_tokens, tiny_model


def test_prompt_shorter_than_start_window_is_kept_whole():
    model = tiny_model("llama")
    params = KVCacheCompressionParameters(start_size=32, intermediate_size=16, recent_size=8)
    ids = random_tokens(10)
    reference = model.generate(ids, max_new_tokens=60, min_new_tokens=60, do_sample=False)
    with KVCacheCompressor(params)(model):
        out = model.generate(ids, max_new_tokens=60, min_new_tokens=60, do_sample=False, return_dict_in_generate=True)
    # identical until the budget is first exceeded
    assert torch.equal(out.sequences[:, :10 + 47], reference[:, :10 + 47])
    assert out.past_key_values.layers[0].keys.shape[-2] <= params.max_cache_size + params.decode_slack


def test_empty_prompt_is_a_clear_error():
    model = tiny_model("llama")
    with KVCacheCompressor(KVCacheCompressionParameters())(model), torch.no_grad():
        with pytest.raises(ValueError, match="empty prompt"):
            model(torch.zeros(1, 0, dtype=torch.long))


@pytest.mark.parametrize("sizes", [
    dict(start_size=0, intermediate_size=16, recent_size=8),
    dict(start_size=4, intermediate_size=0, recent_size=8),
    dict(start_size=4, intermediate_size=16, recent_size=0),
])
def test_zero_sized_areas_work_as_documented(sizes):
    model = tiny_model("llama")
    params = KVCacheCompressionParameters(**sizes, decode_slack=0)
    with KVCacheCompressor(params)(model) as session, torch.no_grad():
        out = model(random_tokens(100), use_cache=True)
        positions = session.layers[0].true_positions[0].tolist()
    assert out.past_key_values.layers[0].keys.shape[-2] == params.max_cache_size
    assert positions[: sizes["start_size"]] == list(range(sizes["start_size"]))
    if sizes["recent_size"]:
        assert positions[-sizes["recent_size"]:] == list(range(100 - sizes["recent_size"], 100))


def test_wrong_parameter_object_is_a_type_error():
    with pytest.raises(TypeError, match="eviction_parameters"):
        KVCacheCompressor(eviction_parameters="snapkv")


def test_mask_of_the_wrong_length_is_refused():
    model = tiny_model("llama")
    with KVCacheCompressor(KVCacheCompressionParameters(start_size=4, intermediate_size=16, recent_size=8))(model):
        with torch.no_grad():
            cache = model(random_tokens(60), use_cache=True).past_key_values
            with pytest.raises(ValueError, match="attention_mask covers 5 tokens"):
                model(random_tokens(1), cache=cache, attention_mask=torch.ones(1, 5, dtype=torch.long))


@pytest.mark.parametrize("budget", [300, 0.2])
def test_a_misspelt_override_of_compress_names_the_closest_parameter(budget):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=re.escape("unknown compression parameter 'windw_size' (did you mean "
                                                   "'window_size'?); accepted: ")):
        compress(model, method="snapkv", budget=budget, windw_size=8)
