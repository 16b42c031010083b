"""What the runner checks before any work, and what its three entry points say: a Hub source that cannot be
reached fails at once naming the local alternatives, a model that cannot be loaded fails before any record is
made, a file of the other benchmark is refused with the command that runs it, and ``--tasks`` takes the file's own
task names. Nothing here reaches the network: the Hub is offline or its answer is replaced."""

from __future__ import annotations

import re
import time
from pathlib import Path

import datasets
import huggingface_hub
import pytest
import yaml
from huggingface_hub import constants as hub_constants

from kvbench.cli import main as eval_main
from kvbench.config import check_model_path
from kvbench.experiment import ConfigError, load_experiment
from longbench.cli import main as longbench_main
from longbench.data import SAMPLE_CONFIG, DataError, DataSource, load_task
from ruler.cli import main as ruler_main

REPO = Path(__file__).resolve().parents[2]
SAMPLE_README = REPO / "configs" / "data" / "longbench_sample" / "README.md"
LOCAL_SOURCES = ("data: {folder: DIR}", "data: {zip: /path/to/data.zip}", f"kvcompress-longbench run {SAMPLE_CONFIG}")


@pytest.fixture
def hub_offline(monkeypatch, tmp_path):
    """HF_HUB_OFFLINE=1 with empty caches, whatever the environment running the tests."""
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")


@pytest.fixture
def hub_unreachable(monkeypatch, tmp_path):
    """Online mode on a machine whose Hub does not answer; a second request (a retry) fails the test."""
    calls = []

    def no_answer(self, repo_id, **kwargs):
        calls.append(repo_id)
        if len(calls) > 1:
            raise AssertionError(f"the Hub was asked again for {calls}")
        raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", no_answer)
    return calls


def _write(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "experiment.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def _ruler_config(folder: Path, **overrides) -> Path:
    config = {
        "benchmark": "ruler", "model": {"path": "default"}, "tasks": ["niah_single_1", "niah_single_2"],
        "lengths": [512, 1024], "data": {"generate": {"tokenizer": "default", "samples": 2}},
        "compression": ["none"], "output_dir": "out",
    }
    return _write(folder, {**config, **overrides})


def _longbench_config(folder: Path, **overrides) -> Path:
    config = {
        "model": {"path": "default"}, "max_length": 7500, "tasks": ["qasper"],
        "data": {"folder": str(REPO / "configs" / "data" / "longbench_sample")}, "compression": ["none"],
        "output_dir": "out",
    }
    return _write(folder, {**config, **overrides})


# ------------------------------------------------------------------------------------- LongBench from the Hub
def test_an_offline_hub_dataset_fails_at_once_naming_the_local_sources(hub_offline):
    with pytest.raises(DataError) as caught:
        load_task(DataSource("hub", "Xnhyacinth/LongBench"), "qasper")
    message = str(caught.value)
    assert message.startswith("data.hub: Xnhyacinth/LongBench is not in the local cache and offline mode is on")
    assert all(source in message for source in LOCAL_SOURCES), message


def test_an_unreachable_hub_dataset_is_asked_once_and_never_loaded(hub_unreachable, monkeypatch):
    def load_dataset(*args, **kwargs):
        raise AssertionError("datasets.load_dataset would retry for 30 s")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(DataError) as caught:
        load_task(DataSource("hub", "Xnhyacinth/LongBench"), "qasper")
    message = str(caught.value)
    assert message.startswith("data.hub: Xnhyacinth/LongBench cannot be fetched: the Hub does not answer (OSError")
    assert "HF_HUB_OFFLINE=1" in message and all(source in message for source in LOCAL_SOURCES), message
    assert hub_unreachable == ["Xnhyacinth/LongBench"]


def test_the_cli_reports_an_offline_hub_dataset_without_a_traceback(tmp_path, hub_offline, capsys):
    config = _longbench_config(tmp_path, data={"hub": "Xnhyacinth/LongBench"}, model={"path": "default",
                                                                                     "dtype": "float32"})
    assert longbench_main(["predict", str(config)]) == 2
    error = capsys.readouterr().err
    last = error.splitlines()[-1]  # after the records' progress bar
    assert last.startswith("kvcompress-longbench: error: data.hub: Xnhyacinth/LongBench is not in the local cache")
    assert "Traceback" not in error


def test_the_sample_readme_names_a_config_that_runs_the_sample():
    named = re.findall(r"`(configs/[\w./-]+\.yaml)`", SAMPLE_README.read_text(encoding="utf-8"))
    assert named, "the sample's README names no config"
    for config in named:
        experiment = load_experiment(REPO / config)
        assert experiment.options.data.location == str(SAMPLE_README.parent), config
    assert SAMPLE_CONFIG in named


# --------------------------------------------------------------------------------------------- model.path
@pytest.mark.parametrize("path, reason", [
    ("{tmp}/models/no-such-model", "is not a folder ({tmp}/models/no-such-model does not exist), an embedded model "
                                   "or a Hub id"),
    ("no-such-org/no-such-model", "is not a folder, and as a Hub id not in the local cache ({tmp}/hub-cache) and "
                                  "cannot be fetched: offline mode is on"),
    ("smollm3", "is not a folder, and as a Hub id not in the local cache"),
], ids=["missing-folder", "uncached-hub-id", "bare-name"])
def test_a_model_that_cannot_be_loaded_is_named(tmp_path, hub_offline, path, reason):
    path = path.format(tmp=tmp_path)
    with pytest.raises(ConfigError) as caught:
        check_model_path(path)
    message = str(caught.value)
    assert message.startswith(f"model.path: {path!r} {reason.format(tmp=tmp_path)}"), message
    assert "Give a folder that exists, 'default' or" in message
    if "/" not in path:  # a bare name may be a misspelt embedded model: the names are listed
        assert "'smollm2-135m-instruct'" in message


def test_an_unreachable_hub_model_is_asked_once(hub_unreachable):
    with pytest.raises(ConfigError, match=r"^model.path: 'org/model' is not a folder, and as a Hub id not in the "
                                          r"local cache .* cannot be fetched: the Hub does not answer \(OSError"):
        check_model_path("org/model")
    assert hub_unreachable == ["org/model"]


def test_models_that_load_offline_pass(tmp_path, hub_offline, tiny_model_dir):
    snapshot = Path(hub_constants.HF_HUB_CACHE) / "models--org--cached" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}", encoding="utf-8")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123", encoding="utf-8")
    for path in ("org/cached", str(tiny_model_dir), "default", "smollm2-135m-instruct", "gemma3-270m"):
        check_model_path(path)


def test_a_missing_model_fails_before_any_record_is_made(tmp_path, hub_offline, monkeypatch, capsys):
    def generate(*args, **kwargs):
        raise AssertionError("RULER records were generated before the model was checked")

    monkeypatch.setattr("ruler.benchmark.generate", generate)
    config = _ruler_config(tmp_path, model={"path": str(tmp_path / "missing")})
    assert ruler_main(["run", str(config)]) == 2
    assert capsys.readouterr().err.startswith(f"kvcompress-ruler: error: model.path: '{tmp_path / 'missing'}' is not")
    assert not (tmp_path / "out").exists()


def test_parsing_alone_does_not_check_the_model(tmp_path, hub_offline):
    """The shipped 8B configs name Hub ids: they parse on a machine without them (test_experiment parses all)."""
    experiment = load_experiment(_ruler_config(tmp_path, model={"path": "no-such-org/no-such-model"}))
    assert experiment.model.path == "no-such-org/no-such-model"
    with pytest.raises(ConfigError, match="^model.path: "):
        load_experiment(_ruler_config(tmp_path, model={"path": "no-such-org/no-such-model"}), check_model=True)


def test_evaluate_does_not_need_the_model(tmp_path, hub_offline, capsys):
    config = _longbench_config(tmp_path, model={"path": str(tmp_path / "missing")})
    longbench_main(["evaluate", str(config)])
    assert "model.path" not in capsys.readouterr().err


# ------------------------------------------------------------------------------------- three entry points
@pytest.fixture
def helps(capsys) -> dict[str, str]:
    texts = {}
    for name, main in (("kvcompress-eval", eval_main), ("kvcompress-longbench", longbench_main),
                       ("kvcompress-ruler", ruler_main)):
        with pytest.raises(SystemExit):
            main(["--help"])
        texts[name] = " ".join(capsys.readouterr().out.split())
    return texts


def test_each_entry_point_has_its_own_help(helps):
    assert helps["kvcompress-eval"].replace("kvcompress-eval", "") != helps["kvcompress-longbench"].replace(
        "kvcompress-longbench", "")
    assert "of the benchmark its `benchmark` key names (default: longbench)" in helps["kvcompress-eval"]
    assert "`benchmark: longbench` is the default of the file's `benchmark` key and the only benchmark this command " \
           "runs (RULER files: kvcompress-ruler" in helps["kvcompress-longbench"]
    assert "`benchmark: ruler` is the default of the file's `benchmark` key and the only benchmark this command " \
           "runs (LongBench files: kvcompress-longbench" in helps["kvcompress-ruler"]
    for name, module in (("kvcompress-eval", "kvbench"), ("kvcompress-longbench", "longbench"),
                         ("kvcompress-ruler", "ruler")):
        assert f"torchrun --nproc_per_node N -m {module}.cli run CONFIG" in helps[name]


def test_a_ruler_file_is_refused_by_kvcompress_longbench(tmp_path, capsys):
    config = _ruler_config(tmp_path)
    assert longbench_main(["evaluate", str(config)]) == 2
    assert capsys.readouterr().err == (
        "kvcompress-longbench: error: benchmark: this is a RULER experiment file (benchmark: ruler), not a LongBench "
        f"one. kvcompress-longbench runs LongBench files only: run it with `kvcompress-ruler evaluate {config}` (or "
        "kvcompress-eval)\n"
    )
    assert not (tmp_path / "out").exists()


def test_a_longbench_file_is_refused_by_kvcompress_ruler(tmp_path, capsys):
    config = _longbench_config(tmp_path)
    assert ruler_main(["run", str(config)]) == 2
    assert capsys.readouterr().err == (
        "kvcompress-ruler: error: max_length: not a RULER key; without a `benchmark` key this file reads as RULER, "
        "but its keys ['max_length'] are LongBench's: a LongBench experiment file. kvcompress-ruler runs RULER files "
        f"only: run it with `kvcompress-longbench run {config}` (or kvcompress-eval)\n"
    )


def test_kvcompress_eval_says_which_benchmark_a_keyless_file_needs(tmp_path, capsys):
    raw = yaml.safe_load(_ruler_config(tmp_path).read_text(encoding="utf-8"))
    del raw["benchmark"]
    config = _write(tmp_path / "keyless", raw)
    assert eval_main(["predict", str(config)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("kvcompress-eval: error: lengths: not a LongBench key;")
    assert error.endswith(f"Add `benchmark: ruler` to the file, or run it with `kvcompress-ruler predict {config}`\n")


def test_kvcompress_eval_runs_either_benchmark(tmp_path):
    assert load_experiment(_ruler_config(tmp_path)).benchmark.name == "ruler"
    assert load_experiment(_longbench_config(tmp_path / "lb")).benchmark.name == "longbench"


def test_tasks_take_the_files_own_names(tmp_path, capsys):
    experiment = load_experiment(_ruler_config(tmp_path))
    assert experiment.select_tasks(["niah_single_2"]) == ["niah_single_2_512", "niah_single_2_1024"]
    assert experiment.select_tasks(["niah_single_1_1024", "niah_single_2"]) == [
        "niah_single_2_512", "niah_single_1_1024", "niah_single_2_1024"]
    assert ruler_main(["predict", str(_ruler_config(tmp_path)), "--tasks", "niah_single_3"]) == 2
    assert capsys.readouterr().err == (
        "kvcompress-ruler: error: --tasks: unknown task(s) ['niah_single_3']; this experiment has ['niah_single_1', "
        "'niah_single_2'], or one at a length: ['niah_single_1_512', 'niah_single_2_512', 'niah_single_1_1024', "
        "'niah_single_2_1024']\n"
    )


def test_longbench_task_names_are_unchanged(tmp_path):
    experiment = load_experiment(_longbench_config(tmp_path, tasks=["qasper", "qasper_e", "2wikimqa"]))
    assert experiment.select_tasks(["qasper"]) == ["qasper"]
    with pytest.raises(ConfigError, match=r"^--tasks: unknown task\(s\) \['trec'\]; this experiment has \['qasper', "
                                          r"'qasper_e', '2wikimqa'\]$"):
        experiment.select_tasks(["trec"])


def test_the_ruler_docs_give_the_sharded_command():
    docs = (REPO / "docs" / "ruler.md").read_text(encoding="utf-8")
    commands = re.findall(r"torchrun --nproc_per_node \d+ -m ruler\.cli run (configs/ruler/[\w.-]+\.yaml)", docs)
    assert commands, "docs/ruler.md gives no torchrun command"
    assert all((REPO / config).is_file() for config in commands)


def test_an_unloadable_model_and_hub_data_are_named_together(tmp_path, hub_offline):
    """The README's published-row command offline: the model and the data both come from the Hub; one run names
    both with their alternatives, before any record is read (before, the data's 30 s of retries came first)."""
    config = _longbench_config(tmp_path, data={"hub": "Xnhyacinth/LongBench"},
                               model={"path": "mistralai/Mistral-7B-Instruct-v0.2"})
    started = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        load_experiment(config, check_model=True)
    assert time.monotonic() - started < 5
    first, second = str(caught.value).splitlines()
    assert first.startswith("model.path: 'mistralai/Mistral-7B-Instruct-v0.2' is not a folder")
    assert second.startswith("data.hub: Xnhyacinth/LongBench is not in the local cache")
    assert all(source in second for source in LOCAL_SOURCES)
