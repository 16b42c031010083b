"""``head_selection="per_head"``: every KV head keeps its own start / scored / recent slots.

* SnapKV's per-head selection equals a per-head top-k computed independently from eager attention weights, and
  each head's cached keys are the uncompressed keys at exactly those positions.
* With one KV head, per-head selection is the shared one.
* Budget above the prompt: exact equality with the uncompressed run; decode keeps every head bounded with its
  own windows; rerotated per-head keys equal keys encoded at the compact positions.
"""

import pytest
import torch
import transformers

from kvcompress import KVCacheCompressionParameters, KVCacheCompressor
from kvcompress.scoring.registry import SCORERS
from tiny_models import TinyTokenizer, random_tokens, scorer_parameters, tiny_model

PROMPT, WINDOW = 60, 8
SIZES = dict(start_size=4, intermediate_size=12, recent_size=8)


def _per_head_reference(attentions, kv_heads, params):
    """Kept positions per KV head of one layer from eager weights (1, H_q, T, T): window sum per query head,
    centred max-pool (kernel 7), sum over the head's group, norm_sum by observing queries, top-k (ties older)."""
    weights = attentions[0].double()
    heads, total, _ = weights.shape
    step = weights[:, total - WINDOW:].sum(1)  # (H_q, T)
    padded = torch.nn.functional.pad(step, (3, 3), value=float("-inf"))
    pooled = torch.stack([padded[:, j : j + 7].max(-1).values for j in range(total)], -1)
    scores = pooled.view(kv_heads, heads // kv_heads, total).sum(1)
    counts = torch.tensor([min(WINDOW, total - t) for t in range(total)], dtype=torch.float64)
    scores = scores / counts.clamp(min=1)
    start, recent = params.start_size, params.recent_size
    kept = []
    for head in range(kv_heads):
        middle = list(range(start, total - recent))
        ranked = sorted(middle, key=lambda t: (-float(scores[head, t]), t))[: params.intermediate_size]
        kept.append(sorted(list(range(start)) + ranked + list(range(total - recent, total))))
    return kept


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_per_head_snapkv_equals_a_top_k_per_head_from_eager_weights(arch):
    model = tiny_model(arch, attn_implementation="eager")
    params = KVCacheCompressionParameters(method="snapkv", window_size=WINDOW, head_selection="per_head", **SIZES)
    ids = random_tokens(PROMPT)
    with torch.no_grad():
        full = model(ids, use_cache=True, output_attentions=True)
        with KVCacheCompressor(params)(model) as session:
            cache = model(ids, use_cache=True).past_key_values
            states = dict(session.layers)
    kv_heads = model.config.num_key_value_heads
    differ = False
    for index, state in states.items():
        expected = _per_head_reference(full.attentions[index], kv_heads, params)
        got = state.true_positions[0].tolist()
        assert got == expected, f"layer {index}"
        differ |= len({tuple(head) for head in got}) > 1
        for head, positions in enumerate(expected):
            torch.testing.assert_close(cache.layers[index].keys[0, head],
                                       full.past_key_values.layers[index].keys[0, head, positions], rtol=0, atol=0)
    assert differ, "every head kept the same slots: the test cannot tell per-head from shared selection"


def test_with_one_kv_head_per_head_equals_shared():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=1, pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = random_tokens(90)
    results = []
    for head_selection in ("shared", "per_head"):
        params = KVCacheCompressionParameters(method="snapkv", head_selection=head_selection, decode_slack=2,
                                              **SIZES)
        with KVCacheCompressor(params)(model) as session:
            out = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
            positions = [state.true_positions[0].reshape(-1).tolist() for state in session.layers.values()]
        results.append((out, positions))
    assert torch.equal(results[0][0], results[1][0])
    assert results[0][1] == results[1][1]


@pytest.mark.parametrize("method", list(SCORERS))
def test_budget_above_the_prompt_changes_nothing(method):
    model = tiny_model("llama")
    ids = random_tokens(50)
    expected = model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    params = scorer_parameters(method, start_size=8, intermediate_size=200, recent_size=8,
                               head_selection="per_head")
    with KVCacheCompressor(params, tokenizer=TinyTokenizer())(model):
        got = model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("strategy", ["per_token", "per_group"])
def test_decode_keeps_every_head_bounded_with_its_own_windows(strategy):
    model = tiny_model("llama")
    params = KVCacheCompressionParameters(method="h2o", strategy=strategy, group_size=4, head_selection="per_head",
                                          decode_slack=3, **SIZES)
    slack = params.decode_slack if strategy == "per_token" else params.group_size
    with KVCacheCompressor(params)(model) as session, torch.no_grad():
        out = model(random_tokens(70), use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(40):
            out = model(token, cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            assert cache.layers[0].keys.shape[-2] <= params.max_cache_size + slack
        seen = cache.get_seq_length()
        for state in session.layers.values():
            for head in state.true_positions[0].tolist():
                assert head == sorted(head) and head[:4] == [0, 1, 2, 3]
                # per_group's recent area is whole pages, the last one partial (test_per_group.py)
                recent = params.recent_size if strategy == "per_token" else (seen - 4) % 4 or 4
                assert head[-recent:] == list(range(seen - recent, seen))


def test_rerotated_per_head_keys_equal_keys_encoded_at_compact_positions():
    """Each head's kept keys, rerotated, equal the uncompressed run's keys for the same tokens re-encoded at
    0 .. K-1 (computed from the unrotated keys of the full run)."""
    from kvcompress.rerotation import rotate_keys

    model = tiny_model("llama")
    params = KVCacheCompressionParameters(method="snapkv", head_selection="per_head", rerotate_keys=True, **SIZES)
    ids = random_tokens(PROMPT)
    with torch.no_grad():
        full = model(ids, use_cache=True).past_key_values
        with KVCacheCompressor(params)(model) as session:
            cache = model(ids, use_cache=True).past_key_values
            states = dict(session.layers)
    module = model.model.layers[0].self_attn
    inv_freq = model.model.rotary_emb.inv_freq
    for index, state in states.items():
        kept = state.true_positions  # (1, H_kv, K)
        assert state.rope_positions.tolist() == [[list(range(kept.shape[-1]))] * kept.shape[1]]
        keys = full.layers[index].keys
        original = keys.gather(2, kept[..., None].expand(-1, -1, -1, keys.shape[-1]))
        expected = rotate_keys(module, original, torch.arange(kept.shape[-1])[None, None] - kept, inv_freq)
        torch.testing.assert_close(cache.layers[index].keys, expected, rtol=0, atol=1e-5)
