"""State hygiene across calls, user caches, and decoding strategies that touch the cache."""

import pytest
import torch
from transformers import DynamicCache, StaticCache

from kvcompress import KVCacheCompressionParameters, KVCacheCompressor
from tiny_models import random_tokens, tiny_model

PARAMS = KVCacheCompressionParameters(start_size=4, intermediate_size=16, recent_size=8, decode_slack=2)


def _greedy(model, ids, **kwargs):
    return model.generate(ids, max_new_tokens=15, min_new_tokens=15, do_sample=False, **kwargs)


def test_two_generate_calls_and_reentry_match_fresh_runs():
    model = tiny_model("llama")
    first, second = random_tokens(70, seed=1), random_tokens(90, seed=2)
    with KVCacheCompressor(PARAMS)(model):
        fresh_first = _greedy(model, first)
    with KVCacheCompressor(PARAMS)(model):
        fresh_second = _greedy(model, second)
    compressor = KVCacheCompressor(PARAMS)
    with compressor(model):
        assert torch.equal(_greedy(model, first), fresh_first)
        assert torch.equal(_greedy(model, second), fresh_second)
    with compressor(model):
        assert torch.equal(_greedy(model, second), fresh_second)


def test_user_supplied_empty_dynamic_cache_works():
    model = tiny_model("llama")
    ids = random_tokens(70)
    with KVCacheCompressor(PARAMS)(model):
        expected = _greedy(model, ids)
        cache = DynamicCache(config=model.config)
        assert torch.equal(_greedy(model, ids, cache=cache), expected)
    assert cache.layers[0].keys.shape[-2] <= PARAMS.max_cache_size + PARAMS.decode_slack


@pytest.mark.parametrize("make_cache, message", [
    (lambda model: StaticCache(config=model.config, max_cache_len=128), "StaticCache"),
    (lambda model: DynamicCache(config=model.config, offloading=True), "offloading"),
])
def test_static_and_offloaded_caches_are_refused_with_advice(make_cache, message):
    model = tiny_model("llama")
    with KVCacheCompressor(PARAMS)(model):
        with pytest.raises(ValueError, match=f"{message}.*DynamicCache"):
            _greedy(model, random_tokens(40), cache=make_cache(model))


def test_cache_filled_outside_the_compressor_is_refused():
    model = tiny_model("llama")
    with torch.no_grad():
        cache = model(random_tokens(40), use_cache=True).past_key_values
        with KVCacheCompressor(PARAMS)(model):
            with pytest.raises(ValueError, match="filled outside the compressor"):
                model(random_tokens(1), cache=cache)


def test_sampling_works_and_is_reproducible():
    model = tiny_model("llama")
    ids = random_tokens(70)
    outputs = []
    for _ in range(2):
        torch.manual_seed(7)
        with KVCacheCompressor(PARAMS)(model):
            outputs.append(model.generate(ids, max_new_tokens=15, do_sample=True, top_k=20))
    assert torch.equal(*outputs)


def test_beam_search_keeps_scores_aligned_with_the_reordered_cache():
    """Each returned beam must equal a greedy re-scoring: its tokens' log-probs under the same compression.

    float64, so that batch-shape rounding cannot flip a near-tie between two slots' scores.
    """
    model = tiny_model("llama", dtype=torch.float64)
    ids = random_tokens(70)
    with KVCacheCompressor(PARAMS)(model) as session:
        out = model.generate(ids, max_new_tokens=12, min_new_tokens=12, num_beams=3, do_sample=False,
                             num_return_sequences=3, output_scores=True, return_dict_in_generate=True)
        for state in session.layers.values():
            assert state.counts.shape[0] == 3
        beam = out.sequences[0]
        # Teacher-force the best beam under the same compression: its greedy-free log-prob must match.
        with torch.no_grad():
            prefill = model(beam[None, :70], use_cache=True)
            cache = prefill.past_key_values
            logprob = torch.log_softmax(prefill.logits[:, -1], -1)[0, beam[70]].item()
            for position in range(70, beam.shape[0] - 1):
                step = model(beam[None, position : position + 1], cache=cache, use_cache=True).logits[:, -1]
                logprob += torch.log_softmax(step, -1)[0, beam[position + 1]].item()
    print("DBG", out.sequences_scores[0].item() * 12, logprob, out.sequences[0, 70:].tolist())
    # sequences_scores is float32 (about 4e-6 per unit at this size); without the reorder the gap is ~3e-3
    assert out.sequences_scores[0].item() * 12 == pytest.approx(logprob, abs=1e-4)


def test_assisted_decoding_and_crop_are_refused():
    model = tiny_model("llama")
    assistant = tiny_model("llama", seed=1)
    with KVCacheCompressor(PARAMS)(model):
        with pytest.raises(ValueError, match="cache that can be cropped"):  # transformers reads is_croppable
            model.generate(random_tokens(60), max_new_tokens=10, do_sample=False, assistant_model=assistant)
        cache = model(random_tokens(60), use_cache=True).past_key_values
        with pytest.raises(NotImplementedError, match="crop"):
            cache.crop(10)


def test_multi_turn_with_plain_calls_matches_a_full_mask_reference():
    """A second turn fed with model(...) calls continues at true positions (checked in test_positions too)."""
    model = tiny_model("llama")
    with KVCacheCompressor(PARAMS)(model) as session, torch.no_grad():
        cache = model(random_tokens(70), use_cache=True).past_key_values
        model(random_tokens(6, seed=4), cache=cache, attention_mask=torch.ones(1, 76, dtype=torch.long))
        assert session.cache.get_seq_length() == 76
        assert cache.layers[0].keys.shape[-2] <= PARAMS.max_cache_size
