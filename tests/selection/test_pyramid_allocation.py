"""``budget_allocation="pyramid"``: PyramidKV's per-layer schedule, the same total as the uniform budget, and
caches that really hold each layer's own budget."""

import itertools

import pytest
import torch
import transformers

from kvcompress import KVCacheCompressionParameters, KVCacheCompressor
from kvcompress.cache import kv_cache_bytes
from kvcompress.selection.allocation import pyramid_scored_units
from tiny_models import random_tokens


def test_the_schedule_falls_linearly_and_sums_to_the_uniform_total():
    base = torch.tensor([100, 37, 0])
    shares = pyramid_scored_units(base, layers=30, beta=20)
    assert shares.shape == (30, 3)
    assert shares.sum(0).tolist() == [3000, 1110, 0]
    assert shares[:, 0].tolist()[0] == 195 and shares[:, 0].tolist()[-1] == 5  # 2·100 − 100/20 down to 100/20
    ideal = [195 - layer * 190 / 29 for layer in range(30)]
    assert all(abs(got - want) < 1 for got, want in zip(shares[:, 0].tolist(), ideal))
    assert all(a >= b for a, b in zip(shares[:, 1].tolist(), shares[1:, 1].tolist()))  # never grows with depth
    assert pyramid_scored_units(base, layers=30, beta=1).tolist() == [base.tolist()] * 30  # beta 1: uniform


def _model(layers=4):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("head_selection", ["shared", "per_head"])
def test_each_layer_holds_its_own_budget_and_the_total_is_the_uniform_one(head_selection):
    model = _model()
    ids = random_tokens(300)
    sizes = dict(start_size=4, intermediate_size=40, recent_size=8, head_selection=head_selection)
    caches = {}
    for allocation in ("uniform", "pyramid"):
        params = KVCacheCompressionParameters(method="snapkv", budget_allocation=allocation, **sizes)
        with KVCacheCompressor(params)(model), torch.no_grad():
            caches[allocation] = model(ids, use_cache=True).past_key_values
    expected = (pyramid_scored_units(torch.tensor([40]), 4, 20.0)[:, 0] + 12).tolist()
    assert [layer.keys.shape[-2] for layer in caches["pyramid"].layers] == expected
    assert expected[0] > expected[-1]
    assert kv_cache_bytes(caches["pyramid"]) == kv_cache_bytes(caches["uniform"])


@pytest.mark.parametrize("allocation, head_selection", list(itertools.product(["uniform", "global", "pyramid"],
                                                                              ["shared", "per_head"])))
def test_budget_above_the_prompt_changes_nothing(allocation, head_selection):
    model = _model()
    ids = random_tokens(60)
    expected = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    params = KVCacheCompressionParameters(method="snapkv", start_size=8, intermediate_size=300, recent_size=8,
                                          budget_allocation=allocation, head_selection=head_selection)
    with KVCacheCompressor(params)(model):
        got = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("head_selection", ["shared", "per_head"])
def test_a_padded_batch_equals_each_sequence_alone(head_selection):
    model = _model()
    params = KVCacheCompressionParameters(method="h2o", start_size=4, intermediate_size=24, recent_size=8,
                                          decode_slack=3, budget_allocation="pyramid", head_selection=head_selection)
    from tiny_models import left_pad

    prompts = [random_tokens(n, seed=i) for i, n in enumerate((90, 55, 30))]
    ids, mask = left_pad(prompts)

    def generate(ids, mask):
        with KVCacheCompressor(params)(model):
            return model.generate(ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                  pad_token_id=0)[:, ids.shape[-1]:]

    batched = generate(ids, mask)
    for row, prompt in enumerate(prompts):
        assert torch.equal(batched[row], generate(prompt, torch.ones_like(prompt))[0]), f"row {row}"
