"""The speed/memory benchmark runs end to end on a tiny model and reports every target's ratio.

Timings are never asserted (they belong to the machine); this checks the plumbing: the paired same-size
decode of target (b), the exact KV ratio, and that both output files are written.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

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
        if row["method"] in ("snapkv-adaptive", "kvzip"):  # head-wise budgets (folded heads): decoding appends
            assert run["kv_slots_after_decode"] == 64 + 20
            assert row["final_kv_bytes_ratio"] == (64 + 20) / (256 + 20)
        else:
            assert run["kv_slots_after_decode"] <= 64 + 16  # the budget plus decode_slack: it kept evicting
    markdown = (tmp_path / "speed_t2.md").read_text()
    assert "## Targets (issue 6)" in markdown and "--model tiny-llama" in markdown


def test_attention_kernel_benchmark_times_every_path(tmp_path):
    """One layer's calls: the kernel, sdpa, and (bfloat16) the kernel on float32 copies and KVzip's path without
    the kernel, each timed; the table is written per thread count."""
    import attention_kernel

    attention_kernel.main(["--slots", "96", "--repeats", "1", "--threads", "1", "--out", str(tmp_path / "kernel")])
    results = json.loads((tmp_path / "kernel_bfloat16_t1_busy0.json").read_text())
    assert [(row["call"], row["slots"]) for row in results["rows"]] == [
        ("prefill", 96), ("reconstruction", 96), ("decode", 96)]
    for row in results["rows"]:
        expected = {"kernel", "sdpa", "kernel on float32 copies"} | (
            {"flash + float32 scores"} if row["call"] == "reconstruction" else set())
        assert set(row["seconds"]) == expected and all(seconds > 0 for seconds in row["seconds"].values())
    assert "| reconstruction | 96 |" in (tmp_path / "kernel_bfloat16_t1_busy0.md").read_text()


def test_decode_overhead_splits_the_gap_on_a_tiny_model(tmp_path):
    """Three caches decode in turn; the split and the profile are written."""
    import decode_overhead

    decode_overhead.main(["--model", "tiny-llama", "--length", "128", "--steps", "4", "--repeats", "1",
                          "--dtype", "float32", "--profile", "--out", str(tmp_path / "split")])
    result = json.loads((tmp_path / "split.json").read_text())
    assert set(result["ms_per_step"]) == {"same-size", "session, no eviction", "continuous"}
    # the profile's top 25 by own time: which functions make it depends on the machine's speed, not their names
    assert result["budget"] == 26 and "Ordered by: internal time" in result["profile"]
    assert "(b) = same-size / continuous" in (tmp_path / "split.md").read_text()
    assert (tmp_path / "split_profile.txt").exists()


def test_throughput_fills_the_memory_with_as_many_sequences_as_fit(tmp_path):
    """The full cache and a compressed one of the same prompt: each batch is the most sequences whose caches (KV
    and state) fit beside the weights, all decoded together; at 20 % kept several times more fit. The GPU table
    reads this file (benchmarks/gpu/report.py)."""
    import throughput

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"))
    import report

    out = tmp_path / "gpu" / "throughput_tiny"
    throughput.main(["--device", "cpu", "--model", "tiny-llama", "--dtype", "float32", "--length", "256",
                     "--methods", "none", "snapkv", "--memory-gib", "1.02", "--new-tokens", "2", "--out", str(out)])
    results = json.loads(out.with_suffix(".json").read_text())
    rows = {row["method"]: row for row in results["methods"]}
    for row in rows.values():
        per_sequence = row["kv_bytes_per_sequence"] + row["state_bytes_per_sequence"]
        weights = results["environment"]["weights_bytes"]
        assert row["batch"] == throughput.largest_batch(int(1.02 * 2**30), weights, per_sequence, 2)
        assert row["tokens_per_s"] > 0
    assert rows["none"]["state_bytes_per_sequence"] == 0 < rows["snapkv"]["state_bytes_per_sequence"]
    assert rows["snapkv"]["batch_x"] > 3
    report.main([str(tmp_path / "gpu")])
    assert "| snapkv |" in (tmp_path / "gpu" / "summary.md").read_text()
