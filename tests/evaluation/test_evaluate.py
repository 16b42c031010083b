"""eval.py's scoring rules, and the score files written for an experiment (from hand-written predictions)."""

from __future__ import annotations

import csv
import json
import math

import pytest

from kvbench.evaluate import evaluate_experiment
from kvbench.experiment import load_experiment
from kvbench.layout import OutputLayout
from longbench.benchmark import LongBench
from longbench.evaluate import sample_score, scorer, scorer_e
from longbench.tasks import ENGLISH16

TREC_CLASSES = ["City", "Country", "Date"]
ENGLISH = "average (english16)"


def test_first_line_rule_strips_only_leading_newlines():
    assert scorer("trec", ["\n\nCity\nCountry"], [["City"]], TREC_CLASSES) == 100.0
    assert scorer("trec", [" \nCity"], [["City"]], TREC_CLASSES) == 0.0  # the blank " " line is the first line
    assert scorer("triviaqa", ["Paris\nQuestion: next"], [["Paris"]], None) == 100.0
    assert scorer("qasper", ["Paris\nQuestion: next"], [["Paris"]], None) == pytest.approx(100 * 2 / 4)  # no rule


def test_samsum_keeps_its_first_line_only():
    assert sample_score("samsum", "Ben meets Anna.\nDialogue: more", ["Ben meets Anna."], None) == pytest.approx(
        2 / (2 + 1e-8)
    )


def test_best_answer_and_rounding():
    # Per sample the best of the gold answers; the task score is round(100 * mean, 2).
    predictions = ["Paris", "Rome", "Oslo"]
    answers = [["London", "Paris"], ["Madrid"], ["Bern"]]
    assert scorer("hotpotqa", predictions, answers, None) == 33.33


def test_e_variants_score_like_their_base():
    assert scorer("trec_e", ["City"], [["City"]], TREC_CLASSES) == scorer("trec", ["City"], [["City"]], TREC_CLASSES)
    with pytest.raises(ValueError, match="unknown LongBench dataset"):
        scorer("trek", ["City"], [["City"]], TREC_CLASSES)


def test_longbench_e_bucket_edges():
    right, wrong = "Paragraph 3", "Paragraph 4"
    lengths = [3999, 4000, 7999, 8000]
    answers = [["Paragraph 3"]] * 4
    assert scorer_e("passage_retrieval_en", [right] * 4, answers, lengths, None) == {
        "0-4k": 100.0, "4-8k": 100.0, "8k+": 100.0}
    # Only the 4000-long sample right: 3999 is in 0-4k, 4000 and 7999 in 4-8k, 8000 in 8k+.
    assert scorer_e("passage_retrieval_en", [wrong, right, wrong, wrong], answers, lengths, None) == {
        "0-4k": 0.0, "4-8k": 50.0, "8k+": 0.0}


def test_longbench_e_empty_bucket_is_nan():
    scores = scorer_e("qasper", ["yes"], [["yes"]], [100], None)
    assert scores["0-4k"] == 100.0 and math.isnan(scores["4-8k"]) and math.isnan(scores["8k+"])
    assert json.dumps(scores) == '{"0-4k": 100.0, "4-8k": NaN, "8k+": NaN}'


def test_metric_fixes_reach_the_metric():
    classes = ["big", "city", "big city"]
    assert scorer("trec", ["big city"], [["big city"]], classes) == 50.0
    assert scorer("trec", ["big city"], [["big city"]], classes, fixes={"classification_iteration"}) == 100.0


def _write_predictions(layout_root, setting, task, lines):
    path = OutputLayout(layout_root, LongBench()).prediction_file(setting, task)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines), encoding="utf-8")


def _record(index, answers, length=100, all_classes=None):
    return {"answers": answers, "all_classes": all_classes, "length": length, "_id": f"id{index}"}


def test_evaluate_experiment_writes_all_reports(tmp_path, make_config, official_line):
    config = make_config(
        tmp_path,
        tasks=["english16", "multifieldqa_zh", "qasper_e"],
        compression=["none", {"method": "snapkv", "budgets": [128, 256]}],
    )
    experiment = load_experiment(config)
    root = experiment.output_dir
    for setting, correct in (("full", 2), ("snapkv-128", 0), ("snapkv-256", 1)):
        for task in ENGLISH16:
            answer = "Paragraph 1" if task == "passage_retrieval_en" else "1"
            records = [_record(i, [answer], all_classes=["1", "2"] if task == "trec" else None) for i in range(2)]
            lines = [official_line(r, answer if i < correct else "zzz") for i, r in enumerate(records)]
            _write_predictions(root, setting, task, lines)
    _write_predictions(root, "full", "qasper_e", [official_line(_record(0, ["yes"], 5000), "yes")])

    summary = evaluate_experiment(experiment, experiment.settings)

    full, small, medium = summary["settings"]
    assert full["scores"]["narrativeqa"] == 100.0 and small["scores"]["narrativeqa"] == 0.0
    assert full["averages"][ENGLISH] == 100.0 and medium["averages"][ENGLISH] == 50.0
    assert math.isnan(full["scores"]["qasper_e"]["0-4k"]) and full["scores"]["qasper_e"]["4-8k"] == 100.0
    assert "multifieldqa_zh" not in full["scores"]  # no prediction file: left out, not scored 0
    assert json.loads((root / "full" / "pred" / "result.json").read_text())["lcc"] == 100.0
    assert (root / "full" / "pred_e" / "result.json").read_text().count("NaN") == 2  # the official file format

    written = json.loads((root / "scores.json").read_text())
    assert [s["name"] for s in written["settings"]] == ["full", "snapkv-128", "snapkv-256"]
    rows = list(csv.DictReader((root / "scores.csv").open()))
    assert {"task": "narrativeqa", "bucket": "", "setting": "snapkv-256", "method": "snapkv", "budget": "256",
            "score": "50.0", "unrounded_score": "50.0", "samples": "2", "kv_bytes": "", "full_kv_bytes": "",
            "kv_ratio": ""} in rows
    summaries = list(csv.DictReader((root / "scores_summary.csv").open()))
    assert [(row["setting"], row[ENGLISH]) for row in summaries] == [("full", "100.0"), ("snapkv-128", "0.0"),
                                                                      ("snapkv-256", "50.0")]
    markdown = (root / "scores.md").read_text()
    assert "| task | full | snapkv-128 | snapkv-256 |" in markdown
    assert "| **average (english16)** | 100.00 | 0.00 | 50.00 |" in markdown
    assert "| qasper_e 8k+ | nan | — | — |" in markdown
    assert "| multifieldqa_zh | — | — | — |" in markdown
    assert (root / "scores.png").read_bytes().startswith(b"\x89PNG")


def test_english16_average_needs_all_sixteen(tmp_path, make_config, official_line):
    experiment = load_experiment(make_config(tmp_path, tasks=["qasper", "trec"]))
    _write_predictions(experiment.output_dir, "full", "qasper", [official_line(_record(0, ["yes"]), "yes")])
    summary = evaluate_experiment(experiment, experiment.settings)
    assert summary["settings"][0]["averages"] == {ENGLISH: None, "average (evaluated v1 tasks)": 100.0}
    assert summary["settings"][0]["kv_ratio"] is None  # hand-written lines carry no KV bytes


def test_evaluate_without_predictions_fails(tmp_path, make_config):
    experiment = load_experiment(make_config(tmp_path, tasks=["qasper"]))
    with pytest.raises(FileNotFoundError, match="run `predict` first"):
        evaluate_experiment(experiment, experiment.settings)


def test_unfinished_tasks_are_marked(tmp_path, make_config, official_line):
    settings = ["none", {"method": "h2o", "budget": 64}]
    experiment = load_experiment(make_config(tmp_path, tasks=["qasper"], compression=settings))
    records = [_record(i, ["yes"]) for i in range(3)]
    _write_predictions(experiment.output_dir, "full", "qasper", [official_line(r, "yes") for r in records])
    _write_predictions(experiment.output_dir, "h2o-64", "qasper", [official_line(records[0], "yes")])
    evaluate_experiment(experiment, experiment.settings)
    markdown = (experiment.output_dir / "scores.md").read_text()
    assert "| qasper | 100.00 | 100.00* |" in markdown and "its predictions are not finished" in markdown
