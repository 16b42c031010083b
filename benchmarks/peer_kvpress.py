"""Peer yardstick: NVIDIA kvpress 0.5.5 on the same RULER prompts, model and budgets as our own benchmark.

Runs under a separate virtualenv, never the project's (kvpress 0.5.5 pins transformers < 5.3; the project uses 5.24)::

    python3 -m venv /work/peer-venv
    /work/peer-venv/bin/pip install torch==2.13.0 kvpress==0.5.5 gguf sentencepiece
    # installed: kvpress 0.5.5, transformers 5.2.0, torch 2.13.0+cpu, tokenizers 0.22.2, accelerate 1.16.0

    /work/peer-venv/bin/python benchmarks/peer_kvpress.py \
        --data out/ruler/niah_single_1_2048/validation.jsonl out/ruler/niah_single_2_2048/validation.jsonl \
        --limit 10 --kept 0.1 0.2 0.4 --out results/peer_kvpress

Model: the project's converted SmolLM2-135M-Instruct folder (``kvcompress.models.converted_model_dir()``, a plain
``save_pretrained`` folder written by transformers 5.24). transformers 5.2.0 loads it as it is -- config
(``rope_parameters``), tokenizer (``TokenizersBackend``) and chat template -- with no workaround; its logits on a
test prompt are bit-identical to 5.24's (max |diff| = 0.0). The folder is found without importing kvcompress (which
needs the project's venv): ``$KVCOMPRESS_CACHE`` or ``$XDG_CACHE_HOME/kvcompress`` or ``~/.cache/kvcompress``, then
the newest ``smollm2-135m-instruct-q4_1-*``. ``--model`` names another: Gemma 3 270M's converted folder
(``gemma3-270m-q4_k_m-*``) with ``--raw-prompt`` reads the records as ``configs/ruler/gemma3-270m-4k.yaml`` does.

Each sample's ``input`` (the full RULER prompt, ending with the answer prefix) is split into context / question /
answer prefix exactly as kvpress's ``evaluation/benchmarks/ruler/create_huggingface_dataset.py`` does (question at
the LAST match of the family's question opening, answer prefix at the first "The special magic" / "Answer:" after
it): ``ruler.prompts.split_input`` from the repo, stdlib only, like ``ruler.metrics``.

Protocols, both through kvpress's own ``KVPressTextGenerationPipeline`` (``pipeline("kv-press-text-generation")``):

* ``context_first`` -- kvpress's query-agnostic default: ``pipe(context, question=question, answer_prefix=prefix)``.
  The press acts only while the context (chat-template head + system prompt + user text up to the question) is
  prefilled; the question, the end-of-user-turn/assistant header and the answer prefix are fed afterwards,
  uncompressed, over the compressed cache.
* ``query_aware`` -- kvpress README's definition: ``pipe(context + question, question="", answer_prefix=prefix)``;
  the question is part of the compressed prefill; only end-of-turn + assistant header + prefix come after.
* ``whole_prompt`` -- our runner's query-aware protocol, for a matched run: the runner's own ids
  (``ruler.chat.encode_prompt``, with the chat template unless ``--raw-prompt``) all compressed but the last, which
  kvpress's pipeline must feed after its prefill (our runner compresses that token too).

The token stream is the same in both (user turn = context + question, then the prefix opens the assistant turn),
which is also the layout our benchmark uses.

``--raw-prompt`` (a base model, the runner's ``chat_template: false``): the pipeline is handed the runner's own
token ids (``ruler.chat.encode_prompt`` without a template: RULER's input, the context with the tokenizer's special
tokens, question and answer prefix after it) instead of kvpress's template-less layout (``bos_token`` + context,
``\n`` between question and answer prefix), so both libraries read the same ids. ``query_aware`` compresses them up to
the answer prefix, which kvpress's pipeline feeds after the prefill as its definition above does (it needs tokens to
feed; our runner compresses the prefix too: a few tokens' difference, the same as with a chat template).

Gemma 3: kvpress compresses only the global-attention layers of ``Gemma3ForConditionalGeneration`` and leaves the
sliding-window ones as they are; the text-only ``Gemma3ForCausalLM`` (Gemma 3 270M) is given the same rule here,
which is also ours, and a cache built from the model's config, so that sliding layers hold their window (the KV
bytes are the tensors' own, the full-size reference counts the sliding layers as held).

Output: one JSONL line per finished (source, index, method, kept, protocol) in ``<out>/peer_kvpress_runs.jsonl``,
flushed and fsynced per line; a rerun skips finished keys and drops a trailing partial line (kill -9 safe).
``<out>/peer_kvpress_summary.md`` holds the accuracy table, and ``<out>/<protocol>/scores.json`` the scores in the
runner's form, for ``kvcompress-ruler report`` (the leaderboard beside ours).
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import glob
import json
import logging
import platform
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------------------------------------------
# Methods and budgets
# ----------------------------------------------------------------------------------------------------------------

ALL_METHODS = (
    "none", "kvzip", "snapkv", "snapkv-default", "expected_attention", "tova", "keydiff", "knorm",
    "streaming_llm", "observed_attention",
)
EAGER_METHODS = {"observed_attention"}  # needs the attention weights: attn_implementation="eager"
PROTOCOLS = ("context_first", "query_aware", "whole_prompt")


# method -> (kvpress press class, its arguments besides compression_ratio)
PRESSES = {
    "kvzip": ("KVzipPress", {}),  # defaults: global (not layerwise), n_sink 4, chunk 2048
    "snapkv": ("SnapKVPress", {"window_size": 8, "kernel_size": 7}),  # our window and kernel
    "snapkv-default": ("SnapKVPress", {}),  # kvpress defaults: window 64, kernel 5
    "expected_attention": ("ExpectedAttentionPress", {}),
    "tova": ("TOVAPress", {}),
    "keydiff": ("KeyDiffPress", {}),
    "knorm": ("KnormPress", {}),
    "streaming_llm": ("StreamingLLMPress", {}),
    "observed_attention": ("ObservedAttentionPress", {}),
}


ADAPTIVE = "-adaptive"  # X-adaptive: kvpress's AdaKVPress around X (AdaKV, alpha_safeguard 0.2 as ours)
BLOCK = re.compile(r"^(.*)-block(\d+)$")  # X-blockN: kvpress's BlockPress around X, blocks of N tokens


def method_name(text: str) -> str:
    """A method of ``ALL_METHODS``, or one wrapped: ``X-adaptive`` (AdaKV), ``X-blockN`` (block-wise)."""
    block = BLOCK.match(text)
    base = block.group(1) if block else text.removesuffix(ADAPTIVE)
    if base not in ALL_METHODS or base == "none" and text != "none":
        raise argparse.ArgumentTypeError(f"unknown method {text!r}; choose from {ALL_METHODS}, X-adaptive, X-blockN")
    return text


def make_press(method: str, kept: float):
    """kvpress press for ``method`` keeping the fraction ``kept`` (compression_ratio = 1 - kept); None: full cache."""
    import kvpress

    if method == "none":
        return None
    block = BLOCK.match(method)
    if block:
        return kvpress.BlockPress(press=make_press(block.group(1), kept), block_size=int(block.group(2)))
    if method.endswith(ADAPTIVE):
        return kvpress.AdaKVPress(press=make_press(method.removesuffix(ADAPTIVE), kept), alpha_safeguard=0.2)
    if method not in PRESSES:
        raise ValueError(f"unknown method {method!r}; choose from {ALL_METHODS}")
    name, arguments = PRESSES[method]
    return getattr(kvpress, name)(compression_ratio=round(1.0 - kept, 6), **arguments)


# ----------------------------------------------------------------------------------------------------------------
# RULER prompt split and scoring: the repo's own (stdlib only, so this older-transformers venv imports them)
# ----------------------------------------------------------------------------------------------------------------

sys.path.insert(0, str(REPO))
from ruler.chat import encode_prompt  # noqa: E402
from ruler.metrics import postprocess_prediction, score_task, string_match_all_per_sample  # noqa: E402
from ruler.prompts import max_new_tokens as ruler_max_new_tokens  # noqa: E402
from ruler.prompts import split_input  # noqa: E402


def string_match_all(pred: str, refs: list[str]) -> float:
    """RULER's per-sample string_match_all as a fraction (the share of references found)."""
    return string_match_all_per_sample([postprocess_prediction(pred)], [refs])[0] / 100


def string_match_all_kvpress(pred: str, refs: list[str]) -> float:
    """kvpress calculate_metrics variant: control characters are deleted instead of replaced by \\n."""
    p = re.sub(r"[\x00-\x1f]", "", (pred or "").strip()).strip().lower()
    return sum(r.lower() in p for r in refs) / len(refs)


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------


def source_and_task(path: Path) -> tuple[str, str]:
    """``out/ruler/niah_single_2_2048/validation.jsonl`` -> ("niah_single_2_2048", "niah_single_2")."""
    source = path.parent.name if path.stem == "validation" else path.stem
    m = re.match(r"^(.*?)_(\d+)$", source)
    return source, (m.group(1) if m else source)


def load_samples(paths: list[str], limit: int | None) -> list[dict]:
    samples = []
    for p in paths:
        path = Path(p)
        source, task = source_and_task(path)
        rows = []
        with path.open() as f:
            for line in f:
                if line.strip():
                    rows.append(json.loads(line))
                if limit is not None and len(rows) >= limit:
                    break
        for r in rows:
            samples.append({**r, "source": source, "task": r.get("task", task)})
    return samples


# ----------------------------------------------------------------------------------------------------------------
# Results file (append-only JSONL, resumable)
# ----------------------------------------------------------------------------------------------------------------


def run_key(rec: dict) -> tuple:
    return (rec["source"], int(rec["index"]), rec["method"], float(rec["kept"]), rec["protocol"])


def read_results(path: Path, repair: bool = False) -> list[dict]:
    """Every complete line. With ``repair`` (the runner, at start) a trailing partial line left by kill -9 is cut
    off the file, so that the next append starts on a fresh line; readers only skip it."""
    if not path.exists():
        return []
    data = path.read_bytes()
    if data and not data.endswith(b"\n") and repair:
        cut = data.rfind(b"\n") + 1
        with path.open("r+b") as f:
            f.truncate(cut)
        data = data[:cut]
    out = []
    for line in data.decode("utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def append_result(path: Path, rec: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


# ----------------------------------------------------------------------------------------------------------------
# Model and pipeline
# ----------------------------------------------------------------------------------------------------------------


def default_model_dir() -> Path:
    root = os.environ.get("KVCOMPRESS_CACHE")
    if root:
        base = Path(root).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvcompress"
    found = sorted(glob.glob(str(base / "smollm2-135m-instruct-q4_1-*")))
    found = [f for f in found if (Path(f) / "config.json").is_file()]
    if not found:
        raise SystemExit(f"no converted SmolLM2 folder with a config.json under {base}; pass --model")
    return Path(found[-1])


def skip_sliding_layers_of_gemma3(model) -> None:
    """kvpress's rule for ``Gemma3ForConditionalGeneration`` (compress the global layers only) for the text-only
    ``Gemma3ForCausalLM`` too: ``BasePress.__call__`` tests ``isinstance(model, Gemma3ForConditionalGeneration)``
    by the module's name, which is given both classes."""
    from kvpress.presses import base_press
    from transformers import Gemma3ForCausalLM, Gemma3ForConditionalGeneration

    if isinstance(model, Gemma3ForCausalLM):
        base_press.Gemma3ForConditionalGeneration = (Gemma3ForConditionalGeneration, Gemma3ForCausalLM)


def answer_prefix_length(tokenizer, input_ids: list[int], parts) -> int:
    """How many of the prompt's last ids spell the answer prefix. Counted on the prompt's own ids (the prefix alone
    tokenises otherwise: RULER's question ends in a space that joins the prefix's first word); an error where no
    suffix of whole tokens spells it, as then no cut keeps the two libraries on the same ids."""
    wanted = parts.answer_prefix.strip()
    for count in range(1, len(input_ids)):
        text = tokenizer.decode(input_ids[-count:]).strip()
        if text == wanted:
            return count
        if len(text) > len(wanted):
            break
    raise ValueError(f"no suffix of the prompt's ids spells the answer prefix {wanted!r}: no query-aware cut")


class Runner:
    """One pipeline per attention implementation (sdpa always; eager only when a method needs it)."""

    def __init__(self, model_dir: Path, raw_prompt: bool = False):
        import kvpress  # noqa: F401  (registers "kv-press-text-generation" and patches attention functions)
        from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

        self.model_dir = model_dir
        self.raw_prompt = raw_prompt
        self._auto_model = AutoModelForCausalLM
        self._pipeline = pipeline
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.pipes: dict[str, object] = {}

    def pipe(self, attn: str):
        if attn not in self.pipes:
            t = time.time()
            model = self._auto_model.from_pretrained(self.model_dir, dtype=torch.float32, attn_implementation=attn)
            model.eval()
            skip_sliding_layers_of_gemma3(model)
            self.pipes[attn] = self._pipeline(
                "kv-press-text-generation", model=model, tokenizer=self.tokenizer, device="cpu"
            )
            print(f"[load] {attn} model in {time.time() - t:.1f}s", flush=True)
        return self.pipes[attn]

    def tensors(self, pipe, parts, protocol: str) -> dict:
        """The pipeline's inputs: kvpress's own preprocessing, or with ``raw_prompt`` the runner's token ids."""
        if protocol == "whole_prompt":
            ids = torch.tensor([encode_prompt(self.tokenizer, parts, "query_aware", not self.raw_prompt).input_ids])
            return {"context_ids": ids[:, :-1], "questions_ids": [ids[:, -1:]]}
        if self.raw_prompt:
            encoded = encode_prompt(self.tokenizer, parts, protocol, chat_template=False)
            split = encoded.prefill_length
            if protocol == "query_aware":
                split = len(encoded.input_ids) - answer_prefix_length(self.tokenizer, encoded.input_ids, parts)
            ids = torch.tensor([encoded.input_ids])
            return {"context_ids": ids[:, :split], "questions_ids": [ids[:, split:]]}
        context, question = parts.context, parts.question
        if protocol == "query_aware":
            context, question = context + question, ""
        return pipe.preprocess(context, questions=[question], answer_prefix=parts.answer_prefix,
                               max_context_length=int(1e10), enable_thinking=False)

    def run(self, method: str, press, parts, protocol: str, max_new_tokens: int) -> dict:
        from transformers import DynamicCache

        attn = "eager" if method in EAGER_METHODS else "sdpa"
        pipe = self.pipe(attn)
        model = pipe.model
        for layer in model.model.layers:  # AdaKV-style masks (KVzip) live on the modules; start clean
            layer.self_attn.masked_key_indices = None
        tensors = self.tensors(pipe, parts, protocol)
        n_ctx = int(tensors["context_ids"].shape[1])
        n_q = int(tensors["questions_ids"][0].shape[1])
        cache = DynamicCache(config=model.config)
        t = time.time()
        pipe.preprocess = lambda *args, **kwargs: tensors  # the pipeline reads exactly these ids
        try:
            with torch.inference_mode():
                out = pipe("", question="", answer_prefix="", press=press, max_new_tokens=max_new_tokens, cache=cache)
        finally:
            del pipe.preprocess
        seconds = time.time() - t
        # The pipeline trims the answer (and question) off the cache afterwards, so this is the compressed context.
        kv_bytes = 0
        eff_bytes = 0
        full_bytes = 0
        positions, masked = [], 0
        for i, layer in enumerate(cache.layers):
            k, v = layer.keys, layer.values
            nbytes = k.numel() * k.element_size() + v.numel() * v.element_size()
            kv_bytes += nbytes
            # a sliding layer is never compressed (its window is what the full cache holds too)
            full_bytes += nbytes if layer.is_sliding else 2 * k.shape[0] * k.shape[1] * n_ctx * k.shape[3] * 4
            positions.append(int(k.shape[2]))
            mki = getattr(model.model.layers[i].self_attn, "masked_key_indices", None)
            n_masked = int(mki[0].numel()) if mki is not None else 0
            masked += n_masked
            per_entry = nbytes / max(1, k.shape[0] * k.shape[1] * k.shape[2])
            eff_bytes += nbytes - n_masked * per_entry
        return {
            "prediction": out["answer"],
            "seconds": round(seconds, 3),
            "context_tokens": n_ctx,
            "question_tokens": n_q,
            "prompt_tokens": n_ctx + n_q,
            "kv_bytes": int(kv_bytes),
            "kv_bytes_full_context": int(full_bytes),
            "kv_positions_min": min(positions),
            "kv_positions_max": max(positions),
            "kv_masked_entries": int(masked),
            "kv_effective_bytes": int(round(eff_bytes)),
            "attn_implementation": attn,
        }


# ----------------------------------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------------------------------


def summarize(records: list[dict]) -> str:
    """Markdown: accuracy per (method, kept, protocol), raw and over samples the full cache answers correctly."""
    latest = {run_key(r): r for r in records}
    recs = list(latest.values())
    base_ok = {
        (r["protocol"], r["source"], int(r["index"])): r["passed"] for r in recs if r["method"] == "none"
    }
    sources = sorted({r["source"] for r in recs})
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in recs:
        groups[(r["method"], float(r["kept"]), r["protocol"])].append(r)
    order = {m: i for i, m in enumerate(ALL_METHODS)}

    def pct(c, n):
        return f"{100 * c / n:.0f}%" if n else "-"

    lines = [
        "| method | kept | protocol | correct / total | acc | correct / base-correct | acc (base-correct) | "
        + " | ".join(f"{s} raw" for s in sources)
        + " | KV bytes / full | effective KV / full | s / gen |",
        "|---|---|---|---|---|---|---|" + "---|" * len(sources) + "---|---|---|",
    ]
    for key in sorted(groups, key=lambda k: (order.get(k[0], 99), k[1], k[2])):
        g = groups[key]
        c, n = sum(r["passed"] for r in g), len(g)
        gb = [r for r in g if base_ok.get((r["protocol"], r["source"], int(r["index"])))]
        cb, nb = sum(r["passed"] for r in gb), len(gb)
        per_src = []
        for s in sources:
            gs = [r for r in g if r["source"] == s]
            per_src.append(f"{sum(r['passed'] for r in gs)}/{len(gs)}" if gs else "-")
        bytes_ratio = sum(r["kv_bytes"] / r["kv_bytes_full_context"] for r in g) / n
        eff_ratio = sum(r["kv_effective_bytes"] / r["kv_bytes_full_context"] for r in g) / n
        secs = sum(r["seconds"] for r in g) / n
        lines.append(
            f"| {key[0]} | {key[1]:g} | {key[2]} | {c}/{n} | {pct(c, n)} | {cb}/{nb} | {pct(cb, nb)} | "
            + " | ".join(per_src)
            + f" | {bytes_ratio:.3f} | {eff_ratio:.3f} | {secs:.1f} |"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------


def write_scores(records: list[dict], out: Path, title: str) -> list[Path]:
    """``<out>/<protocol>/scores.json`` in the form of the runner's (``kvcompress-ruler report`` reads them beside
    ours): per (method, kept) the RULER score of each records file, the samples, and the KV bytes held over the
    full cache's (the tensors' real bytes: a press that masks holds them all)."""
    latest = list({run_key(r): r for r in records}.values())
    written = []
    for protocol in sorted({r["protocol"] for r in latest}):
        groups: dict[tuple, list[dict]] = defaultdict(list)
        for r in latest:
            if r["protocol"] == protocol:
                groups[(r["method"], float(r["kept"]))].append(r)
        settings = []
        for (method, kept), group in groups.items():
            by_source: dict[str, list[dict]] = defaultdict(list)
            for r in sorted(group, key=lambda r: int(r["index"])):
                by_source[r["source"]].append(r)
            settings.append({
                "name": "full" if method == "none" else f"{method}-{kept:g}", "method": method,
                "budget": None if method == "none" else kept,
                "scores": {source: score_task(rs[0]["task"], [r["prediction"] for r in rs], [r["outputs"] for r in rs])
                           for source, rs in by_source.items()},
                "samples": {source: len(rs) for source, rs in by_source.items()},
                "kv_ratio": round(sum(r["kv_bytes"] for r in group) / sum(r["kv_bytes_full_context"] for r in group),
                                  4),
            })
        order = {m: i for i, m in enumerate(ALL_METHODS)}
        settings.sort(key=lambda s: (s["budget"] is not None, order.get(s["method"], 99), s["method"],
                                     s["budget"] or 0))
        path = out / protocol / "scores.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        summary = {"benchmark": "ruler", "experiment": title, "library": "kvpress", "protocol": protocol,
                   "full_cache_setting": "full" if any(s["name"] == "full" for s in settings) else None,
                   "settings": settings, "versions": versions()}
        path.write_text(json.dumps(summary, indent=2) + "\n")
        written.append(path)
    return written


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for d in ("kvpress", "transformers", "torch", "tokenizers", "accelerate"):
        try:
            out[d] = md.version(d)
        except md.PackageNotFoundError:
            out[d] = None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", nargs="+", default=[], help="RULER validation.jsonl file(s)")
    ap.add_argument("--methods", nargs="+", default=list(ALL_METHODS), type=method_name,
                    help="methods of kvpress (ALL_METHODS), X-adaptive (AdaKVPress), X-blockN (BlockPress)")
    ap.add_argument("--kept", nargs="+", type=float, default=[0.1, 0.2, 0.4], help="kept fractions (1 - ratio)")
    ap.add_argument("--protocols", nargs="+", default=list(PROTOCOLS[:2]), choices=PROTOCOLS)
    ap.add_argument("--limit", type=int, default=None, help="first N samples of each file")
    ap.add_argument("--max-new-tokens", type=int, default=32,
                    help="greedy decode budget; 0 = RULER's per-task value (niah 128, vt 30, cwe 120, fwe 50, qa 32)")
    ap.add_argument("--model", type=Path, default=None, help="converted model folder (default: project's cache)")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "peer_kvpress")
    ap.add_argument("--summary-only", action="store_true", help="only rewrite the summary from the results file")
    ap.add_argument("--title", default="kvpress 0.5.5", help="the runs' name in <out>/<protocol>/scores.json")
    ap.add_argument("--raw-prompt", action="store_true",
                    help="the runner's token ids without a chat template (a base model)")
    args = ap.parse_args(argv)

    logging.getLogger("kvpress").setLevel(logging.ERROR)
    import transformers

    transformers.logging.set_verbosity_error()

    args.out.mkdir(parents=True, exist_ok=True)
    results_path = args.out / "peer_kvpress_runs.jsonl"
    summary_path = args.out / "peer_kvpress_summary.md"
    done = read_results(results_path, repair=not args.summary_only)
    finished = {run_key(r) for r in done}

    def write_summary():
        recs = read_results(results_path)
        # The records name their model; lines written before they did fall back to --model or the default model.
        fallback = args.model.name if args.model else "SmolLM2-135M-Instruct"
        model_name = ", ".join(sorted({r.get("model", fallback) for r in recs})) or fallback
        table = summarize(recs)
        vers = versions()
        text = (
            f"# kvpress 0.5.5 peer run ({model_name}, float32, CPU)\n\n"
            f"versions: {json.dumps(vers)}\n\n"
            f"results: `{results_path.name}` ({len(recs)} lines). `passed` = RULER string_match_all == 1 "
            "(every reference in the cleaned, lower-cased prediction). 'base-correct' = samples the full cache "
            "(method none, same protocol) answers correctly. KV bytes = real key+value tensor bytes after "
            "compression / full-context float32 cache; 'effective' subtracts kvpress's masked entries (KVzip keeps "
            "the full tensors and masks evicted keys at attention time).\n\n" + table + "\n"
        )
        tmp = summary_path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(summary_path)
        write_scores(recs, args.out, args.title)
        return table

    if args.summary_only:
        print(write_summary())
        return 0
    if not args.data:
        ap.error("--data is required unless --summary-only")

    split_name = "ruler.prompts.split_input"
    samples = load_samples(args.data, args.limit)
    model_dir = args.model or default_model_dir()
    print(f"[setup] {len(samples)} samples; split: {split_name}; model: {model_dir}; versions: {versions()}",
          flush=True)

    # Work list: full cache first (needed for the base-correct filter), then methods x kept x protocol x sample.
    work = []
    for protocol in args.protocols:
        if "none" in args.methods:
            for s in samples:
                work.append(("none", 1.0, protocol, s))
    for kept in args.kept:
        for method in args.methods:
            if method == "none":
                continue
            for protocol in args.protocols:
                for s in samples:
                    work.append((method, kept, protocol, s))
    todo = [w for w in work if (w[3]["source"], int(w[3]["index"]), w[0], float(w[1]), w[2]) not in finished]
    print(f"[setup] {len(work)} runs, {len(work) - len(todo)} already done, {len(todo)} to do", flush=True)
    if not todo:
        print(write_summary())
        return 0

    runner = Runner(model_dir, raw_prompt=args.raw_prompt)
    vers = versions()
    presses: dict[tuple, object] = {}
    t0 = time.time()
    for i, (method, kept, protocol, s) in enumerate(todo):
        parts = split_input(s["task"], s["input"])
        mnt = args.max_new_tokens or ruler_max_new_tokens(s["task"])
        if (method, kept) not in presses:
            presses[(method, kept)] = make_press(method, kept)
        press = presses[(method, kept)]
        res = runner.run(method, press, parts, protocol, mnt)
        score = string_match_all(res["prediction"], s["outputs"])
        rec = {
            "source": s["source"], "task": s["task"], "index": int(s["index"]), "method": method,
            "kept": float(kept), "compression_ratio": round(1.0 - kept, 6) if method != "none" else 0.0,
            "protocol": protocol, "outputs": s["outputs"], "length": s.get("length"),
            "prediction": res.pop("prediction"), "score": score, "passed": score == 1.0,
            "max_new_tokens": mnt, **res,
            "model": model_dir.name, "split": split_name, "press": repr(press), "kvpress": vers["kvpress"],
            "transformers": vers["transformers"], "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        rec["score_kvpress_cleanup"] = string_match_all_kvpress(rec["prediction"], s["outputs"])
        append_result(results_path, rec)
        elapsed = time.time() - t0
        print(
            f"[{i + 1}/{len(todo)}] {s['source']}#{s['index']} {method} kept={kept:g} {protocol}: "
            f"{'PASS' if rec['passed'] else 'fail'} {res['seconds']:.1f}s ctx={res['context_tokens']} "
            f"kv={res['kv_bytes'] / 2**20:.1f}MiB eff={res['kv_effective_bytes'] / 2**20:.1f}MiB "
            f"pred={rec['prediction'][:60]!r} (elapsed {elapsed / 60:.1f} min)",
            flush=True,
        )
    print(write_summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
