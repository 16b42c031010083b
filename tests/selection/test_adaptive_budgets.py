"""``budget_allocation="adaptive"``: a layer's KV heads share its budget by score (AdaKV), or with
``"global_adaptive"`` every head of every layer shares the model's (KVzip); the cache holds exactly the kept
(head, token) slots (the folded layout of ``kvcompress/ragged.py``).

* The kept sets equal an independent "floor, then compete" selection computed from the scores the heads were
  ranked by; the counts sum to the layer's (the model's) budget; a floor of 1 is uniform per-head selection.
* Attention over the folded layout equals a full-cache run whose attention hides, per head, the evicted slots.
* Real KV bytes equal the nominal budget; budget >= prompt changes nothing for every scorer; a padded batch
  gives every sequence its solo run; a folded cache refuses to be compressed again, with a clear error.
"""

import pytest
import torch
import transformers
from transformers import AttentionInterface
from transformers.models.llama.modeling_llama import repeat_kv

from kvcompress import KVCacheCompressionParameters, KVCacheCompressor
from kvcompress.cache import kv_cache_bytes, kv_cache_length
from kvcompress.scoring.registry import SCORERS
from tiny_models import TinyTokenizer, random_tokens, scorer_parameters, tiny_model, torch_threads

SIZES = dict(start_size=4, intermediate_size=16, recent_size=6)
PROMPT, NEW = 70, 8


def _model(kv_heads: int = 4, layers: int = 2, attn_implementation: str = "sdpa"):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                                      num_attention_heads=8, num_key_value_heads=kv_heads, pad_token_id=0)
    config._attn_implementation = attn_implementation
    return transformers.LlamaForCausalLM(config).eval()


def _adaptive(floor: float = 0.2, **overrides) -> KVCacheCompressionParameters:
    base = dict(method="snapkv", window_size=8, head_selection="per_head", budget_allocation="adaptive",
                adaptive_floor=floor, compress_during_decoding=False, **SIZES)
    return KVCacheCompressionParameters(**{**base, **overrides})


def _kept_per_head(state) -> list[list[list[int]]]:
    """Each sequence's kept true positions per KV head, from a folded state or a rectangular per-head one."""
    if state.folded_heads is None:
        return [[head.tolist() for head in row] for row in state.true_positions]
    return [[row_positions[row_valid & (row_heads == head)].tolist() for head in range(state.folded_heads)]
            for row_positions, row_valid, row_heads in zip(state.true_positions, state.slot_valid, state.slot_head)]


def _floor_then_compete(layer_scores: list[torch.Tensor], params) -> list[list[list[int]]]:
    """The kept positions per layer and head of one sequence, from its eviction scores (H, T) per competing layer,
    by plain Python: windows in every head; each head's best ⌊floor·n⌋ of the scored area; the rest of L·H·n by
    score over every (layer, head) (ties: lower layer, lower head, older token); each head's count filled from its
    own ranking."""
    heads, total = layer_scores[0].shape
    start, recent, n = params.start_size, params.recent_size, params.intermediate_size
    middle = range(start, total - recent)
    safe = int(params.adaptive_floor * n)
    ranked = [[sorted(middle, key=lambda t, h=h, s=s: (-float(s[h, t]), t)) for h in range(heads)]
              for s in layer_scores]
    counts = [[safe] * heads for _ in layer_scores]
    layers = range(len(layer_scores))
    rest = sorted(((i, h, t) for i in layers for h in range(heads) for t in ranked[i][h][safe:]),
                  key=lambda iht: (-float(layer_scores[iht[0]][iht[1], iht[2]]), *iht))
    for i, h, _ in rest[: len(layer_scores) * heads * (n - safe)]:
        counts[i][h] += 1
    windows = list(range(start)) + list(range(total - recent, total))
    return [[sorted(windows + ranked[i][h][: counts[i][h]]) for h in range(heads)] for i in layers]


@pytest.mark.parametrize("floor", [0.0, 0.2, 0.9])
@pytest.mark.parametrize("method, allocation", [("snapkv", "adaptive"), ("keydiff", "adaptive"),
                                                   ("snapkv", "global_adaptive"), ("kvzip", "global_adaptive")])
def test_kept_sets_equal_an_independent_floor_then_compete_selection(method, allocation, floor):
    model = _model(layers=3)
    params = _adaptive(floor, method=method, window_size=8 if method == "snapkv" else None,
                       budget_allocation=allocation, scorer_options={"chunk_size": 32} if method == "kvzip" else {})
    captured = []
    with KVCacheCompressor(params, tokenizer=TinyTokenizer())(model) as session, torch.no_grad():
        ranking = session.scorer.eviction_scores

        def capture(state, keys, values, slot_valid):
            scores = ranking(state, keys, values, slot_valid)
            captured.append(scores[0].clone())
            return scores

        session.scorer.eviction_scores = capture
        cache = model(random_tokens(PROMPT), use_cache=True).past_key_values
        states = [session.layers[index] for index in sorted(session.layers)]
    global_ = allocation == "global_adaptive"
    expected = _floor_then_compete(captured, params) if global_ else [
        _floor_then_compete([scores], params)[0] for scores in captured]
    heads, layer_totals = model.config.num_key_value_heads, []
    uneven = False
    for layer, state in enumerate(states):
        kept = _kept_per_head(state)[0]
        assert kept == expected[layer], f"layer {layer}"
        counts = [len(head) for head in kept]
        layer_totals.append(sum(counts))
        assert min(counts) >= params.start_size + params.recent_size + int(floor * params.intermediate_size)
        uneven |= len(set(counts)) > 1
        assert cache.layers[layer].keys.shape == (1, 1, sum(counts), model.config.head_dim)
    assert uneven, "every head kept the same count: the test cannot tell adaptive from uniform"
    if global_:  # the model's total is exact; the layers' differ unless the floor leaves nothing to compete for
        assert sum(layer_totals) == len(states) * heads * params.max_cache_size
        assert len(set(layer_totals)) > 1 or floor > 0.5
    else:
        assert layer_totals == [heads * params.max_cache_size] * len(states)


def test_a_floor_of_one_is_uniform_per_head_selection():
    model = _model()
    ids = random_tokens(PROMPT)
    runs = []
    for params in (_adaptive(1.0), KVCacheCompressionParameters(
            method="snapkv", window_size=8, head_selection="per_head", compress_during_decoding=False, **SIZES)):
        with KVCacheCompressor(params)(model) as session:
            out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0,
                                 output_scores=True, return_dict_in_generate=True)
            kept = [[[t for t in head if t < PROMPT] for head in _kept_per_head(state)[0]]
                    for state in session.layers.values()]
        runs.append((out.sequences, torch.stack(out.scores), kept))
    assert runs[0][2] == runs[1][2]
    assert torch.equal(runs[0][0], runs[1][0])
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=0, atol=1e-5)


_HIDDEN: dict[int, torch.Tensor] = {}  # layer -> (H_kv, T) bool: prompt slots a head no longer sees


def _eager_hiding_evicted(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager attention over the full cache, with each KV head's evicted prompt slots hidden from the queries that
    follow the prompt (the prompt's own queries saw it whole, before eviction)."""
    keys, values = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
    weights = torch.matmul(query, keys.transpose(2, 3)) * scaling
    length, total = weights.shape[-2:]
    future = torch.ones(length, total, dtype=torch.bool).triu(total - length + 1)  # causal, no padding here
    weights = weights.masked_fill(future, float("-inf"))
    hidden = _HIDDEN.get(module.layer_idx)
    if hidden is not None:
        per_query_head = hidden.repeat_interleave(module.num_key_value_groups, 0)  # (H, T_prompt)
        columns = torch.nn.functional.pad(per_query_head, (0, total - hidden.shape[-1]), value=False)
        after_prompt = torch.arange(total - length, total) >= hidden.shape[-1]  # (q,)
        weights = weights.masked_fill(columns[:, None, :] & after_prompt[None, :, None], float("-inf"))
    weights = weights.softmax(-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, values).transpose(1, 2).contiguous(), weights


def _reference_generate(model, kept, ids, **options):
    """``generate`` on the full cache with each head's evicted prompt slots (not in ``kept``) hidden."""
    _HIDDEN.clear()
    for index, heads in kept.items():
        hidden = torch.ones(len(heads), PROMPT, dtype=torch.bool)
        for head, positions in enumerate(heads):
            hidden[head, [t for t in positions if t < PROMPT]] = False
        _HIDDEN[index] = hidden
    AttentionInterface.register("test_hide_evicted", _eager_hiding_evicted)
    model.set_attn_implementation("test_hide_evicted")
    try:
        return model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0, **options)
    finally:
        model.set_attn_implementation("sdpa")
        _HIDDEN.clear()


@pytest.mark.parametrize("allocation", ["adaptive", "global_adaptive"])
def test_folded_attention_equals_the_full_cache_with_evicted_slots_hidden_per_head(allocation):
    """Decode steps (one query per head group) after a prompt compressed inside generate."""
    model = _model()
    ids = random_tokens(PROMPT)
    with KVCacheCompressor(_adaptive(0.2, budget_allocation=allocation))(model) as session:
        out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
        kept = {index: _kept_per_head(state)[0] for index, state in session.layers.items()}
    assert len({len(head) for heads in kept.values() for head in heads}) > 1, "no head kept a count of its own"
    reference = _reference_generate(model, kept, ids, output_scores=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference.sequences)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(reference.scores), rtol=0, atol=1e-4)


def test_a_question_on_a_folded_context_equals_the_full_cache_with_evicted_slots_hidden():
    """A multi-token forward on a folded cache: the question's tokens see their heads' kept slots and each
    other causally."""
    model = _model()
    context, question = random_tokens(PROMPT), random_tokens(9, seed=3)
    logits = []  # each forward's last-position logits, compressed run then reference
    hook = model.lm_head.register_forward_hook(lambda module, args, output: logits.append(output[:, -1]))
    try:
        with KVCacheCompressor(_adaptive(0.2))(model) as session:
            session.prefill(context)
            del logits[:]  # the context's own forward
            answer = session.generate(question, max_new_tokens=NEW)
            kept = {index: _kept_per_head(state)[0] for index, state in session.layers.items()}
        compressed, logits[:] = list(logits), []
        reference = _reference_generate(model, kept, torch.cat([context, question], dim=-1))
    finally:
        hook.remove()
    assert torch.equal(answer, reference[:, PROMPT + question.shape[1]:])
    torch.testing.assert_close(torch.stack(compressed), torch.stack(logits), rtol=0, atol=1e-4)


def test_real_kv_bytes_are_the_nominal_budget():
    model = _model(layers=3)
    with KVCacheCompressor(_adaptive(0.2))(model), torch.no_grad():
        cache = model(random_tokens(PROMPT), use_cache=True).past_key_values
    config = model.config
    element = torch.finfo(torch.float32).bits // 8
    nominal = 2 * config.num_hidden_layers * config.num_key_value_heads * _adaptive().max_cache_size
    assert kv_cache_bytes(cache) == nominal * config.head_dim * element
    assert kv_cache_length(cache) == _adaptive().max_cache_size


@pytest.mark.parametrize("allocation", ["adaptive", "global_adaptive"])
@pytest.mark.parametrize("method", list(SCORERS))
def test_budget_above_the_prompt_changes_nothing(method, allocation):
    model = tiny_model("llama")
    ids = random_tokens(50)
    expected = model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    params = scorer_parameters(method, start_size=8, intermediate_size=200, recent_size=8,
                               head_selection="per_head", budget_allocation=allocation, compress_during_decoding=False)
    with KVCacheCompressor(params, tokenizer=TinyTokenizer())(model):
        got = model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("method, allocation", [("snapkv", "adaptive"), ("kvzip", "adaptive"),
                                                   ("expected_attention", "adaptive"), ("kvzip", "global_adaptive")])
@pytest.mark.parametrize("strategy", ["per_token", "per_group"])
def test_each_sequence_of_a_padded_batch_matches_its_solo_run(method, allocation, strategy):
    model = _model()
    sizes = dict(start_size=4, intermediate_size=16, recent_size=8) if strategy == "per_group" else SIZES
    params = scorer_parameters(method, strategy=strategy, group_size=4, head_selection="per_head",
                               budget_allocation=allocation, compress_during_decoding=False,
                               scorer_options={"chunk_size": 32} if method == "kvzip" else {}, **sizes)
    prompts = [random_tokens(n, seed=i) for i, n in enumerate((70, 45, 24))]  # the last fits its budget
    width = max(p.shape[1] for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.shape[1]:], mask[row, width - prompt.shape[1]:] = prompt[0], 1

    def run(tokens, attention_mask):
        with KVCacheCompressor(params, tokenizer=TinyTokenizer())(model) as session:
            out = model.generate(tokens, attention_mask=attention_mask, max_new_tokens=NEW, min_new_tokens=NEW,
                                 do_sample=False, pad_token_id=0)[:, tokens.shape[1]:]
            return out, [_kept_per_head(state) for state in session.layers.values()]

    batched, batched_kept = run(ids, mask)
    for row, prompt in enumerate(prompts):
        alone, alone_kept = run(prompt, torch.ones_like(prompt))
        assert torch.equal(batched[row], alone[0]), f"sequence {row} diverged"
        assert [layer[row] for layer in batched_kept] == [layer[0] for layer in alone_kept], f"sequence {row}"


def test_questions_on_a_compressed_context_and_a_second_compression_refused():
    model = _model()
    context, question = random_tokens(PROMPT), random_tokens(6, seed=1)
    with KVCacheCompressor(_adaptive(0.2))(model) as session:
        cache = session.prefill(context)
        slots = kv_cache_bytes(cache)
        first = session.generate(question, max_new_tokens=NEW)
        again = session.generate(question, max_new_tokens=NEW)
        assert torch.equal(first, again) and kv_cache_bytes(cache) == slots  # each question on its own copy
        with pytest.raises(ValueError, match="budget_allocation='adaptive' compresses one prompt"):
            model(random_tokens(30, seed=2), cache=cache, use_cache=True)
        assert kv_cache_bytes(cache) == slots  # refused before any layer changed


def _kvzip(allocation: str, **overrides) -> KVCacheCompressionParameters:
    return KVCacheCompressionParameters(**{
        **dict(method="kvzip", head_selection="per_head", budget_allocation=allocation, adaptive_floor=1.0,
               compress_during_decoding=False, scorer_options={"chunk_size": 32}, **SIZES), **overrides})


def _turns(model, params, turns, new_tokens: int = NEW):
    """Chat turns on one cache under ``params``: each turn's prompt (compressed), then greedy decoding; the
    answers, each layer's kept positions per head after every turn, and the cache's KV bytes."""
    answers, kept, cache, sequences = [], [], None, turns[0][:, :0]
    with KVCacheCompressor(params, tokenizer=TinyTokenizer())(model) as session:
        for turn in turns:
            tokens = torch.cat([sequences, turn], dim=-1)
            output = model.generate(tokens, cache=cache, max_new_tokens=new_tokens,
                                    min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                    return_dict_in_generate=True)
            cache, sequences = output.past_key_values, output.sequences
            answers.append(output.sequences[:, tokens.shape[1]:])
            kept.append([_kept_per_head(state) for state in session.layers.values()])
    return answers, kept, kv_cache_bytes(cache)


def test_a_folded_kvzip_cache_compresses_every_chat_turn_as_the_rectangular_per_head_cache_does():
    """KVzip re-scores and re-selects a folded cache at every turn. With ``adaptive_floor=1`` every head keeps
    exactly its own share, so the folded cache (``adaptive``) must keep, turn after turn, what the rectangular
    per-head cache (``uniform``: its attention and scores from the tested rectangular kernels) keeps, and answer
    the same: the second and third prompts are reconstructed over folded layers (``ragged.folded_attention``'s
    scores) and evicted per head again (``ragged.head_grid``)."""
    model = _model(kv_heads=2)
    turns = [random_tokens(PROMPT), random_tokens(40, seed=1), random_tokens(25, seed=2)]
    folded_answers, folded_kept, folded_bytes = _turns(model, _kvzip("adaptive"), turns)
    answers, kept, rectangular_bytes = _turns(model, _kvzip("uniform"), turns)
    assert folded_kept == kept and folded_bytes == rectangular_bytes
    for folded, rectangular in zip(folded_answers, answers):
        assert torch.equal(folded, rectangular)
    heads_budget = SIZES["start_size"] + SIZES["intermediate_size"] + SIZES["recent_size"]
    # the last answer token is never fed back, so each head holds its budget and NEW - 1 answer tokens
    assert all(len(head) == heads_budget + NEW - 1 for layer in kept[-1] for row in layer for head in row)


def test_a_folded_kvzap_cache_scores_its_new_tokens_and_compresses_every_chat_turn_as_the_rectangular_cache_does(
        tmp_path):
    """KVzap scores each token alone, from its hidden states, whatever the layer's layout: a folded layer takes the
    scores of its new slots (decoded tokens, later prompts) in its own order, so it compresses every chat turn
    again, and with ``adaptive_floor=1`` keeps, turn after turn, what the rectangular per-head cache keeps, and
    answers the same (a decoded token scored 0 on the folded layer would leave first at the next turn)."""
    from kvcompress.surrogate import random_surrogate

    model = _model(kv_heads=2)
    weights = random_surrogate(model, seed=7, name="tiny").save(tmp_path / "tiny.safetensors")

    def kvzap(allocation):
        return KVCacheCompressionParameters(
            method="kvzap", head_selection="per_head", budget_allocation=allocation, adaptive_floor=1.0,
            compress_during_decoding=False, scorer_options={"weights": str(weights)}, **SIZES)

    turns = [random_tokens(PROMPT), random_tokens(40, seed=1), random_tokens(25, seed=2)]
    folded_answers, folded_kept, folded_bytes = _turns(model, kvzap("adaptive"), turns, new_tokens=3 * NEW)
    answers, kept, rectangular_bytes = _turns(model, kvzap("uniform"), turns, new_tokens=3 * NEW)
    assert folded_kept == kept and folded_bytes == rectangular_bytes
    for folded, rectangular in zip(folded_answers, answers):
        assert torch.equal(folded, rectangular)
    heads_budget = SIZES["start_size"] + SIZES["intermediate_size"] + SIZES["recent_size"]
    # the last answer token is never fed back, so each head holds its budget and the other answer tokens
    assert all(len(head) == heads_budget + 3 * NEW - 1 for layer in kept[-1] for row in layer for head in row)


@pytest.mark.parametrize("method", ["kvzip", "kvzap"])
def test_a_folded_cache_evicts_while_decoding_as_the_rectangular_per_head_cache_does(tmp_path, method):
    """With ``compress_during_decoding`` a head-wise cache evicts as it decodes (the methods that score folded
    layers): each head keeps the count its prompt's selection gave it. With ``adaptive_floor=1`` that count is
    the budget, so the folded cache must keep, step after step and turn after turn, what the rectangular per-head
    cache keeps with the same decode evictions, and answer the same; each head then holds exactly its budget."""
    from kvcompress.surrogate import random_surrogate

    model = _model(kv_heads=2)
    options = {"chunk_size": 32}
    if method == "kvzap":
        options = {"weights": str(random_surrogate(model, seed=7, name="tiny").save(tmp_path / "tiny.safetensors"))}
    turns = [random_tokens(PROMPT), random_tokens(40, seed=1)]
    runs = [_turns(model, _kvzip(allocation, method=method, scorer_options=options, compress_during_decoding=True,
                                 decode_slack=2), turns, new_tokens=3 * NEW)
            for allocation in ("adaptive", "uniform")]
    (folded_answers, folded_kept, folded_bytes), (answers, kept, rectangular_bytes) = runs
    assert folded_kept == kept and folded_bytes == rectangular_bytes
    for folded, rectangular in zip(folded_answers, answers):
        assert torch.equal(folded, rectangular)
    heads_budget = SIZES["start_size"] + SIZES["intermediate_size"] + SIZES["recent_size"]
    # 3·NEW - 1 tokens fed back since the turn's eviction, evicted every decode_slack + 1 = 3 steps: 2 past it
    assert all(len(head) == heads_budget + 2 for layer in kept[-1] for row in layer for head in row)


def test_global_adaptive_kvzip_holds_each_layers_share_while_decoding():
    """``global_adaptive`` with ``compress_during_decoding``: the prompt's competition gives each (layer, head)
    its count; a long generation then evicts each head back to that count, so the cache holds exactly the
    nominal budget (all layers and heads together) after every eviction, and each head its prompt-time count."""
    model = _model(kv_heads=2)
    params = _kvzip("global_adaptive", adaptive_floor=0.2, compress_during_decoding=True, decode_slack=0)
    with KVCacheCompressor(params, tokenizer=TinyTokenizer())(model) as session:
        with torch.no_grad():
            cache = model(random_tokens(PROMPT), use_cache=True).past_key_values
            after_prompt = [[len(head) for head in _kept_per_head(state)[0]] for state in session.layers.values()]
            for step in range(3 * NEW):
                model(random_tokens(1, seed=step), cache=cache, use_cache=True)
        during = [[len(head) for head in _kept_per_head(state)[0]] for state in session.layers.values()]
    budget = SIZES["start_size"] + SIZES["intermediate_size"] + SIZES["recent_size"]
    assert during == after_prompt and len(set(sum(after_prompt, []))) > 1  # the heads' shares differ
    assert kv_cache_bytes(cache) == 2 * 2 * budget * 2 * 8 * 4  # layers, heads, budget, keys and values, d, float32


def test_global_adaptive_kvzip_keeps_its_budget_over_chat_turns_and_a_batch_turn_is_each_sequence_alone():
    """With ``global_adaptive`` the heads of every layer compete again at each turn: after each prompt the cache
    holds exactly the nominal budget over all layers and heads (then the answer's tokens), and a left-padded batch
    of two conversations keeps and answers what each keeps and answers alone."""
    model = _model(kv_heads=2)
    params = _kvzip("global_adaptive", adaptive_floor=0.2)
    first = [random_tokens(n, seed=10 + n) for n in (70, 52)]
    second = [random_tokens(n, seed=20 + n) for n in (30, 41)]
    alone = [_turns(model, params, [a, b]) for a, b in zip(first, second)]
    layers, kv_heads, head_dim = 2, 2, 8
    budget = SIZES["start_size"] + SIZES["intermediate_size"] + SIZES["recent_size"]
    for _, _, held in alone:  # keys and values in float32; the last answer token is never fed back
        assert held == layers * kv_heads * (budget + NEW - 1) * 2 * head_dim * 4
    width = max(t.shape[1] for t in first)
    ids = torch.stack([torch.cat([torch.zeros(width - t.shape[1], dtype=torch.long), t[0]]) for t in first])
    mask = (torch.arange(width) >= width - torch.tensor([[t.shape[1]] for t in first])).long()
    with KVCacheCompressor(params, tokenizer=TinyTokenizer())(model) as session:
        output = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                pad_token_id=0, return_dict_in_generate=True)
        turn_width = max(t.shape[1] for t in second)
        turn = torch.stack([torch.cat([torch.zeros(turn_width - t.shape[1], dtype=torch.long), t[0]]) for t in second])
        turn_mask = (torch.arange(turn_width) >= turn_width - torch.tensor([[t.shape[1]] for t in second])).long()
        tokens = torch.cat([output.sequences, turn], dim=-1)
        attention = torch.cat([mask, torch.ones(2, NEW, dtype=torch.long), turn_mask], dim=-1)
        answer = model.generate(tokens, attention_mask=attention, cache=output.past_key_values,
                                max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
        kept = [_kept_per_head(state) for state in session.layers.values()]
    for row, (answers, alone_kept, _) in enumerate(alone):
        assert torch.equal(answer[row, tokens.shape[1]:], answers[1][0]), f"sequence {row} diverged"
        assert [layer[row] for layer in kept] == [layer[0] for layer in alone_kept[1]], f"sequence {row}"


def test_the_runners_full_cache_bytes_of_a_folded_cache_are_the_uncompressed_caches():
    from kvbench.generation import cache_bytes

    model = _model()
    ids = random_tokens(PROMPT)
    with torch.no_grad():
        uncompressed = kv_cache_bytes(model(ids, use_cache=True).past_key_values)
        with KVCacheCompressor(_adaptive(0.2))(model):
            cache = model(ids, use_cache=True).past_key_values
    held, full = cache_bytes(cache, PROMPT)
    assert held == kv_cache_bytes(cache) and full == uncompressed
    assert held * PROMPT == full * _adaptive().max_cache_size


@pytest.mark.parametrize("path", ["kernel", "triton", "sdpa", "eager in chunks"])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("length", [1, 3])
def test_folded_attention_equals_a_per_head_loop(monkeypatch, length, softcap, path):
    """The folded attention against plain per-head softmax attention over each head's live slots (soft-capped as
    Gemma 2 does where asked), on random slots: two sequences, three KV heads of two query heads each. Every path:
    the compiled kernel (a CPU decode step, on two threads the pairs' slots cut into chunks of its key block; a
    longer forward over the heads laid out as rows, in key blocks of 8), the accelerators' Triton kernels
    (interpreted: a decode step on the split-key kernel, its 123 slots cut into chunks of 32; a longer forward over
    the same rows), sdpa (CPU) and the eager formula (soft-capping, no kernel), there in chunks of one row.
    With observed queries (the last token of the second sequence unobserved) a slot's score is the most attention
    an observed query of its KV head's group gives it, and a new slot no observed query can see scores 0; the
    kernel's unobserved rows (padding tokens, never read) also see their head's dead slots, as its rectangular
    decode step's do."""
    from kvcompress import ragged
    from kvcompress.kernels import attention, native
    from kvcompress.ragged import folded_attention

    cached = 11
    if path == "kernel":
        if softcap:
            pytest.skip("the kernel serves attention without soft-capping")
        assert native.kernel() is not None
        monkeypatch.setattr(native, "KEY_BLOCK", 8)
        cached = 120
    elif path == "triton":
        if softcap:
            pytest.skip("the Triton kernels serve attention without soft-capping")
        monkeypatch.setenv("KVCOMPRESS_NATIVE", "0")
        monkeypatch.setattr(attention, "TRITON_ON_CPU", True)
        cached = 120
    else:
        monkeypatch.setattr(ragged, "folded_single_query", lambda *args: None)
        monkeypatch.setattr(ragged, "per_head_rows_serve", lambda *args: False)
    if path == "eager in chunks":
        monkeypatch.setattr(ragged, "_sdpa_serves", lambda keys, softcap: False)
        monkeypatch.setattr(ragged, "LOGIT_ELEMENTS", 1)

    torch.manual_seed(0)
    batch, kv_heads, group, dim = 2, 3, 2, 8
    total = cached + length * kv_heads
    query = torch.randn(batch, kv_heads * group, length, dim)
    keys, values = torch.randn(batch, 1, total, dim), torch.randn(batch, 1, total, dim)
    # the cached slots: three quarters head-major, as a fold leaves them (the kernel multiplies a head's stretch of
    # 16 slots or more where it lies; its first chunk holds no slot of head 2), then mixed heads as decoding
    # leaves them (copied together); then the forward's own, token-major
    folded = cached * 3 // 4
    slot_head = torch.cat([torch.randint(0, kv_heads, (batch, folded)).sort(-1).values,
                           torch.randint(0, kv_heads, (batch, cached - folded)),
                           torch.arange(kv_heads).repeat(length).expand(batch, -1)], dim=-1)
    slot_valid = torch.rand(batch, total) > 0.2
    slot_valid[:, cached:] = True
    observed = torch.ones(batch, length, dtype=torch.bool)
    observed[1, -1] = False
    with torch_threads(2 if path == "kernel" else 1):
        got, none = folded_attention(query, keys, values, slot_valid, slot_head, kv_heads, 0.3, softcap)
        scored, scores = folded_attention(query, keys, values, slot_valid, slot_head, kv_heads, 0.3, softcap,
                                          observed)
    assert none is None and scores.shape == (batch, 1, total)
    expected_scores = torch.zeros(batch, 1, total)
    for b in range(batch):
        for head in range(kv_heads * group):
            for token in range(length):
                own = (slot_head[b] == head // group) & slot_valid[b]
                own[cached:] &= torch.arange(length).repeat_interleave(kv_heads) <= token
                logits = keys[b, 0, own] @ query[b, head, token] * 0.3
                if softcap:
                    logits = softcap * torch.tanh(logits / softcap)
                expected = logits.softmax(-1) @ values[b, 0, own]
                torch.testing.assert_close(got[b, token, head], expected, rtol=0, atol=1e-5)
                if observed[b, token] or path not in ("kernel", "triton"):  # kernels: padding rows see dead slots
                    torch.testing.assert_close(scored[b, token, head], expected, rtol=0, atol=1e-5)
                if observed[b, token]:
                    expected_scores[b, 0, own] = torch.maximum(expected_scores[b, 0, own], logits.softmax(-1))
    torch.testing.assert_close(scores, expected_scores, rtol=0, atol=1e-6)
