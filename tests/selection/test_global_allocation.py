"""budget_allocation="global": the layers share one budget by score, and each keeps (and frees) its own length.

* The scored areas of all layers compete for L × intermediate_size slots per sequence: each layer keeps its
  start and recent windows plus its winners, so the layers' lengths differ and their sum is the total budget.
* Attention over the compacted layers of different lengths equals attention over the full cache with each
  layer's evicted slots masked out (an independent reference built with an attention function of its own).
* Padded batches: each sequence gets what it gets alone; the cache is freed, not masked.
"""

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from kvcompress import KVCacheCompressor
from kvcompress.cache import kv_cache_bytes
from tiny_models import TinyTokenizer, random_tokens, scorer_parameters, tiny_model

PROMPT, QUESTION = 70, 6
SIZES = dict(start_size=4, intermediate_size=16, recent_size=8, budget_allocation="global")


def _compressed(model, method, ids):
    params = scorer_parameters(method, **SIZES)
    with KVCacheCompressor(params, tokenizer=TinyTokenizer())(model) as session:
        cache = session.prefill(ids)
        kept = {index: state.true_positions[0].tolist() for index, state in session.layers.items()}
    return params, cache, kept


@pytest.mark.parametrize("method", ["kvzip", "snapkv"])
def test_layers_split_one_budget_and_free_the_rest(method):
    model = tiny_model("llama")
    params, cache, kept = _compressed(model, method, random_tokens(PROMPT))
    layers = model.config.num_hidden_layers
    lengths = [cache.layers[index].keys.shape[-2] for index in range(layers)]
    assert sum(lengths) == layers * params.max_cache_size  # the same total as the uniform budget
    for index in range(layers):
        assert kept[index][: params.start_size] == list(range(params.start_size))
        assert kept[index][-params.recent_size :] == list(range(PROMPT - params.recent_size, PROMPT))
        assert len(kept[index]) == lengths[index]
    per_slot = cache.layers[0].keys[0, :, 0].nbytes * 2
    assert kv_cache_bytes(cache) == per_slot * sum(lengths)  # really freed: bytes follow the kept slots


def test_scores_decide_which_layer_keeps_more():
    """Scale one layer's scores up: it wins (nearly) the whole shared scored area."""
    from kvcompress.scoring.snapkv import SnapKV

    class Favour(SnapKV):
        def eviction_scores(self, state, keys, values, slot_valid):
            scores = super().eviction_scores(state, keys, values, slot_valid)
            return scores * 1000 if state is session.cache.layers[1] else scores

    model = tiny_model("llama")
    params = scorer_parameters("snapkv", **SIZES)
    with KVCacheCompressor(params)(model) as session:
        session.scorer.__class__ = Favour
        cache = session.prefill(random_tokens(PROMPT))
    windows = params.start_size + params.recent_size
    assert cache.layers[1].keys.shape[-2] - windows >= 2 * params.intermediate_size - 1
    assert cache.layers[0].keys.shape[-2] - windows <= 1


def _masked_eager(kept_per_layer, context):
    """eager attention that hides, for the queries after the context, each layer's evicted context slots."""
    import transformers.models.llama.modeling_llama as llama

    def attention(module, query, key, value, attention_mask, **kwargs):
        hidden = torch.ones(key.shape[-2], dtype=torch.bool)
        hidden[kept_per_layer[module.layer_idx]] = False
        hidden[context:] = False
        rows = torch.arange(key.shape[-2] - query.shape[2], key.shape[-2])
        extra = torch.where((rows >= context)[:, None] & hidden[None, :], float("-inf"), 0.0)
        mask = extra if attention_mask is None else attention_mask + extra
        return llama.eager_attention_forward(module, query, key, value, mask, **kwargs)

    return attention


@pytest.mark.parametrize("method", ["kvzip", "snapkv"])
def test_layers_of_different_lengths_equal_the_masked_full_cache(method):
    model = tiny_model("llama", attn_implementation="eager")
    context, question = random_tokens(PROMPT, seed=1), random_tokens(QUESTION, seed=2)
    params, cache, kept = _compressed(model, method, context)
    assert len({cache.layers[i].keys.shape[-2] for i in kept}) > 1  # the layers really differ in length
    with KVCacheCompressor(params, tokenizer=TinyTokenizer())(model) as session, torch.no_grad():
        session.prefill(context)
        compressed = model(question, cache=session._context[0], use_cache=True).logits
    AttentionInterface.register("kept_only_eager", _masked_eager(kept, PROMPT))
    AttentionMaskInterface.register("kept_only_eager", ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    model.config._attn_implementation = "kept_only_eager"
    try:
        with torch.no_grad():
            reference = model(torch.cat([context, question], dim=-1)).logits[:, PROMPT:]
    finally:
        model.config._attn_implementation = "eager"
    torch.testing.assert_close(compressed, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["kvzip", "snapkv", "expected_attention"])
def test_padded_batch_matches_solo_runs(method):
    from tiny_models import BATCH_LENGTHS as LENGTHS
    from tiny_models import generate_batch, left_pad

    model = tiny_model("llama")
    params = scorer_parameters(method, start_size=4, intermediate_size=24, recent_size=12, decode_slack=4,
                               budget_allocation="global")
    prompts = [random_tokens(n, seed=i) for i, n in enumerate(LENGTHS)]
    batched = generate_batch(model, params, *left_pad(prompts))
    for row, prompt in enumerate(prompts):
        alone = generate_batch(model, params, prompt, torch.ones_like(prompt))
        assert torch.equal(batched[row], alone[0]), f"sequence {row} (length {prompt.shape[1]}) diverged"
