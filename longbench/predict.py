"""Generating predictions: greedy decoding per the official pred.py, under a KV-cache compressor, resumable.

Each sample is generated on its own (batch size 1, greedy), so a sample's prediction does not depend on which
other samples ran before it, in this process or another: that is what makes a resumed or sharded run produce
byte-identical files to an uninterrupted single-process one.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from .data import load_task
from .experiment import CompressionSetting, ConfigError, Experiment, pipeline_record
from .layout import OutputLayout
from .modeling import input_device, load_model
from .predictions import PredictionWriter, merge, prediction_line, read_predictions
from .prompt import encode_prompt
from .sharding import Shard, wait_for_samples
from .tasks import TASKS, Task

__all__ = ["generate_prediction", "predict_task", "predict_experiment"]


def seed_everything(seed: int) -> None:
    """pred.py's seeding. Greedy decoding draws no random numbers; this only keeps any other code path repeatable."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def generate_prediction(
    model: Any,
    tokenizer: Any,
    task: Task,
    record: Mapping[str, Any],
    experiment: Experiment,
    setting: CompressionSetting,
) -> str:
    """One sample: prompt, greedy generation (under the setting's compressor), decoded new tokens only."""
    inputs = encode_prompt(task, record, tokenizer, experiment.max_length, experiment.model.chat_template)
    inputs = inputs.to(input_device(model))
    context_length = inputs["input_ids"].shape[-1]
    options: dict[str, Any] = {
        "max_new_tokens": experiment.max_new_tokens or task.max_new_tokens,
        "num_beams": 1,
        "do_sample": False,
        "temperature": 1.0,
    }
    if task.base == "samsum":  # upstream's guard against endless "\nDialogue": stop at the first newline
        newline = tokenizer.encode("\n", add_special_tokens=False)[-1]
        options.update(min_length=context_length + 1, eos_token_id=[tokenizer.eos_token_id, newline])
    elif experiment.min_one_new_token:  # the SnapKV and KVCache-Factory pipelines do this for every task
        options["min_length"] = context_length + 1
    if setting.parameters is None:
        compression = contextlib.nullcontext()
    else:
        from kvcompress import KVCacheCompressor

        compression = KVCacheCompressor(eviction_parameters=setting.parameters)(model)
    with compression:
        output = model.generate(**inputs, **options)[0]
    return tokenizer.decode(output[context_length:], skip_special_tokens=True)


def _done_ids(layout: OutputLayout, setting: str, task: str) -> set[str]:
    """Samples already predicted by any earlier run, single-process or sharded, whatever its world size."""
    files = [layout.prediction_file(setting, task), *layout.shard_files(setting, task)]
    return {line.sample_id for path in files for line in read_predictions(path)}


def predict_task(
    model: Any,
    tokenizer: Any,
    experiment: Experiment,
    setting: CompressionSetting,
    task_name: str,
    records: Sequence[Mapping[str, Any]],
    shard: Shard,
) -> None:
    """Predicts this rank's share of ``records`` that no earlier run finished, one durable line per sample."""
    layout = OutputLayout(experiment.output_dir)
    task = TASKS[task_name]
    target = (
        layout.prediction_file(setting.name, task_name)
        if shard.world_size == 1
        else layout.shard_file(setting.name, task_name, shard.rank)
    )
    read_predictions(target, repair=True)  # drop a line torn by a crash before appending after it
    done = _done_ids(layout, setting.name, task_name)
    mine = shard.select(records)
    todo = [record for record in mine if record["_id"] not in done]
    rank = f" [rank {shard.rank}/{shard.world_size}]" if shard.world_size > 1 else ""
    with PredictionWriter(target) as writer, tqdm(
        total=len(mine), initial=len(mine) - len(todo), desc=f"{setting.name}/{task_name}{rank}", unit="sample"
    ) as progress:
        for record in todo:
            prediction = generate_prediction(model, tokenizer, task, record, experiment, setting)
            writer.append(prediction_line(record, prediction))
            progress.update()


def _finalise_task(experiment: Experiment, setting: str, task_name: str, order: Sequence[str]) -> None:
    """Rank 0: waits until every sample has a line somewhere, then writes the task's file in data order."""
    layout = OutputLayout(experiment.output_dir)
    final = layout.prediction_file(setting, task_name)
    wanted = set(order)

    def missing() -> int:
        return len(wanted - _done_ids(layout, setting, task_name))

    wait_for_samples(missing, f"{setting}/{task_name}", experiment.shard_timeout)
    shards = layout.shard_files(setting, task_name)
    merge(final, [read_predictions(final), *(read_predictions(path) for path in shards)], order)
    for path in shards:
        path.unlink()


def _check_pipeline(experiment: Experiment, setting: CompressionSetting) -> None:
    """Records the pipeline on first use; refuses to resume predictions that a different pipeline started."""
    path = OutputLayout(experiment.output_dir).pipeline_file(setting.name)
    record = pipeline_record(experiment, setting)
    if path.exists():
        previous = json.loads(path.read_text(encoding="utf-8"))["generation"]
        changed = sorted(key for key in record["generation"] if previous.get(key) != record["generation"][key])
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


def predict_experiment(experiment: Experiment, settings: Sequence[CompressionSetting], shard: Shard) -> None:
    """Predicts every (setting, task) pair on this rank; rank 0 then merges all ranks' files."""
    for setting in settings:
        _check_pipeline(experiment, setting)
    records = {task: load_task(experiment.data, task)[: experiment.limit] for task in experiment.tasks}
    seed_everything(experiment.seed)
    model, tokenizer = load_model(experiment.model, shard)
    if experiment.model.chat_template and tokenizer.chat_template is None:
        raise ConfigError(
            f"model.chat_template: true, but the tokenizer of {experiment.model.path} has no chat template; set it "
            "to false for the raw-prompt pipeline (as SnapKV, AdaKV and PyramidKV ran Mistral)"
        )
    for setting in settings:
        for task in experiment.tasks:
            predict_task(model, tokenizer, experiment, setting, task, records[task], shard)
    if shard.is_main:
        for setting in settings:
            for task in experiment.tasks:
                _finalise_task(experiment, setting.name, task, [record["_id"] for record in records[task]])
