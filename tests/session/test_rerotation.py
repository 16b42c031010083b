"""Rerotated keys equal the keys the model computes for the same tokens encoded at the compact positions."""

import pytest
import torch

from kvcompress import KVCacheCompressionParameters, KVCacheCompressor
from tiny_models import random_tokens, tiny_model


def _capture_unrotated_keys(model, arch):
    """Hook the last op before RoPE on the key path: k_proj (Llama) or k_norm (Qwen3). Keys by true position."""
    captured = {}  # (layer, position) -> (H_kv, d)
    handles = []
    for layer_index, layer in enumerate(model.model.layers):
        attention = layer.self_attn
        source = attention.k_norm if arch == "qwen3" else attention.k_proj

        def hook(module, args, output, layer_index=layer_index, attention=attention):
            keys = output.view(*output.shape[:2], -1, attention.head_dim)  # (B, q, H_kv, d)
            captured.setdefault(layer_index, []).append(keys[0].transpose(0, 1).detach().clone())

        handles.append(source.register_forward_hook(hook))
    return captured, handles


def _expected_cache_keys(model, unrotated_by_position, true_positions, compact_positions):
    keys = torch.stack([unrotated_by_position[p] for p in true_positions], dim=1)[None]  # (1, H_kv, T, d)
    cos, sin = model.model.rotary_emb(keys, torch.tensor([compact_positions]))
    module = type(model.model.layers[0].self_attn).__module__
    import sys

    rotated, _ = sys.modules[module].apply_rotary_pos_emb(keys, keys, cos, sin)
    return rotated


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("strategy", ["per_token", "per_group"])
def test_rerotated_keys_match_reencoding_at_compact_positions(arch, strategy):
    model = tiny_model(arch)
    sizes = dict(start_size=4, intermediate_size=16, recent_size=8, decode_slack=3)
    if strategy == "per_group":
        sizes = dict(start_size=4, intermediate_size=16, recent_size=8, group_size=4)
    params = KVCacheCompressionParameters(strategy=strategy, rerotate_keys=True, **sizes)
    prompt = random_tokens(90)
    steps = random_tokens(20, seed=5)
    captured, handles = _capture_unrotated_keys(model, arch)
    evictions_checked = 0
    try:
        with KVCacheCompressor(params)(model) as session, torch.no_grad():
            cache = model(prompt, use_cache=True).past_key_values
            for i in range(steps.shape[1] + 1):
                for layer_index, state in session.layers.items():
                    unrotated = torch.cat(captured[layer_index], dim=1)  # (H_kv, seen, d), by true position
                    by_position = {p: unrotated[:, p] for p in range(unrotated.shape[1])}
                    true_positions = state.true_positions[0].tolist()
                    expected = _expected_cache_keys(model, by_position, true_positions,
                                                    list(range(len(true_positions))))
                    torch.testing.assert_close(cache.layers[layer_index].keys, expected, atol=1e-5, rtol=0)
                    assert state.rope_positions[0].tolist() == list(range(len(true_positions)))
                evictions_checked = session.evictions
                if i < steps.shape[1]:
                    model(steps[:, i : i + 1], cache=cache, use_cache=True)
    finally:
        for handle in handles:
            handle.remove()
    assert evictions_checked >= 4  # the prompt's eviction and at least three during decoding


def test_rerotation_generates_past_max_positions_with_bounded_position_ids():
    model = tiny_model("llama")
    model.config.max_position_embeddings = 64
    params = KVCacheCompressionParameters(start_size=4, intermediate_size=16, recent_size=8, rerotate_keys=True)
    seen_positions = []
    with KVCacheCompressor(params)(model):
        # registered after the compressor's own pre-hook, so it sees the position ids the model will use
        handle = model.model.register_forward_pre_hook(
            lambda module, args, kwargs: seen_positions.append(int(kwargs["position_ids"].max())), with_kwargs=True
        )
        try:
            out = model.generate(random_tokens(50), max_new_tokens=100, min_new_tokens=100, do_sample=False)
        finally:
            handle.remove()
    assert out.shape[1] == 150 > model.config.max_position_embeddings
    assert max(seen_positions[1:]) <= params.max_cache_size + params.decode_slack


def test_rerotation_refused_for_sliding_window_models():
    model = tiny_model("gemma3")
    with pytest.raises(ValueError, match="rerotate_keys"):
        with KVCacheCompressor(KVCacheCompressionParameters(rerotate_keys=True))(model):
            pass


def test_rerotation_refused_for_length_dependent_rope():
    model = tiny_model("llama")
    model.model.rotary_emb.rope_type = "dynamic"
    with pytest.raises(ValueError, match="rope_type='dynamic'"):
        with KVCacheCompressor(KVCacheCompressionParameters(rerotate_keys=True))(model):
            pass
