"""Prediction files: torn-line repair, corruption errors, deterministic merging; the shard arithmetic."""

from __future__ import annotations

import pytest

from kvbench.predictions import PredictionError, PredictionWriter, merge, read_predictions
from kvbench.sharding import Shard, wait_for_samples
from longbench.benchmark import LongBench

KEYS = LongBench.line_keys


@pytest.fixture
def _line(official_line):
    def line(sample_id, prediction="p"):
        return official_line({"answers": ["a"], "all_classes": None, "length": 3, "_id": sample_id}, prediction)

    return line


def test_official_line_format(_line):
    assert _line("x", "Paris\n") == (
        '{"pred": "Paris\\n", "answers": ["a"], "all_classes": null, "length": 3, "_id": "x"}\n')


def test_torn_last_line_is_ignored_and_repaired(tmp_path, _line):
    path = tmp_path / "qasper.jsonl"
    path.write_text(_line("a") + _line("b") + '{"pred": "half', encoding="utf-8")
    assert [line.sample_id for line in read_predictions(path)] == ["a", "b"]
    assert path.read_text().endswith('"half')  # reading alone changes nothing
    read_predictions(path, repair=True)
    assert path.read_text() == _line("a") + _line("b")
    with PredictionWriter(path) as writer:
        writer.append(_line("c"))
    assert [line.sample_id for line in read_predictions(path)] == ["a", "b", "c"]


def test_damage_before_the_last_line_is_an_error(tmp_path, _line):
    path = tmp_path / "qasper.jsonl"
    path.write_text(_line("a") + "garbage\n" + _line("b"), encoding="utf-8")
    with pytest.raises(PredictionError, match=r"qasper.jsonl line 2: not valid JSON"):
        read_predictions(path, repair=True)
    path.write_text('{"pred": "x"}\n', encoding="utf-8")
    with pytest.raises(PredictionError, match=r"line 1: a prediction line needs the keys \['pred', '_id'\]"):
        read_predictions(path)
    path.write_text('{"pred": "x", "_id": "a"}\n', encoding="utf-8")  # another benchmark's line
    with pytest.raises(PredictionError, match=r"line 1: a prediction line needs the keys \['pred', 'answers'"):
        read_predictions(path, KEYS)


def test_line_separators_inside_predictions_survive(tmp_path, _line):
    path = tmp_path / "vcsum.jsonl"
    path.write_text(_line("a", "one\u2028two\u0085three") + _line("b"), encoding="utf-8")
    lines = read_predictions(path)
    assert [line.record["pred"] for line in lines] == ["one\u2028two\u0085three", "p"]


def test_merge_orders_by_data_and_copies_bytes(tmp_path, _line):
    rank0, rank1, target = tmp_path / "r0.jsonl", tmp_path / "r1.jsonl", tmp_path / "final.jsonl"
    rank0.write_text(_line("a") + _line("c"), encoding="utf-8")
    rank1.write_text(_line("d") + _line("b"), encoding="utf-8")
    merge(target, [read_predictions(rank0), read_predictions(rank1)], ["a", "b", "c", "d"])
    assert target.read_text() == _line("a") + _line("b") + _line("c") + _line("d")
    with pytest.raises(PredictionError, match="1 sample\\(s\\) have no prediction, e.g. e"):
        merge(target, [read_predictions(rank0)], ["a", "e"])


def test_shard_from_env_and_selection():
    assert Shard.from_env({}) == Shard(0, 1, 0)
    shard = Shard.from_env({"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "0"})
    assert (shard.rank, shard.world_size, shard.local_rank, shard.is_main) == (1, 3, 0, False)
    assert shard.select(list(range(8))) == [1, 4, 7]
    with pytest.raises(ValueError, match="RANK < WORLD_SIZE"):
        Shard.from_env({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="WORLD_SIZE must be an integer"):
        Shard.from_env({"WORLD_SIZE": "two"})


def test_waiting_gives_up_without_progress_only():
    counts = iter([3, 2, 1, 0])
    wait_for_samples(lambda: next(counts), "x", timeout=0.05, poll_interval=0.01)
    with pytest.raises(TimeoutError, match="2 sample\\(s\\) still missing"):
        wait_for_samples(lambda: 2, "full/qasper", timeout=0.05, poll_interval=0.01)
