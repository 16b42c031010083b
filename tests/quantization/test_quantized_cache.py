"""A compressed cache that holds its kept slots quantized (``kv_bits``): eviction keeps the same slots as at 16 bits
(it decides on full-precision scores), the layer then holds exactly the kept keys' and values' codes (dequantized,
equal to quantizing the 16-bit run's kept keys and values), full-precision copies of the newest ``kv_residual``,
the bytes that says, and generation runs on every layout."""

import pytest
import torch

from kvcompress import compress
from kvcompress.cache import kv_cache_bytes
from kvcompress.quantization import dequantize, quantize
from tiny_models import TinyTokenizer, random_tokens, tiny_model

PROMPT = 120


def _prefill(model, method, budget, **overrides):
    tokenizer = TinyTokenizer() if method == "kvzip" else None
    with compress(model, method=method, budget=budget, tokenizer=tokenizer, **overrides) as session, \
            torch.no_grad():
        out = model(random_tokens(PROMPT), use_cache=True)
    return session, out.past_key_values


@pytest.mark.parametrize("method, overrides", [("snapkv", {}), ("h2o", {}),
                                                ("kvzip", {"budget_allocation": "adaptive"})],
                         ids=["snapkv", "h2o", "kvzip-folded"])
@pytest.mark.parametrize("bits", [8, 4])
def test_the_kept_slots_are_the_16_bit_run_s_quantized(method, overrides, bits):
    model = tiny_model("llama")
    _, full = _prefill(model, method, 40, **overrides)
    _, packed = _prefill(model, method, 40, kv_bits=bits, kv_key_group_size=8, kv_value_group_size=16,
                         kv_residual=5, **overrides)
    for layer, reference in zip(packed.layers, full.layers):
        assert torch.equal(layer.true_positions, reference.true_positions)
        keys, values = layer.full_keys_values()
        assert layer.keys.shape[-2] == 5 and layer.physical_length == reference.physical_length
        for got, kept, group in ((keys, reference.keys, 8), (values, reference.values, 16)):
            expected = dequantize(quantize(kept, bits, group), kept.dtype)
            torch.testing.assert_close(got[..., :-5, :], expected[..., :-5, :], rtol=0, atol=0)
            # the newest five: copies of the originals (the whole prompt is in full precision until its eviction)
            torch.testing.assert_close(got[..., -5:, :], kept[..., -5:, :], rtol=0, atol=0)
    ratio = kv_cache_bytes(packed) / kv_cache_bytes(full)
    head_dim = full.layers[0].keys.shape[-1]
    # per slot and head, the mean of a key's and a value's bytes: codes, and a float16 scale and minimum per group
    # (8 channels of a key, 16 of a value)
    per_slot = head_dim * bits / 8 + (4 * head_dim / 8 + 4 * head_dim / 16) / 2
    slots = full.layers[0].physical_length
    expected = (slots * per_slot + 5 * head_dim * 4) / (slots * head_dim * 4)  # float32 model: 4 bytes
    assert ratio == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("bits", [8, 4])
def test_generation_stays_close_to_the_16_bit_cache(bits):
    model = tiny_model("llama")
    ids = random_tokens(PROMPT)
    with compress(model, method="snapkv", budget=40) as session:
        full = model.generate(ids, max_new_tokens=6, do_sample=False, output_scores=True,
                              return_dict_in_generate=True)
    with compress(model, method="snapkv", budget=40, kv_bits=bits, kv_key_group_size=16,
                  kv_value_group_size=16, kv_residual=4) as quantized:
        packed = model.generate(ids, max_new_tokens=6, do_sample=False, output_scores=True,
                                return_dict_in_generate=True)
    layer = packed.past_key_values.layers[0]
    assert layer.keys.shape[-2] == 4 and layer.physical_length == full.past_key_values.layers[0].physical_length
    assert quantized.report().kv_bytes < (0.6 if bits == 8 else 0.35) * session.report().kv_bytes
    first = torch.stack([full.scores[0], packed.scores[0]]).softmax(-1)
    assert (first[0] - first[1]).abs().max() < (0.02 if bits == 8 else 0.1)


def test_the_head_size_is_checked_and_no_residual_holds_codes_only():
    with pytest.raises(ValueError, match="kv_key_group_size must divide the model's head size"):
        with compress(tiny_model("llama"), method="snapkv", budget=40, kv_bits=8, kv_key_group_size=7):
            pass
    model = tiny_model("llama")
    with compress(model, method="snapkv", budget=40, kv_bits=4, kv_key_group_size=16,
                  kv_value_group_size=16, kv_residual=0) as session:
        out = model.generate(random_tokens(PROMPT), max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    layer = out.past_key_values.layers[0]
    assert layer.keys.shape[-2] == 0 and layer.kv_nbytes == layer.quantized.nbytes
    assert session.report().kv_bytes == sum(layer.quantized.nbytes for layer in out.past_key_values.layers)


LAYOUTS = {  # name -> (method, budget, overrides)
    "per_head": ("snapkv", 40, {"head_selection": "per_head"}),
    "evicting at every decode step": ("h2o", 40, {"decode_slack": 0}),
    "global": ("snapkv", 0.3, {"budget_allocation": "global"}),
    "folded, evicting while decoding (KVzip's)": ("kvzip", 0.3, {"decode_slack": 0}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_decodes_a_padded_batch_close_to_16_bits(layout):
    """A padded batch of two through prefill and ten decode steps that evict (the residual's copies then move
    with the slots they follow): as many slots per layer as at 16 bits, at most ``kv_residual`` copies, and every
    step's next-token probabilities within 0.05 of the 16-bit cache's."""
    from tiny_models import left_pad

    method, budget, overrides = LAYOUTS[layout]
    model = tiny_model("llama")
    ids, mask = left_pad([random_tokens(PROMPT, seed=1), random_tokens(PROMPT - 30, seed=2)])
    runs = []
    for extra in ({}, {"kv_bits": 8, "kv_key_group_size": 8, "kv_residual": 3}):
        with compress(model, method=method, budget=budget, tokenizer=TinyTokenizer(), **overrides, **extra):
            runs.append(model.generate(ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10,
                                       do_sample=False, output_scores=True, return_dict_in_generate=True,
                                       pad_token_id=0))
    for layer, reference in zip(runs[1].past_key_values.layers, runs[0].past_key_values.layers):
        assert layer.quantized is not None and layer.keys.shape[-2] <= 3
        assert layer.physical_length == reference.physical_length
    for full, packed in zip(runs[0].scores, runs[1].scores):
        assert (full.softmax(-1) - packed.softmax(-1)).abs().max() < 0.05


def test_beam_search_reorders_the_codes_with_the_slots():
    """Three beams: every reordering moves a layer's codes and scales with its rows (``_select_rows``), so each
    beam's cache holds its own decoded tokens: the same sequences as the 16-bit run and, slot by slot, keys within
    8-bit rounding of that run's (a beam reading another beam's codes would be off by far more)."""
    model = tiny_model("llama")
    ids = random_tokens(PROMPT)
    outputs = []
    for extra in ({}, {"kv_bits": 8, "kv_key_group_size": 8, "kv_residual": 0}):
        with compress(model, method="snapkv", budget=40, **extra):
            outputs.append(model.generate(ids, max_new_tokens=6, num_beams=3, num_return_sequences=3,
                                          do_sample=False, return_dict_in_generate=True))
    assert torch.equal(outputs[0].sequences, outputs[1].sequences)
    assert len({tuple(row[-4:].tolist()) for row in outputs[0].sequences}) > 1  # the beams differ
    for layer, reference in zip(outputs[1].past_key_values.layers, outputs[0].past_key_values.layers):
        keys = layer.full_keys_values()[0]
        assert (keys - reference.keys).abs().max() <= reference.keys.abs().max() / 100
