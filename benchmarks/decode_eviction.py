#!/usr/bin/env python
"""Quality of eviction during long generations: a chat whose question comes after a long answer.

Each RULER record (single needles, the runner's records) becomes a two-turn chat: the user gives the record's
context and asks for something unrelated ("tell me about the report you wrote"), the assistant's answer is
``--preamble`` tokens of an unrelated text (kvcompress's demo report), then the user asks the record's question
and the assistant's answer prefix follows. The first user turn is prefilled and compressed to ``--budget`` of its
tokens; everything after it is forced one token at a time (what a reasoning trace or a long answer does to the
cache: every token is a decode step), and the answer is generated greedily and scored with RULER's metric.
Methods that evict during decoding keep the cache at its budget throughout (KVzap scores each new token with its
surrogate; SnapKV and H2O by the attention it receives); ``kvzip-prompt`` compresses the prompt with KVzip and then
keeps every generated token (its reconstruction cannot score them), so its cache grows by the forced tokens;
``kvzip-decoding`` (KVzip's head-wise preset) and ``kvzap-heads`` (KVzap's scores, every head of every layer
competing) evict while decoding, each head kept to the count the prompt's selection gave it (KVzip scores a
decoded token by the most attention later steps give it).
The table gives records answered and the KV bytes at the answer against the full cache's.

Resumable: every (method, record) is one line of ``<out>.jsonl``, skipped when present.

    python benchmarks/decode_eviction.py --methods full kvzap kvzip-prompt snapkv h2o --out results/decode_eviction
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvcompress import compress  # noqa: E402
from kvcompress.cache import kv_cache_bytes  # noqa: E402
from kvcompress.models import load_model  # noqa: E402
from ruler.metrics import score_task  # noqa: E402
from ruler.prompts import max_new_tokens, split_input  # noqa: E402

RECORDS = ROOT / "results" / "ruler_runner_smollm2_2k" / "data"
PREAMBLE = ROOT / "kvcompress" / "data" / "demo_report.txt"  # unrelated to the records' haystacks and needles
FIRST_REQUEST = "\n\nBefore my question about the text above: write me a long business report."
METHODS = {  # name -> (preset method, overrides; a "budget" of their own replaces --budget)
    "kvzap": ("kvzap", {}),
    # what scores below 0.045 leaves (a 20 % share on calibration records), prompt and decoded tokens alike; half the
    # prompt is the cap
    "kvzap-t0.045": ("kvzap", {"score_threshold": 0.045, "budget": 0.5}),
    # layer-wise, as first measured (the preset was then); the head-wise preset evicting while decoding beside it
    "kvzip-prompt": ("kvzip", {"budget_allocation": "global", "compress_during_decoding": False}),
    "kvzip-decoding": ("kvzip", {"compress_during_decoding": True}),
    "kvzap-heads": ("kvzap", {"budget_allocation": "global_adaptive", "compress_during_decoding": True}),
    "snapkv": ("snapkv", {}),
    "h2o": ("h2o", {}),
    "expected_attention": ("expected_attention", {}),
}


def record_prompts(tokenizer, task: str, limit: int,
                   preamble: str) -> list[tuple[str, list[int], list[int], list[str]]]:
    """(id, the first user turn's ids up to the assistant's reply, the ids forced after it, references) of the
    task's first ``limit`` records."""
    path = next(RECORDS.glob(f"{task}_*/validation.jsonl"))
    prompts = []
    for line in path.read_text(encoding="utf-8").splitlines()[:limit]:
        record = json.loads(line)
        parts = split_input(task, record["input"])
        first = [{"role": "user", "content": parts.context + FIRST_REQUEST}]
        chat = [*first, {"role": "assistant", "content": preamble}, {"role": "user", "content": parts.question.strip()}]
        head = tokenizer.apply_chat_template(first, add_generation_prompt=True, tokenize=False)
        whole = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(head, add_special_tokens=False)
        forced = tokenizer.encode(whole[len(head):] + parts.answer_prefix.strip(), add_special_tokens=False)
        prompts.append((f"{task}-{record['index']}", ids, forced, record["outputs"]))
    return prompts


@torch.no_grad()
def answer(model, tokenizer, ids: list[int], forced: list[int], new_tokens: int) -> tuple[str, int]:
    """Prefill ``ids``, force ``forced`` one token at a time, then greedy decoding; the answer and the KV bytes
    the cache holds when the answer starts."""
    output = model(torch.tensor([ids]), use_cache=True)
    cache = output.past_key_values
    for token in forced:
        output = model(torch.tensor([[token]]), cache=cache, use_cache=True)
    held = kv_cache_bytes(cache)
    generated = []
    for _ in range(new_tokens):
        token = int(output.logits[0, -1].argmax())
        if token == tokenizer.eos_token_id:
            break
        generated.append(token)
        output = model(torch.tensor([[token]]), cache=cache, use_cache=True)
    return tokenizer.decode(generated, skip_special_tokens=True), held


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=["full", *METHODS], choices=["full", *METHODS])
    parser.add_argument("--tasks", nargs="+", default=["niah_single_1", "niah_single_2"])
    parser.add_argument("--records", type=int, default=10, help="per task")
    parser.add_argument("--budget", type=float, default=0.2, help="fraction of the prompt kept")
    parser.add_argument("--preamble", type=int, default=512, help="tokens forced before the answer")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True, help="writes OUT.jsonl (resumable) and OUT.md")
    parser.add_argument("--report-only", action="store_true", help="render OUT.md from the runs so far")
    args = parser.parse_args(argv)
    if args.report_only:
        write_report(args, args.out.with_suffix(".jsonl"))
        return 0
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("default", dtype=torch.float32)
    preamble_ids = tokenizer.encode(PREAMBLE.read_text(encoding="utf-8"), add_special_tokens=False)
    preamble = tokenizer.decode(preamble_ids[: args.preamble])
    lines = args.out.with_suffix(".jsonl")
    done = {(row["method"], row["id"]) for row in map(json.loads, lines.read_text().splitlines())} \
        if lines.exists() else set()
    for task in args.tasks:
        for record_id, ids, forced, references in record_prompts(tokenizer, task, args.records, preamble):
            for method in args.methods:
                if (method, record_id) in done:
                    continue
                started = time.perf_counter()
                if method == "full":
                    prediction, held = answer(model, tokenizer, ids, forced, max_new_tokens(task))
                else:
                    name, overrides = METHODS[method]
                    overrides = {"budget": args.budget, **overrides}
                    with compress(model, method=name, tokenizer=tokenizer, **overrides):
                        prediction, held = answer(model, tokenizer, ids, forced, max_new_tokens(task))
                row = {"method": method, "id": record_id, "task": task, "prompt_tokens": len(ids),
                       "forced_tokens": len(forced), "kv_bytes": held, "prediction": prediction,
                       "references": references, "score": score_task(task, [prediction], [references]),
                       "seconds": round(time.perf_counter() - started, 1)}
                with lines.open("a") as handle:
                    handle.write(json.dumps(row) + "\n")
                print(f"{method} {record_id}: {row['score']:.0f} ({row['seconds']} s)", file=sys.stderr, flush=True)
    write_report(args, lines)
    return 0


def write_report(args, lines: Path) -> None:
    rows = [json.loads(line) for line in lines.read_text().splitlines()]
    full_bytes = {row["id"]: row["kv_bytes"] for row in rows if row["method"] == "full"}
    table = ["| method | records answered | KV bytes at the answer × full |", "|---|---|---|"]
    for method in args.methods:
        mine = [row for row in rows if row["method"] == method]
        if not mine:
            continue
        answered = sum(row["score"] >= 100 for row in mine)
        ratio = [row["kv_bytes"] / full_bytes[row["id"]] for row in mine if row["id"] in full_bytes]
        shown = f"{sum(ratio) / len(ratio):.3f}" if ratio else "n/a"
        table.append(f"| {method} | {answered} / {len(mine)} | {shown} |")
    command = "python benchmarks/decode_eviction.py " + shlex.join(sys.argv[1:])
    text = (f"# Eviction during long generations (default model, float32)\n\nCommand: `{command}`\n\n"
            f"RULER {', '.join(args.tasks)} at 2k ({args.records} records each) as a chat: the context and an "
            f"unrelated request prefilled and compressed to {args.budget:.0%} of its tokens, then {args.preamble} "
            "tokens of an unrelated answer, the record's question as the next user turn and the answer prefix, "
            "forced one decode step each, then the greedy answer.\n\n" + "\n".join(table) + "\n")
    args.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
