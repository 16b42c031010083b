#!/usr/bin/env python
"""Fractional budgets on the default model: a long chat keeps its fraction, and each row of a padded batch answers
as it does alone.

``chat``: docs/usage.md's chat, continued: turn one is the start of the demo report (``--document-tokens``) and a
question about it, then ``--turns`` - 1 short questions, each answered greedily (``--answer-tokens`` at most) on the
cache the previous turn left. Each turn's ids are the previous turn's ids, its answer and its end of turn, then the
template's next user turn, so the cache always holds exactly what the ids say. Per method, at every turn: the tokens
seen and the kept share of the KV bytes (``kvcompress.cache.kept_fraction``), with the answers in the JSONL.

``batch``: two prompts cut from the demo report (``--batch-tokens``, the same question after each) in one
left-padded batch, under each method at ``--budget``; a row counts as equal when its greedy answer equals the one
it gives alone, token for token.

    python benchmarks/fractional_budgets.py chat --methods full kvzip kvzap snapkv --out results/fractional_budgets
    python benchmarks/fractional_budgets.py batch --methods snapkv tova expected_attention kvzip kvzap \
        --out results/fractional_budgets

Each writes MODE.jsonl (a line per turn or row) and MODE.md (its table) into the ``--out`` folder.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvcompress import compress, method_names  # noqa: E402
from kvcompress.cache import kept_fraction  # noqa: E402
from kvcompress.models import load_model  # noqa: E402

DOCUMENT = ROOT / "kvcompress" / "data" / "demo_report.txt"
FIRST_QUESTION = "According to the report, in which city will the new battery factory be built?"
TOPICS = ("the factory's size", "the jobs it creates", "its energy supply", "the timeline", "the investors",
          "the risks", "the suppliers", "the local reaction", "the competitors", "the costs")


def questions(turns: int) -> list[str]:
    """The short questions after the first: each topic asked about in turn, numbered so none repeats exactly."""
    return [f"Question {turn}: in one sentence, what does the report say about {TOPICS[turn % len(TOPICS)]}?"
            for turn in range(1, turns)]


def next_turn_text(tokenizer) -> str:
    """What follows an assistant's end-of-turn token before the next user message: the template's own text between
    an answer and a question, with the question as ``{}``."""
    answered = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    asked = tokenizer.apply_chat_template([*answered, {"role": "user", "content": "{}"}], add_generation_prompt=True,
                                          tokenize=False)
    before = tokenizer.apply_chat_template(answered, tokenize=False)
    after_answer = before[before.rindex("A") + 1:].removeprefix(tokenizer.eos_token)
    return after_answer + asked[len(before):]


@torch.no_grad()
def chat(model, tokenizer, method: str, budget: float, args) -> list[dict]:
    """Every turn's tokens seen, kept share and answer under ``method`` (``full``: no compression)."""
    document = tokenizer.decode(tokenizer.encode(DOCUMENT.read_text(encoding="utf-8"))[: args.document_tokens])
    first = tokenizer.apply_chat_template([{"role": "user", "content": f"{document}\n\n{FIRST_QUESTION}"}],
                                          add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(first, add_special_tokens=False)
    template = next_turn_text(tokenizer)
    rows, cache = [], None
    session = compress(model, method=method, budget=budget, tokenizer=tokenizer) if method != "full" else None
    with session if session is not None else torch.no_grad():
        for turn, question in enumerate([FIRST_QUESTION, *questions(args.turns)]):
            if turn:
                ids = ids + tokenizer.encode(template.format(question), add_special_tokens=False)
            sequence = torch.tensor([ids])
            out = model.generate(sequence, attention_mask=torch.ones_like(sequence), cache=cache, do_sample=False,
                                 max_new_tokens=args.answer_tokens, return_dict_in_generate=True)
            answer = out.sequences[0, len(ids):].tolist()
            cache = out.cache
            ids = ids + answer + ([] if answer[-1] == tokenizer.eos_token_id else [tokenizer.eos_token_id])
            rows.append({"mode": "chat", "method": method, "budget": budget, "turn": turn + 1,
                         "tokens_seen": cache.get_seq_length(), "kept_fraction": round(kept_fraction(cache), 4),
                         "answer": tokenizer.decode(answer, skip_special_tokens=True)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


@torch.no_grad()
def batch(model, tokenizer, method: str, budget: float, args) -> list[dict]:
    """Each row's answer in the padded batch and alone, under ``method``."""
    tokens = tokenizer.encode(DOCUMENT.read_text(encoding="utf-8"))
    prompts = []
    for length in args.batch_tokens:
        text = tokenizer.decode(tokens[:length]) + f"\n\n{FIRST_QUESTION}"
        prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                     tokenize=False))
    tokenizer.padding_side = "left"

    def answers(texts: list[str]) -> list[list[int]]:
        encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with compress(model, method=method, budget=budget, tokenizer=tokenizer):
            out = model.generate(**encoded, do_sample=False, max_new_tokens=args.answer_tokens,
                                 min_new_tokens=args.answer_tokens, pad_token_id=tokenizer.eos_token_id)
        return out[:, encoded["input_ids"].shape[1]:].tolist()

    together = answers(prompts)
    rows = []
    for row, text in enumerate(prompts):
        alone = answers([text])[0]
        rows.append({"mode": "batch", "method": method, "budget": budget,
                     "prompt_tokens": len(tokenizer.encode(text, add_special_tokens=False)),
                     "equal": together[row] == alone, "batched": tokenizer.decode(together[row]),
                     "alone": tokenizer.decode(alone)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def write_report(path: Path, rows: list[dict], command: str) -> None:
    lines = ["# Fractional budgets on the default model", "", f"`{command}` (float32, one thread)", ""]
    chats = [row for row in rows if row["mode"] == "chat"]
    if chats:
        lines += ["## A long chat: the kept share of the KV bytes after each turn", "",
                  "| method | budget | turns | tokens seen at the end | kept share, fewest | at the last turn |",
                  "|---|---|---|---|---|---|"]
        for method in dict.fromkeys(row["method"] for row in chats):
            mine = [row for row in chats if row["method"] == method]
            lines.append(f"| {method} | {mine[0]['budget']} | {len(mine)} | {mine[-1]['tokens_seen']:,} | "
                         f"{min(row['kept_fraction'] for row in mine):.3f} | {mine[-1]['kept_fraction']:.3f} |")
        lines.append("")
    batches = [row for row in rows if row["mode"] == "batch"]
    if batches:
        lines += ["## A padded batch: each row against its own run", "",
                  "| method | budget | rows equal to their own run | prompt tokens |", "|---|---|---|---|"]
        for method in dict.fromkeys(row["method"] for row in batches):
            mine = [row for row in batches if row["method"] == method]
            lines.append(f"| {method} | {mine[0]['budget']} | {sum(row['equal'] for row in mine)} / {len(mine)} | "
                         f"{', '.join(str(row['prompt_tokens']) for row in mine)} |")
        lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["chat", "batch"])
    parser.add_argument("--methods", nargs="+", default=["full", "kvzip", "kvzap", "snapkv"],
                        choices=["full", *method_names()])
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--document-tokens", type=int, default=300)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--batch-tokens", type=int, nargs="+", default=[420, 270])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True, help="a folder: writes MODE.jsonl and MODE.md there")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("default", dtype=torch.float32)
    run = chat if args.mode == "chat" else batch
    rows = [row for method in args.methods for row in run(model, tokenizer, method, args.budget, args)]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / args.mode
    stem.with_suffix(".jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    write_report(stem.with_suffix(".md"), rows, "python benchmarks/fractional_budgets.py " + shlex.join(argv or
                                                                                                        sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
