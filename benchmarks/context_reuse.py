"""Store a compressed context and reuse it in another process: how long, how big, how much memory, how exact.

Per (model, dtype, method, context length), at ``--budget`` (0.2: 20 % of the context's slots), two processes:

* ``compress`` (a subprocess per row): loads the model, builds the context (the demo report's text, repeated, in
  the model's chat template through ``kvcompress.chat.document_prompt``, cut to the length), runs a short forward
  that pages in the weights, then times the uncompressed prefill (``model(ids, use_cache=True, logits_to_keep=1)``),
  the compressed one (``with session: session.prefill(ids)``: what compressing the context again costs), answers
  the demo question greedily in memory (``session.generate``, ``--max-new-tokens``), and times ``session.save``.
* ``load`` (a fresh subprocess, after the first has exited): loads the model (not timed) and pages in its weights,
  then from one clock: ``kvcompress.load(model, file)`` (load), then ``with session: session.generate(question,
  max_new_tokens=1)`` (load + first answer token); memory is the kernel's RSS high-water mark (VmHWM, reset
  through ``/proc/self/clear_refs``) above the RSS before the load, over the load alone and over load + first
  token, with glibc's malloc thresholds fixed so that the RSS follows the live tensors. Then the whole answer,
  which must equal the in-memory one token for token (exact).

The file is read back from the page cache (it was just written); the memory-mapped keys and values count in the
RSS once touched. Each finished row is appended to ``<out>/rows.jsonl`` keyed by model/dtype/method/length, and a
rerun skips what is there (``--fresh`` starts over); ``<out>/README.md``'s table is rewritten from every row.

    OMP_NUM_THREADS=1 python benchmarks/context_reuse.py --models default --dtypes float32 --methods kvzip kvzap \\
        --lengths 4096 16384 --out results/context_reuse
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    DEMO_TEXT,
    _high_water_mark_bytes,
    _reset_high_water_mark,
    _rss_bytes,
    fixed_malloc_thresholds,
    release_memory,
)

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "According to the report, in which city will the new battery factory be built?"
MODEL_NAMES = {"default": "SmolLM2-135M-Instruct", "gemma3-270m": "Gemma 3 270M"}
METHOD_NAMES = {"kvzip": "KVzip", "kvzap": "KVzap"}
MB = 1e6


def _key(row: dict) -> tuple:
    return row["model"], row["dtype"], row["method"], row["length"]


# ---------------------------------------------------------------------------------------------------- one phase
def _model(name: str, dtype: str, threads: int):
    from kvcompress.models import load_model

    torch.set_num_threads(threads)
    return load_model(name, dtype=getattr(torch, dtype))


def _prompt(tokenizer, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The context's ids (1, length): the chat template's head around the demo report repeated, cut to ``length``;
    and the question's ids (1, Q) that close the user turn."""
    from kvcompress.chat import document_prompt

    text = DEMO_TEXT.read_text(encoding="utf-8").strip()
    per_copy = len(tokenizer.encode(text, add_special_tokens=False))
    document = "\n\n".join([text] * (length // per_copy + 2))
    rendered = document_prompt(tokenizer, document)
    head = rendered.head_ids(tokenizer)
    if len(head) < length:
        raise ValueError(f"the context holds {len(head)} tokens, fewer than {length}")
    return torch.tensor([head[:length]]), torch.tensor([rendered.question_ids(tokenizer, QUESTION)])


@torch.no_grad()
def compress_phase(args) -> dict:
    import kvcompress

    model, tokenizer = _model(args.model, args.dtype, args.threads)
    ids, question = _prompt(tokenizer, args.length)
    model(ids[:, :16])  # pages in the memory-mapped weights
    started = time.perf_counter()
    out = model(ids, use_cache=True, logits_to_keep=1)
    prefill_s = time.perf_counter() - started
    del out
    release_memory()
    session = kvcompress.compress(model, method=args.method, budget=args.budget, tokenizer=tokenizer)
    with session:
        started = time.perf_counter()
        session.prefill(ids)
        compress_s = time.perf_counter() - started
        report = session.report()
        answer = session.generate(question, max_new_tokens=args.max_new_tokens)[0].tolist()
    started = time.perf_counter()
    summary = session.save(args.file)
    save_s = time.perf_counter() - started
    return {
        "tokens": int(ids.shape[1]), "question_tokens": int(question.shape[1]), "prefill_s": prefill_s,
        "compress_s": compress_s, "save_s": save_s, "file_bytes": os.path.getsize(args.file),
        "kv_bytes": report.kv_bytes, "full_kv_bytes": report.full_kv_bytes, "saved_summary": summary,
        "compression_timings": {k: round(v, 4) for k, v in report.timings.items()},
        "answer_ids": answer,
        "answer": tokenizer.decode(answer, skip_special_tokens=True).strip(),
    }


@torch.no_grad()
def load_phase(args) -> dict:
    import kvcompress

    fixed_malloc_thresholds()
    model, tokenizer = _model(args.model, args.dtype, args.threads)
    ids, question = _prompt(tokenizer, args.length)
    model(ids[:, :16])  # pages in the memory-mapped weights
    del ids
    release_memory()
    base = _rss_bytes()
    hwm = _reset_high_water_mark()
    started = time.perf_counter()
    session = kvcompress.load(model, args.file, tokenizer=tokenizer)
    load_s = time.perf_counter() - started
    load_peak = _high_water_mark_bytes() if hwm else _rss_bytes()
    rss_after_load = _rss_bytes()
    _reset_high_water_mark()  # the mark back to the RSS now: the first token's own peak
    with session:
        first = session.generate(question, max_new_tokens=1)[0].tolist()
    first_token_s = time.perf_counter() - started
    token_peak = _high_water_mark_bytes() if hwm else _rss_bytes()
    rss_after_token = _rss_bytes()
    with session:
        answer = session.generate(question, max_new_tokens=args.max_new_tokens)[0].tolist()
    report = session.report()
    del session
    release_memory()
    # a second load of the file in the same process: what a process that serves contexts pays per load, once the
    # model's identity is known (computed once per model and process) and the mapping's pages are cached
    warm_base = _rss_bytes()
    _reset_high_water_mark()
    started = time.perf_counter()
    again = kvcompress.load(model, args.file, tokenizer=tokenizer)
    warm_load_s = time.perf_counter() - started
    warm_peak = _high_water_mark_bytes() if hwm else _rss_bytes()
    return {
        "warm_load_s": warm_load_s, "warm_load_peak_bytes": warm_peak - warm_base,
        "warm_load_kv_bytes": again.report().kv_bytes,
        "compressed_cache_bytes": report.kv_bytes + report.state_bytes,
        "load_s": load_s, "load_first_token_s": first_token_s,
        "memory_method": "VmHWM" if hwm else "RSS after (no VmHWM reset)",
        "load_peak_bytes": load_peak - base, "load_first_token_peak_bytes": max(load_peak, token_peak) - base,
        "rss_after_load_bytes": rss_after_load - base, "rss_after_first_token_bytes": rss_after_token - base,
        "first_token": first, "loaded_answer_ids": answer,
    }


# ---------------------------------------------------------------------------------------------------- the rows
def _subprocess(phase: str, model: str, dtype: str, method: str, length: int, file: Path, args) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--phase", phase, "--model", model, "--dtype", dtype,
               "--method", method, "--length", str(length), "--file", str(file), "--budget", str(args.budget),
               "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{phase} {model} {dtype} {method} {length} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_row(model: str, dtype: str, method: str, length: int, args) -> dict:
    file = args.workdir / f"{model}_{dtype}_{method}_{length}.safetensors"
    row = {"model": model, "dtype": dtype, "method": method, "length": length, "budget": args.budget}
    started = time.perf_counter()
    row |= _subprocess("compress", model, dtype, method, length, file, args)
    row |= _subprocess("load", model, dtype, method, length, file, args)
    file.unlink(missing_ok=True)
    row["exact"] = row["loaded_answer_ids"] == row["answer_ids"] and row["first_token"] == row["answer_ids"][:1]
    row["wall_s"] = round(time.perf_counter() - started, 1)
    return row


def _fmt(value: float, digits: int = 2) -> str:
    return f"{value:.{digits}f}"


def table(rows: list[dict]) -> str:
    lines = [
        "| model | dtype | method | tokens | uncompressed prefill s | compress s | save s | load s "
        "| load + first token s | ÷ compress | ÷ uncompressed prefill | file MB | kept KV MB | file ÷ kept "
        "| peak load MB ÷ kept | peak load + first token MB ÷ kept | exact |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    order = {name: i for i, name in enumerate(MODEL_NAMES)}
    for r in sorted(rows, key=lambda r: (order.get(r["model"], 9), r["dtype"] != "float32", r["method"] != "kvzip",
                                         r["length"])):
        kept = r["kv_bytes"]
        lines.append(
            f"| {MODEL_NAMES.get(r['model'], r['model'])} | {r['dtype']} | {METHOD_NAMES.get(r['method'], r['method'])}"
            f" | {r['tokens']:,} | {_fmt(r['prefill_s'], 1)} | {_fmt(r['compress_s'], 1)} | {_fmt(r['save_s'], 3)}"
            f" | {_fmt(r['load_s'], 3)} | {_fmt(r['load_first_token_s'], 3)}"
            f" | {_fmt(r['load_first_token_s'] / r['compress_s'], 4)}"
            f" | {_fmt(r['load_first_token_s'] / r['prefill_s'], 4)} | {_fmt(r['file_bytes'] / MB, 1)}"
            f" | {_fmt(kept / MB, 1)} | {_fmt(r['file_bytes'] / kept, 3)}"
            f" | {_fmt(r['load_peak_bytes'] / MB, 1)} ÷ {_fmt(kept / MB, 1)} = {_fmt(r['load_peak_bytes'] / kept)}"
            f" | {_fmt(r['load_first_token_peak_bytes'] / MB, 1)} = {_fmt(r['load_first_token_peak_bytes'] / kept)}"
            f" | {'yes' if r['exact'] else 'NO'} |")
    return "\n".join(lines)


def memory_table(rows: list[dict]) -> str:
    """The loads' memory, for rows that measured a second (warm) load: against the kept KV bytes, and against the
    compressed cache the loaded session holds (its keys and values and their eviction state)."""
    lines = ["| model | dtype | method | tokens | kept KV MB | compressed cache MB | first load peak MB (÷ kept, "
             "÷ cache) | second load s | second load peak MB (÷ kept, ÷ cache) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "warm_load_peak_bytes" not in r:
            continue
        kept, cache = r["kv_bytes"], r["compressed_cache_bytes"]

        def peak(value: int) -> str:
            return f"{_fmt(value / MB, 1)} ({_fmt(value / kept)}, {_fmt(value / cache)})"

        lines.append(f"| {MODEL_NAMES.get(r['model'], r['model'])} | {r['dtype']} | "
                     f"{METHOD_NAMES.get(r['method'], r['method'])} | {r['tokens']:,} | {_fmt(kept / MB, 1)} | "
                     f"{_fmt(cache / MB, 1)} | {peak(r['load_peak_bytes'])} | {_fmt(r['warm_load_s'], 3)} | "
                     f"{peak(r['warm_load_peak_bytes'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["default"], help="embedded models: default, gemma3-270m")
    parser.add_argument("--dtypes", nargs="+", default=["float32"])
    parser.add_argument("--methods", nargs="+", default=["kvzip", "kvzap"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[4096])
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "context_reuse")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/context_reuse"), help="where the files go")
    parser.add_argument("--fresh", action="store_true", help="ignore earlier rows in <out>/rows.jsonl")
    parser.add_argument("--phase", choices=["compress", "load"], help=argparse.SUPPRESS)
    for name, kind in (("model", str), ("dtype", str), ("method", str), ("length", int), ("file", str)):
        parser.add_argument(f"--{name}", type=kind, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phase:
        result = (compress_phase if args.phase == "compress" else load_phase)(args)
        print(json.dumps(result), flush=True)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    records = args.out / "rows.jsonl"
    rows = [] if args.fresh or not records.exists() else [json.loads(line) for line in records.read_text().splitlines()]
    done = {_key(r) for r in rows}
    with records.open("w" if args.fresh else "a") as sink:
        for model in args.models:
            for dtype in args.dtypes:
                for method in args.methods:
                    for length in args.lengths:
                        if (model, dtype, method, length) in done:
                            continue
                        print(f"{model} {dtype} {method} {length} ...", flush=True)
                        row = run_row(model, dtype, method, length, args)
                        row["date"] = time.strftime("%Y-%m-%d %H:%M")
                        print(f"  prefill {row['prefill_s']:.1f}s compress {row['compress_s']:.1f}s save "
                              f"{row['save_s']:.3f}s load+1 {row['load_first_token_s']:.3f}s file "
                              f"{row['file_bytes'] / MB:.1f}MB kept {row['kv_bytes'] / MB:.1f}MB peak "
                              f"{row['load_peak_bytes'] / MB:.1f}/{row['load_first_token_peak_bytes'] / MB:.1f}MB "
                              f"exact {row['exact']} answer {row['answer']!r}", flush=True)
                        sink.write(json.dumps(row) + "\n")
                        sink.flush()
                        rows.append(row)
                        done.add(_key(row))
    (args.out / "table.md").write_text(table(rows) + "\n\n" + memory_table(rows) + "\n")
    print(table(rows))
    print(memory_table(rows))
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
