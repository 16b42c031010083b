"""Loading and validating LongBench records: folder, official zip layout, Hub mirrors (offline, with a fake)."""

from __future__ import annotations

import json
import zipfile

import pytest

from longbench.data import DataError, DataSource, load_task
from longbench.tasks import TASKS


def _lines(sample_data, task):
    return (sample_data / f"{task}.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)


@pytest.mark.parametrize("task", list(TASKS))
def test_every_sample_file_is_valid(sample_data, task):
    records = load_task(DataSource("folder", str(sample_data)), task)
    assert len(records) == 2 and all(set(record) >= {"input", "context", "_id"} for record in records)


def test_zip_in_the_official_layout(tmp_path, sample_data):
    archive = tmp_path / "data.zip"
    with zipfile.ZipFile(archive, "w") as bundle:
        for path in sample_data.glob("*.jsonl"):
            bundle.write(path, f"data/{path.name}")
    from_zip = load_task(DataSource("zip", str(archive)), "lsht")
    assert from_zip == load_task(DataSource("folder", str(sample_data)), "lsht")
    with zipfile.ZipFile(tmp_path / "flat.zip", "w") as bundle:
        bundle.write(sample_data / "lsht.jsonl", "lsht.jsonl")
    with pytest.raises(DataError, match="has no data/lsht.jsonl"):
        load_task(DataSource("zip", str(tmp_path / "flat.zip")), "lsht")


def test_missing_file_points_at_the_unzipped_data_folder(tmp_path):
    (tmp_path / "data").mkdir()
    with pytest.raises(DataError, match="no file qasper.jsonl .* point data.folder at it"):
        load_task(DataSource("folder", str(tmp_path)), "qasper")


def _break(record: dict, changes: dict) -> str:
    record = {**record, **changes}
    return json.dumps({key: value for key, value in record.items() if value is not _DROP}, ensure_ascii=False) + "\n"


_DROP = object()


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"input": "x", \n', r"line 2: not valid JSON"),
        ("\n", r"line 2: not valid JSON"),
        ("[1, 2]\n", r"line 2: a record must be a JSON object"),
        (dict(context=_DROP), r"line 2: missing field\(s\) \['context'\]"),
        (dict(length="300"), r"line 2: field 'length' must be an integer"),
        (dict(length=True), r"line 2: field 'length' must be an integer"),
        (dict(answers=[]), r"line 2: field 'answers' must be a non-empty list of strings"),
        (dict(answers="City"), r"line 2: field 'answers' must be a non-empty list of strings"),
        (dict(all_classes="City"), r"line 2: field 'all_classes' must be null or a list of strings"),
        (dict(all_classes=None), r"line 2: field 'all_classes' must list the labels"),
        (dict(dataset="lsht"), r"line 2: field 'dataset' is 'lsht', expected 'trec'"),
        (dict(_id=""), r"line 2: field '_id' must be a non-empty string"),
    ],
)
def test_a_bad_record_names_file_and_line(tmp_path, sample_data, line, message):
    good = _lines(sample_data, "trec")
    first = json.loads(good[0])
    bad = _break(first, {"_id": "another-id", **line}) if isinstance(line, dict) else line
    (tmp_path / "trec.jsonl").write_text(good[0] + bad + good[1], encoding="utf-8")
    with pytest.raises(DataError, match=rf"{tmp_path / 'trec.jsonl'} {message}"):
        load_task(DataSource("folder", str(tmp_path)), "trec")


def test_a_repeated_id_is_an_error(tmp_path, sample_data):
    good = _lines(sample_data, "qasper")
    (tmp_path / "qasper.jsonl").write_text(good[0] + good[1] + good[0], encoding="utf-8")
    with pytest.raises(DataError, match=r"line 3: _id '[0-9a-f]+' already appeared at .*qasper.jsonl line 1$"):
        load_task(DataSource("folder", str(tmp_path)), "qasper")


def test_e_files_may_name_the_base_or_the_e_task(tmp_path, sample_data):
    for dataset in ("qasper", "qasper_e"):
        records = [json.loads(line) for line in _lines(sample_data, "qasper_e")]
        (tmp_path / "qasper_e.jsonl").write_text(
            "".join(json.dumps({**record, "dataset": dataset}) + "\n" for record in records), encoding="utf-8"
        )
        assert len(load_task(DataSource("folder", str(tmp_path)), "qasper_e")) == 2


@pytest.mark.parametrize("dataset_id", ["THUDM/LongBench", "zai-org/LongBench"])
def test_the_official_hub_script_is_refused_with_the_way_out(dataset_id):
    with pytest.raises(DataError) as error:
        load_task(DataSource("hub", dataset_id), "qasper")
    assert "loading script" in str(error.value) and "datasets>=4" in str(error.value)
    assert "Xnhyacinth/LongBench" in str(error.value) and "data.zip" in str(error.value)


@pytest.fixture
def hub_answers(monkeypatch):
    """A Hub that has the dataset (no request is made; the rows come from a faked ``datasets.load_dataset``)."""
    monkeypatch.setattr("longbench.data.hub_problem", lambda repo_id, repo_type: None)


def _kvpress_row(record: dict, task: str, context_keeps: int, answer_prefix_chars: int) -> dict:
    """The kvpress converter's layout: the official prompt cut into context / question / answer_prefix."""
    template = TASKS[task].prompt
    head, rest = template.split("{context}")
    middle, tail = rest.split("{input}") if "{input}" in rest else (rest, "")
    stored_input = record["input"] if "{input}" in rest else ""
    split_tail = len(tail) - answer_prefix_chars
    row = {key: value for key, value in record.items() if key != "input"}
    row["context"] = head + record["context"] + middle[:context_keeps]
    row["question"] = middle[context_keeps:] + stored_input + tail[:split_tail]
    row["answer_prefix"] = tail[split_tail:]
    row.update(task=task, max_new_tokens=TASKS[task].max_new_tokens + 20)
    return row


@pytest.mark.parametrize(
    "task, context_keeps, answer_prefix_chars",
    [
        # narrativeqa as kvpress cuts it: "Question: " opens the question, "Answer:" is the prefix.
        ("narrativeqa", len(TASKS["narrativeqa"].prompt.split("{context}")[1].split("Question: ")[0]), 7),
        ("trec", 1, 0),  # kvpress moves "Type:" from the input into answer_prefix; the official tail is empty
        ("lcc", 0, len("Next line of code:\n")),
        ("gov_report", 2, len("Summary:")),
        ("passage_retrieval_zh", 5, 4),
        ("repobench-p", 0, 3),
    ],
)
def test_kvpress_layout_mirror_recovers_the_official_record(
    monkeypatch, hub_answers, sample_data, task, context_keeps, answer_prefix_chars
):
    import datasets

    from longbench.prompt import build_prompt

    originals = load_task(DataSource("folder", str(sample_data)), task)
    rows = [_kvpress_row(record, task, context_keeps, answer_prefix_chars) for record in originals]
    monkeypatch.setattr(datasets, "load_dataset", lambda dataset_id, name, split: rows)
    recovered = load_task(DataSource("hub", "someone/LongBench-parquet"), task)

    class Whitespace:  # build_prompt only needs ids whose count stays under the cap
        def __call__(self, text, truncation=False):
            return type("Encoding", (), {"input_ids": text.split()})()

    for original, record in zip(originals, recovered):
        assert record["_id"] == original["_id"] and "question" not in record
        assert build_prompt(TASKS[task], record, Whitespace(), 10**9, False) == build_prompt(
            TASKS[task], original, Whitespace(), 10**9, False
        )


def test_hub_rows_are_validated_by_row_number(monkeypatch, hub_answers, sample_data):
    import datasets

    rows = load_task(DataSource("folder", str(sample_data)), "qasper")
    rows = [rows[0], {**rows[1], "length": None}]
    monkeypatch.setattr(datasets, "load_dataset", lambda dataset_id, name, split: rows)
    with pytest.raises(DataError, match=r"someone/mirror/qasper row 2: field 'length' must be an integer"):
        load_task(DataSource("hub", "someone/mirror"), "qasper")

