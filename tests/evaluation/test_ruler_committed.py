"""The committed small RULER run (configs/ruler/smollm2-2k.yaml) reproduces: its full-cache setting, rerun with the
recorded command into a fresh folder, scores what the committed results say, on the same generated records. The
committed predictions were made in bfloat16; where the CPU computes bfloat16 natively the rerun uses it too and
its answers must be the same text, elsewhere (float32) the scores must still agree. The first 5 records of one of
the run's two tasks are rerun (niah_single_1, the shorter prompts), through the config's own ``limit``: the
generator, the runner and the scorer are the same for every record, and the whole run's reproduction is the
runner's job (``kvcompress-ruler run``), not the suite's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from kvcompress.models import default_dtype
from ruler.cli import main
from ruler.metrics import score_task

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "ruler" / "smollm2-2k.yaml"
COMMITTED = REPO / "results" / "ruler_runner_smollm2_2k"
TASK = "niah_single_1"
RECORDS = 5  # the committed run's first records of the task

pytest.importorskip("long_context_eval", reason="RULER generation needs nvidia-long-context-eval")


@pytest.mark.slow
def test_full_cache_scores_of_the_committed_run_reproduce(tmp_path):
    config = yaml.safe_load(CONFIG.read_text(encoding="utf-8"))
    assert Path(CONFIG.parent, config["output_dir"]).resolve() == COMMITTED  # the results are where it writes
    config.update(output_dir=str(tmp_path / "out"), tasks=[TASK], limit=RECORDS)
    path = tmp_path / "smollm2-2k.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")

    assert main(["run", str(path), "--settings", "full"]) == 0

    fresh = json.loads((tmp_path / "out" / "scores.json").read_text())["settings"][0]
    key = f"{TASK}_2048"
    records = f"data/{key}/validation.jsonl"
    assert (tmp_path / "out" / records).read_bytes() == (COMMITTED / records).read_bytes()
    committed = [json.loads(line) for line in (COMMITTED / "full" / "pred" / f"{key}.jsonl").read_text().splitlines()]
    committed = committed[:RECORDS]
    assert fresh["name"] == "full" and fresh["samples"] == {key: RECORDS}
    expected_score = score_task(TASK, [line["pred"] for line in committed], [line["outputs"] for line in committed])
    assert fresh["scores"] == {key: expected_score}
    answers = [json.loads(line)["pred"] for line in (tmp_path / "out" / "full" / "pred" / f"{key}.jsonl")
               .read_text().splitlines()]
    assert len(answers) == RECORDS
    if default_dtype() == torch.bfloat16:
        assert answers == [line["pred"] for line in committed]


@pytest.mark.slow
def test_a_context_store_scores_as_the_context_first_protocol_on_the_default_model(tmp_path):
    """KVzap at 20 % (query-agnostic, and the cheapest to compress) on the committed run's first records,
    compressed in the process and from a context store (every question answered from a fresh load of its stored
    context): the same answers, so the same scores."""
    config = yaml.safe_load(CONFIG.read_text(encoding="utf-8"))
    store = str(tmp_path / "store")
    config.update(output_dir=str(tmp_path / "out"), tasks=[TASK], limit=2, compression=[
        {"name": "kvzap", "method": "kvzap", "budget": 0.2},
        {"name": "kvzap-stored", "method": "kvzap", "budget": 0.2, "context_store": store}])
    config["data"] = {"folder": str(COMMITTED / "data")}
    path = tmp_path / "smollm2-2k.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")

    assert main(["run", str(path)]) == 0

    settings = json.loads((tmp_path / "out" / "scores.json").read_text())["settings"]
    assert [setting["name"] for setting in settings] == ["kvzap", "kvzap-stored"]
    assert settings[0]["scores"] == settings[1]["scores"]
    key = f"{TASK}_2048"
    answers = [[json.loads(line)["pred"] for line in (tmp_path / "out" / name / "pred" / f"{key}.jsonl")
                .read_text().splitlines()] for name in ("kvzap", "kvzap-stored")]
    assert answers[0] == answers[1] and len(answers[0]) == 2
