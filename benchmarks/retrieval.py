"""Long-context retrieval quality of the default model under KV-cache compression.

First calibrates: every prompt runs with the full cache, and only the (task, length) cells the model solves
(accuracy >= --min-full-accuracy) go on to the sweep of methods x budgets, so a loss of accuracy measures the
compression, not the model. Budgets are fractions of each prompt's token count. Each generation is appended to
``<stem>_runs.jsonl`` as it finishes (``--resume`` continues an interrupted run); the summary goes to
``<stem>.csv``, ``<stem>.json``, ``<stem>.md`` (with the command) and ``<stem>.png``.

    python benchmarks/retrieval.py --quick          # about 2 minutes: one length, two methods, one budget
    python benchmarks/retrieval.py                  # the full sweep (see results/retrieval.md)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shlex
import sys
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.retrieval_methods import DEFAULT_METHODS, METHODS, method_parameters  # noqa: E402
from benchmarks.retrieval_report import (  # noqa: E402
    ALL,
    FULL,
    Record,
    append_record,
    calibration_table,
    headline_table,
    load_records,
    markdown_table,
    plot,
    summarise,
    write_tables,
)
from benchmarks.retrieval_tasks import DEFAULT_TASKS, TASKS, Sample, make_samples  # noqa: E402
from kvcompress import KVCacheCompressionParameters, KVCacheCompressor  # noqa: E402
from kvcompress.cache import kv_cache_length  # noqa: E402
from kvcompress.models import load_default_model  # noqa: E402

QUICK = dict(tasks=["passkey", "kv-2"], lengths=[1024], depths=[0.5], methods=["start+recent", "snapkv-norm_sum"],
             budgets=[0.2])
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(DEFAULT_TASKS))
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096], help="prompt lengths in tokens")
    parser.add_argument("--depths", nargs="+", type=float, default=[0.1, 0.3, 0.5, 0.7, 0.9],
                        help="needle depths in [0, 1]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(DEFAULT_METHODS))
    parser.add_argument("--budgets", nargs="+", type=float, default=[0.1, 0.2, 0.4],
                        help="KV budget per layer as a fraction of the prompt's tokens")
    parser.add_argument("--min-full-accuracy", type=float, default=0.8,
                        help="a (task, length) cell enters the sweep only if the full cache reaches this accuracy")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--dtype", choices=list(DTYPES), default="auto",
                        help="auto: bfloat16 where the CPU computes it natively (AVX512-BF16 or AMX), else float32")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--output-dir", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    parser.add_argument("--resume", action="store_true", help="keep the runs already recorded and do the rest")
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK}")
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    for name in ("depths", "budgets"):
        bad = [v for v in getattr(args, name) if not 0.0 <= v <= 1.0 or (name == "budgets" and v == 0.0)]
        if bad:
            parser.error(f"--{name} must lie in {'(0, 1]' if name == 'budgets' else '[0, 1]'}, got {bad}")
    if min(args.lengths) < 256:
        parser.error(f"--lengths must be >= 256 tokens (the question and the needles need room), got {args.lengths}")
    return args


def generate(model, tokenizer, sample: Sample, params: KVCacheCompressionParameters | None, max_new_tokens: int):
    """Greedy answer of one prompt, with the cache compressed by ``params`` (None: the full cache)."""
    ids = torch.tensor([sample.input_ids])
    session = KVCacheCompressor(eviction_parameters=params)(model) if params else contextlib.nullcontext()
    start = time.perf_counter()
    with session:
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, return_dict_in_generate=True)
    seconds = time.perf_counter() - start
    text = tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)
    return text, kv_cache_length(out.cache), seconds


def run(model, tokenizer, sample: Sample, method: str, budget: float, max_new_tokens: int) -> Record:
    params = None if method == FULL else method_parameters(method, max(1, round(budget * sample.prompt_tokens)))
    text, slots, seconds = generate(model, tokenizer, sample, params, max_new_tokens)
    return Record(sample.task, sample.length, sample.depth, sample.seed, sample.fingerprint, method, budget,
                  sample.prompt_tokens, slots, " ".join(sample.answers), text, sample.is_correct(text),
                  round(seconds, 3))


def run_all(jobs, model, tokenizer, args, runs_path: Path, done: dict[tuple, Record], title: str) -> list[Record]:
    records = []
    for sample, method, budget in tqdm(jobs, desc=title, unit="run", dynamic_ncols=True):
        key = (sample.fingerprint, method, budget)
        if key not in done:
            done[key] = run(model, tokenizer, sample, method, budget, args.max_new_tokens)
            append_record(runs_path, done[key])
        records.append(done[key])
    return records


def write_markdown(path: Path, args, argv, calibration, summary, kept, records) -> None:
    """The README-ready report; the command omits ``--resume``, which does not change the results."""
    command = shlex.join(a for a in argv if a != "--resume")
    minutes = sum(r.seconds for r in records) / 60
    environment = (f"SmolLM2-135M-Instruct (default model, {args.dtype}), torch {torch.__version__}, "
                   f"{args.threads} thread(s), {platform.machine()}; {len(records)} generations, "
                   f"{minutes:.0f} min of generation time")
    sections = [
        "# Retrieval under KV-cache compression (default model)",
        f"Command (from the repository root, {datetime.now(timezone.utc):%Y-%m-%d}):\n\n"
        f"```bash\npython benchmarks/retrieval.py {command}\n```".replace(" \n", "\n"),
        f"{environment}. Greedy decoding, at most {args.max_new_tokens} new tokens; an answer is correct when it "
        "contains the expected number. Budget = slots kept per layer as a fraction of the prompt's tokens "
        "(start area min(32, budget/8), recent min(64, budget/4), the rest chosen by score; start+recent keeps "
        "the same start area and spends the rest on recent tokens). Cells: accuracy (correct/total).",
        "## Accuracy, pooled over the calibrated tasks and lengths\n\n"
        + headline_table(summary, args.methods, args.budgets),
        "## Calibration (full cache)\n\n" + calibration_table(calibration, kept),
        "## All calibrated tasks, per length\n\n" + markdown_table(summary, ALL, args.methods, args.budgets),
    ]
    for task in args.tasks:
        if any(t == task for t, _ in kept):
            sections.append(f"## {task}\n\n" + markdown_table(summary, task, args.methods, args.budgets))
    path.write_text("\n\n".join(sections) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    stem = "retrieval_quick" if args.quick else "retrieval"
    args.output_dir.mkdir(parents=True, exist_ok=True)
    runs_path = args.output_dir / f"{stem}_runs.jsonl"
    if not args.resume:
        runs_path.unlink(missing_ok=True)
    done = {r.key: r for r in load_records(runs_path)}

    model, tokenizer = load_default_model(dtype=DTYPES[args.dtype])
    args.dtype = str(model.dtype).removeprefix("torch.")  # what "auto" chose, for the report
    samples = make_samples(args.tasks, args.lengths, args.depths, args.seed, tokenizer)
    calibration = run_all([(s, FULL, 1.0) for s in samples], model, tokenizer, args, runs_path, done, "full cache")
    per_cell: dict[tuple[str, int], list[bool]] = defaultdict(list)
    for record in calibration:
        per_cell[(record.task, record.length)].append(record.correct)
    kept = {cell for cell, results in per_cell.items() if sum(results) / len(results) >= args.min_full_accuracy}
    print("full-cache accuracy: " + ", ".join(f"{t}@{n}={sum(v)}/{len(v)}" for (t, n), v in sorted(per_cell.items())))

    jobs = [(s, m, b) for s in samples if (s.task, s.length) in kept for m in args.methods for b in args.budgets]
    sweep = run_all(jobs, model, tokenizer, args, runs_path, done, "sweep")
    summary = summarise(sweep + [r for r in calibration if (r.task, r.length) in kept])
    write_tables(summary, args.output_dir, stem)
    write_markdown(args.output_dir / f"{stem}.md", args, argv, summarise(calibration), summary, kept,
                   calibration + sweep)
    plotted = plot(summary, args.methods, args.budgets, args.output_dir / f"{stem}.png")
    print((args.output_dir / f"{stem}.md").read_text(encoding="utf-8"))
    if not plotted:
        print("matplotlib is not installed (pip install 'kvcompress[plot]'): no plot written", file=sys.stderr)


if __name__ == "__main__":
    main()
