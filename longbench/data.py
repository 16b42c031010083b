"""Loading LongBench records from a local folder, the official ``data.zip``, or a parquet mirror on the Hub.

Every record is validated field by field: a record with a missing or mistyped field would otherwise surface as a
wrong score or a crash hours into a run, so a bad line stops the load with the file and line number.
"""

from __future__ import annotations

import dataclasses
import io
import json
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from kvbench.config import hub_problem

from .tasks import TASKS, Task

__all__ = ["DataError", "DataSource", "SAMPLE_CONFIG", "SCRIPT_DATASETS", "load_task", "validate_record"]

# Hub ids of the official dataset, which is a loading script (LongBench.py) rather than data files.
SCRIPT_DATASETS = frozenset({"THUDM/LongBench", "zai-org/LongBench"})
SAMPLE_CONFIG = "configs/longbench/sample-smollm2.yaml"  # the shipped made-up records (configs/data/longbench_sample)
_ZIP_DOWNLOAD = "huggingface_hub.hf_hub_download('THUDM/LongBench', 'data.zip', repo_type='dataset')"
_SCRIPT_HINT = (
    "{id} is a dataset loading script (LongBench.py downloading data.zip); datasets>=4 refuses loading scripts "
    "(installed: datasets {version}). Use a parquet mirror instead (data: {{hub: Xnhyacinth/LongBench}}), or download "
    f"the official zip once with {_ZIP_DOWNLOAD} and set data: {{{{zip: /path/to/data.zip}}}}"
)
_NO_HUB_HINT = (
    "data.hub: {id} {problem}. Without the Hub, read the records from disk: data: {{folder: DIR}} (the official "
    f"data.zip unpacked, DIR its data/ folder) or data: {{{{zip: /path/to/data.zip}}}} (downloaded once with "
    f"{_ZIP_DOWNLOAD}); to try the pipeline on the shipped sample records: kvcompress-longbench run {SAMPLE_CONFIG}"
)


_OFFLINE = "is not in the local cache and offline mode is on (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE)"


class DataError(ValueError):
    """A record or file that does not follow the official LongBench schema."""


@dataclasses.dataclass(frozen=True)
class DataSource:
    """Where the records come from: ``folder`` (``<task>.jsonl`` files), ``zip`` (``data/<task>.jsonl`` inside,
    the layout of the official data.zip) or ``hub`` (a dataset id with one configuration per task, test split)."""

    kind: Literal["folder", "zip", "hub"]
    location: str
    # how the config names it (a path relative to the config): what the pipeline record holds, so that a run
    # resumes from another checkout of the same files
    written: str | None = None

    def describe(self) -> str:
        return f"{self.kind}:{self.written or self.location}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


_FIELDS: dict[str, tuple[str, Any]] = {
    "input": ("a string", lambda v: isinstance(v, str)),
    "context": ("a string", lambda v: isinstance(v, str)),
    "answers": ("a non-empty list of strings", lambda v: _is_str_list(v) and len(v) > 0),
    "length": ("an integer", _is_int),
    "dataset": ("a string", lambda v: isinstance(v, str)),
    "language": ("a string", lambda v: isinstance(v, str)),
    "all_classes": ("null or a list of strings", lambda v: v is None or _is_str_list(v)),
    "_id": ("a non-empty string", lambda v: isinstance(v, str) and len(v) > 0),
}


def validate_record(record: Any, task: Task, where: str) -> dict[str, Any]:
    """Checks one record against the official schema; ``where`` (file and line) prefixes every error."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    missing = [name for name in _FIELDS if name not in record]
    if missing:
        raise DataError(f"{where}: missing field(s) {missing}; a LongBench record has {list(_FIELDS)}")
    for name, (expected, check) in _FIELDS.items():
        if not check(record[name]):
            raise DataError(f"{where}: field {name!r} must be {expected}, got {record[name]!r:.80}")
    # LongBench-E files may name either the base task or the _e configuration (unverified on the real files).
    if record["dataset"] not in (task.base, task.name):
        raise DataError(
            f"{where}: field 'dataset' is {record['dataset']!r}, expected {task.base!r} for task {task.name}"
        )
    if task.metric == "classification_score" and not record["all_classes"]:
        raise DataError(f"{where}: field 'all_classes' must list the labels for the classification task {task.name}")
    return record


def _checked(rows: Iterable[tuple[str, Any]], task: Task) -> list[dict[str, Any]]:
    """Validates ``(where, record)`` pairs and rejects a repeated ``_id``, which resuming and merging key on."""
    records: list[dict[str, Any]] = []
    first_seen: dict[str, str] = {}
    for where, record in rows:
        validate_record(record, task, where)
        if record["_id"] in first_seen:
            raise DataError(f"{where}: _id {record['_id']!r} already appeared at {first_seen[record['_id']]}")
        first_seen[record["_id"]] = where
        records.append(record)
    return records


def _parse_jsonl(lines: Iterable[str], source: str) -> Iterator[tuple[str, Any]]:
    for number, line in enumerate(lines, start=1):
        where = f"{source} line {number}"
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None


def _load_folder(folder: Path, task: Task) -> list[dict[str, Any]]:
    path = folder / f"{task.name}.jsonl"
    if not path.is_file():
        hint = " (the official data.zip unpacks into a data/ folder: point data.folder at it)" if (
            folder / "data"
        ).is_dir() else ""
        raise DataError(f"no file {path.name} for task {task.name} in {folder}{hint}")
    with path.open(encoding="utf-8") as handle:
        return _checked(_parse_jsonl(handle, str(path)), task)


def _load_zip(archive: Path, task: Task) -> list[dict[str, Any]]:
    member = f"data/{task.name}.jsonl"
    with zipfile.ZipFile(archive) as bundle:
        if member not in bundle.namelist():
            raise DataError(
                f"{archive} has no {member} (the official data.zip layout); it holds {bundle.namelist()[:8]}"
            )
        with bundle.open(member) as raw:
            return _checked(_parse_jsonl(io.TextIOWrapper(raw, encoding="utf-8"), f"{archive}:{member}"), task)


def _split_template(task: Task) -> tuple[str, str | None, str]:
    """The official template as (before {context}, between {context} and {input} or None, after the last field)."""
    head, rest = task.prompt.split("{context}")
    if "{input}" not in rest:
        return head, None, rest
    middle, tail = rest.split("{input}")
    return head, middle, tail


def _from_prompt_parts(row: Mapping[str, Any], task: Task, where: str) -> dict[str, Any]:
    """Recovers the official ``context`` and ``input`` from a kvpress-style row.

    kvpress's converter (used for Xnhyacinth/LongBench) stores the official prompt in three consecutive pieces:
    ``context`` (template head + context + part of the text between the fields), ``question`` and
    ``answer_prefix``. Their concatenation is the official prompt, so the split that reproduces it exactly is
    searched for; the prompt built from the recovered fields is then identical to the official one by
    construction.
    """
    full = row["context"] + row["question"] + (row.get("answer_prefix") or "")
    head, middle, tail = _split_template(task)
    stored_context = row["context"]
    if not (full.startswith(head) and full.endswith(tail) and stored_context.startswith(head)):
        raise DataError(
            f"{where}: the row's context/question/answer_prefix do not form the official {task.base} prompt"
        )
    body = full[len(head):len(full) - len(tail)]
    fields = {key: value for key, value in row.items() if key != "question"}
    if middle is None:  # templates without {input}: the official input is ""
        return {**fields, "context": body, "input": ""}
    for kept in range(len(middle), -1, -1):  # how much of `middle` the stored context ends with
        if not stored_context.endswith(middle[:kept]):
            continue
        context = stored_context[len(head):len(stored_context) - kept]
        if body[len(context):len(context) + len(middle)] == middle:
            return {**fields, "context": context, "input": body[len(context) + len(middle):]}
    raise DataError(f"{where}: cannot split the row into the official {task.base} context and input")


def hub_source_problem(dataset_id: str) -> str | None:
    """Why the Hub cannot serve ``dataset_id``, with the local sources named, or None: online, asked once without
    retries; offline, whether an earlier run cached it (the Hub's cache or ``datasets``'). Checked before any record
    is read, so that a run reports it beside any other source it cannot load."""
    import datasets
    from huggingface_hub import constants

    if not datasets.config.HF_HUB_OFFLINE:
        return _unreachable_hub(dataset_id)
    namespace, _, name = dataset_id.rpartition("/")
    caches = (Path(constants.HF_HUB_CACHE) / f"datasets--{dataset_id.replace('/', '--')}",
              Path(datasets.config.HF_DATASETS_CACHE) / f"{namespace}___{name}")
    if any(cache.is_dir() for cache in caches):
        return None
    return _NO_HUB_HINT.format(id=dataset_id, problem=_OFFLINE)


def _unreachable_hub(dataset_id: str) -> str | None:
    problem = hub_problem(dataset_id, "dataset")
    if problem is None:
        return None
    return _NO_HUB_HINT.format(id=dataset_id,
                               problem=problem + " (with HF_HUB_OFFLINE=1 a copy that an earlier run cached is read)")


def _load_hub(dataset_id: str, task: Task) -> list[dict[str, Any]]:
    """A task's rows from a Hub dataset. A Hub that cannot serve it stops the run at once, naming the local
    sources, rather than after ``datasets``' 30 s of retries with a ``ConnectionError`` that names none."""
    import datasets

    hint = _SCRIPT_HINT.format(id=dataset_id, version=datasets.__version__)
    if dataset_id in SCRIPT_DATASETS:
        raise DataError(hint)
    problem = None if datasets.config.HF_HUB_OFFLINE else _unreachable_hub(dataset_id)
    if problem is not None:  # offline, datasets reads a copy an earlier run cached, or fails at once
        raise DataError(problem)
    try:
        rows = datasets.load_dataset(dataset_id, task.name, split="test")
    except ConnectionError as error:  # offline and not cached
        raise DataError(_NO_HUB_HINT.format(id=dataset_id, problem=f"{_OFFLINE[:-1]}; {error})")) from None
    except Exception as error:
        if "script" in str(error).lower():
            raise DataError(f"{hint}\n(datasets said: {error})") from error
        raise
    return _checked(_official_rows(rows, task, f"{dataset_id}/{task.name}"), task)


def _official_rows(
    rows: Iterable[Mapping[str, Any]], task: Task, source: str
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Hub rows in the official schema; rows in kvpress's layout are converted back first."""
    for number, row in enumerate(rows, start=1):
        where, row = f"{source} row {number}", dict(row)
        if "input" not in row and "question" in row:
            row = _from_prompt_parts(row, task, where)
        for extra in ("answer_prefix", "task", "max_new_tokens"):  # kvpress columns the official schema lacks
            row.pop(extra, None)
        yield where, row


def load_task(source: DataSource, task_name: str) -> list[dict[str, Any]]:
    """All records of one task, in file order (the order predictions and shards refer to)."""
    task = TASKS[task_name]
    if source.kind == "folder":
        return _load_folder(Path(source.location), task)
    if source.kind == "zip":
        return _load_zip(Path(source.location), task)
    return _load_hub(source.location, task)

