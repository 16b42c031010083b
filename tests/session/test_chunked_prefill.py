"""``session.prefill(context, chunk_size=N)``: the context in chunks, the cache back to its budget after each one.

The references are the one-shot prefill (a chunk as long as the context is the same computation), each sequence's
own chunked prefill (a left-padded batch), and the cache's length seen from inside every forward (never more than
the budget plus one chunk).
"""

from __future__ import annotations

import pytest
import torch

from kvcompress import KVCacheCompressor, compress
from kvcompress.scoring.catalogue import SCORERS
from tiny_models import TinyTokenizer, kvzip_reference_scores, left_pad, random_tokens, scorer_parameters, tiny_model

CONTEXT = 300
CHUNK = 64
SIZES = dict(start_size=4, intermediate_size=40, recent_size=12)  # a budget of 56 slots


def _kept(session) -> list[list[list[int]]]:
    """Per layer, per sequence: the true positions the cache keeps (live slots only)."""
    return [[row[valid].tolist() for row, valid in zip(state.true_positions, state.slot_valid)]
            for state in session.layers.values()]


def _largest_cache_seen(model, run) -> int:
    """The most slots any compressed layer held when a forward started, while ``run()`` prefills."""
    largest = [0]

    def before(module, args, kwargs):
        cache = kwargs.get("cache") or kwargs.get("past_key_values")
        if cache is not None and cache.layers and getattr(cache.layers[0], "keys", None) is not None:
            largest[0] = max(largest[0], max(layer.keys.shape[-2] for layer in cache.layers))

    handle = model.model.register_forward_pre_hook(before, with_kwargs=True)
    try:
        run()
    finally:
        handle.remove()
    return largest[0]


@pytest.mark.parametrize("method", list(SCORERS))
def test_each_chunk_is_compressed_and_the_cache_never_holds_more_than_budget_plus_chunk(method):
    model = tiny_model("llama")
    params = scorer_parameters(method, **SIZES)
    ids = random_tokens(CONTEXT)
    with KVCacheCompressor(params, tokenizer=TinyTokenizer())(model) as session:
        largest = _largest_cache_seen(model, lambda: session.prefill(ids, chunk_size=CHUNK))
        kept = _kept(session)
        assert session.cache.get_seq_length() == CONTEXT
    # every chunk found the cache back at its budget; KVzip's reconstruction passes run over the kept slots and
    # the chunk they score (their own tokens are dropped layer by layer)
    assert largest == params.max_cache_size + (CHUNK if params.scorer.reconstructs else 0)
    for layer in kept:
        assert len(layer[0]) == params.max_cache_size
        assert layer[0][:4] == [0, 1, 2, 3] and layer[0][-12:] == list(range(CONTEXT - 12, CONTEXT))


@pytest.mark.parametrize("method", ["snapkv", "kvzip", "expected_attention"])
def test_one_chunk_as_long_as_the_context_is_the_one_shot_prefill(method):
    model = tiny_model("llama")
    params = scorer_parameters(method, **SIZES)
    ids = random_tokens(CONTEXT)
    kept = []
    for chunk_size in (None, CONTEXT, CONTEXT + 50):
        with KVCacheCompressor(params, tokenizer=TinyTokenizer())(model) as session:
            session.prefill(ids, chunk_size=chunk_size)
            answer = session.generate(random_tokens(6, seed=1), max_new_tokens=8)
            kept.append((_kept(session), answer.tolist()))
    assert kept[0] == kept[1] == kept[2]


def test_chunks_change_what_is_kept_but_not_how_much():
    """The check above can fail: smaller chunks score each token against fewer others and keep other tokens."""
    model = tiny_model("llama")
    params = scorer_parameters("snapkv", **SIZES)
    ids = random_tokens(CONTEXT)
    kept = []
    for chunk_size in (None, CHUNK):
        with KVCacheCompressor(params)(model) as session:
            session.prefill(ids, chunk_size=chunk_size)
            kept.append(_kept(session))
    assert [len(layer[0]) for layer in kept[0]] == [len(layer[0]) for layer in kept[1]]
    assert kept[0] != kept[1]


def test_kvzip_scores_a_first_chunk_that_fits_the_budget_by_its_own_reconstruction():
    """The first chunk (44 tokens) fits the budget (56 slots): nothing is evicted after it, yet the next chunks
    evict on its slots' scores, which must be at least those of its own reconstruction (later passes only raise
    them), not only the attention the later chunks' reconstructions give it."""
    model = tiny_model("llama", attn_implementation="eager")
    params = scorer_parameters("kvzip", **SIZES)
    ids = random_tokens(CONTEXT)
    first = CONTEXT % CHUNK
    assert first < params.max_cache_size
    own = kvzip_reference_scores(model, ids[:, :first], params)
    with KVCacheCompressor(params, tokenizer=TinyTokenizer())(model) as session:
        session.prefill(ids, chunk_size=CHUNK)
        for layer, state in enumerate(session.layers.values()):
            positions = state.true_positions[0]
            from_first = (positions < first) & state.slot_valid[0]
            scores = state.head_scores[0][:, from_first]
            assert bool((scores >= own[layer][:, positions[from_first]] - 1e-5).all()), layer


def test_a_fractional_budget_is_a_fraction_of_the_whole_context():
    model = tiny_model("llama")
    ids = random_tokens(CONTEXT)
    counts = []
    for chunk_size in (None, CHUNK):
        with compress(model, method="snapkv", budget=0.25) as session:
            session.prefill(ids, chunk_size=chunk_size)
            counts.append([len(layer[0]) for layer in _kept(session)])
    assert counts[0] == counts[1] == [round(0.25 * CONTEXT)] * 2


@pytest.mark.parametrize("method", ["h2o", "kvzip"])
def test_a_left_padded_batch_keeps_what_each_sequence_keeps_alone(method):
    model = tiny_model("llama")
    params = scorer_parameters(method, **SIZES)
    prompts = [random_tokens(length, seed=seed) for seed, length in enumerate((300, 170, 40))]
    ids, mask = left_pad(prompts)
    with KVCacheCompressor(params, tokenizer=TinyTokenizer())(model) as session:
        session.prefill(ids, attention_mask=mask, chunk_size=CHUNK)
        batch = _kept(session)
    for row, prompt in enumerate(prompts):
        with KVCacheCompressor(params, tokenizer=TinyTokenizer())(model) as session:
            session.prefill(prompt, chunk_size=CHUNK)
            alone = _kept(session)
        assert [layer[row] for layer in batch] == [layer[0] for layer in alone], row


@pytest.mark.parametrize("chunk_size", [None, 64])
def test_an_empty_context_is_refused_as_in_one_shot(chunk_size):
    model = tiny_model("llama")
    with KVCacheCompressor(scorer_parameters("snapkv", **SIZES))(model) as session:
        with pytest.raises(ValueError, match="the input has no tokens"):
            session.prefill(random_tokens(0), chunk_size=chunk_size)


@pytest.mark.parametrize("chunk_size", [0, -4, 2.5, True])
def test_a_bad_chunk_size_names_the_parameter(chunk_size):
    model = tiny_model("llama")
    with KVCacheCompressor(scorer_parameters("snapkv", **SIZES))(model) as session:
        with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
            session.prefill(random_tokens(20), chunk_size=chunk_size)
    assert torch.isfinite(model(random_tokens(5)).logits).all()  # the model is as it was


def _kept_per_head(session) -> list[list[list[int]]]:
    """Per layer, per KV head of the one sequence: the true positions kept, from a folded or a per-head state."""
    kept = []
    for state in session.layers.values():
        if state.folded_heads is None:
            kept.append([head.tolist() for head in state.true_positions[0]])
            continue
        live = state.slot_valid[0]
        kept.append([state.true_positions[0][live & (state.slot_head[0] == head)].tolist()
                     for head in range(state.folded_heads)])
    return kept


def test_kvzip_chunks_fold_the_cache_once_and_compress_it_again_per_head():
    """Head-wise KVzip in chunks: the second chunk's eviction folds the layers, every later one re-selects the folded
    slots per head. With ``adaptive_floor=1`` each head keeps its own share, which must be exactly what the
    rectangular per-head cache keeps chunk after chunk; ``global_adaptive`` holds the nominal budget over all layers
    and heads, each head with its windows."""
    model = tiny_model("llama")
    ids = random_tokens(CONTEXT)
    kept = {}
    for allocation, floor in (("uniform", 1.0), ("adaptive", 1.0), ("global_adaptive", 0.2)):
        params = scorer_parameters("kvzip", head_selection="per_head", budget_allocation=allocation,
                                   adaptive_floor=floor, compress_during_decoding=False, **SIZES)
        with KVCacheCompressor(params, tokenizer=TinyTokenizer())(model) as session:
            session.prefill(ids, chunk_size=CHUNK)
            kept[allocation] = _kept_per_head(session)
    assert kept["adaptive"] == kept["uniform"]
    heads = [head for layer in kept["global_adaptive"] for head in layer]
    assert sum(len(head) for head in heads) == len(heads) * params.max_cache_size
    assert all(head[:4] == [0, 1, 2, 3] and head[-12:] == list(range(CONTEXT - 12, CONTEXT)) for head in heads)
