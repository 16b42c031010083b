"""Fixtures for the LongBench runner: a tiny random Llama with a tokenizer trained here, the sample data, configs.

Everything is built offline in seconds. The tokenizer is byte-level (any text, Chinese and code included,
round-trips), adds a BOS like Llama's and has a chat template that writes its own BOS, so the truncation and
chat-template paths of the official pipeline are exercised for real.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[2]
SAMPLE_DATA = REPO / "configs" / "data" / "longbench_sample"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Small enough that the longer sample records are middle-truncated.
TEST_MAX_LENGTH = 384
TEST_MAX_NEW_TOKENS = 6


def _corpus() -> list[str]:
    from longbench.tasks import PROMPTS

    texts = list(PROMPTS.values())
    for path in sorted(SAMPLE_DATA.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            texts += [record["context"], record["input"], *record["answers"]]
    return texts


def _build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator(_corpus(), trainer=trainer)
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _build_model(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A saved tiny model folder, loaded by the runner through the ordinary ``from_pretrained`` path."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    _build_model(len(tiny_tokenizer)).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def make_config(tiny_model_dir) -> Callable[..., Path]:
    """``make_config(folder, **top_level_keys)`` writes an experiment file running the tiny model over the sample
    data (test-sized truncation cap and generation length) and returns its path; a key set to None is removed."""

    def write(folder: Path, **overrides: Any) -> Path:
        config: dict[str, Any] = {
            "model": {"path": str(tiny_model_dir), "dtype": "float32", "chat_template": True},
            "compression": ["none"],
            "tasks": "all",
            "data": {"folder": str(SAMPLE_DATA)},
            "max_length": TEST_MAX_LENGTH,
            "max_new_tokens": TEST_MAX_NEW_TOKENS,
            "output_dir": "out",
        }
        config.update(overrides)
        config = {key: value for key, value in config.items() if value is not None}
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "experiment.yaml"
        path.write_text(yaml.safe_dump(config, allow_unicode=True, sort_keys=False), encoding="utf-8")
        return path

    return write


@pytest.fixture(scope="session")
def official_line() -> Callable[[dict[str, Any], str], str]:
    """``official_line(record, prediction)``: the line the runner writes for a LongBench sample, without KV bytes."""
    from longbench.benchmark import LongBench

    def line(record: dict[str, Any], prediction: str) -> str:
        return json.dumps({**LongBench().prediction_line(record, prediction), "_id": record["_id"]},
                          ensure_ascii=False) + "\n"

    return line


@pytest.fixture(scope="session")
def sample_data() -> Path:
    return SAMPLE_DATA


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return _build_tokenizer()


@pytest.fixture(scope="session")
def runner_env() -> dict[str, str]:
    """Environment for runner subprocesses: one thread (reproducible sums, fair on a shared machine), offline."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(REPO)})
    return env


def predicted_lines(out: Path) -> int:
    """Prediction lines on disk under an output folder: every setting's ``pred*/`` files, every task."""
    return sum(len(path.read_bytes().splitlines()) for path in out.glob("*/pred*/*.jsonl"))


@pytest.fixture
def kill_9_after(runner_env) -> Callable[..., int]:
    """``kill_9_after(module, config, out, lines=3)``: runs ``python -m <module> predict <config>``, kills it with
    SIGKILL once ``lines`` prediction lines are under ``out``, and returns how many lines were there."""

    def run(module: str, config: Path, out: Path, lines: int = 3) -> int:
        log_path = config.parent / "log.txt"
        with log_path.open("w") as log:
            process = subprocess.Popen([sys.executable, "-m", module, "predict", str(config)], env=runner_env,
                                       stdout=log, stderr=log)
            deadline = time.monotonic() + 120
            while predicted_lines(out) < lines and process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert process.poll() is None, log_path.read_text()[-2000:]
            process.send_signal(signal.SIGKILL)
            process.wait()
        return predicted_lines(out)

    return run
