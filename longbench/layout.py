"""Where an experiment's files live under its output folder.

Inside each setting's folder the prediction files follow the official layout (``pred/<task>.jsonl`` and, for
LongBench-E, ``pred_e/<task>.jsonl`` without the ``_e``), so the official ``eval.py`` can be pointed at them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .tasks import TASKS

__all__ = ["OutputLayout"]


@dataclasses.dataclass(frozen=True)
class OutputLayout:
    root: Path

    def setting_dir(self, setting: str) -> Path:
        return self.root / setting

    def pipeline_file(self, setting: str) -> Path:
        return self.setting_dir(setting) / "pipeline.json"

    def prediction_dir(self, setting: str, longbench_e: bool) -> Path:
        return self.setting_dir(setting) / ("pred_e" if longbench_e else "pred")

    def prediction_file(self, setting: str, task: str) -> Path:
        spec = TASKS[task]
        return self.prediction_dir(setting, spec.is_longbench_e) / f"{spec.base}.jsonl"

    def result_file(self, setting: str, longbench_e: bool) -> Path:
        """The official eval.py output: task → score (or → {bucket: score} for LongBench-E)."""
        return self.prediction_dir(setting, longbench_e) / "result.json"

    def shard_dir(self, setting: str) -> Path:
        return self.setting_dir(setting) / "shards"

    def shard_file(self, setting: str, task: str, rank: int) -> Path:
        return self.shard_dir(setting) / f"{task}.rank{rank}.jsonl"

    def shard_files(self, setting: str, task: str) -> list[Path]:
        """Every rank's file for the task, whatever world size wrote it, in a fixed order."""
        return sorted(self.shard_dir(setting).glob(f"{task}.rank*.jsonl"))

    def report_file(self, suffix: str) -> Path:
        return self.root / f"scores{suffix}"
