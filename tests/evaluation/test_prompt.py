"""pred.py's prompt and generation rules: middle truncation, chat template, special tokens, samsum, decoding."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from kvbench.experiment import load_experiment
from kvbench.predict import generate_prediction
from kvbench.settings import CompressionSetting
from longbench.data import DataSource, load_task
from longbench.prompt import build_prompt, encode_prompt
from longbench.tasks import TASKS

BIG = 10**6


def _record(sample_data, task, index=0):
    return load_task(DataSource("folder", str(sample_data)), task)[index]


def test_short_prompt_is_the_template_filled_in(sample_data, tiny_tokenizer):
    record = _record(sample_data, "trec")
    prompt, templated = build_prompt(TASKS["trec"], record, tiny_tokenizer, BIG, chat_template=True)
    assert prompt == TASKS["trec"].prompt.format(**record) and templated is False  # trec is a chat exception


def test_middle_truncation_keeps_head_and_tail(sample_data, tiny_tokenizer):
    task, record = TASKS["narrativeqa"], _record(sample_data, "narrativeqa")
    raw = task.prompt.format(**record)
    ids = tiny_tokenizer(raw).input_ids
    assert ids[0] == tiny_tokenizer.bos_token_id and len(ids) > 301
    prompt, _ = build_prompt(task, record, tiny_tokenizer, 301, chat_template=False)
    half = 150  # int(301 / 2)
    assert prompt == tiny_tokenizer.decode(ids[:half], skip_special_tokens=True) + tiny_tokenizer.decode(
        ids[-half:], skip_special_tokens=True)
    assert prompt.startswith("You are given a story") and prompt.endswith(f"Question: {record['input']}\n\nAnswer:")
    assert abs(len(tiny_tokenizer(prompt).input_ids) - 301) <= 3


def test_bos_counts_towards_the_cap(sample_data, tiny_tokenizer):
    task, record = TASKS["qasper"], _record(sample_data, "qasper")
    raw = task.prompt.format(**record)
    length = len(tiny_tokenizer(raw).input_ids)  # BOS included
    assert build_prompt(task, record, tiny_tokenizer, length, False)[0] == raw
    assert build_prompt(task, record, tiny_tokenizer, length - 1, False)[0] != raw


def test_truncation_happens_before_the_chat_template(sample_data, tiny_tokenizer):
    task, record = TASKS["hotpotqa"], _record(sample_data, "hotpotqa")
    truncated, _ = build_prompt(task, record, tiny_tokenizer, 64, chat_template=False)
    templated, used = build_prompt(task, record, tiny_tokenizer, 64, chat_template=True)
    assert used and templated == f"<s><|user|>\n{truncated}</s>\n<|assistant|>\n"


@pytest.mark.parametrize("task", ["qasper", "trec", "lcc", "multifieldqa_zh"])
def test_exactly_one_bos(sample_data, tiny_tokenizer, task):
    """A template that writes BOS is tokenised without special tokens; raw prompts get the tokenizer's BOS."""
    ids = encode_prompt(TASKS[task], _record(sample_data, task), tiny_tokenizer, BIG, chat_template=True)["input_ids"]
    assert ids.shape[0] == 1 and ids[0, 0].item() == tiny_tokenizer.bos_token_id
    assert (ids == tiny_tokenizer.bos_token_id).sum().item() == 1


class RecordingModel:
    """Stands in for a causal LM: records generate()'s options and appends fixed ids to the prompt."""

    def __init__(self, new_ids):
        self.new_ids, self.options = torch.tensor([new_ids]), None
        self.embedding = torch.nn.Embedding(4, 2)

    def get_input_embeddings(self):
        return self.embedding

    def generate(self, input_ids, attention_mask, return_dict_in_generate, **options):
        assert return_dict_in_generate  # the runner reads the cache's bytes from the output
        self.options = options
        return SimpleNamespace(sequences=torch.cat([input_ids, self.new_ids], dim=-1), cache=DynamicCache())


@pytest.fixture
def experiment(tmp_path, make_config):
    return load_experiment(make_config(tmp_path, max_new_tokens=None))


FULL = CompressionSetting("full", "none", None)


def test_greedy_official_lengths_and_new_tokens_only(sample_data, tiny_tokenizer, experiment):
    answer = tiny_tokenizer.encode(" Elin Varga", add_special_tokens=False)
    model = RecordingModel(answer + [tiny_tokenizer.eos_token_id])
    line = generate_prediction(model, tiny_tokenizer, experiment, FULL, "narrativeqa",
                               _record(sample_data, "narrativeqa"))
    # decoded without the prompt and without special tokens, not stripped
    assert json.loads(line)["pred"] == " Elin Varga"
    assert model.options == {"max_new_tokens": 128, "num_beams": 1, "do_sample": False, "temperature": 1.0}


def test_samsum_stops_at_a_newline(sample_data, tiny_tokenizer, experiment):
    model = RecordingModel([5])
    record = _record(sample_data, "samsum")
    generate_prediction(model, tiny_tokenizer, experiment, FULL, "samsum_e", record)
    prompt_length = len(tiny_tokenizer(TASKS["samsum"].prompt.format(**record)).input_ids)
    newline = tiny_tokenizer.encode("\n", add_special_tokens=False)[-1]
    assert model.options["eos_token_id"] == [tiny_tokenizer.eos_token_id, newline]
    assert model.options["min_length"] == prompt_length + 1 and model.options["max_new_tokens"] == 128


def test_min_one_new_token_option_and_length_override(sample_data, tiny_tokenizer, experiment):
    model = RecordingModel([5])
    changed = dataclasses.replace(experiment, max_new_tokens=3,
                                  options=dataclasses.replace(experiment.options, min_one_new_token=True))
    generate_prediction(model, tiny_tokenizer, changed, FULL, "lcc", _record(sample_data, "lcc"))
    assert "min_length" in model.options and "eos_token_id" not in model.options
    assert model.options["max_new_tokens"] == 3
