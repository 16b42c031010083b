"""``kvcompress-ruler report``: means over the tasks the full cache solves, per run, from the runs' scores.json."""

from __future__ import annotations

import json

import pytest

from ruler.cli import main
from ruler.leaderboard import leaderboard


def _setting(name, method, budget, scores, kv_ratio=None):
    return {"name": name, "method": method, "budget": budget, "scores": scores, "kv_ratio": kv_ratio}


def _run(folder, settings, protocol="context_first", **extra):
    folder.mkdir()
    full = next((s["name"] for s in settings if s["budget"] is None), None)
    summary = {"experiment": folder.name, "protocol": protocol, "full_cache_setting": full, "settings": settings,
               **extra}
    (folder / "scores.json").write_text(json.dumps(summary))
    return folder


@pytest.fixture
def runs(tmp_path):
    ours = _run(tmp_path / "ours", [
        _setting("full", "none", None, {"a_4096": 100.0, "b_4096": 80.0, "c_4096": 20.0}, 1.0),
        _setting("kvzip-0.1", "kvzip", 0.1, {"a_4096": 90.0, "b_4096": 60.0, "c_4096": 0.0}, 0.1),
        _setting("kvzip-0.5", "kvzip", 0.5, {"a_4096": 100.0, "b_4096": 80.0, "c_4096": 20.0}, 0.5),
        _setting("snapkv-0.1", "snapkv", 0.1, {"a_4096": 40.0}, 0.1),  # unfinished: one counted task of two
    ])
    peer = _run(tmp_path / "peer", [
        _setting("kvzip-0.1", "kvzip", 0.1, {"a_4096": 70.0, "b_4096": 50.0, "c_4096": 100.0}, 1.0),
    ], library="kvpress")
    return ours, peer


def test_only_the_tasks_the_full_cache_solves_count(runs, tmp_path):
    text = leaderboard(runs, tmp_path / "out" / "board")
    assert "Counted tasks (2, where the full cache of `ours` scores >= 50): a_4096, b_4096; left out: c_4096." in text
    assert "Full cache (all of its KV bytes, 1.00): 90.0" in text
    assert "| kvzip | 75.0 (0.10) | 90.0 (0.50) |" in text  # (90 + 60) / 2; c_4096 is not counted
    assert "| snapkv | 40.0 (0.10)* | — |" in text
    assert "### peer (kvpress, context_first)" in text and "| kvzip | 60.0 (1.00) |" in text
    assert (tmp_path / "out" / "board.md").read_text() == text and (tmp_path / "out" / "board.png").is_file()


def test_the_command_reports_a_run_without_scores_without_a_traceback(runs, tmp_path, capsys):
    assert main(["report", str(runs[0]), str(tmp_path / "missing"), "--out", str(tmp_path / "board")]) == 2
    assert "missing/scores.json: no scores" in capsys.readouterr().err
    assert main(["report", str(runs[1]), "--out", str(tmp_path / "board")]) == 2
    assert "no run has a full-cache setting" in capsys.readouterr().err
    assert main(["report", *map(str, runs), "--out", str(tmp_path / "board")]) == 0
