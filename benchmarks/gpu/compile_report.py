#!/usr/bin/env python
"""What every Triton kernel needs on each NVIDIA architecture, compiled ahead of time on CPU (no GPU needed).

For each kernel at its widest launch (``ahead_of_time.launches``), dtype, head dimension and architecture of
``ahead_of_time.ARCHITECTURES``: the shared memory per block against the architecture's limit, and the registers
per thread and spills (bytes per thread stored to local memory) that Triton's own ptxas reports. Writes
``compile_report.json`` and ``compile_report.md`` under ``--out``:

    python benchmarks/gpu/compile_report.py --out results/gpu

A few minutes on two cores (each launch goes through the whole pipeline, ptxas included).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvcompress.kernels import ahead_of_time, triton_blocks  # noqa: E402


def compile_report(head_dims: list[int]) -> list[dict]:
    """One row per kernel, dtype, head dimension and architecture."""
    cases = ahead_of_time.widest_launches(tuple(head_dims))
    results = ahead_of_time.compile_all(cases, depth="cubin")
    return [dict(kernel=case["kernel"], bits=case["constexprs"].get("BITS", 16), dtype=case["dtype"],
                 head_dim=case["constexprs"]["BLOCK_D"],
                 architecture=case["target"], limit=triton_blocks.shared_memory(divmod(case["target"], 10)),
                 warps=case["warps"], stages=case["stages"],
                 blocks={name: value for name, value in case["constexprs"].items() if name.startswith("BLOCK")},
                 **result) for case, result in zip(cases, results)]


def markdown(rows: list[dict], seconds: float) -> str:
    """A table per head dimension: kernel and dtype down, architectures across, each cell shared bytes (percent
    of the limit), registers and spilled bytes."""
    architectures = sorted({row["architecture"] for row in rows})
    lines = ["# Triton kernels compiled ahead of time", "",
             f"`python benchmarks/gpu/compile_report.py --out results/gpu` ({seconds:.0f} s on this machine's CPU, "
             f"Triton {triton.__version__}): each kernel at its widest launch (every flag that adds a tile on), "
             "without codes and reading a quantized layer's 8-bit codes, "
             "through Triton's own ptxas. A cell: shared memory per block in bytes (share of the architecture's "
             "limit), registers per thread, bytes spilled per thread (stores). Limits: "
             + ", ".join(f"sm_{a} {triton_blocks.shared_memory(divmod(a, 10)):,} B" for a in architectures) + ".", ""]
    for head_dim in sorted({row["head_dim"] for row in rows}):
        header = " | ".join(f"sm_{architecture}" for architecture in architectures)
        lines += [f"## Head dimension {head_dim}", "", f"| kernel | dtype | rows × keys, warps, stages | {header} |",
                  "|---|---|---|" + "---:|" * len(architectures)]
        keyed = {(row["kernel"], row["bits"], row["dtype"], row["architecture"]): row
                 for row in rows if row["head_dim"] == head_dim}
        for kernel, bits, dtype in dict.fromkeys(key[:3] for key in keyed):
            first = keyed[(kernel, bits, dtype, architectures[0])]
            blocks = " × ".join(str(first["blocks"][name]) for name in ("BLOCK_M", "BLOCK_N")
                                if name in first["blocks"])
            cells = [cell(keyed[(kernel, bits, dtype, architecture)]) for architecture in architectures]
            name = f"`{kernel}`" + (f", {bits}-bit codes" if bits != 16 else "")
            lines.append(f"| {name} | {dtype} | {blocks}, {first['warps']} w, {first['stages']} s | "
                         + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def cell(row: dict) -> str:
    if "error" in row:
        return "error: " + row["error"].splitlines()[0][:60]
    spilled = row.get("spill_stores", 0)
    return (f"{row['shared']:,} ({100 * row['shared'] / row['limit']:.0f}%), {row.get('registers', '?')} r"
            + (f", **{spilled:,} B spilled**" if spilled else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "gpu")
    parser.add_argument("--head-dims", type=int, nargs="+", default=list(ahead_of_time.HEAD_DIMS))
    args = parser.parse_args()
    started = time.perf_counter()
    rows = compile_report(args.head_dims)
    seconds = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compile_report.json").write_text(json.dumps(dict(seconds=seconds, rows=rows), indent=1) + "\n")
    (args.out / "compile_report.md").write_text(markdown(rows, seconds))
    print(markdown(rows, seconds))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
