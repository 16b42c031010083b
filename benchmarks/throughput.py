#!/usr/bin/env python
"""Sequences served at once in a fixed memory, and their aggregate decode rate: the reason to compress.

For each method (``none`` = the full cache): one prompt of ``--length`` tokens is prefilled (compressed by the
method), what its cache holds is counted (keys, values and, for a compressed cache, the eviction state beside
them), and the largest batch of such sequences that fits in ``--memory-gib`` next to the model's weights is
decoded together: the cache is repeated to that batch (``batch_repeat_interleave``, as ``generate`` does for
several return sequences; the contents do not change the speed) and ``--new-tokens`` greedy steps are timed.
The batch leaves room for one layer's worth of transient copies per step (the cache's concatenation); a batch
that still runs out of memory is retried 10 % smaller. Reported per method: batch, bytes per sequence, decode
ms per step, aggregate tokens per second and, on a GPU, the peak memory of the decode.

Example (the committed GPU results, see ``benchmarks/gpu/run.sh``)::

    python benchmarks/throughput.py --device cuda --model llama3-8b-shape --length 32768 --budget 0.2 \
        --methods none snapkv kvzip --memory-gib 100 --out results/gpu/throughput_llama3-8b
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import shlex
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from transformers import DynamicCache  # noqa: E402

import kvcompress  # noqa: E402
from benchmarks.common import (  # noqa: E402
    SHAPES,
    build_model,
    gpu_description,
    release_memory,
    synchronize,
    write_results,
)
from kvcompress.cache import kv_cache_bytes, state_bytes  # noqa: E402

RESERVE_BYTES = 1 << 30  # logits, hidden states and allocator slack of a decode step


def log(message: str) -> None:
    print(f"[throughput {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def weight_bytes(model) -> int:
    return sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())


def largest_batch(limit: int, weights: int, per_sequence: int, layers: int) -> int:
    """Sequences whose caches fit beside the weights and the prefilled sequence they are copied from, with one
    layer's copy per sequence in flight."""
    return max(1, int((limit - weights - RESERVE_BYTES - per_sequence) // (per_sequence * (1 + 1 / layers))))


def serve(model, tokenizer, prompt: torch.Tensor, method: str, budget: float, limit: int, new_tokens: int,
          device: str) -> dict:
    """Prefill one sequence, repeat its cache to the largest batch that fits, time the batch's decode."""
    cache = DynamicCache(config=model.config)
    session = (contextlib.nullcontext() if method == "none" else
               kvcompress.compress(model, method=method, budget=budget, tokenizer=tokenizer))
    record: dict = {"method": method}
    with torch.no_grad(), session:
        token = model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
        release_memory()
        record["kv_bytes_per_sequence"] = kv_cache_bytes(cache)
        record["state_bytes_per_sequence"] = state_bytes(cache)
        per_sequence = record["kv_bytes_per_sequence"] + record["state_bytes_per_sequence"]
        batch = largest_batch(limit, weight_bytes(model), per_sequence, model.config.num_hidden_layers)
        for _ in range(4):
            trial = None
            try:
                trial = copy.deepcopy(cache)
                trial.batch_repeat_interleave(batch)
                record.update(_decode(model, trial, token.expand(batch, 1), new_tokens, device))
                record["batch"] = batch
                break
            except torch.OutOfMemoryError:
                log(f"{method}: batch {batch} ran out of memory; trying {int(batch * 0.9)}")
                del trial
                release_memory()
                batch = max(1, int(batch * 0.9))
        record["tokens_per_s"] = record["batch"] * new_tokens / record["decode_s"] if "batch" in record else None
    return record


def _decode(model, cache, token: torch.Tensor, steps: int, device: str) -> dict:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        token = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    synchronize(device)
    seconds = time.perf_counter() - started
    record = {"decode_s": seconds, "decode_ms_per_step": 1000 * seconds / steps}
    if device.startswith("cuda"):
        record["decode_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return record


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b-shape", choices=["default", *SHAPES])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--budget", type=float, default=0.2, help="fraction of the prompt kept")
    parser.add_argument("--methods", nargs="+", default=["none", "snapkv", "kvzip"])
    parser.add_argument("--memory-gib", type=float, default=100.0, help="memory for weights and caches together")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--out", default=None, help="JSON file (and a Markdown table beside it)")
    args = parser.parse_args(argv)
    model, tokenizer, (low, high), described = build_model(args.model, args.device, getattr(torch, args.dtype))
    prompt = torch.randint(low, high, (1, args.length), generator=torch.Generator().manual_seed(0)).to(args.device)
    limit = int(args.memory_gib * 2**30)
    rows = []
    for method in args.methods:
        release_memory()
        row = serve(model, tokenizer, prompt, method, args.budget, limit, args.new_tokens, args.device)
        rows.append(row)
        log(f"{method}: batch {row.get('batch')}, {row['kv_bytes_per_sequence'] / 2**30:.3f} GiB KV + "
            f"{row['state_bytes_per_sequence'] / 2**20:.1f} MiB state per sequence, "
            f"{row.get('decode_ms_per_step', float('nan')):.1f} ms/step, {row['tokens_per_s'] or 0:.0f} tok/s")
    full = next((row for row in rows if row["method"] == "none" and row.get("tokens_per_s")), None)
    for row in rows:
        if full is not None and row.get("tokens_per_s"):
            row["batch_x"] = row["batch"] / full["batch"]
            row["tokens_per_s_x"] = row["tokens_per_s"] / full["tokens_per_s"]
    results = {
        "environment": {
            "command": "python " + " ".join(shlex.quote(a) for a in ["benchmarks/throughput.py",
                                                                     *(sys.argv[1:] if argv is None else argv)]),
            "model": described, "device": args.device, "dtype": args.dtype, "length": args.length,
            "budget": args.budget, "memory_gib": args.memory_gib, "new_tokens": args.new_tokens,
            "weights_bytes": weight_bytes(model), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), **gpu_description(),
        },
        "methods": rows,
    }
    table = markdown(results)
    print(table)
    if args.out:
        write_results(args.out, results, table)


def markdown(results: dict) -> str:
    env = results["environment"]
    lines = [f"# Decode throughput in {env['memory_gib']:g} GiB: {env['model']}", "",
             f"Command: `{env['command']}`", "",
             f"{env.get('gpu', env['device'])}, {env['dtype']}, {env['length']} prompt tokens, "
             f"{env['budget']} kept, weights {env['weights_bytes'] / 2**30:.1f} GiB, {env['new_tokens']} decode steps, "
             f"{env['date']}.", "",
             "| method | batch | × full | GiB per sequence (KV + state) | ms / step | tokens / s | × full | peak GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for row in results["methods"]:
        per_sequence = (row["kv_bytes_per_sequence"] + row["state_bytes_per_sequence"]) / 2**30

        def f(value, pattern):
            return "—" if value is None else pattern.format(value)

        lines.append(f"| {row['method']} | {row.get('batch', '—')} | {f(row.get('batch_x'), '{:.2f}')} | "
                     f"{per_sequence:.3f} | {f(row.get('decode_ms_per_step'), '{:.1f}')} | "
                     f"{f(row.get('tokens_per_s'), '{:.0f}')} | {f(row.get('tokens_per_s_x'), '{:.2f}')} | "
                     f"{f(row.get('decode_peak_gib'), '{:.1f}')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
