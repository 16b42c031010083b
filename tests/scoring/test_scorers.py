"""The query-agnostic scorers against independent references (eager attention weights, plain tensor formulas).

* KVzip: the scores equal the most attention each prompt slot receives from any reconstruction query of any
  query head of its group, read from ``output_attentions`` of reconstruction forwards run by hand on a copy of
  the prompt's cache; afterwards the cache holds the prompt's own keys only, one pass per chunk.
* TOVA keeps the slots the last query attends to most (mean over all query heads), the same in every head.
* Knorm keeps the smallest key norms; KeyDiff is scale-invariant and -1 for identical keys.
* Expected Attention with one future position, no covariance and no value norm is the softmax attention of the
  (identical) query rotated to the next position, over the keys past the sinks.
"""

import pytest
import torch

from kvcompress import KVCacheCompressionParameters, KVCacheCompressor
from kvcompress.rerotation import rotate_keys
from kvcompress.scoring.expected_attention import N_SINK, ExpectedAttention
from kvcompress.scoring.keydiff import KeyDiff
from kvcompress.scoring.kvzip import FIRST_REQUEST, NEXT_REQUEST, TAIL_TOKENS, KVzip
from tiny_models import TinyTokenizer, kvzip_reference_scores, random_tokens, tiny_model

PROMPT, CHUNK = 40, 16
SIZES = dict(start_size=4, intermediate_size=12, recent_size=4)


def _prefill(model, ids, params, tokenizer=None):
    with KVCacheCompressor(params, tokenizer=tokenizer)(model) as session, torch.no_grad():
        out = model(ids, use_cache=True)
        return out.past_key_values, dict(session.layers), dict(session.timings)


def _kept_positions(states, layer):
    return states[layer].true_positions[0].tolist()


def _expected_kept(scores, params):
    """Start and recent windows plus the best ``intermediate_size`` of the middle by the summed head scores."""
    start, recent = params.start_size, params.recent_size
    middle = scores[start : PROMPT - recent]
    order = sorted(range(middle.numel()), key=lambda i: (-float(middle[i]), i))[: params.intermediate_size]
    return sorted([*range(start), *(start + i for i in order), *range(PROMPT - recent, PROMPT)])


def test_kvzip_replay_inputs_follow_the_reference_layout():
    scorer = KVzip(KVCacheCompressionParameters(method="kvzip", scorer_options={"chunk_size": CHUNK}))
    tokenizer = TinyTokenizer()
    scorer.bind(None, tokenizer)
    context = [list(range(10, 10 + PROMPT)), list(range(50, 60))]
    passes = scorer.replay_inputs(context)
    assert len(passes) == -(-PROMPT // CHUNK)  # one pass per chunk of the longest context
    first, turn = tokenizer.encode(FIRST_REQUEST), tokenizer.encode("\n")
    assert passes[0][0] == first + turn + context[0][:CHUNK]
    assert passes[1][0] == tokenizer.encode(NEXT_REQUEST) + context[0][CHUNK - TAIL_TOKENS : CHUNK] + turn + (
        context[0][CHUNK : 2 * CHUNK])
    assert passes[0][1] == first + turn + context[1] and passes[1][1] == passes[2][1] == []


def test_kvzip_needs_a_tokenizer():
    model = tiny_model("llama")
    params = KVCacheCompressionParameters(method="kvzip", **SIZES)
    with pytest.raises(ValueError, match="tokenizer"):
        KVCacheCompressor(params)(model).__enter__()


def test_kvzip_scores_equal_eager_reconstruction_attention():
    model = tiny_model("llama", attn_implementation="eager")
    ids = random_tokens(PROMPT)
    params = KVCacheCompressionParameters(method="kvzip", scorer_options={"chunk_size": CHUNK}, **SIZES)
    cache, states, timings = _prefill(model, ids, params, TinyTokenizer())
    expected = kvzip_reference_scores(model, ids, params)
    with torch.no_grad():
        full = model(ids, use_cache=True).past_key_values

    assert timings["reconstruction"] > 0
    for layer in range(model.config.num_hidden_layers):
        kept = _kept_positions(states, layer)
        assert kept == _expected_kept(expected[layer].sum(0), params)
        torch.testing.assert_close(states[layer].head_scores[0], expected[layer][:, kept], rtol=1e-4, atol=1e-6)
        # no reconstruction slot is left: the cache holds exactly the prompt's own keys at the kept positions
        torch.testing.assert_close(cache.layers[layer].keys, full.layers[layer].keys[:, :, kept], rtol=0, atol=0)
    assert all(0.0 <= float(states[layer].head_scores.max()) <= 1.0 for layer in states)


def test_kvzip_scores_every_pass_over_the_prompt_alone_in_a_model_with_sliding_layers():
    """Each reconstruction pass sees the prompt's cache and nothing else: a sliding-window layer holding the
    previous pass's tokens would shift every later pass's masks and windows (Gemma 3 lost its needles)."""
    model = tiny_model("gemma3", attn_implementation="eager")
    ids = random_tokens(PROMPT)
    params = KVCacheCompressionParameters(method="kvzip", scorer_options={"chunk_size": CHUNK}, **SIZES)
    scorer = KVzip(params)
    scorer.bind(model, TinyTokenizer())
    assert len(scorer.replay_inputs([ids[0].tolist()])) == 3
    _, states, _ = _prefill(model, ids, params, TinyTokenizer())
    expected = kvzip_reference_scores(model, ids, params)
    assert list(states) == [1]  # the full-attention layer; its neighbours slide
    kept = _kept_positions(states, 1)
    assert kept == _expected_kept(expected[1].sum(0), params)
    torch.testing.assert_close(states[1].head_scores[0], expected[1][:, kept], rtol=1e-4, atol=1e-6)


def test_kvzip_scores_a_prompt_that_fits_its_budget():
    """Nothing is evicted now, but a later chunk, chat turn or decode step that goes over the budget evicts on
    these scores: a prompt that fits is reconstructed all the same."""
    model = tiny_model("llama", attn_implementation="eager")
    params = KVCacheCompressionParameters(method="kvzip", scorer_options={"chunk_size": CHUNK}, **SIZES)
    ids = random_tokens(params.max_cache_size - 2)
    _, states, _ = _prefill(model, ids, params, TinyTokenizer())
    expected = kvzip_reference_scores(model, ids, params)
    for layer in range(model.config.num_hidden_layers):
        assert _kept_positions(states, layer) == list(range(ids.shape[-1]))
        torch.testing.assert_close(states[layer].head_scores[0], expected[layer], rtol=1e-4, atol=1e-6)


def test_tova_keeps_what_the_last_query_attends_to_most():
    model = tiny_model("llama", attn_implementation="eager")
    ids = random_tokens(PROMPT)
    params = KVCacheCompressionParameters(method="tova", **SIZES)
    cache, states, _ = _prefill(model, ids, params)
    with torch.no_grad():
        attentions = model(ids, output_attentions=True).attentions
    for layer, weights in enumerate(attentions):
        last_row = weights[0, :, -1].mean(0)  # mean over all query heads of the layer
        assert _kept_positions(states, layer) == _expected_kept(last_row, params)
        scores = states[layer].head_scores[0]
        assert torch.equal(scores, scores[:1].expand_as(scores))  # every KV head holds the same, layer-shared


def test_knorm_keeps_the_smallest_key_norms():
    model = tiny_model("llama")
    ids = random_tokens(PROMPT)
    params = KVCacheCompressionParameters(method="knorm", **SIZES)
    cache, states, _ = _prefill(model, ids, params)
    with torch.no_grad():
        full = model(ids, use_cache=True).past_key_values
    for layer in range(model.config.num_hidden_layers):
        norms = full.layers[layer].keys[0].float().norm(dim=-1)  # (H_kv, T)
        assert _kept_positions(states, layer) == _expected_kept(-norms.sum(0), params)


def test_keydiff_is_scale_invariant_and_minus_one_for_identical_keys():
    scorer = KeyDiff(KVCacheCompressionParameters(method="keydiff"))
    keys = torch.randn(2, 3, 10, 8)
    live = torch.ones(2, 10, dtype=torch.bool)
    scores = scorer.eviction_scores(None, keys, None, live)
    scale = torch.rand(2, 3, 10, 1) + 0.1
    torch.testing.assert_close(scorer.eviction_scores(None, keys * scale, None, live), scores)
    same = torch.randn(1, 1, 1, 8).expand(2, 3, 10, 8)
    torch.testing.assert_close(scorer.eviction_scores(None, same, None, live), torch.full((2, 3, 10), -1.0))
    # dead slots do not move the anchor
    padded = torch.cat([torch.randn(2, 3, 4, 8) * 100, keys], dim=2)
    mask = torch.cat([torch.zeros(2, 4, dtype=torch.bool), live], dim=-1)
    torch.testing.assert_close(scorer.eviction_scores(None, padded, None, mask)[..., 4:], scores)


def test_expected_attention_is_the_rotated_query_attention_when_queries_are_identical():
    model = tiny_model("llama")
    module = model.model.layers[0].self_attn
    batch, heads, kv_heads, length, dim = 1, 4, 2, 24, 16
    params = KVCacheCompressionParameters(
        method="expected_attention",
        scorer_options={"future_positions": 1, "covariance": False, "value_norm": False},
    )
    scorer = ExpectedAttention(params)
    scorer.bind(model, None)
    inv_freq = scorer.inv_freq.float()
    positions = torch.arange(length)[None]
    query = torch.randn(batch, heads, 1, dim)
    rotated_queries = rotate_keys(module, query.expand(-1, -1, length, -1), positions, inv_freq)
    keys = torch.randn(batch, kv_heads, length, dim)

    class State:
        statistics = {}
        true_positions = positions

    call = type("Call", (), dict(module=module, queries=rotated_queries, positions=positions, scaling=0.25,
                                 observed=torch.ones(batch, length, dtype=torch.bool)))()
    scorer.attend(call, State)
    scores = scorer.eviction_scores(State, keys, None, torch.ones(batch, length, dtype=torch.bool))

    at_next = rotate_keys(module, query, torch.full((1, 1), length), inv_freq)[:, :, 0]  # (B, H, d)
    logits = 0.25 * torch.einsum("bkgd,bktd->bkgt", at_next.view(batch, kv_heads, -1, dim), keys)
    expected = torch.softmax(logits[..., N_SINK:], dim=-1).mean(2)
    torch.testing.assert_close(scores[..., N_SINK:], expected, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(scores[..., N_SINK:].sum(-1), torch.ones(batch, kv_heads))
    assert bool((scores[..., :N_SINK] > scores[..., N_SINK:].max()).all())  # sinks are never evicted first


def test_expected_attention_statistics_do_not_depend_on_the_row_chunks(monkeypatch):
    """The queries' mean and covariance are accumulated over chunks of rows (bounded memory on long prompts): one
    row per chunk gives what one chunk of all rows gives, padding and sink positions left out alike."""
    from kvcompress.scoring import expected_attention

    model = tiny_model("llama")
    params = KVCacheCompressionParameters(method="expected_attention")
    scorer = ExpectedAttention(params)
    scorer.bind(model, None)
    generator = torch.Generator().manual_seed(3)
    observed = torch.ones(2, 30, dtype=torch.bool)
    observed[1, :5] = False
    call = type("Call", (), dict(module=model.model.layers[0].self_attn, scaling=0.25, observed=observed,
                                 queries=torch.randn(2, 4, 30, 16, generator=generator),
                                 positions=(torch.arange(30)[None] - torch.tensor([[0], [5]])).clamp(min=0)))()
    whole = scorer._statistics(call)
    monkeypatch.setattr(expected_attention, "STATISTICS_ELEMENTS", 1)
    rows = scorer._statistics(call)
    for name in ("mean", "covariance"):
        torch.testing.assert_close(rows[name], whole[name], rtol=1e-5, atol=1e-6)
