"""``kvcompress.compress``: a method name and a budget, in slots or as a fraction of each prompt."""

import pytest
import torch

from kvcompress import compress, method_names, preset
from kvcompress.presets import STREAMING_LLM, STREAMING_LLM_SINKS
from kvcompress.scoring.registry import SCORERS
from tiny_models import TinyTokenizer, random_kvzap_weights, random_tokens, tiny_model


def test_slot_budget_is_the_preset():
    model = tiny_model("llama")
    with compress(model, method="h2o", budget=40) as session:
        out = model.generate(random_tokens(90), max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert session.parameters == preset("h2o", 40)
    assert out.past_key_values.layers[0].keys.shape[-2] <= 40 + session.parameters.decode_slack


def test_fraction_is_applied_to_each_prompt_of_a_batch():
    from tiny_models import left_pad

    model = tiny_model("llama")
    prompts = [random_tokens(200, seed=1), random_tokens(120, seed=2)]
    ids, mask = left_pad(prompts)
    with compress(model, method="snapkv", budget=0.2) as session, torch.no_grad():
        model(ids, attention_mask=mask, use_cache=True)
        kept = session.layers[0].live.tolist()
    assert kept == [40, 24]  # 20 % of 200 and of 120 real tokens
    with compress(model, method="snapkv", budget=0.2) as session, torch.no_grad():
        model(prompts[1], use_cache=True)
        assert session.layers[0].live.tolist() == [24]


def test_method_names_are_exactly_what_compress_takes():
    assert method_names() == [STREAMING_LLM, *SCORERS]
    assert "none" not in method_names()
    with pytest.raises(ValueError, match="method='none' keeps the full cache"):
        compress(tiny_model("llama"), method="none", budget=32)
    assert preset("none", 32) is None  # the runners' full cache


@pytest.mark.parametrize("method", method_names())
def test_every_method_runs_from_its_name(method):
    model = tiny_model("llama")
    overrides = {"scorer_options": {"weights": str(random_kvzap_weights())}} if method == "kvzap" else {}
    with compress(model, method=method, budget=0.25, tokenizer=TinyTokenizer(), **overrides) as session:
        model.generate(random_tokens(96), max_new_tokens=4, do_sample=False)
    # the session's layers stay readable after the block; a folded (head-wise) layer holds a slot per head and token
    per_head = [state.tracked_slots / (state.folded_heads or 1) for state in session.layers.values()]
    assert len(per_head) == 2 and sum(per_head) <= 2 * (24 + session.parameters.decode_slack)


def test_streaming_llm_keeps_sinks_and_recent_and_bad_budgets_name_the_parameter():
    params = preset("streaming_llm", 64)
    assert (params.start_size, params.intermediate_size, params.recent_size) == (STREAMING_LLM_SINKS, 0, 60)
    model = tiny_model("llama")
    for budget in (0, 1.5, -0.1, True):
        with pytest.raises(ValueError, match="budget"):
            compress(model, budget=budget)
    with pytest.raises(ValueError, match="method must be one of"):
        compress(model, method="pyramid", budget=32)


def test_kvzip_preset_selects_as_its_reference_and_overrides_win():
    """KVzip's reference (its code, kvpress's KVzipPress) keeps 4 sinks and otherwise a pure top-k of every KV head
    of every layer: no recent window, no per-head floor."""
    params = preset("kvzip", 400)
    assert (params.start_size, params.intermediate_size, params.recent_size) == (4, 396, 0)
    assert (params.budget_allocation, params.adaptive_floor) == ("global_adaptive", 0.0)
    assert preset("kvzip", 3).start_size == 3  # windows are at most the budget
    assert preset("kvzip", 512, strategy="per_group").start_size == 0  # and whole pages
    overridden = preset("kvzip", 400, start_size=32, recent_size=64, adaptive_floor=0.2)
    assert (overridden.start_size, overridden.recent_size, overridden.adaptive_floor) == (32, 64, 0.2)
    other = preset("snapkv", 400)
    assert (other.start_size, other.recent_size, other.adaptive_floor) == (32, 64, 0.2)  # from_budget's defaults
