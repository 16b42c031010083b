"""The shared runner on RULER with a tiny model: both protocols, real KV bytes, RULER's scores, kill -9 and resume.

The records are RULER niah records written here (the generator's templates, a short haystack), so the runner is
tested without the generator scripts; ``tests/ruler`` tests those, and the committed small run uses them.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from kvbench.experiment import load_experiment
from ruler.chat import encode_prompt
from ruler.cli import main
from ruler.metrics import score_task
from ruler.prompts import split_input

LENGTH = 512  # the folder names' max_seq_length; the prompts are shorter
TASKS = ("niah_single_1", "niah_single_2")
SAMPLES = 6
NEW_TOKENS = 5
HAYSTACK = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"


def _record(index: int) -> dict:
    key, number = f"key-{index}", str(1000000 + 7919 * index)
    lines = [HAYSTACK] * 8
    lines.insert(index % 8, f"One of the special magic numbers for {key} is: {number}.\n")
    text = (
        "A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you "
        f"about the number afterwards.\n{''.join(lines)}What is the special magic number for {key} mentioned in the "
        f"provided text? The special magic number for {key} mentioned in the provided text is"
    )
    return {"index": index, "input": text, "outputs": [number], "length": 300}


@pytest.fixture(scope="module")
def ruler_data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ruler-data")
    for task in TASKS:
        path = folder / f"{task}_{LENGTH}" / "validation.jsonl"
        path.parent.mkdir()
        path.write_text("".join(json.dumps(_record(i)) + "\n" for i in range(SAMPLES)), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def make_ruler_config(tiny_model_dir, ruler_data):
    def write(folder: Path, **overrides) -> Path:
        config = {
            "benchmark": "ruler",
            "model": {"path": str(tiny_model_dir), "dtype": "float32"},
            "tasks": list(TASKS),
            "lengths": [LENGTH],
            "data": {"folder": str(ruler_data)},
            "compression": ["none", {"method": "snapkv", "budget": 0.5, "window_size": 4}],
            "max_new_tokens": NEW_TOKENS,
            "output_dir": "out",
            **overrides,
        }
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "ruler.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        return path

    return write


def _lines(out: Path, setting: str, task: str) -> list[dict]:
    path = out / setting / "pred" / f"{task}_{LENGTH}.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _files(root: Path) -> dict[str, bytes]:
    return {path.relative_to(root).as_posix(): path.read_bytes() for path in sorted(root.rglob("*"))
            if path.suffix == ".jsonl" or path.name in ("pipeline.json", "scores.json", "scores.md", "scores.csv")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, make_ruler_config) -> Path:
    """One uninterrupted context-first run with the full cache, SnapKV at half the context, and a budget that
    keeps the whole context."""
    folder = tmp_path_factory.mktemp("reference")
    settings = ["none", {"method": "snapkv", "budget": 0.5, "window_size": 4}, {"method": "snapkv", "budget": 4096}]
    assert main(["run", str(make_ruler_config(folder, compression=settings))]) == 0
    return folder / "out"


def _direct_answer(model_dir: Path, tokenizer, record: dict, task: str) -> str:
    """The independent reference: the full prompt through plain ``generate``, no runner, no kvcompress."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([encode_prompt(tokenizer, split_input(task, record["input"]), "query_aware").input_ids])
    output = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    return tokenizer.decode(output[0, ids.shape[1]:], skip_special_tokens=True)


def test_full_cache_lines_match_plain_generate_and_ruler_scores(reference, tiny_model_dir, tiny_tokenizer):
    for task in TASKS:
        lines = _lines(reference, "full", task)
        assert [line["_id"] for line in lines] == [str(i) for i in range(SAMPLES)]
        assert set(lines[0]) == {"index", "pred", "outputs", "length", "_id", "kv_bytes", "full_kv_bytes"}
        assert all(line["kv_bytes"] == line["full_kv_bytes"] > 0 for line in lines)
        assert lines[0]["pred"] == _direct_answer(tiny_model_dir, tiny_tokenizer, _record(0), task)
    scores = json.loads((reference / "scores.json").read_text())
    full = scores["settings"][0]
    for task in TASKS:
        lines = _lines(reference, "full", task)
        assert full["scores"][f"{task}_{LENGTH}"] == score_task(task, [line["pred"] for line in lines],
                                                                 [line["outputs"] for line in lines])
    assert full["averages"] == {f"average ({LENGTH})": round(sum(full["unrounded_scores"].values()) / 2, 2)}
    assert full["kv_ratio"] == 1.0 and scores["full_cache_setting"] == "full"


def test_context_first_compresses_the_context_only(reference, tiny_tokenizer):
    """Half the context's slots are kept (the question is not compressed); a budget above the context evicts
    nothing and answers exactly as the full cache."""
    for task in TASKS:
        for index, line in enumerate(_lines(reference, "snapkv-0.5", task)):
            context = encode_prompt(tiny_tokenizer, split_input(task, _record(index)["input"]), "context_first")
            kept = round(0.5 * context.prefill_length)
            assert line["kv_bytes"] * context.prefill_length == line["full_kv_bytes"] * kept
        unbounded, full = _lines(reference, "snapkv-4096", task), _lines(reference, "full", task)
        assert [line["pred"] for line in unbounded] == [line["pred"] for line in full]
    markdown = (reference / "scores.md").read_text()
    assert "| task | full | snapkv-0.5 | snapkv-4096 |" in markdown and "Protocol `context_first`" in markdown
    assert re.search(r"\| KV × \| 1\.000 \| 0\.(49\d|500) \| 1\.000 \|", markdown)  # half, rounded per prompt


def test_query_aware_compresses_the_whole_prompt(tmp_path, make_ruler_config, tiny_tokenizer):
    config = make_ruler_config(tmp_path, protocol="query_aware", tasks=["niah_single_1"],
                               compression=[{"method": "kvzip", "budget": 0.5}])
    assert main(["run", str(config)]) == 0
    for index, line in enumerate(_lines(tmp_path / "out", "kvzip-0.5", "niah_single_1")):
        prompt = encode_prompt(tiny_tokenizer, split_input("niah_single_1", _record(index)["input"]), "query_aware")
        assert prompt.prefill_length == len(prompt.input_ids)
        # the cache ends with half the prompt plus the decoded tokens but the last (never fed back)
        new_tokens = len(tiny_tokenizer.encode(line["pred"], add_special_tokens=False))
        held = line["kv_bytes"] / line["full_kv_bytes"] * (len(prompt.input_ids) + new_tokens - 1)
        assert abs(held - (round(0.5 * len(prompt.input_ids)) + new_tokens - 1)) <= 1


def test_a_task_whose_records_cannot_be_made_is_left_out_and_the_others_run(tmp_path, make_ruler_config,
                                                                           monkeypatch, caplog):
    """As qa_2 at lengths its generator never finishes: the runner says so and goes on."""
    from ruler.benchmark import Ruler
    from ruler.generate import GenerationTimeout

    load_records = Ruler.load_records

    def hanging_second_task(self, options, task, output_dir):
        if task == f"niah_single_2_{LENGTH}":
            raise GenerationTimeout("did not finish within 600 s")
        return load_records(self, options, task, output_dir)

    monkeypatch.setattr(Ruler, "load_records", hanging_second_task)
    assert main(["run", str(make_ruler_config(tmp_path, compression=["none"]))]) == 0
    assert f"niah_single_2_{LENGTH}: left out, its records cannot be made (did not finish" in caplog.text
    scores = json.loads((tmp_path / "out" / "scores.json").read_text())["settings"][0]["scores"]
    assert list(scores) == [f"niah_single_1_{LENGTH}"]


@pytest.mark.parametrize("protocol", ["context_first", "query_aware"])
def test_a_chunk_as_long_as_the_prompt_answers_as_the_one_shot_prefill(tmp_path, make_ruler_config, protocol):
    """Chunks of the prompt go through session.prefill; one chunk is the one-shot context-first prefill (and, in
    the query-aware protocol, the whole prompt but its last token, which opens the answer)."""
    settings = [{"name": "one-shot", "method": "snapkv", "budget": 0.5, "window_size": 4},
                {"name": "one-chunk", "method": "snapkv", "budget": 0.5, "window_size": 4, "prefill_chunk_size": 4096},
                {"name": "chunked", "method": "snapkv", "budget": 0.5, "window_size": 4, "prefill_chunk_size": 64}]
    config = make_ruler_config(tmp_path, protocol=protocol, tasks=["niah_single_1"], compression=settings)
    assert main(["run", str(config)]) == 0
    one_shot, one_chunk, chunked = (_lines(tmp_path / "out", name, "niah_single_1") for name in
                                    ("one-shot", "one-chunk", "chunked"))
    assert [line["kv_bytes"] for line in one_chunk] == [line["kv_bytes"] for line in chunked]
    if protocol == "context_first":
        assert [line["pred"] for line in one_chunk] == [line["pred"] for line in one_shot]
        assert [line["kv_bytes"] for line in one_chunk] == [line["kv_bytes"] for line in one_shot]


def test_predictions_made_in_another_dtype_are_not_resumed(tmp_path, make_ruler_config, capsys):
    config = make_ruler_config(tmp_path, tasks=["niah_single_1"], compression=["none"], limit=2)
    assert main(["predict", str(config)]) == 0
    pipeline = tmp_path / "out" / "full" / "pipeline.json"
    record = json.loads(pipeline.read_text())
    assert record["generation"]["computed_dtype"] == "float32"
    record["generation"]["computed_dtype"] = "bfloat16"  # as a machine with native bfloat16 would have made them
    pipeline.write_text(json.dumps(record))
    assert main(["predict", str(config)]) == 2
    assert "were made with different ['computed_dtype']" in capsys.readouterr().err
    del record["generation"]["computed_dtype"]  # a run of an earlier version, which did not record it
    pipeline.write_text(json.dumps(record))
    assert main(["predict", str(config)]) == 0


def test_a_moved_checkout_resumes_its_predictions(tmp_path, make_ruler_config, ruler_data):
    """A data folder is recorded as the config writes it (relative to the config), not where this checkout lies."""
    shutil.copytree(ruler_data, tmp_path / "first" / "records")
    config = make_ruler_config(tmp_path / "first", tasks=["niah_single_1"], compression=["none"], limit=1,
                               data={"folder": "records"})
    assert main(["predict", str(config)]) == 0
    record = json.loads((tmp_path / "first" / "out" / "full" / "pipeline.json").read_text())
    assert record["generation"]["data"] == "folder:records"
    (tmp_path / "first").rename(tmp_path / "moved")
    assert main(["predict", str(tmp_path / "moved" / "ruler.yaml")]) == 0


def test_config_errors_name_the_key(tmp_path, make_ruler_config, capsys):
    assert main(["evaluate", str(make_ruler_config(tmp_path, protocol="question_first"))]) == 2
    assert "protocol: must be one of ['query_aware', 'context_first']" in capsys.readouterr().err
    assert main(["evaluate", str(make_ruler_config(tmp_path, tasks=["niah_single_9"]))]) == 2
    assert "tasks: unknown RULER task(s) ['niah_single_9']" in capsys.readouterr().err
    assert main(["evaluate", str(make_ruler_config(tmp_path, lengths=[]))]) == 2
    assert "lengths: must be a non-empty list" in capsys.readouterr().err
    assert main(["evaluate", str(make_ruler_config(tmp_path, max_length=100))]) == 2
    assert "max_length: unknown key" in capsys.readouterr().err  # a LongBench key
    experiment = load_experiment(make_ruler_config(tmp_path, compression=[{"method": "snapkv", "budgets": [0.1, 64]}]))
    assert [setting.name for setting in experiment.settings] == ["snapkv-0.1", "snapkv-64"]
    with pytest.raises(ValueError, match=r"compression\[0\]\.budget: a fractional budget must lie in \(0, 1\)"):
        load_experiment(make_ruler_config(tmp_path, compression=[{"method": "snapkv", "budget": 1.5}]))


def test_kill_9_then_resume_gives_identical_files(reference, tmp_path, make_ruler_config, kill_9_after):
    """The reference's settings, killed after three lines; the rerun loses nothing and doubles nothing."""
    settings = ["none", {"method": "snapkv", "budget": 0.5, "window_size": 4}, {"method": "snapkv", "budget": 4096}]
    config = make_ruler_config(tmp_path, compression=settings)
    out = tmp_path / "out"
    assert 3 <= kill_9_after("ruler.cli", config, out) < 3 * len(TASKS) * SAMPLES
    assert main(["run", str(config)]) == 0
    assert _files(out) == _files(reference)


def test_predictions_of_retrained_kvzap_weights_are_not_resumed(tmp_path, make_ruler_config, tiny_model_dir, capsys):
    """The pipeline record names a learned scorer's weights by their checksum: a file trained again under the same
    path must not continue the predictions of the one before."""
    from transformers import AutoModelForCausalLM

    from kvcompress.surrogate import load as load_surrogate
    from kvcompress.surrogate import random_surrogate

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    weights = tmp_path / "tiny.safetensors"
    random_surrogate(model, seed=1).save(weights)
    setting = {"name": "kvzap", "method": "kvzap", "budget": 0.5, "scorer_options": {"weights": str(weights)}}
    config = make_ruler_config(tmp_path, tasks=["niah_single_1"], compression=[setting], limit=1)
    assert main(["predict", str(config)]) == 0
    recorded = json.loads((tmp_path / "out" / "kvzap" / "pipeline.json").read_text())["generation"]
    assert recorded["scorer_weights"] == load_surrogate(weights).checksum != ""
    assert main(["predict", str(config)]) == 0  # the same weights resume
    random_surrogate(model, seed=2).save(weights)
    assert main(["predict", str(config)]) == 2
    assert "were made with different ['scorer_weights']" in capsys.readouterr().err


def test_predictions_of_an_earlier_preset_are_not_resumed(tmp_path, make_ruler_config, monkeypatch, capsys):
    """A fractional budget's setting records the parameters its preset gives a 100,000-token prompt: a preset changed
    since (here SnapKV's windows) does not continue the files the earlier one started."""
    from kvcompress.scoring.snapkv import SnapKV

    config = make_ruler_config(tmp_path, tasks=["niah_single_1"], limit=1,
                               compression=[{"method": "snapkv", "budget": 0.5, "window_size": 4}])
    assert main(["predict", str(config)]) == 0
    recorded = json.loads((tmp_path / "out" / "snapkv-0.5" / "pipeline.json").read_text())["generation"]
    assert recorded["parameters_at_100k_tokens"]["start_size"] == 32
    monkeypatch.setattr(SnapKV, "reference_selection", {"start_size": 4})
    assert main(["predict", str(config)]) == 2
    assert "were made with different ['parameters_at_100k_tokens']" in capsys.readouterr().err


def test_a_context_store_answers_as_the_context_first_protocol(tmp_path, make_ruler_config):
    """Contexts compressed once into a store, each question answered from a fresh load: the same predictions and
    bytes as compressing in the process, one entry per record, and a rerun loads them all (nothing compressed)."""
    settings = [{"name": "in-process", "method": "snapkv", "budget": 0.5, "window_size": 4},
                {"name": "stored", "method": "snapkv", "budget": 0.5, "window_size": 4, "context_store": "store"}]
    config = make_ruler_config(tmp_path, tasks=["niah_single_1"], compression=settings)
    assert main(["run", str(config)]) == 0
    in_process, stored = (_lines(tmp_path / "out", name, "niah_single_1") for name in ("in-process", "stored"))
    assert [(line["pred"], line["kv_bytes"]) for line in stored] == [(line["pred"], line["kv_bytes"])
                                                                    for line in in_process]
    from kvcompress import ContextStore

    entries = ContextStore(str(tmp_path / "store")).list()  # relative to the config's folder
    assert len(entries) == len(stored)
