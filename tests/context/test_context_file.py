"""A stored context continues exactly as the session that saved it (``session.save`` / ``kvcompress.load``).

Reference: the same session in memory. After ``prefill`` the context is saved; the in-memory session and the loaded
one then each answer a question (``session.generate``) and go on with a chat turn through a plain ``generate`` on a
copy of the context (the turn compressed again, decoding that evicts as it goes): answers, sequences and the final
caches must be equal, bit for bit. One test loads in a new process. Faults: a flipped byte, a truncated file,
another model, another dtype and a newer format version are refused with the file's name and what differs, and
leave the model as it was.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import kvcompress
from kvcompress.context_file import FORMAT_VERSION, _checksum, read_context, write_atomically
from kvcompress.scoring.registry import SCORERS
from tiny_models import TINY_CONFIGS, TinyTokenizer, random_kvzap_weights, random_tokens, tiny_model

CONTEXT, QUESTION, TURN, ANSWER, TURN_ANSWER = 160, 7, 30, 6, 24
HERE = Path(__file__).parent


def _kvzap(arch: str = "llama") -> dict:
    return {"scorer_options": {"weights": str(random_kvzap_weights(arch))}}


# name -> (architecture, method, budget, compress() overrides, prefill chunk size)
LAYOUTS = {
    "layer-wise": ("llama", "snapkv", 48, {}, None),
    "per_head": ("llama", "snapkv", 48, {"head_selection": "per_head"}, None),
    "pyramid": ("llama", "h2o", 0.25, {"budget_allocation": "pyramid"}, None),
    "global": ("qwen3", "snapkv", 0.25, {"budget_allocation": "global"}, None),
    "adaptive": ("llama", "snapkv", 0.25, {"budget_allocation": "adaptive"}, None),
    "global_adaptive (KVzip's)": ("llama", "kvzip", 0.2, {}, None),
    "sliding layers (Gemma 3)": ("gemma3", "kvzip", 0.2, {}, None),
    "score_threshold": ("llama", "kvzap", 48, {"score_threshold": 0.9, "decode_slack": 0}, None),
    "chunked prefill": ("llama", "kvzip", 0.2, {}, 48),
    "rerotated keys": ("llama", "snapkv", 48, {"rerotate_keys": True, "decode_slack": 2}, None),
    "evicting at every decode step": ("qwen2", "h2o", 48, {"decode_slack": 0}, None),
    "per_group pages": ("mistral", "tova", 64, {"strategy": "per_group", "group_size": 8}, None),
    "criticalkv": ("phi3", "snapkv", 48, {"refined_algorithm": "criticalkv", "refined_size": 8}, None),
    "4-bit keys and values, chunked (KVzip's)": ("llama", "kvzip", 0.2, {"kv_bits": 4, "kv_key_group_size": 8,
                                                                          "kv_residual": 4}, 48),
}


def _session(model, method, budget, overrides, arch="llama"):
    if method == "kvzap":
        overrides = {**_kvzap(arch), **overrides}
    return kvcompress.compress(model, method, budget, tokenizer=TinyTokenizer(), **overrides)


def _prefilled(model, method: str = "kvzip", length: int = CONTEXT, budget: float = 0.2):
    """A session of ``method`` at ``budget`` that prefilled ``length`` random tokens (seed 1)."""
    session = _session(model, method, budget, {})
    with session:
        session.prefill(random_tokens(length, seed=1))
    return session


def _continuations(model, session, mask=None):
    """A question's answer, then a chat turn and its answer after the context (plain generate, a copy of it)."""
    question, turn = random_tokens(QUESTION, seed=2), random_tokens(TURN, seed=3)
    context_ids = session.context_ids
    batch = context_ids.shape[0]
    question, turn = question.expand(batch, -1), turn.expand(batch, -1)
    with session:
        answer = session.generate(question, max_new_tokens=ANSWER, eos_token_id=[])
        folded = any(layer.folded_heads for layer in session.layers.values())
        if folded and not session.scorer.scores_folded_layers:  # a per-head selection of one prompt, by design
            return answer, answer, []
        context_mask = session.context[1]
        out = model.generate(torch.cat([context_ids, turn], -1),
                             attention_mask=torch.cat([context_mask, torch.ones_like(turn)], -1),
                             cache=session.context_cache(), max_new_tokens=TURN_ANSWER,
                             min_new_tokens=TURN_ANSWER, do_sample=False, return_dict_in_generate=True, pad_token_id=0)
    layers = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    return answer, out.sequences, layers


def _assert_same(saved, loaded):
    assert torch.equal(saved[0], loaded[0])
    assert torch.equal(saved[1], loaded[1])
    for (keys, values), (other_keys, other_values) in zip(saved[2], loaded[2], strict=True):
        assert torch.equal(keys, other_keys) and torch.equal(values, other_values)


def _round_trip(model, session, tmp_path, context, mask=None, chunk=None, **load):
    with session:
        session.prefill(context, attention_mask=mask, chunk_size=chunk)
    path = tmp_path / "context.safetensors"
    session.save(path)
    loaded = kvcompress.load(model, path, tokenizer=TinyTokenizer(), **load)
    return _continuations(model, session), _continuations(model, loaded), path


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_continues_exactly_after_a_load(layout, tmp_path):
    arch, method, budget, overrides, chunk = LAYOUTS[layout]
    model = tiny_model(arch)
    session = _session(model, method, budget, overrides, arch)
    saved, loaded, _ = _round_trip(model, session, tmp_path, random_tokens(CONTEXT, seed=1), chunk=chunk)
    _assert_same(saved, loaded)


@pytest.mark.parametrize("arch", list(TINY_CONFIGS))
def test_every_architecture_continues_exactly_after_a_load(arch, tmp_path):
    model = tiny_model(arch)
    session = _session(model, "kvzip", 0.2, {})
    saved, loaded, _ = _round_trip(model, session, tmp_path, random_tokens(CONTEXT, seed=1))
    _assert_same(saved, loaded)


def test_a_loaded_session_saves_the_same_file(tmp_path):
    """Saving what was loaded, before any use, writes the same metadata and tensors: nothing is lost on the way."""
    model = tiny_model("gemma3")
    _prefilled(model).save(tmp_path / "first.safetensors")
    kvcompress.load(model, tmp_path / "first.safetensors", TinyTokenizer()).save(tmp_path / "second.safetensors")
    first, second = (read_context(tmp_path / name) for name in ("first.safetensors", "second.safetensors"))
    assert first[0] == second[0]  # the metadata (the safetensors writer orders its entries as it likes)
    assert first[1].keys() == second[1].keys()
    assert all(torch.equal(first[1][name], second[1][name]) for name in first[1])


@pytest.mark.parametrize("method", list(SCORERS))
def test_every_scorer_continues_exactly_after_a_load(method, tmp_path):
    model = tiny_model("llama")
    session = _session(model, method, 0.2, {})
    saved, loaded, _ = _round_trip(model, session, tmp_path, random_tokens(CONTEXT, seed=1))
    _assert_same(saved, loaded)


def test_bfloat16_and_a_padded_batch_continue_exactly(tmp_path):
    model = tiny_model("llama", dtype=torch.bfloat16)
    short, long = random_tokens(CONTEXT - 40, seed=4), random_tokens(CONTEXT, seed=1)
    ids = torch.cat([torch.cat([torch.zeros(1, 40, dtype=torch.long), short], -1), long])
    mask = torch.cat([torch.cat([torch.zeros(1, 40), torch.ones(1, CONTEXT - 40)], -1), torch.ones(1, CONTEXT)]).long()
    session = _session(model, "kvzip", 0.2, {})
    saved, loaded, path = _round_trip(model, session, tmp_path, ids, mask)
    _assert_same(saved, loaded)
    assert loaded[2][0][0].dtype == torch.bfloat16


def test_the_file_holds_the_kept_bytes_and_little_else(tmp_path):
    """The file is the kept keys and values plus their state, compacted: within 5 % of the KV bytes on a layout
    whose state is the largest share (per-head positions; tiny heads make the share larger than real models')."""
    session = _prefilled(tiny_model("llama"), "snapkv", 2000, 0.25)
    summary = session.save(tmp_path / "c.safetensors")
    assert summary["kv_bytes"] == session.report().kv_bytes
    assert os.path.getsize(tmp_path / "c.safetensors") <= 1.05 * summary["kv_bytes"] + 16_384  # the header's JSON


def test_a_plain_generate_continues_from_the_file(tmp_path):
    """Ids that begin with the stored context's: ``generate`` on ``context_cache()`` equals the in-memory cache's."""
    model = tiny_model("llama")
    session = _prefilled(model)
    session.save(tmp_path / "c.safetensors")
    ids = torch.cat([random_tokens(CONTEXT, seed=1), random_tokens(QUESTION, seed=2)], -1)
    answers = []
    for current in (session, kvcompress.load(model, tmp_path / "c.safetensors", TinyTokenizer())):
        with current:
            answers.append(model.generate(ids, cache=current.context_cache(), max_new_tokens=8,
                                          do_sample=False, pad_token_id=0))
    assert torch.equal(*answers)


def test_a_new_process_loads_and_answers_the_same(tmp_path):
    """Saved here, loaded by another Python process (the tiny model is rebuilt from its seed there)."""
    results = {}
    for arch, method in (("llama", "kvzip"), ("gemma3", "snapkv")):
        model = tiny_model(arch)
        session = _session(model, method, 0.2, {})
        with session:
            session.prefill(random_tokens(CONTEXT, seed=1))
            results[arch] = session.generate(random_tokens(QUESTION, seed=2), max_new_tokens=ANSWER,
                                             eos_token_id=[]).tolist()
        session.save(tmp_path / f"{arch}.safetensors")
    script = f"""
import json, sys, torch, kvcompress
sys.path.insert(0, {str(HERE.parent)!r})
from tiny_models import random_tokens, tiny_model, TinyTokenizer
answers = {{}}
for arch in ("llama", "gemma3"):
    session = kvcompress.load(tiny_model(arch), {str(tmp_path)!r} + f"/{{arch}}.safetensors", TinyTokenizer())
    with session:
        answers[arch] = session.generate(random_tokens({QUESTION}, seed=2), max_new_tokens={ANSWER},
                                         eos_token_id=[]).tolist()
print(json.dumps(answers))
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1]) == results


# ---------------------------------------------------------------------------------------------------- faults
def _model_state(model):
    return ({name: tensor.clone() for name, tensor in model.state_dict().items()}, model.config._attn_implementation,
            sum(len(module._forward_hooks) + len(module._forward_pre_hooks) for module in model.modules()))


def _assert_untouched(model, before):
    state, attention, hooks = _model_state(model)
    assert attention == before[1] and hooks == before[2]
    assert all(torch.equal(state[name], before[0][name]) for name in state)


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    model = tiny_model("llama")
    path = tmp_path_factory.mktemp("stored") / "context.safetensors"
    _prefilled(model).save(path)
    return model, path


def _refused(model, path, match, **load):
    before = _model_state(model)
    with pytest.raises(kvcompress.ContextFileError, match=match) as error:
        kvcompress.load(model, path, **load)
    assert str(path) in str(error.value)
    _assert_untouched(model, before)


@pytest.mark.parametrize("where", [0.0, 0.001, 0.01, 0.3, 0.6, 0.999])
def test_a_flipped_byte_is_refused(stored, tmp_path, where):
    model, path = stored
    data = bytearray(path.read_bytes())
    offset = min(len(data) - 1, int(where * len(data)))
    data[offset] ^= 0x10
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(bytes(data))
    _refused(model, damaged, "damaged|not a readable|not a kvcompress")


@pytest.mark.parametrize("keep", [0.0, 0.5, 0.99])
def test_a_truncated_file_is_refused(stored, tmp_path, keep):
    model, path = stored
    data = path.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: int(keep * len(data))])
    _refused(model, truncated, "truncated or damaged|not a readable")


def test_another_model_is_refused_naming_what_differs(stored):
    _, path = stored
    _refused(tiny_model("llama", seed=1), path, "another model.*the weights")
    _refused(tiny_model("qwen3"), path, "another model.*architecture LlamaForCausalLM vs Qwen3ForCausalLM")


def test_another_dtype_is_refused_unless_converted(stored):
    model, path = stored
    bfloat16 = tiny_model("llama", dtype=torch.bfloat16)
    _refused(bfloat16, path, "holds float32 keys and values, the model runs in bfloat16")
    session = kvcompress.load(bfloat16, path, dtype=torch.bfloat16)  # an explicit conversion loads
    assert session.context[0].layers[0].keys.dtype == torch.bfloat16


def test_a_newer_format_version_is_refused(stored, tmp_path):
    model, path = stored
    with safe_open(path, framework="pt") as handle:
        metadata, tensors = handle.metadata(), {key: handle.get_tensor(key) for key in handle.keys()}
    metadata["format_version"] = str(FORMAT_VERSION + 1)
    metadata["checksum"] = _checksum(tensors, metadata)
    newer = tmp_path / "newer.safetensors"
    write_atomically(tensors, metadata, str(newer))
    _refused(model, newer, f"format version {FORMAT_VERSION + 1}.*upgrade kvcompress")


def test_a_missing_file_is_named(tmp_path):
    _refused(tiny_model("llama"), tmp_path / "absent.safetensors", "no such context file")
