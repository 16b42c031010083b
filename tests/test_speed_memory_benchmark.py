"""The speed/memory benchmark runs end to end on a tiny model and reports every target's ratio.

Timings are never asserted (they belong to the machine); this checks the plumbing: the paired same-size
decode of target (b), the exact KV ratio, and that both output files are written.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import speed_memory  # noqa: E402


def test_default_methods_are_every_registered_scorer():
    from kvcompress.presets import method_names

    args = speed_memory.parse_args([])
    assert args.methods == [m for m in method_names() if m not in ("none", "streaming_llm")]
    assert "kvzip" in args.methods and args.threads == [1, 2]


def test_tiny_run_writes_every_target(tmp_path):
    """One file pair per thread count; KVzip runs on the random model with the tokenizer trained for it."""
    out = tmp_path / "speed"
    speed_memory.main(["--model", "tiny-llama", "--lengths", "256", "--methods", "snapkv", "h2o", "kvzip",
                       "snapkv-adaptive", "--budget", "0.25", "--new-tokens", "20", "--repeats", "1",
                       "--threads", "1", "2", "--out", str(out)])
    for threads in (1, 2):
        results = json.loads((tmp_path / f"speed_t{threads}.json").read_text())
        assert results["environment"]["threads"] == threads
    (setting,) = results["settings"]
    assert {row["method"] for row in setting["methods"]} == {"snapkv", "h2o", "kvzip", "snapkv-adaptive"}
    for row in setting["methods"]:
        assert row["kv_bytes_ratio"] == row["kv_bytes_expected_ratio"] == 64 / 256
        for key in ("prefill_ratio", "peak_memory_ratio", "decode_speedup_vs_full", "decode_throughput_vs_same_size"):
            assert row[key] > 0, key
        (run,) = setting["runs"][row["method"]]
        if row["method"] == "snapkv-adaptive":  # the prompt is compressed once (folded heads), decoding appends
            assert run["kv_slots_after_decode"] == 64 + 20
            assert row["final_kv_bytes_ratio"] == (64 + 20) / (256 + 20)
        else:
            assert run["kv_slots_after_decode"] <= 64 + 16  # the budget plus decode_slack: it kept evicting
    markdown = (tmp_path / "speed_t2.md").read_text()
    assert "## Targets (issue 6)" in markdown and "--model tiny-llama" in markdown
