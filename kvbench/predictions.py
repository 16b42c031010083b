"""Prediction files: one JSON line per sample, durable as soon as it is written, safe to resume and to merge.

A run can die at any instant (Ctrl-C, kill -9, a node going away). Each line is therefore written with one
``write`` and made durable with ``fsync`` before the next sample starts, so a crash loses at most the sample in
flight; the only damage a crash can leave is a last line without its newline, which the next run removes before
appending. Anything else that does not parse is reported, never skipped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

__all__ = ["PredictionError", "PredictionLine", "PredictionWriter", "read_predictions", "merge"]

REQUIRED_KEYS = ("pred", "_id")  # every benchmark's lines have these; a benchmark names its other keys


class PredictionError(ValueError):
    """A prediction file that was not written by this runner or was damaged beyond a torn last line."""


@dataclasses.dataclass(frozen=True)
class PredictionLine:
    record: dict[str, Any]
    text: str  # the exact line, newline included, so that merging copies bytes instead of re-serialising

    @property
    def sample_id(self) -> str:
        return self.record["_id"]


def read_predictions(
    path: Path, required: Sequence[str] = REQUIRED_KEYS, *, repair: bool = False
) -> list[PredictionLine]:
    """The complete lines of a prediction file (none if it does not exist).

    A last line without a newline is a write cut short by a crash: it is ignored, and with ``repair`` (only for
    the file this process is about to append to) cut off the file so that the next line starts cleanly. A line
    without one of the ``required`` keys was not written by this runner for this benchmark: it raises.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:  # not written yet, or a merged shard file removed while this rank looked
        return []
    complete = data.rfind(b"\n") + 1
    if repair and complete < len(data):
        with path.open("r+b") as handle:
            handle.truncate(complete)
            handle.flush()
            os.fsync(handle.fileno())
    lines = []
    # Split on "\n" only: ensure_ascii=False leaves U+2028 and friends unescaped, and str.splitlines splits there.
    for number, body in enumerate(data[:complete].decode("utf-8").split("\n")[:-1], start=1):
        raw = body + "\n"
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as error:
            raise PredictionError(f"{path} line {number}: not valid JSON ({error.msg})") from None
        if not isinstance(record, dict) or any(key not in record for key in required):
            raise PredictionError(f"{path} line {number}: a prediction line needs the keys {list(required)}")
        lines.append(PredictionLine(record, raw))
    return lines


class PredictionWriter:
    """Appends lines to one file, each flushed and fsynced before ``append`` returns.

    The file (and its folder) is created by the first line: a rank with nothing left to predict, starting after
    rank 0 merged and removed the shard files, must not leave an empty one behind.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._handle: TextIO | None = None

    def append(self, line: str) -> None:
        if self._handle is None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._handle = self._path.open("a", encoding="utf-8")
        self._handle.write(line)
        self._handle.flush()
        os.fsync(self._handle.fileno())

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()

    def __enter__(self) -> "PredictionWriter":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, staging = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise


def merge(target: Path, sources: Sequence[Iterable[PredictionLine]], order: Sequence[str]) -> None:
    """Writes ``target`` with one line per id of ``order``, in that order, taken from the first source holding it.

    Sharded and single-process runs thus end with byte-identical files. The file is replaced atomically and
    only when its content changes. Raises when an id has no line in any source.
    """
    by_id: dict[str, str] = {}
    for source in sources:
        for line in source:
            by_id.setdefault(line.sample_id, line.text)
    missing = [sample_id for sample_id in order if sample_id not in by_id]
    if missing:
        raise PredictionError(f"cannot write {target}: {len(missing)} sample(s) have no prediction, e.g. {missing[0]}")
    text = "".join(by_id[sample_id] for sample_id in order)
    if not target.exists() or target.read_text(encoding="utf-8") != text:
        _write_atomically(target, text)
