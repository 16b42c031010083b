"""Peak memory and time of a compressed prefill, one-shot against chunked, as the context grows (CPU).

Each measurement runs in a fresh process (the parent starts one per context length and mode), so nothing that an
earlier prefill left in the allocator counts. A process loads the model, builds a context of the requested length
(the demo report's text, repeated), runs a short forward that pages in its memory-mapped weights, then measures
one prefill: ``full`` (the uncompressed ``model(ids)``, the reference), ``one-shot`` (``session.prefill(ids)``) or
``chunk-N`` (``session.prefill(ids, chunk_size=N)``). Peak memory is the kernel's high-water mark (VmHWM) above
the process's level before the prefill, with glibc's malloc thresholds fixed so that the resident size follows the
live tensors; the ratios are against the ``full`` prefill of the same length, measured the same way.

    python benchmarks/chunked_prefill.py --model default --lengths 2048 4096 8192 --chunk-sizes 1024 \\
        --out results/chunked_prefill_default
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import DEMO_TEXT, PeakMemory, fixed_malloc_thresholds, write_results  # noqa: E402

FULL, ONE_SHOT = "full", "one-shot"


def _context(tokenizer, length: int) -> torch.Tensor:
    text = DEMO_TEXT.read_text(encoding="utf-8")
    ids = tokenizer.encode(text, add_special_tokens=False)
    return torch.tensor([(ids * (length // len(ids) + 1))[:length]])


@torch.no_grad()
def measure_one(model_name: str, method: str, budget: int | float, length: int, mode: str, threads: int,
                allocation: str | None = None) -> dict:
    """One prefill in this process: its peak memory above the loaded model, its seconds, the cache's bytes."""
    from kvcompress import compress
    from kvcompress.cache import full_cache_bytes, kv_cache_bytes
    from kvcompress.models import load_model

    torch.set_num_threads(threads)
    fixed_malloc_thresholds()
    model, tokenizer = load_model(model_name)
    ids = _context(tokenizer, length)
    model(ids[:, :16])  # pages the weights in (they are memory-mapped) before the measurement
    started = time.perf_counter()
    with PeakMemory("cpu") as peak:
        if mode == FULL:
            cache = model(ids, use_cache=True, logits_to_keep=1).past_key_values
        else:
            overrides = {"budget_allocation": allocation} if allocation else {}
            with compress(model, method=method, budget=budget, tokenizer=tokenizer, **overrides) as session:
                cache = session.prefill(ids, chunk_size=None if mode == ONE_SHOT else int(mode.split("-")[1]))
    seconds = time.perf_counter() - started
    return {"length": length, "mode": mode, "dtype": str(model.dtype).removeprefix("torch."),
            "peak_bytes": peak.delta, "seconds": seconds,
            "kv_bytes": kv_cache_bytes(cache), "full_kv_bytes": full_cache_bytes(cache, length)}


def run(args: argparse.Namespace) -> list[dict]:
    """Every (length, mode) in a child process of its own."""
    rows = []
    modes = [FULL, *([ONE_SHOT] if args.one_shot else []), *(f"chunk-{size}" for size in args.chunk_sizes)]
    for length in args.lengths:
        for mode in modes:
            command = [sys.executable, __file__, "--one", str(length), mode, "--model", args.model, "--method",
                       args.method, "--budget", str(args.budget), "--threads", str(args.threads),
                       *(["--budget-allocation", args.budget_allocation] if args.budget_allocation else [])]
            done = subprocess.run(command, capture_output=True, text=True, check=True,
                                  env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"{length} {mode}: {rows[-1]['peak_bytes'] / 2**20:.0f} MiB, {rows[-1]['seconds']:.1f} s",
                  flush=True)
    return rows


def markdown(rows: list[dict], args: argparse.Namespace, argv: list[str]) -> str:
    full = {row["length"]: row for row in rows if row["mode"] == FULL}
    lines = [
        "# Compressed prefill: one-shot against chunked, peak memory as the context grows", "",
        f"Command: `python benchmarks/chunked_prefill.py {' '.join(argv)}`", "",
        f"Model `{args.model}` ({rows[0]['dtype']}), {args.method} "
        f"(budget_allocation {args.budget_allocation or 'of its preset'}) keeping "
        f"{f'{args.budget:g} of the context' if isinstance(args.budget, float) else f'{args.budget} slots per layer'}, "
        f"{args.threads} thread(s), torch {torch.__version__}, {time.strftime('%Y-%m-%d')}. Each row is a fresh "
        "process; peak = the prefill's high-water mark above the loaded model; × = against the uncompressed "
        "prefill of the same length (`full`).", "",
        "| context | mode | peak MiB | peak × | seconds | time × | KV bytes × |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        reference = full[row["length"]]
        lines.append(
            f"| {row['length']} | {row['mode']} | {row['peak_bytes'] / 2**20:.0f} | "
            f"{row['peak_bytes'] / reference['peak_bytes']:.2f} | {row['seconds']:.1f} | "
            f"{row['seconds'] / reference['seconds']:.2f} | {row['kv_bytes'] / row['full_kv_bytes']:.3f} |")
    return "\n".join(lines) + "\n"


def _budget(text: str) -> int | float:
    return float(text) if "." in text else int(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="an embedded model (kvcompress.models.model_names())")
    parser.add_argument("--method", default="kvzip")
    parser.add_argument("--budget-allocation", help="instead of the method preset's (KVzip's: global_adaptive)")
    parser.add_argument("--budget", type=_budget, default=0.2,
                        help="a share of the context (0.2), or slots per layer (1024): flat as the context grows")
    parser.add_argument("--lengths", nargs="+", type=int, default=[2048, 4096, 8192])
    parser.add_argument("--chunk-sizes", nargs="+", type=int, default=[1024])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-one-shot", dest="one_shot", action="store_false",
                        help="leave out the one-shot prefill (at the longest contexts it alone takes most of the run)")
    parser.add_argument("--one", nargs=2, metavar=("LENGTH", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help="write <out>.json and <out>.md")
    args = parser.parse_args(argv)
    if args.one:
        row = measure_one(args.model, args.method, args.budget, int(args.one[0]), args.one[1], args.threads,
                          args.budget_allocation)
        print(json.dumps(row))
        return
    argv = list(sys.argv[1:] if argv is None else argv)
    rows = run(args)
    table = markdown(rows, args, argv)
    print(table)
    if args.out:
        write_results(args.out, {"rows": rows, "args": vars(args), "torch": torch.__version__}, table)


if __name__ == "__main__":
    main()
