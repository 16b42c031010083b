"""The runner's reports say what the measurements say: the full cache's bytes cover the tokens the compressed
settings' do, the KV ratio is the ratio of the report's own byte rows, averages are taken of unrounded scores, the
CSV is tidy, the plots stay readable with one budget, and the kernel says it compiles only when it does.

RULER predictions are written by hand (no model) except where the generation itself is under test (tiny models).
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension
import yaml

from kvbench.benchmark import Prompt
from kvbench.evaluate import evaluate_experiment
from kvbench.experiment import Experiment, load_experiment
from kvbench.generation import generate
from kvbench.report import _figure
from kvbench.settings import CompressionSetting
from kvcompress.cache import kv_cache_bytes
from kvcompress.kernels import native
from ruler import leaderboard
from tiny_models import TinyTokenizer, random_tokens, tiny_model

LENGTH = 512
TASKS = ("niah_single_1", "niah_single_2")
AVERAGE = f"average ({LENGTH})"


def _experiment(folder: Path, compression: list) -> Experiment:
    (folder / "data").mkdir(parents=True)
    config = {"benchmark": "ruler", "model": {"path": str(folder)}, "tasks": list(TASKS), "lengths": [LENGTH],
              "data": {"folder": "data"}, "compression": compression, "output_dir": "out"}
    path = folder / "ruler.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return load_experiment(path)


def _predict(experiment: Experiment, setting: str, task: str, correct: list[bool],
             kv_bytes: list[tuple[int, int]] | None = None) -> None:
    """Hand-written RULER lines: the answer where ``correct``, with (kv_bytes, full_kv_bytes) if given."""
    path = experiment.output_dir / setting / "pred" / f"{task}_{LENGTH}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for index, right in enumerate(correct):
        line = {"index": index, "pred": "1234567" if right else "no idea", "outputs": ["1234567"], "length": 300,
                "_id": str(index)}
        if kv_bytes is not None:
            line.update(kv_bytes=kv_bytes[index][0], full_kv_bytes=kv_bytes[index][1])
        lines.append(json.dumps(line) + "\n")
    path.write_text("".join(lines), encoding="utf-8")


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


# 1. The full cache's bytes and the compressed settings' cover the same tokens; the ratio is that of the byte rows.

@pytest.mark.parametrize("arch, context", [("llama", 40), ("gemma3", 40), ("gemma3", 10)])
def test_context_first_full_cache_bytes_cover_the_context_as_the_compressed_settings_do(arch, context):
    """gemma3's sliding layers (window 16) hold only the last tokens: a context longer and shorter than them."""
    model, prompt_ids = tiny_model(arch), random_tokens(context + 12)[0].tolist()
    prompt = Prompt(prompt_ids, context, {"max_new_tokens": 6})
    with torch.no_grad():
        context_only = kv_cache_bytes(model(torch.tensor([prompt_ids[:context]]), use_cache=True).past_key_values)
    full = generate(model, TinyTokenizer(), CompressionSetting("full", "none", None), prompt)
    snapkv = generate(model, TinyTokenizer(), CompressionSetting("snapkv-0.5", "snapkv", 0.5,
                                                                 overrides={"window_size": 4}), prompt)
    assert full.kv_bytes == full.full_kv_bytes == context_only  # before: the prompt and the answer but one token
    assert snapkv.full_kv_bytes == context_only and snapkv.kv_bytes < context_only


def test_query_aware_full_cache_bytes_still_cover_everything_it_saw():
    model, prompt_ids = tiny_model(), random_tokens(40)[0].tolist()
    full = generate(model, TinyTokenizer(), CompressionSetting("full", "none", None),
                    Prompt(prompt_ids, len(prompt_ids), {"max_new_tokens": 6, "min_new_tokens": 6}))
    with torch.no_grad():
        everything = model(torch.tensor([prompt_ids + full.new_ids[:-1]]), use_cache=True).past_key_values
    assert full.kv_bytes == full.full_kv_bytes == kv_cache_bytes(everything)


def test_the_kv_ratio_is_the_ratio_of_the_reports_own_byte_rows(tmp_path):
    experiment = _experiment(tmp_path, ["none", {"method": "snapkv", "budget": 0.5}])
    context = [(1000, 1000), (1200, 1200), (800, 800)]
    kept = [(337, 1000), (611, 1200), (402, 800)]
    for task in TASKS:
        _predict(experiment, "full", task, [True] * 3, context)
        _predict(experiment, "snapkv-0.5", task, [True, False, True], kept)

    summary = evaluate_experiment(experiment, experiment.settings)

    full, snapkv = summary["settings"]
    held, reference = sum(snapkv["kv_bytes"].values()), sum(snapkv["full_kv_bytes"].values())
    assert (held, reference) == (2 * 1350, 2 * 3000) and snapkv["kv_ratio"] == held / reference  # not rounded
    assert sum(full["kv_bytes"].values()) == reference and full["kv_ratio"] == 1.0
    assert full["matches_full_cache_bytes"] is snapkv["matches_full_cache_bytes"] is True
    root = experiment.output_dir
    for row in _rows(root / "scores.csv"):
        assert float(row["kv_ratio"]) == int(row["kv_bytes"]) / int(row["full_kv_bytes"])
    by_setting = {row["setting"]: row for row in _rows(root / "scores_summary.csv")}
    assert float(by_setting["snapkv-0.5"]["kv_ratio"]) == held / reference
    assert by_setting["snapkv-0.5"]["full_kv_bytes"] == by_setting["full"]["kv_bytes"] == str(reference)
    markdown = (root / "scores.md").read_text(encoding="utf-8")
    assert "| KV held (MB) | 0.01 | 0.00 |" in markdown  # 6000 and 2700 bytes
    assert "| full cache, same tokens (MB) | 0.01 | 0.01 |" in markdown and "| KV × | 1.000 | 0.450 |" in markdown
    assert "bytes differ" not in markdown


def test_full_cache_bytes_over_other_tokens_are_flagged(tmp_path):
    """Predictions made before the fix measured the context-first full cache over the prompt and the answer."""
    experiment = _experiment(tmp_path, ["none", {"method": "snapkv", "budget": 0.5}])
    for task in TASKS:
        _predict(experiment, "full", task, [True] * 3, [(1100, 1100)] * 3)
        _predict(experiment, "snapkv-0.5", task, [True] * 3, [(500, 1000)] * 3)

    summary = evaluate_experiment(experiment, experiment.settings)

    assert [s["matches_full_cache_bytes"] for s in summary["settings"]] == [True, False]
    assert summary["settings"][1]["kv_ratio"] == 0.5  # against its own full-cache bytes, not the full setting's
    markdown = (experiment.output_dir / "scores.md").read_text(encoding="utf-8")
    assert "`full`'s bytes differ from the full cache's bytes of every other setting" in markdown


# 2. Averages of unrounded task scores.

def test_averages_are_taken_of_unrounded_task_scores(tmp_path):
    experiment = _experiment(tmp_path, ["none"])
    _predict(experiment, "full", "niah_single_1", [True, True, False])  # 66.666...: RULER's score 66.67
    _predict(experiment, "full", "niah_single_2", [True, True, True])

    (full,) = evaluate_experiment(experiment, experiment.settings)["settings"]

    assert full["averages"] == {AVERAGE: 83.33}  # 5 of 6; the mean of the rounded scores is 83.335 -> 83.34
    assert full["scores"] == {f"niah_single_1_{LENGTH}": 66.67, f"niah_single_2_{LENGTH}": 100.0}  # official
    assert full["unrounded_scores"][f"niah_single_1_{LENGTH}"] == pytest.approx(200 / 3)
    assert f"| **{AVERAGE}** | 83.33 |" in (experiment.output_dir / "scores.md").read_text(encoding="utf-8")
    assert _rows(experiment.output_dir / "scores_summary.csv")[0][AVERAGE] == "83.33"


def test_the_leaderboard_means_unrounded_scores(tmp_path):
    counted = ["a_4096", "b_4096"]
    setting = {"scores": {"a_4096": 66.67, "b_4096": 100.0}, "unrounded_scores": {"a_4096": 200 / 3, "b_4096": 100.0}}
    assert leaderboard._mean(setting, counted) == (pytest.approx(250 / 3), True)
    peer = {"scores": {"a_4096": 66.67, "b_4096": 100.0}}  # benchmarks/peer_kvpress.py: rounded scores only
    assert leaderboard._mean(peer, counted) == (pytest.approx(83.335), True)


# 3. A tidy CSV, summaries apart.

def test_the_csv_has_one_row_per_task_and_setting_and_the_summaries_are_apart(tmp_path):
    experiment = _experiment(tmp_path, ["none", {"method": "snapkv", "budgets": [0.25, 0.5]}])
    for setting in ("full", "snapkv-0.25", "snapkv-0.5"):
        for task in TASKS:
            _predict(experiment, setting, task, [True, False, True], [(500, 1000)] * 3)

    evaluate_experiment(experiment, experiment.settings)

    rows = _rows(experiment.output_dir / "scores.csv")
    assert list(rows[0]) == ["task", "bucket", "setting", "method", "budget", "score", "unrounded_score", "samples",
                             "kv_bytes", "full_kv_bytes", "kv_ratio"]
    units = {f"{task}_{LENGTH}" for task in TASKS}
    assert sorted((row["task"], row["setting"]) for row in rows) == sorted(
        (unit, setting) for unit in units for setting in ("full", "snapkv-0.25", "snapkv-0.5"))
    first = {key: rows[0][key] for key in ("task", "setting", "score", "samples", "kv_bytes", "full_kv_bytes",
                                           "kv_ratio")}
    assert first == {"task": f"niah_single_1_{LENGTH}", "setting": "full", "score": "66.67", "samples": "3",
                     "kv_bytes": "1500", "full_kv_bytes": "3000", "kv_ratio": "0.5"}
    summaries = _rows(experiment.output_dir / "scores_summary.csv")
    assert [row["setting"] for row in summaries] == ["full", "snapkv-0.25", "snapkv-0.5"]
    assert summaries[1] == {"setting": "snapkv-0.25", "method": "snapkv", "budget": "0.25", "samples": "6",
                            AVERAGE: "66.67", "kv_bytes": "3000", "full_kv_bytes": "6000", "kv_ratio": "0.5",
                            "matches_full_cache_bytes": "false", "full_cache_solved": "4", "full_cache_solved_of": "4"}


# 4. Plots readable with one budget or one setting.

def _summary(*settings: tuple[str, str, float | int | None, float]) -> dict:
    return {"experiment": "one budget", "settings": [
        {"name": name, "method": method, "budget": budget, "averages": {AVERAGE: score}}
        for name, method, budget, score in settings]}


def _full_cache_points(axes) -> list[tuple[float, float, str]]:
    return [(line.get_xdata()[0], line.get_ydata()[0], line.get_label()) for line in axes.lines
            if line.get_marker() == "*"]


def test_one_fractional_budget_spans_0_to_1_with_the_full_cache_at_1():
    figure = _figure(_summary(("full", "none", None, 83.3), ("kvzip-0.2", "kvzip", 0.2, 60.0),
                              ("kvzip-headwise-0.2", "kvzip", 0.2, 70.0)), "RULER")
    (axes,) = figure.axes
    assert axes.get_xlim() == (0.0, 1.05)  # before: 0.19-0.21 around the only budget
    assert _full_cache_points(axes) == [(1.0, 83.3, "full cache, 100 %")]
    assert [tick.get_text() for tick in axes.get_xticklabels()] == ["20%", "100 %\n(full)"]
    assert {line.get_label() for line in axes.lines if line.get_marker() == "o"} == {"kvzip", "kvzip-headwise"}


def test_the_full_cache_alone_and_one_slot_budget_give_readable_axes():
    alone = _figure(_summary(("full", "none", None, 50.0)), "RULER").axes[0]
    assert alone.get_xlim() == (0.0, 1.05) and _full_cache_points(alone) == [(1.0, 50.0, "full cache, 100 %")]
    slots = _figure(_summary(("full", "none", None, 40.0), ("snapkv-128", "snapkv", 128, 30.0)), "LongBench").axes[0]
    assert slots.get_xlim() == pytest.approx((64, 256)) and slots.get_xscale() == "log"


def test_the_leaderboard_heads_each_table_with_the_full_cache_and_plots_it_at_1(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    settings = [{"name": "full", "method": "none", "budget": None, "scores": {"a_4096": 100.0}, "kv_ratio": 1.0},
                {"name": "kvzip-0.2", "method": "kvzip", "budget": 0.2, "scores": {"a_4096": 80.0}, "kv_ratio": 0.2}]
    (run / "scores.json").write_text(json.dumps({"experiment": "run", "protocol": "context_first",
                                                 "full_cache_setting": "full", "settings": settings}))

    text = leaderboard.leaderboard([run], tmp_path / "board")

    assert "Full cache (all of its KV bytes, 1.00): 100.0\n\n| method | 20% kept |" in text
    assert "| full cache |" not in text  # before: the full cache's row under "20% kept"
    axes = leaderboard._figure([leaderboard.load_run(run)], ["a_4096"], 100.0).axes[0]
    assert axes.get_xlim() == (0.0, 1.05) and _full_cache_points(axes) == [(1.0, 100.0, "full cache (1.0)")]


# 5. The kernel's compile message only when it compiles.

def test_the_kernel_says_it_compiles_only_when_it_does(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    builds = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **options: builds.append(options))
    with caplog.at_level(logging.INFO, logger=native.__name__):
        native._build()
        assert "compiling the fused CPU attention kernel (once per machine, ~1 min)" in caplog.text
        caplog.clear()
        built = Path(builds[0]["build_directory"]) / f"{builds[0]['name']}{torch.utils.cpp_extension.LIB_EXT}"
        built.touch()  # what the build leaves; the next run's loader only loads it
        native._build()
        assert not caplog.records  # before: "(compiled once per machine, ~1 min)" on every run
