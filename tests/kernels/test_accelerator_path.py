"""The accelerator path end to end, on CPU: a session whose fused passes run the Triton kernels (interpreted).

What a GPU run takes beyond the kernels themselves (tests/kernels/test_fused_attention.py checks those against float64):
the session hands them the module's queries and the cache, padded batches give them masks, KVzip's
reconstruction passes give them a prefix and the maximum. Each run is compared with the torch implementation,
the reference on every device: the same tokens, and at 25 % kept the same slots.
"""

import pytest
import torch
from transformers import DynamicCache

import kvcompress
from kvcompress.kernels import attention
from tiny_models import TinyTokenizer, random_tokens, tiny_model


@pytest.fixture
def triton_path(monkeypatch):
    """Switch from the torch implementation to the Triton kernels (the compiled CPU kernel off in both); the calls
    made of them: a fused pass's query shape, or "folded decode"."""
    monkeypatch.setenv("KVCOMPRESS_NATIVE", "0")
    calls = []
    fused, folded_decode = attention._triton_fused, attention.triton_attention.folded_decode

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return fused(*args, **kwargs)

    def counted_decode(*args, **kwargs):
        calls.append("folded decode")
        return folded_decode(*args, **kwargs)

    monkeypatch.setattr(attention, "_triton_fused", counted)
    monkeypatch.setattr(attention.triton_attention, "folded_decode", counted_decode)

    def use(enabled: bool):
        monkeypatch.setattr(attention, "TRITON_ON_CPU", enabled)
        return calls

    return use


def _kept_positions(session):
    return {index: (state.true_positions.clone(), state.slot_valid.clone())
            for index, state in session.layers.items()}


def _run(model, method, budget, ids, mask, **overrides):
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), kvcompress.compress(model, method=method, budget=budget, tokenizer=TinyTokenizer(),
                                              **overrides) as session:
        out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=4, min_new_tokens=4,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        return out, _kept_positions(session)


def test_budget_above_the_prompt_gives_the_uncompressed_tokens(triton_path):
    model = tiny_model("llama")
    ids = random_tokens(40)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        reference = model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                                   output_logits=True, return_dict_in_generate=True)
    calls = triton_path(True)
    got, _ = _run(model, "h2o", 64, ids, mask)
    assert calls, "the prefill did not run the Triton kernels"
    assert torch.equal(got.sequences, reference.sequences)
    for expected, logits in zip(reference.logits, got.logits):
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("method, overrides", [("h2o", {}), ("kvzip", {"budget_allocation": "global_adaptive"})])
def test_padded_batch_keeps_the_slots_of_the_torch_path(triton_path, method, overrides):
    """Two left-padded prompts at 25 % kept: H2O (every query observed, masks for the padding) and KVzip with
    head-wise global selection (its reconstruction passes on the kernels' maximum, then folded layers, whose
    decode steps run the split-key decode kernel)."""
    model = tiny_model("llama")
    ids = random_tokens(32, batch=2, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    ids[1, :7] = 0
    triton_path(False)
    expected, expected_slots = _run(model, method, 0.25, ids, mask, **overrides)
    calls = triton_path(True)
    got, slots = _run(model, method, 0.25, ids, mask, **overrides)
    assert calls and ("folded decode" in calls) == (method == "kvzip")
    assert torch.equal(got.sequences, expected.sequences)
    assert slots.keys() == expected_slots.keys()
    for index, (positions, valid) in slots.items():
        assert torch.equal(valid, expected_slots[index][1])
        assert torch.equal(positions[valid], expected_slots[index][0][valid])


def test_a_quantized_cache_decodes_as_on_the_torch_path(triton_path, monkeypatch):
    """KVzip's head-wise cache with its kept slots in 4 bits (``kv_bits``): the folded decode kernel reads the codes
    of the slots older than the full-precision residual; the torch path reads them dequantized. The same tokens."""
    model = tiny_model("llama")
    ids = random_tokens(32, batch=2, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    ids[1, :7] = 0
    quantized = dict(budget_allocation="global_adaptive", kv_bits=4, kv_key_group_size=8, kv_value_group_size=16,
                     kv_residual=2)
    triton_path(False)
    expected, _ = _run(model, "kvzip", 0.25, ids, mask, **quantized)
    calls = triton_path(True)
    read_codes = []
    operands = attention.triton_attention._code_operands
    monkeypatch.setattr(attention.triton_attention, "_code_operands",
                        lambda coded, *args: read_codes.append(coded is not None) or operands(coded, *args))
    got, _ = _run(model, "kvzip", 0.25, ids, mask, **quantized)
    assert "folded decode" in calls and any(read_codes)
    assert torch.equal(got.sequences, expected.sequences)
    for expected_logits, logits in zip(expected.logits, got.logits):
        torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)
