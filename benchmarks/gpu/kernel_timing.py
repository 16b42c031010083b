#!/usr/bin/env python
"""One layer's scoring pass on the GPU against the attention it replaces, to choose the kernels by measurement.

At the 8B shape's heads (32 query / 8 KV heads of 128, bfloat16), per length: torch's sdpa (causal, output only:
what the uncompressed layer pays) against ``triton_attention.fused_attention`` with either forward (torch's flash
attention with its log-sum-exp, or the Triton forward) and either statistic (H2O's sums, KVzip's maxima), for a
prefill and for a KVzip reconstruction pass (2,048 rows after the prefix); then the column pass alone over a few
block shapes; and a decode step over a folded (head-wise) layer against sdpa over rectangular ones. Median of
``--repeats`` CUDA-event timings after a warm-up; writes JSON (``--out``) and prints it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import gpu_description  # noqa: E402
from benchmarks.gpu.check import folded_inputs  # noqa: E402
from kvcompress.kernels import triton_attention, triton_blocks  # noqa: E402

HEADS, KV_HEADS, DIM = 32, 8, 128


def timed(function, repeats: int) -> float:
    """Median milliseconds of ``function()`` (CUDA events), after one warm-up call."""
    function()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def inputs(rows: int, total: int):
    generator = torch.Generator(device="cuda").manual_seed(0)
    queries = torch.randn(1, rows, HEADS, DIM, generator=generator, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    keys = torch.randn(1, KV_HEADS, total, DIM, generator=generator, device="cuda", dtype=torch.bfloat16)
    values = torch.randn(1, KV_HEADS, total, DIM, generator=generator, device="cuda", dtype=torch.bfloat16)
    return queries, keys, values


def sdpa(queries, keys, values):
    """The uncompressed layer's attention: causal, aligned to the end of the keys (a prefix sees everything)."""
    if keys.shape[2] == queries.shape[2]:
        return torch.nn.functional.scaled_dot_product_attention(queries, keys, values, is_causal=True,
                                                                enable_gqa=True)
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(queries.shape[2], keys.shape[2])
    return torch.nn.functional.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=True)


def fused(queries, keys, values, forward: str, maximum: bool):
    triton_attention.FORWARD = forward
    return triton_attention.fused_attention(queries, keys, values, DIM**-0.5, maximum=maximum)


def measure_case(length: int, case: str, rows: int, total: int, repeats: int, record) -> None:
    """sdpa, both forwards × both statistics, then the column pass's block shapes, for one call shape."""
    queries, keys, values = inputs(rows, total)
    baseline = timed(lambda: sdpa(queries, keys, values), repeats)
    record(length=length, case=case, path="sdpa", ms=baseline, x=1.0)
    for forward in ("flash", "triton"):
        for maximum in (False, True):
            path = f"{forward} + {'max' if maximum else 'sum'}"
            try:
                ms = timed(lambda: fused(queries, keys, values, forward, maximum), repeats)
                record(length=length, case=case, path=path, ms=ms, x=ms / baseline)
            except Exception as error:  # noqa: BLE001 - recorded, the next one runs
                record(length=length, case=case, path=path, error=f"{type(error).__name__}: {error}"[:400])
    triton_attention.FORWARD = "auto"
    for keys_per_program, rows_per_step, warps, stages in ((64, 64, 4, 2), (64, 64, 8, 3), (128, 64, 8, 3),
                                                          (128, 32, 4, 3), (128, 128, 8, 2)):
        blocks = dict(column_keys=keys_per_program, column_rows=rows_per_step, warps=warps, stages=stages)
        triton_blocks.BLOCK_OVERRIDES.update(blocks)
        try:
            ms = timed(lambda: fused(queries, keys, values, "flash", False), repeats)
            record(length=length, case=case, path="flash + sum", blocks=blocks, ms=ms, x=ms / baseline)
        except Exception as error:  # noqa: BLE001 - shared memory or register limits of a shape
            record(length=length, case=case, blocks=blocks, error=f"{type(error).__name__}: {error}"[:300])
        triton_blocks.BLOCK_OVERRIDES.clear()


def masked_eager(queries, keys, values, slot_valid, slot_head):
    """A folded decode step as it ran before the split-key kernel: ``ragged.folded_attention`` with no kernel."""
    from kvcompress import ragged

    kernel_step, ragged.folded_single_query = ragged.folded_single_query, lambda *args: None
    try:
        return ragged.folded_attention(queries, keys, values, slot_valid, slot_head, KV_HEADS, DIM**-0.5)
    finally:
        ragged.folded_single_query = kernel_step


def measure_folded_decode(length: int, repeats: int, record) -> None:
    """A decode step over 20 % of ``length`` kept: sdpa over the full cache and over a rectangular 20 % (what a
    layer-wise selection leaves), against a folded layer of as many slots (a head-wise selection's, 16 tokens
    decoded since) on the split-key kernel (output only, and with KVzip's scores) and on the masked eager formula
    it replaces."""
    queries, keys, values = inputs(1, length)
    full = timed(lambda: torch.nn.functional.scaled_dot_product_attention(queries, keys, values, enable_gqa=True),
                 repeats)
    record(length=length, case="decode", path="sdpa, full cache", ms=full, x=1.0)
    kept = keys[:, :, : length // 5].contiguous(), values[:, :, : length // 5].contiguous()
    ms = timed(lambda: torch.nn.functional.scaled_dot_product_attention(queries, *kept, enable_gqa=True), repeats)
    record(length=length, case="decode", path="sdpa, rectangular 20 %", ms=ms, x=ms / full)
    queries, keys, values, slot_valid, slot_head = folded_inputs("cuda", torch.bfloat16, 1, int(length / 5 / 1.25), 16)
    observed = torch.ones(1, 1, dtype=torch.bool, device="cuda")
    paths = {
        "folded, split-key kernel": lambda: triton_attention.folded_decode(
            queries, keys, values, slot_valid, slot_head, KV_HEADS, DIM**-0.5),
        "folded, split-key kernel + scores": lambda: triton_attention.folded_decode(
            queries, keys, values, slot_valid, slot_head, KV_HEADS, DIM**-0.5, observed),
        "folded, masked eager": lambda: masked_eager(queries, keys, values, slot_valid, slot_head),
    }
    for path, function in paths.items():
        try:
            ms = timed(function, repeats)
            record(length=length, case="decode", path=path, slots=keys.shape[2], ms=ms, x=ms / full)
        except Exception as error:  # noqa: BLE001 - recorded, the next one runs
            record(length=length, case="decode", path=path, error=f"{type(error).__name__}: {error}"[:400])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="kernels.json")
    args = parser.parse_args(argv)
    results = {"environment": {"torch": torch.__version__, "triton": triton_attention.triton.__version__,
                               **gpu_description()}, "rows": []}

    def record(**row):
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1))

    for length in args.lengths:
        for case, rows in (("prefill", length), ("reconstruction", 2048)):
            measure_case(length, case, rows, length if case == "prefill" else length + 2048, args.repeats, record)
            torch.cuda.empty_cache()
        measure_folded_decode(length, args.repeats, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
