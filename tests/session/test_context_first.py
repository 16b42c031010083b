"""Compress a context once, then ask questions after it (``session.prefill`` + ``session.generate``).

* Budget above everything: the answers equal plain greedy ``generate`` on context + question, uncompressed.
* Small budget: the context is compressed before any question is seen; each question starts at the context's
  true length, neither it nor the answer is evicted, and afterwards the cache is tensor-equal to the compressed
  context, so the second question's answer does not depend on the first.
"""

import pytest
import torch

from kvcompress import KVCacheCompressionParameters, KVCacheCompressor
from kvcompress.scoring.registry import SCORERS
from tiny_models import TinyTokenizer, random_tokens, scorer_parameters, tiny_model

CONTEXT, QUESTION, NEW = 70, 9, 12


def _reference(model, ids):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                         do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_budget_above_everything_equals_uncompressed_generate(arch):
    model = tiny_model(arch)
    context, question = random_tokens(CONTEXT, seed=1), random_tokens(QUESTION, seed=2)
    expected = _reference(model, torch.cat([context, question], dim=-1))
    params = KVCacheCompressionParameters(start_size=8, intermediate_size=200, recent_size=8)
    with KVCacheCompressor(params)(model) as session:
        session.prefill(context)
        answer = session.generate(question, max_new_tokens=NEW, eos_token_id=[])
    assert torch.equal(answer, expected)


@pytest.mark.parametrize("method", list(SCORERS))
def test_questions_see_the_same_compressed_context(method):
    model = tiny_model("llama")
    params = scorer_parameters(method, start_size=4, intermediate_size=16, recent_size=8, decode_slack=2)
    context = random_tokens(CONTEXT, seed=1)
    questions = [random_tokens(QUESTION, seed=2), random_tokens(QUESTION + 3, seed=3)]
    with KVCacheCompressor(params, tokenizer=TinyTokenizer())(model) as session:
        cache = session.prefill(context)
        compressed = [layer.keys.clone() for layer in cache.layers]
        assert compressed[0].shape[-2] == params.max_cache_size
        first = session.generate(questions[0], max_new_tokens=NEW, eos_token_id=[])
        assert cache.layers[0].keys.shape[-2] == params.max_cache_size  # restored
        second = session.generate(questions[1], max_new_tokens=NEW, eos_token_id=[])
        for layer, keys in zip(cache.layers, compressed):
            assert torch.equal(layer.keys, keys)
    with KVCacheCompressor(params, tokenizer=TinyTokenizer())(model) as fresh:
        fresh.prefill(context)
        alone = fresh.generate(questions[1], max_new_tokens=NEW, eos_token_id=[])
    assert torch.equal(second, alone)  # the first question left no trace
    assert first.shape == (1, NEW)


def test_question_positions_continue_the_true_context_and_nothing_is_evicted():
    model = tiny_model("llama")
    params = KVCacheCompressionParameters(start_size=4, intermediate_size=16, recent_size=8, decode_slack=0)
    context, question = random_tokens(CONTEXT, seed=1), random_tokens(QUESTION, seed=2)
    seen = []

    def record(module, args, kwargs):
        seen.append((kwargs["position_ids"][0].tolist(), kwargs["cache"].layers[0].keys.shape[-2]))

    with KVCacheCompressor(params)(model) as session:
        session.prefill(context)
        handle = model.model.register_forward_hook(lambda *a, **k: None)
        pre = model.model.register_forward_pre_hook(record, with_kwargs=True)
        try:
            session.generate(question, max_new_tokens=4, eos_token_id=[])
        finally:
            handle.remove()
            pre.remove()
    # hooks run in registration order: the session's pre-hook (registered first) has set the true positions
    assert seen[0][0] == list(range(CONTEXT, CONTEXT + QUESTION))
    assert [step[0] for step in seen[1:]] == [[CONTEXT + QUESTION + i] for i in range(3)]
    budget = params.max_cache_size
    assert [step[1] for step in seen] == [budget, budget + QUESTION, budget + QUESTION + 1, budget + QUESTION + 2]


def test_generate_needs_a_prefilled_context():
    model = tiny_model("llama")
    with KVCacheCompressor(KVCacheCompressionParameters())(model) as session:
        with pytest.raises(RuntimeError, match="prefill"):
            session.generate(random_tokens(4), max_new_tokens=2)
