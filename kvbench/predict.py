"""Generating predictions: greedy decoding under a KV-cache compressor, one durable line per sample, resumable.

Each sample is generated on its own (batch size 1, greedy), so a sample's prediction does not depend on which
other samples ran before it, in this process or another: that is what makes a resumed or sharded run produce
byte-identical files to an uninterrupted single-process one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from .experiment import ConfigError, Experiment, pipeline_record
from .generation import generate
from .layout import OutputLayout
from .modeling import computed_dtype, load_model
from .predictions import PredictionWriter, merge, read_predictions
from .settings import CompressionSetting
from .sharding import RunLock, Shard, wait_for_samples

__all__ = ["generate_prediction", "predict_task", "predict_experiment"]

logger = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    """LongBench pred.py's seeding. Greedy decoding draws no random numbers; this only keeps any other code path
    repeatable."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def generate_prediction(
    model: Any,
    tokenizer: Any,
    experiment: Experiment,
    setting: CompressionSetting,
    task: str,
    record: Mapping[str, Any],
) -> str:
    """One sample's prediction line (JSON text with its newline): the benchmark's prompt, greedy generation
    under the setting's compressor, the decoded new tokens, the cache's real KV bytes."""
    benchmark = experiment.benchmark
    prompt = benchmark.prompt(experiment.options, task, record, tokenizer, experiment.model.chat_template)
    if experiment.max_new_tokens is not None:
        generation = {**prompt.generation, "max_new_tokens": experiment.max_new_tokens}
        prompt = dataclasses.replace(prompt, generation=generation)
    generated = generate(model, tokenizer, setting, prompt)
    line = benchmark.prediction_line(record, tokenizer.decode(generated.new_ids, skip_special_tokens=True))
    line.update(_id=record["_id"], kv_bytes=generated.kv_bytes, full_kv_bytes=generated.full_kv_bytes)
    return json.dumps(line, ensure_ascii=False) + "\n"


def _done_ids(experiment: Experiment, layout: OutputLayout, setting: str, task: str) -> set[str]:
    """Samples already predicted by any earlier run, single-process or sharded, whatever its world size."""
    files = [layout.prediction_file(setting, task), *layout.shard_files(setting, task)]
    return {line.sample_id for path in files for line in read_predictions(path, experiment.benchmark.line_keys)}


def predict_task(
    model: Any,
    tokenizer: Any,
    experiment: Experiment,
    setting: CompressionSetting,
    task: str,
    records: Sequence[Mapping[str, Any]],
    shard: Shard,
) -> None:
    """Predicts this rank's share of ``records`` that no earlier run finished, one durable line per sample."""
    layout = OutputLayout(experiment.output_dir, experiment.benchmark)
    target = (
        layout.prediction_file(setting.name, task)
        if shard.world_size == 1
        else layout.shard_file(setting.name, task, shard.rank)
    )
    # drop a line torn by a crash before appending after it
    read_predictions(target, experiment.benchmark.line_keys, repair=True)
    done = _done_ids(experiment, layout, setting.name, task)
    mine = shard.select(records)
    todo = [record for record in mine if record["_id"] not in done]
    rank = f" [rank {shard.rank}/{shard.world_size}]" if shard.world_size > 1 else ""
    if len(todo) < len(mine):
        logger.info("%s/%s%s: resuming: %d of %d samples already predicted, %d left", setting.name, task, rank,
                    len(mine) - len(todo), len(mine), len(todo))
    with PredictionWriter(target) as writer, tqdm(
        total=len(mine), initial=len(mine) - len(todo), desc=f"{setting.name}/{task}{rank}", unit="sample"
    ) as progress:
        for record in todo:
            writer.append(generate_prediction(model, tokenizer, experiment, setting, task, record))
            progress.update()


def _finalise_task(experiment: Experiment, setting: str, task: str, order: Sequence[str]) -> None:
    """Rank 0: waits until every sample has a line somewhere, then writes the task's file in data order and
    removes the merged shard files."""
    layout = OutputLayout(experiment.output_dir, experiment.benchmark)
    keys = experiment.benchmark.line_keys
    final = layout.prediction_file(setting, task)
    wanted = set(order)

    def missing() -> int:
        return len(wanted - _done_ids(experiment, layout, setting, task))

    wait_for_samples(missing, f"{setting}/{task}", experiment.shard_timeout)
    shards = layout.shard_files(setting, task)
    merge(final, [read_predictions(final, keys), *(read_predictions(path, keys) for path in shards)], order)
    for path in shards:
        path.unlink()


def _check_pipeline(experiment: Experiment, setting: CompressionSetting, dtype: str, model: Any) -> None:
    """Records the pipeline on first use; refuses to resume predictions that a different pipeline started (a key
    an earlier version did not record is not compared)."""
    path = OutputLayout(experiment.output_dir, experiment.benchmark).pipeline_file(setting.name)
    record = pipeline_record(experiment, setting, dtype, setting.scorer_weights(model))
    if path.exists():
        previous = json.loads(path.read_text(encoding="utf-8"))["generation"]
        changed = sorted(key for key, value in record["generation"].items()
                         if key in previous and previous[key] != value)
        if changed:
            raise ConfigError(
                f"{path}: the predictions in {path.parent} were made with different {changed}; resuming would mix "
                "two pipelines. Use another output_dir or setting name, or delete that folder"
            )
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    staging.replace(path)  # ranks may race here; they write the same content


def predict_experiment(experiment: Experiment, settings: Sequence[CompressionSetting], shard: Shard,
                       tasks: Sequence[str]) -> None:
    """Predicts every (setting, task) pair on this rank (``Experiment.select_tasks`` picks the tasks); rank 0 then
    merges all ranks' files. Refuses (``FolderInUseError``) an output folder that another run is using, before
    anything is read or written there."""
    with RunLock(OutputLayout(experiment.output_dir, experiment.benchmark).lock_file(), shard):
        _predict_experiment(experiment, settings, shard, tasks)


def _predict_experiment(experiment: Experiment, settings: Sequence[CompressionSetting], shard: Shard,
                        tasks: Sequence[str]) -> None:
    benchmark = experiment.benchmark
    records = {}  # first: a data source that cannot be read fails before the model's modules are imported
    for task in tqdm(tasks, desc="records", unit="task"):  # RULER generates a task's on first use (~15-40 s)
        started = time.monotonic()
        try:
            records[task] = benchmark.load_records(experiment.options, task, experiment.output_dir)[: experiment.limit]
        except benchmark.unavailable as error:
            logger.warning("%s: left out, its records cannot be made (%s)", task, error)
            continue
        logger.info("%s: %d records ready in %.1f s", task, len(records[task]), time.monotonic() - started)
    dtype = computed_dtype(experiment.model, shard)
    seed_everything(experiment.seed)
    model, tokenizer = load_model(experiment.model, shard)
    if experiment.model.chat_template and tokenizer.chat_template is None:
        raise ConfigError(
            f"model.chat_template: true, but the tokenizer of {experiment.model.path} has no chat template; set it "
            "to false for the raw-prompt pipeline (as SnapKV, AdaKV and PyramidKV ran Mistral)"
        )
    for setting in settings:  # the model first: a learned scorer's weights are found by its fingerprint
        _check_pipeline(experiment, setting, dtype, model)
    for setting in settings:
        done = sum(len(_done_ids(experiment, OutputLayout(experiment.output_dir, benchmark), setting.name, task)
                       & {record["_id"] for record in records[task]}) for task in records)
        total = sum(len(task_records) for task_records in records.values())
        logger.info("%s: %d of %d samples predicted, %d left", setting.name, done, total, total - done)
        for task in records:
            predict_task(model, tokenizer, experiment, setting, task, records[task], shard)
    if shard.is_main:
        for setting in settings:
            for task in records:
                _finalise_task(experiment, setting.name, task, [record["_id"] for record in records[task]])
            # Every rank is done with the setting's tasks; files left are other tasks' (another `--tasks`).
            shard_dir = OutputLayout(experiment.output_dir, benchmark).shard_dir(setting.name)
            if shard_dir.is_dir() and not any(shard_dir.iterdir()):
                shard_dir.rmdir()
