"""The context store: compress once, load on every later request, from a folder or an fsspec URL; entries appear
whole or not at all, even when the writing process is killed (SIGKILL trials) or two processes add one key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvcompress
from kvcompress import context_store
from kvcompress.context_store import ContextStore
from tiny_models import TinyTokenizer, random_tokens, tiny_model

HERE = Path(__file__).parent
CONTEXT, QUESTION = 160, 7


@pytest.fixture
def counted(monkeypatch):
    """How many times the store compressed (calls of ``compress``)."""
    calls = []
    original = context_store.compress

    def compress(*args, **kwargs):
        calls.append(args[1:3])
        return original(*args, **kwargs)

    monkeypatch.setattr(context_store, "compress", compress)
    return calls


def _answer(session):
    with session:
        return session.generate(random_tokens(QUESTION, seed=2), max_new_tokens=8, eos_token_id=[])


@pytest.mark.parametrize("root", ["folder", "memory://kvcompress-test-store"])
def test_a_context_is_compressed_once_then_loaded(root, tmp_path, counted):
    store = ContextStore(str(tmp_path / "store") if root == "folder" else root)
    model, ids = tiny_model("llama"), random_tokens(CONTEXT, seed=1)
    first = store.get_or_compress(model, ids, method="kvzip", budget=0.2, tokenizer=TinyTokenizer())
    second = store.get_or_compress(model, ids, method="kvzip", budget=0.2, tokenizer=TinyTokenizer())
    assert len(counted) == 1
    assert torch.equal(_answer(first), _answer(second))
    [entry] = store.list()
    assert entry.key == store.key_for(model, ids, "kvzip", 0.2) and entry.tokens == CONTEXT
    store.delete(entry.key)
    assert store.list() == []


def test_the_key_follows_model_parameters_and_ids(tmp_path):
    store = ContextStore(str(tmp_path))
    model, ids = tiny_model("llama"), random_tokens(CONTEXT, seed=1)
    key = store.key_for(model, ids, "kvzip", 0.2)
    assert key == store.key_for(model, ids.clone(), "kvzip", "20%")
    others = {store.key_for(model, ids, "snapkv", 0.2), store.key_for(model, ids, "kvzip", 0.3),
              store.key_for(model, random_tokens(CONTEXT, seed=2), "kvzip", 0.2),
              store.key_for(tiny_model("llama", seed=1), ids, "kvzip", 0.2),
              store.key_for(model, ids, "kvzip", 0.2, chunk_size=64),
              store.key_for(model, ids, "kvzip", 0.2, budget_allocation="uniform")}
    assert key not in others and len(others) == 6


class _Tokenizer(TinyTokenizer):
    def decode(self, ids, skip_special_tokens=False) -> str:
        return " ".join(map(str, ids.tolist()))


def test_a_document_as_text_is_asked_after_a_load(tmp_path):
    store = ContextStore(str(tmp_path))
    model = tiny_model("llama")
    session = store.get_or_compress(model, "a document " * 30, method="snapkv", budget=0.5, tokenizer=_Tokenizer())
    again = store.load(model, store.list()[0].key, _Tokenizer())
    answers = []
    for current in (session, again):
        with current:
            answers.append(current.ask("which?", max_new_tokens=6))
    assert answers[0] == answers[1]


def test_the_least_recently_used_entries_leave_beyond_max_bytes(tmp_path):
    model = tiny_model("llama")
    store = ContextStore(str(tmp_path), max_bytes=10**9)
    keys = []
    for seed in (1, 2, 3):
        store.get_or_compress(model, random_tokens(CONTEXT, seed=seed), method="snapkv", budget=0.5)
        keys.append(store.list()[0].key)
    store.load(model, keys[0])  # the oldest becomes the most recently used
    sizes = {entry.key: entry.file_bytes for entry in store.list()}
    store.max_bytes = sum(sizes.values()) - 1 + sizes[keys[1]] - sizes[keys[1]]
    store.get_or_compress(model, random_tokens(CONTEXT, seed=4), method="snapkv", budget=0.5)
    left = {entry.key for entry in store.list()}
    assert keys[1] not in left and keys[0] in left  # the least recently used left first


def test_a_damaged_entry_is_compressed_again(tmp_path, counted):
    store = ContextStore(str(tmp_path))
    model, ids = tiny_model("llama"), random_tokens(CONTEXT, seed=1)
    store.get_or_compress(model, ids, method="snapkv", budget=0.5)
    path = Path(store.path(store.key_for(model, ids, "snapkv", 0.5)))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="damaged"):
        store.get_or_compress(model, ids, method="snapkv", budget=0.5)
    assert len(counted) == 2
    kvcompress.load(model, path)  # whole again


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="max_bytes"):
        ContextStore(str(tmp_path), max_bytes=0)
    store = ContextStore(str(tmp_path))
    with pytest.raises(KeyError, match="no context"):
        store.load(tiny_model("llama"), "00ff")
    with pytest.raises(ValueError, match="key must be"):
        store.delete("../etc")
    with pytest.raises(ValueError, match="tokenizer"):
        store.get_or_compress(tiny_model("llama"), "text without a tokenizer")


def test_killed_writers_leave_the_previous_entry_or_none(tmp_path):
    """20 processes killed with SIGKILL at random moments while saving: every time, the entry is a whole file
    (either of the two being written) or absent, never a part that loads or fails; the store lists only whole
    entries."""
    model = tiny_model("llama")
    for name, seed in (("a", 1), ("b", 2)):
        session = kvcompress.compress(model, "snapkv", 0.9)
        with session:
            session.prefill(random_tokens(4000, seed=seed))
        session.save(tmp_path / f"{name}.safetensors")
    run = subprocess.run([sys.executable, str(HERE / "kill_writer.py"), str(tmp_path), "20", "0"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr
    outcomes = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(outcomes) == 20 and set(outcomes) <= {"a", "b", "none"}, outcomes
    assert {"a", "b"} & set(outcomes), outcomes  # some kills came after a whole write
    entries = ContextStore(str(tmp_path / "store")).list()
    assert len(entries) == 1 and entries[0].tokens == 4000, (entries, outcomes)


def test_two_processes_adding_one_key_leave_one_readable_entry(tmp_path):
    script = f"""
import sys
sys.path.insert(0, {str(HERE.parent)!r})
from kvcompress import ContextStore
from tiny_models import random_tokens, tiny_model
store = ContextStore({str(tmp_path)!r})
session = store.get_or_compress(tiny_model("llama"), random_tokens(1000, seed=1), method="snapkv", budget=0.9)
print(store.key_for(tiny_model("llama"), random_tokens(1000, seed=1), "snapkv", 0.9))
"""
    runs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    outputs = [run.communicate(timeout=300) for run in runs]
    assert all(run.returncode == 0 for run in runs), outputs
    [entry] = ContextStore(str(tmp_path)).list()
    assert entry.key == outputs[0][0].strip() == outputs[1][0].strip()
    kvcompress.load(tiny_model("llama"), ContextStore(str(tmp_path)).path(entry.key))
