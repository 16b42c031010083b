"""Where an experiment's files live under its output folder.

Each setting has a folder with its ``pipeline.json``, its prediction files where the benchmark puts them (LongBench:
the official ``pred/<task>.jsonl`` and ``pred_e/<task>.jsonl``, so the official ``eval.py`` can be pointed at
them) and, during a sharded run, one file per rank and task under ``shards/``. The reports sit at the top, and
while a run predicts, its lock file (``sharding.RunLock``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .benchmark import Benchmark

__all__ = ["OutputLayout"]


@dataclasses.dataclass(frozen=True)
class OutputLayout:
    root: Path
    benchmark: Benchmark

    def setting_dir(self, setting: str) -> Path:
        return self.root / setting

    def pipeline_file(self, setting: str) -> Path:
        return self.setting_dir(setting) / "pipeline.json"

    def prediction_file(self, setting: str, task: str) -> Path:
        return self.setting_dir(setting) / self.benchmark.prediction_path(task)

    def shard_dir(self, setting: str) -> Path:
        return self.setting_dir(setting) / "shards"

    def shard_file(self, setting: str, task: str, rank: int) -> Path:
        return self.shard_dir(setting) / f"{task}.rank{rank}.jsonl"

    def shard_files(self, setting: str, task: str) -> list[Path]:
        """Every rank's file for the task, whatever world size wrote it, in a fixed order."""
        return sorted(self.shard_dir(setting).glob(f"{task}.rank*.jsonl"))

    def lock_file(self) -> Path:
        return self.root / "run.lock"

    def report_file(self, suffix: str) -> Path:
        return self.root / f"scores{suffix}"
