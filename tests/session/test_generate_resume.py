"""``generate`` resumes a compressed cache: chat turns, chunked prefill, several questions on one document.

* Budget above everything: a three-turn conversation under compression equals the uncompressed one token for
  token (the cache's true length, mask sizes and positions are all transformers needs).
* Small budget: a later turn feeds only its new tokens, at the positions the uncompressed run gives them, and the
  cache stays within its bound.
* Chunked prefill: accumulated attention adds up over chunks, so chunks that evict only at the end keep exactly
  the slots of one prefill; with evictions between chunks every method keeps the cache bounded.
"""

import copy

import pytest
import torch
from transformers.cache_utils import DynamicCache

from kvcompress import KVCacheCompressionParameters, KVCacheCompressor
from kvcompress.layer import CompressedLayer
from kvcompress.scoring.registry import SCORERS
from tiny_models import TinyTokenizer, random_tokens, scorer_parameters, tiny_model

TURNS = (70, 9, 12)  # new tokens of each user turn
ANSWER = 6


def _conversation(model, session_factory=None, record=None):
    """Three generate turns on one cache; returns every turn's answer (and records what the decoder gets)."""
    handles = []
    if record is not None:  # the decoder's inputs of each model call (not of KVzip's reconstruction passes)
        def decoder_inputs(module, args, kwargs):
            if record and record[-1] is None:
                record[-1] = kwargs["input_ids"].shape[-1], kwargs["position_ids"][0].tolist()

        handles.append(model.register_forward_pre_hook(lambda *args: record.append(None)))
        handles.append(model.model.register_forward_pre_hook(decoder_inputs, with_kwargs=True))
    context = session_factory(model) if session_factory else _NoSession()
    answers, cache, sequence = [], None, torch.zeros(1, 0, dtype=torch.long)
    try:
        with context, torch.no_grad():
            for turn, length in enumerate(TURNS):
                sequence = torch.cat([sequence, random_tokens(length, seed=10 + turn)], dim=-1)
                out = model.generate(sequence, attention_mask=torch.ones_like(sequence), cache=cache,
                                     max_new_tokens=ANSWER, min_new_tokens=ANSWER, do_sample=False,
                                     return_dict_in_generate=True, pad_token_id=0)
                answers.append(out.sequences[:, sequence.shape[-1]:])
                sequence, cache = out.sequences, out.past_key_values
    finally:
        for handle in handles:
            handle.remove()
    return answers, cache


class _NoSession:
    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return None


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_budget_above_everything_three_turns_equal_uncompressed(arch):
    model = tiny_model(arch)
    expected, _ = _conversation(model)
    params = KVCacheCompressionParameters(start_size=8, intermediate_size=400, recent_size=8)
    answers, cache = _conversation(model, KVCacheCompressor(params))
    for turn, (got, want) in enumerate(zip(answers, expected)):
        assert torch.equal(got, want), f"turn {turn + 1} diverged"
    assert any(isinstance(layer, CompressedLayer) for layer in cache.layers)


@pytest.mark.parametrize("method", ["snapkv", "h2o", "kvzip"])
def test_small_budget_later_turns_feed_only_new_tokens_at_true_positions(method):
    model = tiny_model("llama")
    params = scorer_parameters(method, start_size=4, intermediate_size=16, recent_size=8, decode_slack=2)
    uncompressed, compressed = [], []
    _conversation(model, record=uncompressed)

    def session(model):
        return KVCacheCompressor(params, tokenizer=TinyTokenizer())(model)

    answers, cache = _conversation(model, session, record=compressed)
    assert [length for length, _ in compressed] == [length for length, _ in uncompressed]
    assert [positions for _, positions in compressed] == [positions for _, positions in uncompressed]
    # turns 2 and 3 start with the last answer token and the new turn only (generate never re-feeds the past)
    starts = [length for length, _ in compressed if length > 1]
    assert starts == [TURNS[0], TURNS[1] + 1, TURNS[2] + 1]
    for index, layer in enumerate(cache.layers):
        assert layer.keys.shape[-2] <= params.max_cache_size + params.decode_slack, index
    assert cache.get_seq_length() == sum(TURNS) + 3 * ANSWER - 1


def test_a_compressed_document_answers_several_questions_from_copies():
    """``copy.deepcopy`` of a compressed cache is a full, independent cache: each question's answer equals the
    answer on a freshly compressed copy of the document, whatever was asked before."""
    model = tiny_model("llama")
    params = KVCacheCompressionParameters(start_size=4, intermediate_size=16, recent_size=8)
    document = random_tokens(90)
    questions = [random_tokens(7, seed=s) for s in (1, 2)]

    def ask(cache, question):
        ids = torch.cat([document, question], dim=-1)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=5,
                             min_new_tokens=5, do_sample=False, pad_token_id=0)
        return out[:, ids.shape[-1]:]

    with KVCacheCompressor(params)(model), torch.no_grad():
        compressed = model(document, use_cache=True).past_key_values
        keys = [layer.keys.clone() for layer in compressed.layers]
        shared = [ask(copy.deepcopy(compressed), question) for question in questions]
        assert all(torch.equal(layer.keys, saved) for layer, saved in zip(compressed.layers, keys))
        alone = [ask(model(document, use_cache=True).past_key_values, question) for question in questions]
    assert all(torch.equal(a, b) for a, b in zip(shared, alone))


def test_chunked_prefill_keeps_the_slots_of_one_prefill_for_h2o_sum():
    """Chunks of 256 whose evictions all fall on the last chunk: every query sees the slots it sees in one
    prefill, so the summed scores, and the kept slots, are those of one prefill."""
    model = tiny_model("llama")
    ids = random_tokens(1024)
    params = KVCacheCompressionParameters(method="h2o", start_size=16, intermediate_size=748, recent_size=16)
    assert params.max_cache_size >= 768  # no eviction before the last chunk
    kept = []
    for chunk in (1024, 256):
        with KVCacheCompressor(params)(model) as session, torch.no_grad():
            cache = DynamicCache(config=model.config)
            for start in range(0, 1024, chunk):
                model(ids[:, start:start + chunk], cache=cache, use_cache=True)
            kept.append([state.true_positions[0].tolist() for state in session.layers.values()])
            assert session.evictions == 1
    assert kept[0] == kept[1]
    assert kept[0][0] != list(range(params.max_cache_size))  # the scores chose (the check can fail)


@pytest.mark.parametrize("method", list(SCORERS))
def test_chunked_prefill_stays_bounded_for_every_method(method):
    model = tiny_model("llama")
    params = scorer_parameters(method, start_size=8, intermediate_size=48, recent_size=16)
    ids = random_tokens(600)
    with KVCacheCompressor(params, tokenizer=TinyTokenizer())(model) as session, torch.no_grad():
        cache = DynamicCache(config=model.config)
        for start in range(0, 600, 256):
            out = model(ids[:, start:start + 256], cache=cache, use_cache=True)
            assert all(layer.keys.shape[-2] <= params.max_cache_size for layer in cache.layers)
        assert cache.get_seq_length() == 600
        kept = session.layers[0].true_positions[0].tolist()
        assert kept[:8] == list(range(8)) and kept[-16:] == list(range(584, 600))
        assert torch.isfinite(out.logits).all()


def test_a_cache_filled_outside_the_session_is_refused():
    model = tiny_model("llama")
    with torch.no_grad():
        cache = model(random_tokens(40), use_cache=True).past_key_values
    with KVCacheCompressor(KVCacheCompressionParameters(start_size=4, intermediate_size=8, recent_size=4))(model):
        with pytest.raises(ValueError, match="filled outside the compressor"):
            model(random_tokens(3), cache=cache, use_cache=True)


def _two_turns(model, params, prompts, follow_ups):
    """Two generate turns of a left-padded batch (or one sequence); returns each row's answers."""
    from tiny_models import left_pad

    ids, mask = left_pad(prompts)
    width = ids.shape[-1]
    with KVCacheCompressor(params)(model), torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=ANSWER, min_new_tokens=ANSWER, do_sample=False,
                             return_dict_in_generate=True, pad_token_id=0)
        first = out.sequences[:, width:]
        ids = torch.cat([out.sequences, follow_ups], dim=-1)
        mask = torch.cat([mask, torch.ones(len(prompts), ids.shape[-1] - mask.shape[-1], dtype=mask.dtype)], dim=-1)
        second = model.generate(ids, attention_mask=mask, cache=out.past_key_values, max_new_tokens=ANSWER,
                                min_new_tokens=ANSWER, do_sample=False, pad_token_id=0)[:, ids.shape[-1]:]
    return first, second


@pytest.mark.parametrize("rerotate", [False, True])
def test_a_padded_batch_of_conversations_equals_each_conversation_alone(rerotate):
    model = tiny_model("llama")
    params = KVCacheCompressionParameters(start_size=4, intermediate_size=16, recent_size=8, decode_slack=2,
                                          rerotate_keys=rerotate)
    prompts = [random_tokens(n, seed=i) for i, n in enumerate((70, 45, 20))]
    follow_ups = random_tokens(9, batch=3, seed=7)
    batched = _two_turns(model, params, prompts, follow_ups)
    for row, prompt in enumerate(prompts):
        alone = _two_turns(model, params, [prompt], follow_ups[row:row + 1])
        for turn in range(2):
            assert torch.equal(batched[turn][row], alone[turn][0]), f"row {row}, turn {turn + 1}"


def test_with_rerotation_a_later_turn_continues_at_compact_positions():
    model = tiny_model("llama")
    params = KVCacheCompressionParameters(start_size=4, intermediate_size=16, recent_size=8, decode_slack=0,
                                          rerotate_keys=True)
    seen = []
    with KVCacheCompressor(params)(model), torch.no_grad():
        cache = model(random_tokens(70), use_cache=True).past_key_values
        live = cache.layers[0].keys.shape[-2]
        handle = model.model.register_forward_pre_hook(
            lambda module, args, kwargs: seen.append(kwargs["position_ids"][0].tolist()), with_kwargs=True)
        try:
            model(random_tokens(5, seed=1), cache=cache, use_cache=True)
        finally:
            handle.remove()
    assert live == params.max_cache_size
    assert seen == [list(range(live, live + 5))]
    assert cache.get_seq_length() == 75
