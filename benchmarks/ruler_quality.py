"""RULER needle tasks on the default model: every method, both protocols, several budgets, real KV bytes.

The prompts are RULER's own (``kvcompress-ruler generate``: NVIDIA's generator scripts from
``nvidia-long-context-eval``, the embedded model's tokenizer), rendered with the model's chat template as kvpress
does (context + question in the user turn, the answer prefix opening the assistant's). Two protocols:

* ``query_aware``: the whole prompt is compressed inside ``model.generate`` (the question is seen);
* ``context_first``: the context is compressed first (``session.prefill``), then the question and the answer
  prefix follow uncompressed (``session.generate``), as kvpress's leaderboard and the KVzip paper evaluate.

The budget is a fraction of the tokens that are compressed (the whole prompt, or the context). Every sample is
first run with the full cache; methods are scored only on the samples the full cache answers correctly
(calibration), with RULER's ``string_match_all``. Each run records the cache's real KV bytes right after the
prompt's compression against the full cache of the same tokens, and the prefill time against the full cache's
prefill of the same tokens (measured in this process, alternately). Runs append to a JSONL file and resume.

    python benchmarks/ruler_quality.py --tasks niah_single_1 niah_single_2 --samples 10 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvbench.generation import cache_bytes  # noqa: E402
from kvcompress import KVCacheCompressionParameters, KVCacheCompressor  # noqa: E402
from kvcompress.budget import budget_slots  # noqa: E402
from kvcompress.models import load_default_model  # noqa: E402
from kvcompress.presets import NONE, method_names, preset  # noqa: E402
from ruler.chat import PROTOCOLS, encode_prompt  # noqa: E402
from ruler.generate import generate as generate_ruler  # noqa: E402
from ruler.metrics import postprocess_prediction, string_match_all_per_sample  # noqa: E402
from ruler.prompts import split_input  # noqa: E402

DEFAULT_METHODS = [m for m in method_names() if m != NONE]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=["niah_single_1", "niah_single_2"])
    parser.add_argument("--length", type=int, default=2048, help="RULER max_seq_length")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=DEFAULT_METHODS)
    parser.add_argument("--budgets", nargs="+", type=float, default=[0.1, 0.2, 0.4])
    parser.add_argument("--variants", nargs="+", default=["preset"], type=parse_variant,
                        help="'preset' (each method as its preset sets it) or parameter overrides KEY=VALUE[,...], "
                             "e.g. head_selection=per_head; each method runs once per variant")
    parser.add_argument("--protocols", nargs="+", default=list(PROTOCOLS), choices=PROTOCOLS)
    parser.add_argument("--max-new-tokens", type=int, default=24,
                        help="greedy tokens (RULER allows 128 for niah; a 7-digit answer and the stop need < 20)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data-dir", type=Path, default=ROOT / "out" / "ruler")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "ruler_smollm2")
    parser.add_argument("--peer", type=Path,
                        default=ROOT / "results" / "peer_kvpress" / "peer_kvpress_runs.jsonl",
                        help="kvpress runs on the same prompts (benchmarks/peer_kvpress.py), shown beside ours")
    parser.add_argument("--resume", action="store_true", help="keep the runs already recorded and do the rest")
    return parser.parse_args(argv)


PRESET = "preset"


def parse_variant(text: str) -> str:
    """A variant as given ('preset', or KEY=VALUE pairs that name parameters), checked on the parser's side."""
    if text != PRESET:
        for pair in text.split(","):
            key, _, value = pair.partition("=")
            if not value or key not in KVCacheCompressionParameters.__dataclass_fields__:
                raise argparse.ArgumentTypeError(f"variant {text!r}: expected KEY=VALUE[,...] with parameter names")
    return text


def variant_overrides(variant: str) -> dict:
    if variant == PRESET:
        return {}
    return {key: yaml.safe_load(value) for key, _, value in (pair.partition("=") for pair in variant.split(","))}


def labels(args) -> list[tuple[str, str, dict]]:
    """(label, method, overrides) of every method and variant; the label names the variant unless it is the preset."""
    return [(method if variant == PRESET else f"{method} [{variant}]", method, variant_overrides(variant))
            for method in args.methods for variant in args.variants]


def load_samples(args, tokenizer) -> list[dict]:
    samples = []
    for task in args.tasks:
        result = generate_ruler("default", task, args.length, args.samples, args.seed, args.data_dir)
        for line in result.path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            parts = split_input(task, record["input"])
            encoded = {protocol: encode_prompt(tokenizer, parts, protocol) for protocol in PROTOCOLS}
            samples.append({"task": task, "index": record["index"], "outputs": record["outputs"],
                            "ids": encoded["query_aware"].input_ids,
                            "prefill": {p: e.prefill_length for p, e in encoded.items()}})
    return samples


def _key(record: dict) -> tuple:
    return record["task"], record["index"], record["method"], record["budget"], record["protocol"]


def load_runs(path: Path) -> dict[tuple, dict]:
    runs = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a kill: that run is redone
                continue
            runs[_key(record)] = record
    return runs


def append_run(path: Path, record: dict) -> None:
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


@torch.no_grad()
def run_one(model, tokenizer, sample: dict, method: str, budget: float, protocol: str, max_new_tokens: int,
            timed: bool, label: str | None = None, overrides: dict | None = None) -> dict:
    """One generation, with the compressed prompt's real KV bytes and (``timed``, context_first) its prefill
    seconds beside a full-cache prefill of the same tokens."""
    ids = torch.tensor([sample["ids"]])
    compressed_tokens = sample["prefill"][protocol]
    record = {"task": sample["task"], "index": sample["index"], "method": label or method, "budget": budget,
              "protocol": protocol, "prompt_tokens": ids.shape[1], "compressed_tokens": compressed_tokens}
    if method == NONE:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                             return_dict_in_generate=True)
        answer = out.sequences[0, ids.shape[1]:]
    else:
        slots = budget_slots(budget, compressed_tokens)
        with KVCacheCompressor(preset(method, slots, **(overrides or {})), tokenizer=tokenizer)(model) as session:
            if protocol == "query_aware":  # the whole prompt, question included, compressed inside generate
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=max_new_tokens, return_dict_in_generate=True)
                answer = out.sequences[0, ids.shape[1]:]
                cache, held = out.cache, ids.shape[1] + answer.shape[0] - 1
            else:
                context, question = ids[:, :compressed_tokens], ids[:, compressed_tokens:]
                started = time.perf_counter()
                cache = session.prefill(context)
                record["prefill_seconds"] = time.perf_counter() - started
                held = compressed_tokens
                answer = session.generate(question, max_new_tokens=max_new_tokens,
                                          eos_token_id=model.generation_config.eos_token_id)[0]
            kv_bytes, full_kv_bytes = cache_bytes(cache, held)
            record.update(slots=slots, kv_bytes=kv_bytes, full_kv_bytes=full_kv_bytes)
        if timed and protocol == "context_first":
            started = time.perf_counter()
            model(ids[:, :compressed_tokens], use_cache=True, logits_to_keep=1)
            record["full_prefill_seconds"] = time.perf_counter() - started
    text = tokenizer.decode(answer, skip_special_tokens=True)
    record["prediction"] = text
    # RULER scores 0-100 per sample; 1 / 0 here, so that sums count correct answers
    record["correct"] = string_match_all_per_sample([postprocess_prediction(text)], [sample["outputs"]])[0] / 100
    return record


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_default_model()
    samples = load_samples(args, tokenizer)
    args.out.mkdir(parents=True, exist_ok=True)
    runs_path = args.out / "runs.jsonl"
    if not args.resume:
        runs_path.unlink(missing_ok=True)
    runs = load_runs(runs_path)

    def run(sample, method, budget, protocol, label=None, overrides=None):
        record = {"task": sample["task"], "index": sample["index"], "method": label or method, "budget": budget,
                  "protocol": protocol}
        if _key(record) not in runs:
            timed = budget == args.budgets[len(args.budgets) // 2]  # the prefill cost, at the middle budget
            runs[_key(record)] = run_one(model, tokenizer, sample, method, budget, protocol, args.max_new_tokens,
                                         timed, label, overrides)
            append_run(runs_path, runs[_key(record)])
        return runs[_key(record)]

    calibrated = [s for s in samples if run(s, NONE, 1.0, "query_aware")["correct"] == 1.0]
    print(f"full cache: {len(calibrated)}/{len(samples)} correct", flush=True)
    for protocol in args.protocols:
        for budget in args.budgets:
            for label, method, overrides in labels(args):
                done = [run(s, method, budget, protocol, label, overrides)["correct"] for s in calibrated]
                print(f"{protocol} {budget:.0%} {label}: {sum(done):.0f}/{len(done)}", flush=True)
    write_report(args, argv, model, samples, calibrated, runs)


# kvpress's press names where they differ from ours (ObservedAttentionPress is H2O's accumulated attention)
PEER_NAMES = {"observed_attention": "h2o"}


def load_peer(path: Path) -> list[dict]:
    """kvpress's runs in this benchmark's terms (method, budget = kept fraction, correct)."""
    if not path or not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        records.append({"task": record["task"], "index": record["index"], "protocol": record["protocol"],
                        "method": PEER_NAMES.get(record["method"], record["method"]), "budget": record["kept"],
                        "correct": float(bool(record["passed"])), "kv_bytes": record["kv_bytes"],
                        "full_kv_bytes": record["kv_bytes_full_context"]})
    return records


def _kv_ratio(records: list[dict]) -> float:
    return sum(r["kv_bytes"] for r in records) / sum(r["full_kv_bytes"] for r in records)


def write_report(args, argv, model, samples, calibrated, runs) -> None:
    keep = {(s["task"], s["index"]) for s in calibrated}
    peer = load_peer(args.peer)
    lines = [
        "# RULER needle tasks under KV-cache compression (default model)",
        f"Command (repository root, {datetime.now(timezone.utc):%Y-%m-%d}):\n\n```bash\n"
        f"python benchmarks/ruler_quality.py {shlex.join(a for a in (argv or sys.argv[1:]) if a != '--resume')}"
        "\n```",
        f"SmolLM2-135M-Instruct ({str(model.dtype).removeprefix('torch.')}), torch {torch.__version__}, "
        f"{args.threads} thread(s), {platform.machine()}; RULER {', '.join(args.tasks)} at max_seq_length "
        f"{args.length}, seed {args.seed}, {args.samples} samples each; greedy, {args.max_new_tokens} new tokens.",
        f"Full cache: {len(calibrated)}/{len(samples)} correct; the methods are scored on those {len(calibrated)} "
        "(accuracy relative to the full cache). KV × = the cache's real key/value bytes right after the prompt's "
        "compression (query_aware: at the end of generation, decoded tokens included) over the full cache's for "
        "the same tokens; prefill × = context_first's compressed prefill (scoring, KVzip's reconstruction, "
        "eviction) over a full-cache prefill of the same tokens right after it, median over the samples.",
    ]
    for protocol in args.protocols:
        lines += [f"\n## {protocol}\n", "| method | " + " | ".join(f"{b:.0%} kept" for b in args.budgets)
                  + " | KV × (at " + f"{args.budgets[len(args.budgets) // 2]:.0%}) | prefill × |",
                  "|---" * (len(args.budgets) + 3) + "|"]
        for method, _, _ in labels(args):
            cells, kv, cost = [], "", ""
            for budget in args.budgets:
                ours = [r for r in runs.values() if r["method"] == method and r["budget"] == budget
                        and r["protocol"] == protocol and (r["task"], r["index"]) in keep]
                cell = f"{sum(r['correct'] for r in ours):.0f}/{len(ours)}"
                theirs = [r for r in peer if r["method"] == method and r["budget"] == budget
                          and r["protocol"] == protocol and (r["task"], r["index"]) in keep]
                if theirs:
                    cell += f" (kvpress {sum(r['correct'] for r in theirs):.0f}/{len(theirs)})"
                cells.append(cell)
                if budget == args.budgets[len(args.budgets) // 2] and ours:
                    kv = f"{_kv_ratio(ours):.3f}" + (f" (kvpress {_kv_ratio(theirs):.2f})" if theirs else "")
                    timed = [r for r in ours if "full_prefill_seconds" in r]
                    ratios = sorted(r["prefill_seconds"] / r["full_prefill_seconds"] for r in timed)
                    cost = f"{ratios[len(ratios) // 2]:.2f}" if ratios else "—"
            lines.append(f"| {method} | " + " | ".join(cells) + f" | {kv} | {cost} |")
    path = args.out / "ruler.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(path.read_text(encoding="utf-8"))


if __name__ == "__main__":
    main()
