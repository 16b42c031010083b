"""YAML experiments: sweeps, defaults, and errors that name the offending key; the shipped configs parse."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvbench.experiment import ConfigError, load_experiment, parse_experiment
from longbench.cli import main
from longbench.tasks import ENGLISH16

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _parse(tmp_path, make_config, **overrides):
    return load_experiment(make_config(tmp_path, **overrides))


def test_sweep_expands_methods_and_budgets(tmp_path, make_config):
    experiment = _parse(
        tmp_path, make_config,
        compression=[
            "none",
            {"method": "snapkv", "budgets": [128, 1024], "window_size": 32, "start_size": 0, "recent_size": 32},
            {"method": "h2o", "budget": 256},
            {"method": "streaming_llm", "budgets": [128]},
            {"name": "explicit", "method": "h2o", "start_size": 4, "intermediate_size": 60, "recent_size": 0},
        ],
    )
    names = [setting.name for setting in experiment.settings]
    assert names == ["full", "snapkv-128", "snapkv-1024", "h2o-256", "streaming_llm-128", "explicit"]
    full, snap128, snap1024, h2o, streaming, explicit = experiment.settings
    assert full.parameters is None and full.budget is None
    assert (snap1024.parameters.start_size, snap1024.parameters.intermediate_size, snap1024.parameters.recent_size) == (
        0, 992, 32)
    assert snap128.parameters.window_size == 32 and snap128.budget == 128
    assert h2o.parameters.method == "h2o" and h2o.parameters.max_cache_size == 256
    assert (streaming.parameters.start_size, streaming.parameters.intermediate_size,
            streaming.parameters.recent_size) == (4, 0, 124)
    assert explicit.method == "h2o" and explicit.budget == 64


def test_a_chunked_prefill_is_part_of_the_setting(tmp_path, make_config):
    experiment = _parse(tmp_path, make_config, compression=[
        {"method": "kvzip", "budgets": [0.2], "prefill_chunk_size": 1024},
        {"name": "mine", "method": "snapkv", "budget": 0.2, "prefill_chunk_size": 512},
        {"method": "kvzip", "budget": 0.2},
    ])
    chunked, named, one_shot = experiment.settings
    assert (chunked.name, chunked.prefill_chunk_size, named.name, named.prefill_chunk_size) == (
        "kvzip-chunk1024-0.2", 1024, "mine", 512)
    assert chunked.describe()["prefill_chunk_size"] == 1024 and "prefill_chunk_size" not in one_shot.describe()
    with pytest.raises(ConfigError, match=r"^compression\[0\]\.prefill_chunk_size: must be"):
        _parse(tmp_path, make_config, compression=[{"method": "kvzip", "budget": 0.2, "prefill_chunk_size": 0}])


def test_old_spellings_are_read_with_a_warning(tmp_path, make_config):
    with pytest.warns(FutureWarning) as caught:
        experiment = _parse(tmp_path, make_config, compression=[
            {"method": "streamingllm", "budget": 128},
            {"name": "explicit", "algorithm": "h2o", "start_size": 4, "intermediate_size": 60, "recent_size": 0},
        ])
    assert [str(warning.message) for warning in caught] == [
        "compression[0].method 'streamingllm' is deprecated: write 'streaming_llm'",
        "compression[1].algorithm is deprecated: write method: 'h2o'",
    ]
    streaming, explicit = experiment.settings
    assert (streaming.name, streaming.method, explicit.method) == ("streaming_llm-128", "streaming_llm", "h2o")


def test_defaults_and_path_resolution(tmp_path, make_config):
    experiment = _parse(tmp_path, make_config, tasks="english16", output_dir="../results")
    assert experiment.tasks == ENGLISH16
    assert experiment.output_dir == (tmp_path.parent / "results").resolve()
    assert (experiment.seed, experiment.limit, experiment.options.min_one_new_token) == (42, None, False)
    assert experiment.model.chat_template is True and experiment.model.attn_implementation == "sdpa"


def test_default_model_shorthand(tmp_path, make_config):
    assert _parse(tmp_path, make_config, model="default").model.path == "default"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"modle": {"path": "x"}}, r"^modle: unknown key; allowed keys: \["),
        ({"model": {"path": "x", "dtpye": "float16"}}, r"^model\.dtpye: unknown key; allowed keys of model"),
        ({"model": {"path": "x", "dtype": "fp16"}}, r"^model\.dtype: must be one of \['auto', 'float32'"),
        ({"model": {"path": "x", "chat_template": "no"}}, r"^model\.chat_template: must be true or false"),
        ({"model": {"dtype": "float16"}}, r"^model\.path: required"),
        ({"max_length": "31500"}, r"^max_length: must be an integer, got str '31500'"),
        ({"max_length": None}, r"^max_length: required, the prompt truncation cap"),
        ({"limit": 0}, r"^limit: must be >= 1, got 0"),
        ({"limit": True}, r"^limit: must be an integer, got bool"),
        ({"tasks": ["qasper", "narative_qa"]}, r"^tasks: unknown task 'narative_qa'"),
        ({"tasks": 3}, r"^tasks: must be a group"),
        ({"data": {"folder": "a", "hub": "b"}}, r"^data: give exactly one of"),
        ({"data": {"path": "a"}}, r"^data\.path: unknown key"),
        ({"data": {"folder": "no/such/folder"}}, r"^data\.folder: .* is not a folder"),
        ({"metric_fixes": ["rouge"]}, r"^metric_fixes: must be a list drawn from"),
        ({"shard_timeout": -1}, r"^shard_timeout: must be a positive number"),
        ({"compression": []}, r"^compression: must be a non-empty list"),
    ],
)
def test_errors_name_the_key(tmp_path, make_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        _parse(tmp_path, make_config, **overrides)


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"method": "snapkv", "budgte": 128}, r"^compression\[1\]\.budgte: unknown key"),
        ({"method": "pyramidkv", "budget": 128}, r"^compression\[1\]\.method: must be one of"),
        ({"method": "snapkv", "budgets": [128, "256"]}, r"^compression\[1\]\.budgets\[1\]: must be an integer"),
        ({"method": "snapkv", "budget": 128, "budgets": [256]}, r"^compression\[1\]: give either"),
        ({"method": "h2o", "budget": 128, "window_size": 8}, r"^compression\[1\]: window_size is only allowed"),
        ({"method": "snapkv", "budget": 128, "score_aggregation": "mean"}, r"^compression\[1\]: score_aggregation"),
        ({"method": "snapkv", "budget": 128, "window_size": "8"}, r"^compression\[1\]: window_size must be an int"),
        ({"method": "streaming_llm"}, r"^compression\[1\]\.budget: required for method 'streaming_llm'"),
        ({"method": "streaming_llm", "budget": 4}, r"^compression\[1\]\.budget: streaming_llm needs a budget above"),
        ({"method": "streaming_llm", "budget": 64, "recent_size": 8}, r"^compression\[1\]\.recent_size: streaming_llm"),
        ({"method": "none", "budget": 64}, r"^compression\[1\]\.budget: method 'none'"),
        ({"method": "snapkv", "algorithm": "h2o", "budget": 64}, r"^compression\[1\]\.algorithm: 'h2o' contradicts"),
        ({"method": "none"}, r"^compression\[1\]: setting name 'full' is used twice"),
        ({"method": "snapkv", "budget": 64, "name": "a b"}, r"^compression\[1\]\.name: 'a b' is used as a folder"),
    ],
)
def test_compression_errors_name_the_setting(tmp_path, make_config, entry, message):
    with pytest.raises(ConfigError, match=message):
        _parse(tmp_path, make_config, compression=["none", entry])


def test_top_level_must_be_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="the experiment file: must be a mapping"):
        parse_experiment(["model"], tmp_path)


def test_cli_reports_config_errors_without_a_traceback(tmp_path, make_config, capsys):
    config = make_config(tmp_path, max_lenght=100)
    assert main(["evaluate", str(config)]) == 2
    assert "error: max_lenght: unknown key" in capsys.readouterr().err


def test_cli_rejects_unknown_settings(tmp_path, make_config, capsys):
    assert main(["evaluate", str(make_config(tmp_path)), "--settings", "snapkv-64"]) == 2
    assert "--settings: unknown setting(s) ['snapkv-64']; this experiment has ['full']" in capsys.readouterr().err


@pytest.mark.parametrize("path", sorted(CONFIGS.rglob("*.yaml")), ids=lambda path: path.name)
def test_shipped_configs_parse(path):
    experiment = load_experiment(path)
    assert experiment.settings and experiment.tasks
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert experiment.benchmark.name == raw.get("benchmark", "longbench") == path.parent.name
    if experiment.benchmark.name == "longbench":
        assert raw["max_length"] == experiment.options.max_length


@pytest.mark.parametrize("benchmark", ["longbench", "ruler"])
def test_a_data_folder_is_recorded_as_the_config_writes_it(tmp_path, make_config, benchmark):
    """The pipeline record names the records by the config's own path, not this checkout's, so that a run resumes
    from another checkout (or a moved one) of the same files."""
    extra = {"benchmark": "ruler", "tasks": ["niah_single_1"], "lengths": [512], "max_length": None}
    recorded = set()
    for checkout in ("first", "moved"):
        (tmp_path / checkout / "records").mkdir(parents=True)
        experiment = _parse(tmp_path / checkout, make_config, data={"folder": "records"},
                            **(extra if benchmark == "ruler" else {}))
        recorded.add(experiment.benchmark.pipeline(experiment.options)["data"])
    assert recorded == {"folder:records"}


def test_a_generators_tokenizer_folder_is_recorded_as_the_config_writes_it(tmp_path, make_config):
    recorded = set()
    for checkout in ("first", "moved"):
        (tmp_path / checkout / "tokenizer").mkdir(parents=True)
        experiment = _parse(tmp_path / checkout, make_config, benchmark="ruler", tasks=["niah_single_1"],
                            lengths=[512], max_length=None, data={"generate": {"tokenizer": "tokenizer", "samples": 2}})
        recorded.add(experiment.benchmark.pipeline(experiment.options)["data"])
    assert recorded == {"generated:tokenizer seed 42, 2 samples"}


def test_a_context_store_is_checked_and_found_from_the_config(tmp_path, make_config):
    stored = {"method": "kvzip", "budget": 0.2, "context_store": "store"}
    [setting] = _parse(tmp_path, make_config, compression=[stored]).settings
    assert setting.context_store == str(tmp_path / "store")
    assert "context_store" not in setting.describe()  # the same predictions as without it: resumable either way
    url = _parse(tmp_path, make_config, compression=[{**stored, "context_store": "memory://contexts"}]).settings
    assert url[0].context_store == "memory://contexts"
    with pytest.raises(ConfigError, match=r"^compression\[0\]\.context_store: needs a budget"):
        _parse(tmp_path, make_config, compression=[{"method": "kvzip", "context_store": "store"}])
    with pytest.raises(ConfigError, match=r"method 'none' \(the full cache\) takes only a name"):
        _parse(tmp_path, make_config, compression=[{"method": "none", "context_store": "store"}])
