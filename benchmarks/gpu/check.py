#!/usr/bin/env python
"""Correctness on the device, before any timing: the Triton kernels compiled for it, then every method end to end.

1. Kernels: ``triton_attention.fused_attention`` on the device at the 8B shape's heads (32 query / 8 KV heads of
   128) against the float64 definition computed on the same device (causal softmax, dead slots hidden from
   observed rows, column sums or maxima over observed rows and the query heads of each KV group), for a prefill,
   a pass after a cached prefix with padding, and bfloat16 / float32 inputs; ``folded_decode`` (a folded layer's
   decode step) against a per-head softmax on a layer laid out as a head-wise selection leaves it. The
   interpreter runs the same kernels in the suite; this is what the compiler makes of them.
2. Methods: for every registered method (and KVzip with head-wise global selection) on a model of random
   weights, (a) a budget above the prompt must give exactly the uncompressed ``generate``'s tokens, and (b) at 20 %
   kept the cache holds 0.20 of the full cache's bytes and decoding runs.
3. What the device's compiler made of each kernel launched (shared bytes, registers, spills: ``compiled``), beside
   the ahead-of-time figures of ``results/gpu/compile_report.md``.

Writes one JSON (``--out``); prints a line per check. Every check is caught on its own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from transformers import DynamicCache  # noqa: E402

import kvcompress  # noqa: E402
from benchmarks.common import random_model, release_memory, tiny_tokenizer  # noqa: E402
from benchmarks.speed_memory import kvzap_weights  # noqa: E402
from kvcompress.cache import kv_cache_bytes  # noqa: E402
from kvcompress.kernels import triton_attention, triton_kernels  # noqa: E402

STARTED = time.perf_counter()


def reference(queries, keys, values, slot_valid, observed, scaling, maximum):
    """Scores (B, H_kv, T) and output (B, q, H, d) in float64, by definition."""
    q, k, v = queries.double(), keys.double(), values.double()
    batch, heads, length, _ = q.shape
    kv_heads, total = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    slots, rows = torch.arange(total, device=q.device), torch.arange(length, device=q.device)
    causal = slots[None, :] <= (total - length + rows)[:, None]
    allowed = causal[None] & (slot_valid[:, None, :] | ~observed[:, :, None])
    weights = (q @ k.transpose(-1, -2) * scaling).masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
    output = (weights @ v).transpose(1, 2)
    counted = (weights * observed[:, None, :, None]).view(batch, kv_heads, groups * length, total)
    return (counted.amax(2) if maximum else counted.sum(2)), output


def kernel_checks(device: str) -> list[dict]:
    rows = []
    cases = [("prefill", 1, 2048, 0, False), ("after a prefix, padded", 2, 300, 1700, True),
             ("short pass", 1, 24, 4000, False)]
    for dtype in (torch.bfloat16, torch.float32):
        for name, batch, length, cached, padded in cases:
            for maximum in (False, True):
                row = {"check": "kernel", "case": name, "dtype": str(dtype).removeprefix("torch."),
                       "statistic": "max" if maximum else "sum", "length": length, "cached": cached}
                try:
                    generator = torch.Generator(device=device).manual_seed(0)
                    total = cached + length
                    queries = torch.randn(batch, 32, length, 128, generator=generator, device=device).to(dtype)
                    keys = torch.randn(batch, 8, total, 128, generator=generator, device=device).to(dtype)
                    values = torch.randn(batch, 8, total, 128, generator=generator, device=device).to(dtype)
                    slot_valid = torch.ones(batch, total, dtype=torch.bool, device=device)
                    observed = torch.ones(batch, length, dtype=torch.bool, device=device)
                    if padded:
                        slot_valid[1, :37] = False
                        slot_valid[1, cached : cached + 5] = False
                        observed[1, :5] = False
                    scaling = 128**-0.5
                    scores, output = triton_attention.fused_attention(
                        queries, keys, values, scaling, slot_valid if padded else None,
                        observed if padded else None, maximum=maximum)
                    expected_scores, expected_output = reference(queries, keys, values, slot_valid, observed,
                                                                 scaling, maximum)
                    real = observed[:, :, None, None].expand_as(output)
                    score_error = float((scores.double() - expected_scores).abs().max())
                    output_error = float((output[real].double() - expected_output[real]).abs().max())
                    output_tolerance = 2e-5 if dtype == torch.float32 else 3e-2
                    row.update(score_error=score_error, output_error=output_error,
                               passed=score_error <= 1e-4 and output_error <= output_tolerance
                               and bool(torch.isfinite(output).all()))
                except Exception as error:  # noqa: BLE001 - recorded, the next check runs
                    row.update(passed=False, error=_error(error))
                _record(rows, row)
    return rows


def folded_inputs(device: str, dtype: torch.dtype, batch: int, per_head: int, decoded: int, seed: int = 0):
    """A folded layer at the 8B shape's heads as a head-wise selection leaves it (each KV head's slots in one
    stretch, left-filled with dead slots, counts differing per head), then ``decoded`` tokens appended token-major
    (one slot per head); one query per head (B, 32, 1, 128). Returns queries, keys, values, slot_valid,
    slot_head."""
    generator = torch.Generator(device=device).manual_seed(seed)
    counts = torch.randint(per_head // 2, 2 * per_head, (batch, 8), generator=generator, device=device)
    width = int(counts.sum(-1).max())
    slot = torch.arange(width, device=device)
    dead = width - counts.sum(-1, keepdim=True)
    ends = dead + counts.cumsum(-1)  # (B, 8): where each head's stretch ends
    folded_head = (slot[None, :, None] >= ends[:, None, :]).sum(-1).clamp(max=7)
    slot_head = torch.cat([folded_head, torch.arange(8, device=device).repeat(decoded).expand(batch, -1)], -1)
    slot_valid = torch.cat([slot[None] >= dead, torch.ones(batch, 8 * decoded, dtype=torch.bool, device=device)], -1)
    total = slot_head.shape[-1]
    queries = torch.randn(batch, 32, 1, 128, generator=generator, device=device).to(dtype)
    keys = torch.randn(batch, 1, total, 128, generator=generator, device=device).to(dtype)
    values = torch.randn(batch, 1, total, 128, generator=generator, device=device).to(dtype)
    return queries, keys, values, slot_valid, slot_head


def folded_reference(queries, keys, values, slot_valid, slot_head, scaling):
    """Output (B, 1, H, d) and each slot's most attention from its own group (B, 1, M), float64, per query head."""
    batch, heads = queries.shape[:2]
    groups = heads // 8
    output = torch.empty(batch, 1, heads, queries.shape[-1], dtype=torch.float64, device=queries.device)
    scores = torch.zeros(batch, 1, keys.shape[2], dtype=torch.float64, device=queries.device)
    for b in range(batch):
        for head in range(heads):
            own = slot_valid[b] & (slot_head[b] == head // groups)
            weights = (keys[b, 0, own].double() @ queries[b, head, 0].double() * scaling).softmax(-1)
            output[b, 0, head] = weights @ values[b, 0, own].double()
            scores[b, 0, own] = torch.maximum(scores[b, 0, own], weights)
    return output, scores


def folded_decode_checks(device: str) -> list[dict]:
    """``triton_attention.folded_decode`` (a folded layer's decode step) against ``folded_reference``."""
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for batch, per_head, decoded in ((1, 1600, 16), (2, 300, 40)):
            row = {"check": "folded decode kernel", "dtype": str(dtype).removeprefix("torch."), "batch": batch,
                   "per_head": per_head, "decoded": decoded}
            try:
                queries, keys, values, slot_valid, slot_head = folded_inputs(device, dtype, batch, per_head, decoded)
                observed = torch.ones(batch, 1, dtype=torch.bool, device=device)
                output, scores = triton_attention.folded_decode(queries, keys, values, slot_valid, slot_head, 8,
                                                                128**-0.5, observed)
                expected_output, expected_scores = folded_reference(queries, keys, values, slot_valid, slot_head,
                                                                    128**-0.5)
                score_error = float((scores.double() - expected_scores).abs().max())
                output_error = float((output.double() - expected_output).abs().max())
                output_tolerance = 2e-5 if dtype == torch.float32 else 3e-2
                row.update(score_error=score_error, output_error=output_error,
                           passed=score_error <= 1e-4 and output_error <= output_tolerance)
            except Exception as error:  # noqa: BLE001 - recorded, the next check runs
                row.update(passed=False, error=_error(error))
            _record(rows, row)
    return rows


def method_checks(device: str, plan: list[tuple[str, int, str]], deadline: float) -> list[dict]:
    rows = []
    variants = [(m, m, {}) for m in kvcompress.method_names()]
    variants.append(("kvzip-global", "kvzip", {"budget_allocation": "global"}))
    for shape, length, dtype_name in plan:
        model = random_model(shape, device, getattr(torch, dtype_name))
        tokenizer = tiny_tokenizer(model.config.vocab_size)
        ids = torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))
        ids = ids.to(device)
        reference_tokens = greedy(model, ids)
        with torch.no_grad():
            full = DynamicCache(config=model.config)
            model(input_ids=ids, cache=full, use_cache=True, logits_to_keep=1)
            full_bytes = kv_cache_bytes(full)
            del full
        # KVzap on a random model: random surrogate weights with its fingerprint (exactness does not depend on them)
        kvzap = {"scorer_options": {"weights": kvzap_weights(model)}}
        for name, method, overrides in variants:
            overrides = {**overrides, **kvzap} if method == "kvzap" else overrides
            if time.perf_counter() > deadline:
                rows.append({"check": "method", "shape": shape, "method": name, "skipped": "time budget"})
                continue
            row = {"check": "method", "shape": shape, "length": length, "dtype": dtype_name, "method": name}
            try:
                with kvcompress.compress(model, method=method, budget=length + 64, tokenizer=tokenizer, **overrides):
                    row["exact"] = greedy(model, ids) == reference_tokens
                cache = DynamicCache(config=model.config)
                with torch.no_grad(), kvcompress.compress(model, method=method, budget=0.2, tokenizer=tokenizer,
                                                          **overrides):
                    token = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1:]
                    row["kv_x"] = kv_cache_bytes(cache) / full_bytes
                    for _ in range(4):
                        token = model(input_ids=token.argmax(-1), cache=cache, use_cache=True).logits[:, -1:]
                    row["finite"] = bool(torch.isfinite(token).all())
                del cache
                row["passed"] = row["exact"] and row["finite"] and abs(row["kv_x"] - 0.2) <= 0.02
            except Exception as error:  # noqa: BLE001 - recorded, the next check runs
                row.update(passed=False, error=_error(error))
            _record(rows, row)
        del model
        release_memory()
    return rows


def _record(rows: list[dict], row: dict) -> None:
    rows.append(row)
    print(f"[check] {row}", flush=True)
    release_memory()


def greedy(model, ids: torch.Tensor) -> list[list[int]]:
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                              do_sample=False).tolist()


def compiled_kernels() -> list[dict]:
    """What the device's compiler made of each kernel the checks launched (shared bytes, registers, spills), to set
    beside the ahead-of-time figures of ``results/gpu/compile_report.md``."""
    found = []
    for name in ("_forward", "_column_statistics", "_folded_decode", "_merge_splits"):
        try:
            for kernel_cache, *_ in getattr(triton_kernels, name).device_caches.values():
                for compiled in kernel_cache.values():
                    compiled._init_handles()
                    constants = {str(key): value for key, value in getattr(compiled.src, "constants", {}).items()}
                    found.append(dict(kernel=name, shared=compiled.metadata.shared, registers=compiled.n_regs,
                                      spills=compiled.n_spills, warps=compiled.metadata.num_warps,
                                      stages=compiled.metadata.num_stages, constants=constants))
        except Exception as error:  # noqa: BLE001 - recorded, the check's result stands
            found.append(dict(kernel=name, error=_error(error)))
    return found


def _error(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error)[:400]} | " + "".join(traceback.format_exc().splitlines(True)[-3:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--plan", default="tiny-llama:512:float32,llama3-8b-shape:2048:float32",
                        help="shape:length:dtype,... of the method checks")
    parser.add_argument("--deadline-s", type=float, default=0.0, help="start no method check after this (0: none)")
    parser.add_argument("--out", default="check.json")
    args = parser.parse_args(argv)
    deadline = STARTED + args.deadline_s if args.deadline_s else float("inf")
    rows = kernel_checks(args.device) + folded_decode_checks(args.device) if args.device != "cpu" else []
    plan = [(shape, int(length), dtype) for shape, length, dtype in (item.split(":") for item in args.plan.split(","))]
    rows += method_checks(args.device, plan, deadline)
    done = [row for row in rows if "passed" in row]
    result = {"device": args.device, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "torch": torch.__version__, "triton": getattr(triton_attention.triton, "__version__", None),
              "passed": sum(row["passed"] for row in done), "failed": sum(not row["passed"] for row in done),
              "rows": rows, "compiled": compiled_kernels() if args.device != "cpu" else [],
              "wall_s": time.perf_counter() - STARTED}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"[check] {result['passed']} passed, {result['failed']} failed, {result['wall_s']:.0f} s", flush=True)
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
