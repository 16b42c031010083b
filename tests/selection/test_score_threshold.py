"""score_threshold: the scored area keeps only slots whose best head scores at least the threshold, under the
budget as a cap, in prefill and during decoding; checked against KVzap's reference scores (the surrogate applied
to hidden states computed outside any session, ``tiny_models.kvzap_reference_scores``)."""

import pytest
import torch

from kvcompress import KVCacheCompressor
from kvcompress.cache import kept_fraction
from tiny_models import (
    generate_batch,
    kvzap_reference_scores,
    left_pad,
    random_tokens,
    scorer_parameters,
    tiny_model,
)

PROMPT, START, RECENT = 60, 4, 8


def _best_head_scores(model, ids) -> dict[int, torch.Tensor]:
    """Per compressed layer, each token's highest predicted score over the KV heads (T,)."""
    return {index: scores.exp().amax(0) for index, scores in kvzap_reference_scores(model, ids).items()}


def _threshold(scores: dict[int, torch.Tensor], quantile: float) -> float:
    return float(torch.cat(list(scores.values())).quantile(quantile))


def _expected(best: torch.Tensor, threshold: float, length: int) -> set[int]:
    """Start window, the scored area's tokens at or above the threshold, recent window (of ``length`` tokens)."""
    middle = {START + t for t in torch.nonzero(best[START : length - RECENT] >= threshold).flatten().tolist()}
    return set(range(START)) | middle | set(range(length - RECENT, length))


@pytest.mark.parametrize("allocation", ["uniform", "global"])
def test_a_prompt_keeps_exactly_the_slots_at_or_above_the_threshold(allocation):
    """A budget far above the prompt: without a threshold nothing is evicted; with one, what falls below leaves."""
    model = tiny_model("llama")
    ids = random_tokens(PROMPT)
    best = _best_head_scores(model, ids)
    threshold = _threshold(best, 0.6)
    params = scorer_parameters("kvzap", start_size=START, intermediate_size=200, recent_size=RECENT,
                               budget_allocation=allocation, score_threshold=threshold)
    with KVCacheCompressor(params)(model) as session, torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    for index, state in session.layers.items():
        assert set(state.true_positions[0].tolist()) == _expected(best[index], threshold, PROMPT)
        assert state.tracked_slots == len(_expected(best[index], threshold, PROMPT)) < PROMPT
    kept = sum(len(_expected(scores, threshold, PROMPT)) for scores in best.values()) / (len(best) * PROMPT)
    assert kept_fraction(cache) == pytest.approx(kept)  # every layer of the tiny model is compressed


def test_the_budget_caps_what_the_threshold_keeps():
    """A threshold below every score changes nothing: the budget's own top-k is kept, slot for slot."""
    model = tiny_model("llama")
    ids = random_tokens(PROMPT)
    kept = []
    for threshold in (None, 1e-30):
        params = scorer_parameters("kvzap", start_size=START, intermediate_size=16, recent_size=RECENT,
                                   score_threshold=threshold)
        with KVCacheCompressor(params)(model) as session, torch.no_grad():
            model(ids, use_cache=True)
        kept.append({index: state.true_positions.clone() for index, state in session.layers.items()})
    for index in kept[0]:
        assert kept[0][index].shape[-1] == START + 16 + RECENT
        assert torch.equal(kept[0][index], kept[1][index])


def test_decoding_drops_what_falls_below_the_threshold():
    """Evicting at every step (decode_slack 0), the cache after generation is the threshold's selection of every
    token that entered it: decoded tokens are scored once and kept or dropped like the prompt's. The first layer's
    input (the embeddings) does not depend on what was evicted, so its reference scores are exact for the compressed
    run's own tokens; every layer keeps only slots at or above the threshold between its windows."""
    model = tiny_model("llama")
    ids = random_tokens(PROMPT)
    steps = 12
    threshold = _threshold(_best_head_scores(model, ids), 0.5)
    params = scorer_parameters("kvzap", start_size=START, intermediate_size=200, recent_size=RECENT,
                               decode_slack=0, score_threshold=threshold)
    with KVCacheCompressor(params)(model):
        out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             return_dict_in_generate=True)
    states = dict(enumerate(out.past_key_values.layers))
    length = PROMPT + steps - 1  # the last token never enters the cache
    best = _best_head_scores(model, out.sequences[:, :-1])
    assert set(states[0].true_positions[0].tolist()) == _expected(best[0], threshold, length)
    for state in states.values():
        positions = state.true_positions[0]
        middle = (positions >= START) & (positions < length - RECENT)
        assert bool((state.head_scores[0].amax(0)[middle] >= threshold).all())
        assert set(range(START)) | set(range(length - RECENT, length)) <= set(positions.tolist())
    assert (positions >= PROMPT).sum() > 0  # decoded tokens above the threshold stayed


def test_with_slack_the_cache_grows_by_at_most_the_slack_between_evictions():
    model = tiny_model("llama")
    ids = random_tokens(PROMPT)
    params = scorer_parameters("kvzap", start_size=START, intermediate_size=200, recent_size=RECENT,
                               decode_slack=4, score_threshold=_threshold(_best_head_scores(model, ids), 0.5))
    lengths = []
    with KVCacheCompressor(params)(model) as session, torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        token = ids[:, -1:]
        for _ in range(15):
            cache = model(token, cache=cache, use_cache=True).past_key_values
            state = session.layers[0]
            lengths.append((state.tracked_slots, state.kept_length))
    assert all(length <= kept + 4 for length, kept in lengths)
    assert len({kept for _, kept in lengths}) > 1  # it evicted while decoding


def test_head_wise_selection_keeps_each_heads_own_slots_at_or_above_the_threshold():
    model = tiny_model("llama")
    ids = random_tokens(PROMPT)
    scores = {index: s.exp() for index, s in kvzap_reference_scores(model, ids).items()}
    threshold = float(torch.cat([s.flatten() for s in scores.values()]).quantile(0.6))
    params = scorer_parameters("kvzap", start_size=START, intermediate_size=200, recent_size=RECENT,
                               head_selection="per_head", budget_allocation="global_adaptive",
                               compress_during_decoding=False, adaptive_floor=0.0, score_threshold=threshold)
    with KVCacheCompressor(params)(model) as session, torch.no_grad():
        model(ids, use_cache=True)
    for index, state in session.layers.items():
        for head in range(scores[index].shape[0]):
            mine = state.slot_head[0] == head
            assert set(state.true_positions[0][mine].tolist()) == _expected(scores[index][head], threshold, PROMPT)


def test_each_sequence_of_a_padded_batch_keeps_what_it_keeps_alone():
    model = tiny_model("llama")
    prompts = [random_tokens(n, seed=i) for i, n in enumerate((50, 33, 64))]
    params = scorer_parameters("kvzap", start_size=START, intermediate_size=24, recent_size=RECENT, decode_slack=4,
                               score_threshold=_threshold(_best_head_scores(model, prompts[0]), 0.5))
    batched = generate_batch(model, params, *left_pad(prompts))
    for row, prompt in enumerate(prompts):
        assert torch.equal(batched[row], generate_batch(model, params, prompt, torch.ones_like(prompt))[0])
