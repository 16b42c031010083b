"""Every combination of scoring, granularity, refinement and rerotation generates with a bounded cache."""

import itertools

import pytest

from kvcompress import KVCacheCompressor
from kvcompress.scoring.registry import SCORERS
from tiny_models import TinyTokenizer, random_tokens, scorer_parameters, tiny_model

# Read from the registry when this module is imported: a scorer registered before (a plugin, another test
# module) joins the matrix without an edit here.
# Refined selection works on a layer's shared selection only: per-head rows go without it.
COMBINATIONS = [
    *itertools.product(list(SCORERS), ["per_token", "per_group"], [None, "kvcrush", "criticalkv"], [False, True],
                       ["shared"]),
    *itertools.product(list(SCORERS), ["per_token", "per_group"], [None], [False, True], ["per_head"]),
]


@pytest.mark.parametrize("method, strategy, refined, rerotate, head_selection", COMBINATIONS)
def test_generate_with_bounded_cache(method, strategy, refined, rerotate, head_selection):
    params = scorer_parameters(
        method, strategy=strategy, group_size=4, start_size=4, intermediate_size=16, recent_size=8,
        refined_algorithm=refined, refined_size=8 if refined else 0, rerotate_keys=rerotate,
        head_selection=head_selection,
    )
    model = tiny_model("llama")
    slack = params.decode_slack if strategy == "per_token" else 1
    with KVCacheCompressor(params, tokenizer=TinyTokenizer())(model) as session:
        out = model.generate(random_tokens(80, batch=2), max_new_tokens=25, min_new_tokens=25, do_sample=False,
                             return_dict_in_generate=True)
    assert out.sequences.shape == (2, 105)
    for layer in out.past_key_values.layers:
        assert layer.keys.shape[-2] <= params.max_cache_size + slack
    assert session.cache is out.cache  # the latest cache stays readable after the block (its report)
