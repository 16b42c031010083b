"""One numeric fact in a made-up report: does a compressed context still answer it?

For each of the generated reports (``tests/data/fact_reports.py``: about 1,500 tokens of prose on a made-up
organisation with exactly one number in it, e.g. "2,750 litres per second") the default model answers the question
for that number with the full cache and with each method at ``--budget`` (0.2: 20 % of the context's slots), the
context first: compressed by ``session.prefill`` before the question is seen, then ``session.generate`` on the
question (the README's "compress a document once, ask several questions"). The prompt is cut as the RULER runner
cuts it (``ruler.chat.encode_prompt``: the user message is context + question, the chat template's header and the
context are the prefill, the question and the template's turn end follow). ``method:query_aware`` runs a method on
the whole prompt at once instead (the quick start); ``method+key=value`` passes a parameter to ``kvcompress.compress``
(``kvzip+budget_allocation=adaptive``); ``method@0.5`` runs it at budget 0.5 instead of ``--budget``. An answer
is right when the expected number, commas removed, appears in it as a whole number.

Each answer is appended to ``<out>/records.jsonl`` as it comes, and a rerun skips what is there (``--fresh``
starts over); the table goes to ``<out>/scores.md`` (the folder's README.md is the analysis). float32, one thread.

    OMP_NUM_THREADS=1 python benchmarks/fact_reports.py --out results/fact_reports
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "data")]

from fact_reports import Report, reports  # noqa: E402

import kvcompress  # noqa: E402
from kvcompress.cache import full_cache_bytes, kv_cache_bytes  # noqa: E402
from kvcompress.models import load_default_model  # noqa: E402
from ruler.chat import encode_prompt  # noqa: E402
from ruler.prompts import PromptParts  # noqa: E402

QUESTION = "\n\nQuestion: {question} Answer with the number and its unit."
ANSWER_PREFIX = ""


def parts(report: Report) -> PromptParts:
    return PromptParts(context=report.text, question=QUESTION.format(question=report.question),
                       answer_prefix=ANSWER_PREFIX)


def correct(answer: str, expected: str) -> bool:
    """The expected number, commas removed, appears in the answer as a whole number."""
    number = expected.replace(",", "")
    text = re.sub(r"(?<=\d),(?=\d)", "", answer)
    return re.search(rf"(?<![\d.]){re.escape(number)}(?![\d]|\.\d)", text) is not None


def override_value(value: str):
    """``0.5``, ``true``/``True``, ``null``/``None``, ``[...]`` as JSON; anything else a string."""
    value = {"True": "true", "False": "false", "None": "null"}.get(value, value)
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


@torch.no_grad()
def run_one(model, tokenizer, report: Report, method: str, budget: float, max_new_tokens: int) -> dict:
    name, _, protocol = method.partition(":")
    protocol = protocol or "context_first"
    name, *settings = name.split("+")  # "kvzip+budget_allocation=adaptive": keyword arguments of compress
    overrides = {key: override_value(value) for key, value in (setting.split("=", 1) for setting in settings)}
    encoded = encode_prompt(tokenizer, parts(report), protocol)
    ids = torch.tensor([encoded.input_ids])
    context, question = ids[:, : encoded.prefill_length], ids[:, encoded.prefill_length :]
    eos = model.generation_config.eos_token_id
    if name == "full":
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        model(input_ids=context, cache=cache, use_cache=True, logits_to_keep=1)
        kept, full = kv_cache_bytes(cache), full_cache_bytes(cache, context.shape[1])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache,
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        new = out[0, ids.shape[1] :]
    elif protocol == "context_first":
        with kvcompress.compress(model, method=name, budget=budget, tokenizer=tokenizer, **overrides) as session:
            cache = session.prefill(context)
            kept, full = kv_cache_bytes(cache), full_cache_bytes(cache, context.shape[1])
            new = session.generate(question, max_new_tokens=max_new_tokens)[0]
    else:  # query_aware: the whole prompt compressed at once inside generate
        with kvcompress.compress(model, method=name, budget=budget, tokenizer=tokenizer, **overrides):
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, return_dict_in_generate=True, eos_token_id=eos, pad_token_id=eos)
        new = out.sequences[0, ids.shape[1] :]
        kept, full = kv_cache_bytes(out.cache), full_cache_bytes(out.cache, ids.shape[1] + len(new) - 1)
    answer = tokenizer.decode(new, skip_special_tokens=True).strip()
    return {"answer": answer, "correct": correct(answer, report.answer), "context_tokens": int(context.shape[1]),
            "kv_bytes": kept, "full_kv_bytes": full}


def split_budget(entry: str, default: float) -> tuple[str, float]:
    """``kvzip@0.5`` -> ("kvzip", 0.5); ``kvzip`` -> ("kvzip", default)."""
    method, at, budget = entry.rpartition("@")
    return (method, float(budget)) if at else (entry, default)


def table(rows: list[dict], runs: list[tuple[str, float]], count: int) -> str:
    by = {run: [r for r in rows if r["method"] == run[0] and (run[0] == "full" or r["budget"] == run[1])]
          for run in runs}
    fulls = [r for (method, _), done in by.items() if method == "full" for r in done]
    full_right = sum(r["correct"] for r in fulls)
    lines = ["| method | budget | facts answered | ratio to full cache | KV bytes kept / full |",
             "|---|---|---|---|---|"]
    for (method, budget), done in by.items():
        right = sum(r["correct"] for r in done)
        kept = sum(r["kv_bytes"] for r in done) / max(sum(r["full_kv_bytes"] for r in done), 1)
        ratio = f"{right / full_right:.2f}" if full_right and len(fulls) == len(done) else "–"
        lines.append(f"| {method} | {'–' if method == 'full' else budget} | {right} / {len(done)}"
                     f"{'' if len(done) == count else f' (of {count})'} | {ratio} | {kept:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=["full", "kvzip", "kvzap"],
                        help="full, or a method name, optionally :query_aware (default context_first), +key=value "
                             "(a compress() parameter) and @budget (instead of --budget): kvzip+adaptive_floor=0.5@0.3")
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--count", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "fact_reports")
    parser.add_argument("--fresh", action="store_true", help="ignore earlier answers in <out>/records.jsonl")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    records = args.out / "records.jsonl"
    key = lambda r: (r["method"], r["budget"], r["seed"], r["index"])  # noqa: E731
    rows = [] if args.fresh or not records.exists() else [json.loads(line) for line in records.read_text().splitlines()]
    done = {key(r) for r in rows}
    model, tokenizer = load_default_model(dtype=torch.float32)
    model.eval()
    items = reports(args.count, args.seed)
    runs = list(dict.fromkeys(split_budget(entry, args.budget) for entry in args.methods))
    with records.open("w" if args.fresh else "a") as sink:
        for method, budget in runs:
            for index, report in enumerate(items):
                row = {"method": method, "budget": budget, "seed": args.seed, "index": index}
                if key(row) in done:
                    continue
                start = time.perf_counter()
                row |= run_one(model, tokenizer, report, method, budget, args.max_new_tokens)
                row |= {"expected": report.answer, "seconds": round(time.perf_counter() - start, 2)}
                print(f"{method:>20} #{index:2d} {'ok ' if row['correct'] else 'MISS'} {report.answer:>8} <- "
                      f"{row['answer'][:70]!r}", flush=True)
                sink.write(json.dumps(row) + "\n")
                sink.flush()
                rows.append(row)
    wanted = {(m, b, args.seed, i) for m, b in runs for i in range(args.count)}
    rows = [r for r in rows if key(r) in wanted]
    text = table(rows, runs, args.count)
    arguments = " ".join(argv if argv is not None else sys.argv[1:])
    command = f"OMP_NUM_THREADS=1 python benchmarks/fact_reports.py {arguments}"
    (args.out / "scores.md").write_text(
        f"# One numeric fact per made-up report\n\n{args.count} reports of `tests/data/fact_reports.py` (seed "
        f"{args.seed}), SmolLM2-135M-Instruct, float32, greedy, {args.max_new_tokens} new tokens; the context first "
        f"(prefilled and compressed before the question) unless `:query_aware`. Per-answer records: "
        f"`records.jsonl`.\n\n```bash\nsource scripts/env.sh\n{command.strip()}\n```\n\n{text}\n")
    print(text)


if __name__ == "__main__":
    main()
