"""The second embedded model, Gemma 3 270M (sliding-window and global layers), where its package is installed
(``pip install -e ".[gemma3]"``; skipped otherwise, the install command as the reason).

A budget above the prompt gives exactly the uncompressed answer; a small one cuts the global layers to it (the
preset's layers share it by score) and leaves the sliding layers (already bounded by their window) as the
uncompressed run has them.
"""

from __future__ import annotations

import pytest
import torch

from kvcompress import compress, models
from kvcompress import surrogate as surrogates

GEMMA = models.embedded_model("gemma3-270m")


def _unavailable() -> str:
    try:
        GEMMA.package_locations()
        import gguf  # noqa: F401
    except ImportError as error:
        return f"Gemma 3 270M not installed: {error}"
    return ""


pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(_unavailable()), reason=_unavailable())]


@pytest.fixture(scope="module")
def gemma():
    return models.load_model("gemma3-270m", dtype=torch.float32)


def test_a_budget_above_the_prompt_answers_as_the_full_cache(gemma):
    model, tokenizer = gemma
    assert model.config.layer_types.count("full_attention") == 3 and model.config.sliding_window == 512
    text = " ".join(f"Item {i} is stored in room {i * 7 % 101}." for i in range(80)) + " Item 42 is stored in room"
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert ids.shape[1] > 600  # longer than the sliding window: those layers have wrapped
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                  return_dict_in_generate=True)
    full = model.generate(ids, **kwargs)
    with compress(model, method="snapkv", budget=2048):
        same = model.generate(ids, **kwargs)
    assert same.sequences.tolist() == full.sequences.tolist()
    with compress(model, method="kvzip", budget=0.2, tokenizer=tokenizer):
        small = model.generate(ids, **kwargs)
    held = []
    for layer_type, layer, reference in zip(model.config.layer_types, small.cache.layers, full.cache.layers):
        if layer_type == "sliding_attention":
            assert layer.keys.shape == reference.keys.shape
        else:  # KVzip's preset: the global layers share their budget by score
            held.append(layer.keys.shape[-2])
    length = ids.shape[1] + 5  # the cache holds the prompt and the new tokens but the last
    assert sum(held) <= 3 * (round(0.2 * ids.shape[1]) + 5) and max(held) < length / 2, held


def test_kvzap_finds_the_shipped_surrogate_and_scores_only_the_global_layers(gemma):
    model, tokenizer = gemma
    surrogate = surrogates.for_model(model)
    assert surrogate.model_name == "gemma3-270m" and sorted(surrogate.weights) == [5, 11, 17]
    text = " ".join(f"Item {i} is in room {i * 7 % 101}." for i in range(40))
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    with compress(model, method="kvzap", budget=0.2), torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    held = [cache.layers[index].keys.shape[-2] for index in (5, 11, 17)]
    assert sum(held) <= 3 * (round(0.2 * ids.shape[1]) + 5), held
