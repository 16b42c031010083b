"""Left-padded batches: every sequence generates what it generates alone under the same compression."""

import itertools

import pytest
import torch

from kvcompress import KVCacheCompressionParameters, KVCacheCompressor
from kvcompress.scoring.registry import SCORERS
from tiny_models import BATCH_LENGTHS as LENGTHS
from tiny_models import generate_batch, left_pad, random_tokens, scorer_parameters, tiny_model


@pytest.mark.parametrize("method, strategy, rerotate, head_selection", list(
    itertools.product(["snapkv", "h2o"], ["per_token", "per_group"], [False, True], ["shared", "per_head"])
))
def test_each_sequence_matches_its_solo_run(method, strategy, rerotate, head_selection):
    model = tiny_model("llama")
    params = KVCacheCompressionParameters(
        method=method, strategy=strategy, group_size=4, start_size=4, intermediate_size=24, recent_size=12,
        window_size=8 if method == "snapkv" else None, rerotate_keys=rerotate, decode_slack=4,
        head_selection=head_selection,
    )
    prompts = [random_tokens(n, seed=i) for i, n in enumerate(LENGTHS)]
    batched = generate_batch(model, params, *left_pad(prompts))
    for row, prompt in enumerate(prompts):
        alone = generate_batch(model, params, prompt, torch.ones_like(prompt))
        assert torch.equal(batched[row], alone[0]), f"sequence {row} (length {prompt.shape[1]}) diverged"


@pytest.mark.parametrize("head_selection", ["shared", "per_head"])
@pytest.mark.parametrize("method", list(SCORERS))
def test_every_scorer_gives_each_sequence_its_solo_run(method, head_selection):
    """Padding never enters a score: KVzip reconstructs each sequence's own tokens, Expected Attention's
    statistics and KeyDiff's anchor leave dead slots out, TOVA reads each sequence's last real query."""
    model = tiny_model("llama")
    params = scorer_parameters(method, start_size=4, intermediate_size=24, recent_size=12, decode_slack=4,
                               scorer_options={"chunk_size": 32} if method == "kvzip" else {},
                               head_selection=head_selection)
    prompts = [random_tokens(n, seed=i) for i, n in enumerate(LENGTHS)]
    batched = generate_batch(model, params, *left_pad(prompts))
    for row, prompt in enumerate(prompts):
        alone = generate_batch(model, params, prompt, torch.ones_like(prompt))
        assert torch.equal(batched[row], alone[0]), f"sequence {row} (length {prompt.shape[1]}) diverged"


def test_pads_are_evicted_first_and_windows_count_real_tokens():
    model = tiny_model("llama")
    params = KVCacheCompressionParameters(start_size=4, intermediate_size=24, recent_size=12)
    prompts = [random_tokens(n, seed=i) for i, n in enumerate(LENGTHS)]
    ids, mask = left_pad(prompts)
    with KVCacheCompressor(params)(model) as session, torch.no_grad():
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # real-token positions, as generate gives them
        out = model(ids, attention_mask=mask, position_ids=positions, use_cache=True)
        assert out.past_key_values.layers[0].keys.shape[-2] == params.max_cache_size
        layout = session.layers[0].slot_valid
        for row, length in enumerate(LENGTHS):
            live = min(length, params.max_cache_size)
            assert layout[row].tolist() == [False] * (params.max_cache_size - live) + [True] * live
            for state in session.layers.values():
                kept = state.true_positions[row][layout[row]].tolist()
                assert kept[:4] == [0, 1, 2, 3] and kept[-12:] == list(range(length - 12, length))


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "qwen3", "phi3"])
def test_padded_batches_on_other_architectures(arch):
    model = tiny_model(arch)
    params = KVCacheCompressionParameters(start_size=4, intermediate_size=24, recent_size=12, decode_slack=4)
    prompts = [random_tokens(n, seed=i) for i, n in enumerate(LENGTHS)]
    batched = generate_batch(model, params, *left_pad(prompts))
    for row, prompt in enumerate(prompts):
        alone = generate_batch(model, params, prompt, torch.ones_like(prompt))
        assert torch.equal(batched[row], alone[0]), f"sequence {row} (length {prompt.shape[1]}) diverged"
