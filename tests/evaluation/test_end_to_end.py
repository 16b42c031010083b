"""The whole runner on every task with a tiny model: outputs, resume after a crash or kill -9, 2-process sharding.

The reference is one uninterrupted single-process run over all 34 tasks with the full cache and a compressed
setting; every other run must reproduce its prediction and score files byte for byte.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import kvbench.predict
from longbench.cli import main
from longbench.tasks import E_TASKS, ENGLISH16, TASKS, V1_TASKS

SETTINGS = ["none", {"method": "snapkv", "budget": 64, "window_size": 4}]
TASK_SPEC = ["all", "longbench_e"]
COMPARED = ("scores.json", "scores.csv", "scores.md")


def _outputs(root: Path, tasks=None) -> dict[str, bytes]:
    """Prediction, result, pipeline and score files by relative path (the PNG is checked for existence only);
    with ``tasks``, only those tasks' prediction files."""
    wanted = None if tasks is None else {
        ("pred_e" if TASKS[task].is_longbench_e else "pred", TASKS[task].base) for task in tasks
    }
    files = {}
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root).as_posix()
        if path.suffix == ".jsonl" and (wanted is None or (path.parent.name, path.stem) in wanted):
            files[relative] = path.read_bytes()
        elif wanted is None and (path.name in ("result.json", "pipeline.json") or relative in COMPARED):
            files[relative] = path.read_bytes()
    return files


@pytest.fixture(scope="module")
def reference(tmp_path_factory, make_config) -> Path:
    folder = tmp_path_factory.mktemp("reference")
    assert main(["run", str(make_config(folder, tasks=TASK_SPEC, compression=SETTINGS))]) == 0
    return folder / "out"


def test_every_task_is_predicted_scored_and_reported(reference):
    for setting in ("full", "snapkv-64"):
        for task in (*V1_TASKS, *E_TASKS):
            folder = "pred_e" if task in E_TASKS else "pred"
            lines = (reference / setting / folder / f"{TASKS[task].base}.jsonl").read_text().splitlines()
            keys = {"pred", "answers", "all_classes", "length", "_id", "kv_bytes", "full_kv_bytes"}
            assert [set(json.loads(line)) for line in lines] == [keys, keys]
        assert not (reference / setting / "shards").exists() or not any((reference / setting / "shards").iterdir())
    scores = json.loads((reference / "scores.json").read_text())
    full, compressed = scores["settings"]
    assert set(full["scores"]) == set(V1_TASKS) | set(E_TASKS)
    assert full["averages"]["average (english16)"] is not None and len(full["scores"]) == 21 + len(E_TASKS)
    assert full["kv_ratio"] == 1.0 and 0 < compressed["kv_ratio"] < 1  # measured on the caches
    assert all(math.isnan(full["scores"][task]["8k+"]) for task in E_TASKS)  # no sample record is 8k+
    assert compressed["parameters"]["window_size"] == 4
    assert compressed["pipeline"]["generation"]["compression"]["budget"] == 64
    assert (reference / "scores.png").read_bytes().startswith(b"\x89PNG")
    markdown = (reference / "scores.md").read_text()
    assert "| task | full | snapkv-64 |" in markdown and "| qasper_e 8k+ | nan | nan |" in markdown


def test_compression_changes_some_predictions(reference):
    """Budget 64 is below every prompt's length, so the compressor evicts and the greedy outputs diverge."""
    full = b"".join(path.read_bytes() for path in sorted((reference / "full").rglob("*.jsonl")))
    compressed = b"".join(path.read_bytes() for path in sorted((reference / "snapkv-64").rglob("*.jsonl")))
    assert full != compressed


def test_rerunning_a_finished_experiment_changes_nothing(reference):
    """Nothing is regenerated, and `run --settings full` still reports every setting that has predictions."""
    before = _outputs(reference)
    config = str(reference.parent / "experiment.yaml")
    assert main(["evaluate", config]) == 0
    assert _outputs(reference) == before
    assert main(["run", config, "--settings", "full"]) == 0
    assert _outputs(reference) == before


def test_tasks_option_predicts_only_the_named_tasks(reference, tmp_path, make_config, capsys):
    """`run --tasks` (a sweep over the tasks the full cache solves) writes those tasks' files, equal to the
    all-task run's, and no other; an unknown name is refused before the model loads."""
    config = str(make_config(tmp_path, tasks=TASK_SPEC, compression=SETTINGS))
    assert main(["predict", config, "--tasks", "narrativeqa_e"]) == 2
    assert "--tasks: unknown task(s) ['narrativeqa_e']" in capsys.readouterr().err
    named = ["qasper", "trec_e"]
    assert main(["run", config, "--tasks", *named]) == 0
    predicted = {path.relative_to(tmp_path / "out").as_posix() for path in (tmp_path / "out").rglob("*.jsonl")}
    assert predicted == set(_outputs(reference, tasks=named)) and len(predicted) == 2 * len(named)
    assert _outputs(tmp_path / "out", tasks=named) == _outputs(reference, tasks=named)


def test_crash_mid_run_then_resume_gives_identical_files(reference, tmp_path, make_config, monkeypatch):
    config = make_config(tmp_path, tasks=TASK_SPEC, compression=SETTINGS)
    real, calls = kvbench.predict.generate_prediction, []

    def crash_on_call_42(*args, **kwargs):
        calls.append(1)
        if len(calls) == 42:  # the second sample of the 21st task
            raise RuntimeError("simulated crash")
        return real(*args, **kwargs)

    monkeypatch.setattr(kvbench.predict, "generate_prediction", crash_on_call_42)
    with pytest.raises(RuntimeError, match="simulated crash"):
        main(["run", str(config)])
    monkeypatch.setattr(kvbench.predict, "generate_prediction", real)
    out = tmp_path / "out"
    in_flight = [path for path in out.rglob("*.jsonl") if len(path.read_text().splitlines()) == 1]
    assert [path.name for path in in_flight] == ["repobench-p.jsonl"]
    with in_flight[0].open("a") as handle:  # what a kill in the middle of a write leaves behind
        handle.write('{"pred": "Please compl')
    assert not (out / "scores.json").exists()

    assert main(["run", str(config)]) == 0
    assert _outputs(out) == _outputs(reference)


def test_kill_9_then_resume_gives_identical_files(reference, tmp_path, make_config, kill_9_after):
    config = make_config(tmp_path, tasks="english16", compression=SETTINGS)
    out = tmp_path / "out"
    written = kill_9_after("longbench.cli", config, out)
    assert 3 <= written < 2 * 2 * 16

    assert main(["predict", str(config)]) == 0
    assert _outputs(out, tasks=ENGLISH16) == _outputs(reference, tasks=ENGLISH16)


def test_two_process_sharded_run_matches_single_process(reference, tmp_path, make_config, runner_env):
    config = make_config(tmp_path, tasks=TASK_SPEC, compression=SETTINGS)
    processes, logs = [], []
    for rank in (0, 1):
        log = (tmp_path / f"rank{rank}.log").open("w")
        env = {**runner_env, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)}
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "longbench.cli", "run", str(config)], env=env, stdout=log, stderr=log
        ))
        logs.append(log)
    codes = [process.wait(timeout=300) for process in processes]
    for log in logs:
        log.close()
    assert codes == [0, 0], (tmp_path / "rank0.log").read_text()[-3000:] + (tmp_path / "rank1.log").read_text()[-3000:]
    out = tmp_path / "out"
    assert _outputs(out) == _outputs(reference)
    assert not (out / "full" / "shards").exists() and not (out / "run.lock").exists()
