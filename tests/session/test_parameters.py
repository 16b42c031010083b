"""Every invalid parameter value raises an error that names the field (table-driven over the dataclass)."""

import dataclasses
import re
import warnings

import pytest

from kvcompress import KVCacheCompressionParameters, preset

INVALID = [
    ({"method": "pyramid"}, ValueError, "method"),
    ({"method": 3}, ValueError, "method"),
    ({"strategy": "per_head"}, ValueError, "strategy"),
    ({"strategy": 1}, TypeError, "strategy"),
    ({"group_size": 0}, ValueError, "group_size"),
    ({"group_size": 2.5}, TypeError, "group_size"),
    ({"start_size": -1}, ValueError, "start_size"),
    ({"start_size": "32"}, TypeError, "start_size"),
    ({"intermediate_size": -5}, ValueError, "intermediate_size"),
    ({"recent_size": -1}, ValueError, "recent_size"),
    ({"recent_size": True}, TypeError, "recent_size"),
    ({"start_size": 0, "intermediate_size": 0, "recent_size": 0}, ValueError, "must be > 0"),
    ({"window_size": 0}, ValueError, "window_size"),
    ({"window_size": 8.0}, TypeError, "window_size"),
    ({"method": "h2o", "window_size": 8}, ValueError, "window_size"),
    ({"snapkv_kernel_size": 4}, ValueError, "snapkv_kernel_size"),
    ({"snapkv_kernel_size": 0}, ValueError, "snapkv_kernel_size"),
    ({"score_aggregation": "mean"}, ValueError, "score_aggregation"),
    ({"score_aggregation": None}, TypeError, "score_aggregation"),
    ({"compress_during_decoding": "yes"}, TypeError, "compress_during_decoding"),
    ({"decode_slack": -1}, ValueError, "decode_slack"),
    ({"refined_algorithm": "diversekv"}, ValueError, "refined_algorithm"),
    ({"refined_size": 8}, ValueError, "refined_size"),
    ({"refined_algorithm": "kvcrush", "refined_size": 200}, ValueError, "refined_size"),
    ({"refined_algorithm": "kvcrush", "refined_size": -1}, ValueError, "refined_size"),
    ({"kvcrush_anchor": "median"}, ValueError, "kvcrush_anchor"),
    ({"kvcrush_seed": "0"}, TypeError, "kvcrush_seed"),
    ({"criticalkv_first_stage_ratio": 1.5}, ValueError, "criticalkv_first_stage_ratio"),
    ({"criticalkv_first_stage_ratio": "half"}, TypeError, "criticalkv_first_stage_ratio"),
    ({"criticalkv_epsilon": -1e-4}, ValueError, "criticalkv_epsilon"),
    ({"rerotate_keys": 1}, TypeError, "rerotate_keys"),
    ({"strategy": "per_group", "start_size": 16}, ValueError, "start_size must be a multiple of group_size"),
    ({"strategy": "per_group", "intermediate_size": 100}, ValueError, "intermediate_size"),
    ({"strategy": "per_group", "recent_size": 48}, ValueError, "recent_size"),
    ({"strategy": "per_group", "refined_algorithm": "kvcrush", "refined_size": 16}, ValueError, "refined_size"),
    ({"scorer_options": {"chunk_size": 512}}, ValueError, "do not apply to method='snapkv'"),
    ({"scorer_options": {"pooling": "mean"}}, ValueError, "pooling'] for method='snapkv' must be one of 'max', 'avg'"),
    ({"scorer_options": {"pooling": 3}}, TypeError, "pooling"),
    ({"scorer_options": {"pool_direction": "backward"}}, ValueError,
     "pool_direction'] for method='snapkv' must be one of 'centred', 'forward'"),
    ({"budget_allocation": "adaptive_layers"}, ValueError, "budget_allocation must be one of"),
    ({"budget_allocation": 1}, TypeError, "budget_allocation"),
    ({"budget_allocation": "global", "rerotate_keys": True}, ValueError, "budget_allocation='global'"),
    ({"budget_allocation": "global", "refined_algorithm": "kvcrush"}, ValueError, "budget_allocation='global'"),
    ({"head_selection": "per_layer"}, ValueError, "head_selection must be one of"),
    ({"adaptive_floor": 1.5}, ValueError, "adaptive_floor must be in"),
    ({"adaptive_floor": "high"}, TypeError, "adaptive_floor"),
    ({"budget_allocation": "adaptive", "compress_during_decoding": False}, ValueError, "head_selection='per_head'"),
    ({"budget_allocation": "adaptive", "head_selection": "per_head"}, ValueError, "compress_during_decoding=False"),
    ({"budget_allocation": "adaptive", "head_selection": "per_head", "compress_during_decoding": False,
      "rerotate_keys": True}, ValueError, "budget_allocation='adaptive'"),
    ({"pyramid_beta": 0.5}, ValueError, "pyramid_beta must be >= 1"),
    ({"pyramid_beta": "steep"}, TypeError, "pyramid_beta"),
    ({"budget_allocation": "pyramid", "rerotate_keys": True}, ValueError, "budget_allocation='pyramid'"),
    ({"head_selection": None}, TypeError, "head_selection"),
    ({"head_selection": "per_head", "refined_algorithm": "criticalkv"}, ValueError, "head_selection='per_head'"),
    ({"scorer_options": [("chunk_size", 512)]}, TypeError, "scorer_options must be a mapping"),
    ({"method": "kvzip", "scorer_options": {"chunk_size": "big"}}, TypeError, "chunk_size"),
    ({"method": "kvzip", "scorer_options": {"chunk_size": 0}}, ValueError, "chunk_size"),
    ({"method": "expected_attention", "scorer_options": {"covariance": 1}}, TypeError, "covariance"),
    ({"method": "tova", "window_size": 8}, ValueError, "window_size is only allowed with method='snapkv'"),
    ({"score_threshold": "0.1"}, TypeError, "score_threshold must be a number"),
    ({"kv_bits": 2}, ValueError, "kv_bits must be one of 16, 8, 4"),
    ({"kv_bits": 8.0}, TypeError, "kv_bits must be an integer"),
    ({"kv_key_group_size": 0}, ValueError, "kv_key_group_size must be >= 1"),
    ({"kv_value_group_size": 0}, ValueError, "kv_value_group_size must be >= 1"),
    ({"kv_residual": -1}, ValueError, "kv_residual must be >= 0"),
    ({"kv_bits": 4, "rerotate_keys": True}, ValueError, "not combined with rerotate_keys"),
    ({"score_threshold": float("nan")}, ValueError, "score_threshold must be a finite number or None"),
    ({"score_threshold": 0.1, "head_selection": "per_head"}, ValueError,
     "score_threshold with head_selection='per_head' needs budget_allocation"),
]


def test_every_field_has_an_invalid_case():
    covered = {key for case, _, _ in INVALID for key in case}
    assert covered == {field.name for field in dataclasses.fields(KVCacheCompressionParameters)}


@pytest.mark.parametrize("overrides, error, field", INVALID)
def test_invalid_values_name_the_field(overrides, error, field):
    with pytest.raises(error, match=field):
        KVCacheCompressionParameters(**overrides)


def test_defaults_and_round_trip(tmp_path):
    params = KVCacheCompressionParameters()
    assert params.method == "snapkv" and params.window_size == 8
    assert params.max_cache_size == 224
    assert KVCacheCompressionParameters.from_dict(params.to_dict()) == params
    path = tmp_path / "p.yaml"
    path.write_text("method: h2o\nstart_size: 4\nintermediate_size: 60\nrecent_size: 4\n")
    loaded = KVCacheCompressionParameters.from_yaml(path)
    assert loaded.method == "h2o" and loaded.window_size is None and loaded.max_cache_size == 68


def test_the_old_name_algorithm_is_read_with_a_warning(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("algorithm: h2o\nstart_size: 4\nintermediate_size: 60\nrecent_size: 4\n")
    with pytest.warns(FutureWarning, match="algorithm is deprecated: write method: 'h2o'"):
        loaded = KVCacheCompressionParameters.from_yaml(path)
    assert loaded.method == "h2o" and loaded.to_dict()["method"] == "h2o" and "algorithm" not in loaded.to_dict()
    with pytest.warns(FutureWarning, match="read .method"):
        assert loaded.algorithm == "h2o"
    with pytest.raises(ValueError, match="algorithm: 'h2o' contradicts method 'snapkv'"):
        KVCacheCompressionParameters.from_dict({"algorithm": "h2o", "method": "snapkv"})


def test_yaml_unknown_key_and_wrong_type(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("algoritm: h2o\n")
    with pytest.raises(ValueError, match="algoritm"):
        KVCacheCompressionParameters.from_yaml(path)
    path.write_text("start_size: many\n")
    with pytest.raises(TypeError, match="start_size"):
        KVCacheCompressionParameters.from_yaml(path)


def test_from_budget_splits_and_validates():
    params = KVCacheCompressionParameters.from_budget(256)
    assert (params.start_size, params.intermediate_size, params.recent_size) == (32, 160, 64)
    streaming = KVCacheCompressionParameters.from_budget(128, start_size=4, recent_size=124)
    assert streaming.intermediate_size == 0
    grouped = KVCacheCompressionParameters.from_budget(512, strategy="per_group", group_size=32)
    assert grouped.start_size % 32 == 0 and grouped.recent_size % 32 == 0 and grouped.max_cache_size == 512
    with pytest.raises(ValueError, match="budget"):
        KVCacheCompressionParameters.from_budget(0)


MISSPELT = {
    "constructor": lambda: KVCacheCompressionParameters(windw_size=8),
    "from_dict": lambda: KVCacheCompressionParameters.from_dict({"windw_size": 8}),
    "from_budget": lambda: KVCacheCompressionParameters.from_budget(300, windw_size=8),
    "preset": lambda: preset("snapkv", 300, windw_size=8),
    "streaming_llm preset": lambda: preset("streaming_llm", 300, windw_size=8),
    "replace": lambda: dataclasses.replace(KVCacheCompressionParameters(), windw_size=8),
}


@pytest.mark.parametrize("build", MISSPELT.values(), ids=MISSPELT.keys())
def test_a_misspelt_keyword_names_the_closest_parameter_and_the_accepted_ones(build):
    with pytest.raises(ValueError, match=re.escape("unknown compression parameter 'windw_size' (did you mean "
                                                   "'window_size'?); accepted: adaptive_floor, ")) as error:
        build()
    accepted = str(error.value).split("accepted: ")[1].split(", ")
    assert accepted == sorted(field.name for field in dataclasses.fields(KVCacheCompressionParameters))


def test_every_unknown_key_is_named_and_one_far_from_any_parameter_gets_no_guess():
    with pytest.raises(ValueError, match=re.escape(
            "unknown compression parameters 'strat_size' (did you mean 'start_size'?), 'colour'; accepted: ")):
        KVCacheCompressionParameters.from_dict({"strat_size": 4, "colour": "red"})
    with pytest.raises(ValueError, match="unknown compression parameter 1; accepted: "):
        KVCacheCompressionParameters.from_dict({1: 2})  # a YAML key that is no string


def test_the_constructor_takes_the_old_name_algorithm_with_a_warning_at_the_callers_line():
    with pytest.warns(FutureWarning, match="algorithm is deprecated: write method: 'h2o'") as record:
        params = KVCacheCompressionParameters(algorithm="h2o")
    assert params == KVCacheCompressionParameters(method="h2o")
    assert [warning.filename for warning in record] == [__file__]  # the line to update, not kvcompress's
    with pytest.warns(FutureWarning, match="algorithm is deprecated"):
        assert KVCacheCompressionParameters.from_budget(64, algorithm="tova").method == "tova"
    with pytest.warns(FutureWarning, match="algorithm is deprecated"):
        assert KVCacheCompressionParameters(algorithm="snapkv", method="snapkv").method == "snapkv"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the contradiction is refused before any warning
        with pytest.raises(ValueError, match="algorithm: 'h2o' contradicts method 'snapkv'"):
            KVCacheCompressionParameters(algorithm="h2o", method="snapkv")
    with pytest.warns(FutureWarning, match="read .method"):
        assert params.algorithm == "h2o"
