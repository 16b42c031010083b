#!/usr/bin/env python
"""A compressed cache's decode step and prefill with its kept slots in 16, 8 and 4 bits (``kv_bits``).

Three sessions of the same method and budget, each on its own copy of the model, prefill the same prompt (timed
in turn, ``--repeats`` times) and then decode step by step in turn (so whatever the machine does hits all three
alike); ms per step is the median of ``--repeats`` rounds of ``--steps`` steps. Ratios are against 16 bits, with
the KV bytes each cache holds after the prompt.

    python benchmarks/quantized_decode.py --method kvzip --length 4096 --threads 1
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import build_model  # noqa: E402
from benchmarks.decode_overhead import Decoder  # noqa: E402
from kvcompress.budget import budget_slots  # noqa: E402
from kvcompress.cache import kv_cache_bytes  # noqa: E402
from kvcompress.presets import preset  # noqa: E402

BITS = (16, 8, 4)


def prefill_seconds(model, tokenizer, prompt: torch.Tensor, parameters) -> float:
    decoder = Decoder(model, tokenizer, prompt[:, :64], parameters)  # a warm session: hooks and kernels loaded
    decoder.close()
    started = time.perf_counter()
    decoder = Decoder(model, tokenizer, prompt, parameters)
    seconds = time.perf_counter() - started
    decoder.close()
    return seconds


def measure(args) -> dict:
    torch.set_num_threads(args.threads)
    model, tokenizer, (low, high), described = build_model(args.model, "cpu", getattr(torch, args.dtype))
    prompt = torch.randint(low, high, (1, args.length), generator=torch.Generator().manual_seed(0))
    budget = budget_slots(args.budget, args.length)
    parameters = {bits: preset(args.method, budget, kv_bits=bits) for bits in BITS}
    models = {bits: model if bits == 16 else copy.deepcopy(model) for bits in BITS}
    prefill = {bits: [] for bits in BITS}
    for _ in range(args.repeats):
        for bits in BITS:
            prefill[bits].append(prefill_seconds(models[bits], tokenizer, prompt, parameters[bits]))
    decoders = {bits: Decoder(models[bits], tokenizer, prompt, parameters[bits]) for bits in BITS}
    kv_bytes = {bits: kv_cache_bytes(decoders[bits].cache) for bits in BITS}
    rounds = {bits: [] for bits in BITS}
    try:
        for decoder in decoders.values():
            decoder.step()
        for _ in range(args.repeats):
            seconds = dict.fromkeys(BITS, 0.0)
            for step in range(args.steps):
                for bits in BITS if step % 2 == 0 else BITS[::-1]:
                    seconds[bits] += decoders[bits].step()
            for bits in BITS:
                rounds[bits].append(seconds[bits] / args.steps)
    finally:
        for decoder in decoders.values():
            decoder.close()
    return {"model": described, "method": args.method, "length": args.length, "budget": budget,
            "threads": args.threads, "dtype": args.dtype, "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M"), "kv_bytes": kv_bytes,
            "prefill_s": {bits: statistics.median(values) for bits, values in prefill.items()},
            "decode_ms": {bits: 1e3 * statistics.median(values) for bits, values in rounds.items()},
            "rounds_ms": {bits: [1e3 * v for v in values] for bits, values in rounds.items()}}


def markdown(result: dict, argv: list[str]) -> str:
    lines = ["# Kept slots in 16, 8 and 4 bits: decode step, prefill, KV bytes", "",
             f"Command: `python benchmarks/quantized_decode.py {' '.join(argv)}`", "",
             f"{result['model']}, {result['dtype']}, {result['threads']} thread(s), {result['method']} at "
             f"{result['budget']} slots of a {result['length']}-token prompt, torch {result['torch']}, "
             f"{result['date']}; medians of the rounds.", "",
             "| kv_bits | KV bytes | × 16 bits | prefill s | × 16 bits | decode ms/step | speed × 16 bits |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    base_bytes, base_prefill, base_decode = (result[key][16] for key in ("kv_bytes", "prefill_s", "decode_ms"))
    for bits in BITS:
        lines.append(f"| {bits} | {result['kv_bytes'][bits]:,} | {result['kv_bytes'][bits] / base_bytes:.3f} | "
                     f"{result['prefill_s'][bits]:.2f} | {result['prefill_s'][bits] / base_prefill:.3f} | "
                     f"{result['decode_ms'][bits]:.2f} | {base_decode / result['decode_ms'][bits]:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--method", default="kvzip")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    result = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result, argv))
    print(markdown(result, argv))


if __name__ == "__main__":
    main()
