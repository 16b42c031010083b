"""kvpress 0.5.5 beside ``speed_memory.py``: prefill time, peak memory, KV bytes and decode time of its presses
against its own uncompressed sdpa run in the same process, on the same random-weight shapes (benchmarks/common.py).

Runs under the peer's virtualenv (kvpress pins transformers < 5.3; see ``peer_kvpress.py`` for its set-up)::

    /work/peer-venv/bin/python benchmarks/peer_kvpress_speed.py --threads 1 2 --busy 0 1 \\
        --out results/peer_kvpress/speed_tiny512
    python benchmarks/peer_kvpress_speed.py --device cuda --model llama3-8b-shape --lengths 8192 32768 \\
        --new-tokens 16 --out results/gpu/peer_kvpress_llama3-8b      # on a GPU (benchmarks/gpu/run.sh)

For each length, thread count and number of busy processes beside, the uncompressed run and each press alternate
(order reversed on every other repeat) and the medians give the ratios, ``--budget`` of the prompt kept
(``compression_ratio = 1 - budget``). ObservedAttentionPress (H2O) needs the attention weights, so it runs with
eager attention (also reported against the eager uncompressed run, how kvpress compares it), up to
``--eager-max-length`` tokens (its weights are L² per head). KVzipPress loads its tokenizer from the model's
folder: the random models' tokenizer is saved in a temporary one. KV bytes are the cache's keys and values after
the prefill; kvpress's head-wise presses (KVzip) keep full tensors and mask evicted entries, counted as
"effective" bytes beside the real ones. Decode: kvpress's own pipeline positions (true positions after the
shorter cache), ``--new-tokens`` greedy steps. Timings are medians on whatever machine runs this; nothing here
asserts on them.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (  # noqa: E402
    SHAPES,
    PeakMemory,
    busy_processes,
    describe_shape,
    gpu_description,
    median,
    random_model,
    ratio,
    release_memory,
    synchronize,
    tiny_tokenizer,
    write_results,
)

PRESSES = ("SnapKVPress", "ObservedAttentionPress", "ExpectedAttentionPress", "KVzipPress", "TOVAPress",
           "KeyDiffPress", "KnormPress", "StreamingLLMPress")
EAGER = {"ObservedAttentionPress"}


class Runner:
    """One model (sdpa, switched to eager for the presses that need the weights) and kvpress's presses."""

    def __init__(self, model_name: str, device: str, dtype: torch.dtype, budget: float):
        import kvpress

        logging.getLogger("kvpress").setLevel(logging.ERROR)  # KVzipPress warns about its cost on every construction
        self.kvpress, self.device, self.budget = kvpress, device, budget
        self.model = random_model(model_name, device, dtype)
        tokenizer_dir = tempfile.mkdtemp(prefix="kvpress-tok-")
        tiny_tokenizer(self.model.config.vocab_size).save_pretrained(tokenizer_dir)
        self.model.config._name_or_path = tokenizer_dir  # where KVzipPress loads its tokenizer from

    def press(self, name: str):
        return None if name.startswith("none") else getattr(self.kvpress, name)(compression_ratio=1 - self.budget)

    def _attention(self, name: str) -> None:
        if hasattr(self.model, "set_attn_implementation"):
            self.model.set_attn_implementation(name)
        else:
            self.model.config._attn_implementation = name

    def _masked_entries(self) -> int:
        """Entries kvpress's head-wise presses mask in the full-size cache instead of freeing them."""
        return sum(int(masked[0].numel()) for layer in self.model.model.layers
                   if (masked := getattr(layer.self_attn, "masked_key_indices", None)) is not None)

    @torch.no_grad()
    def run(self, name: str, ids: torch.Tensor, new_tokens: int) -> dict:
        model, press = self.model, self.press(name)
        eager = name in EAGER or name == "none-eager"
        for layer in model.model.layers:  # head-wise masks (KVzipPress) live on the modules: start clean
            layer.self_attn.masked_key_indices = None
        if eager:
            self._attention("eager")
        cache, record = DynamicCache(), {}
        try:
            with PeakMemory(self.device) as peak:
                synchronize(self.device)
                started = time.perf_counter()
                with press(model) if press is not None else contextlib.nullcontext():  # KVzip compresses on exit
                    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                synchronize(self.device)
                record["prefill_s"] = time.perf_counter() - started
            record["peak_bytes"] = peak.delta
            layers = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]
            record["kv_bytes"] = sum(layer.keys.nbytes + layer.values.nbytes for layer in layers)
            per_entry = 2 * layers[0].keys.shape[-1] * layers[0].keys.element_size()
            record["kv_bytes_effective"] = record["kv_bytes"] - self._masked_entries() * per_entry
            token = out.logits[:, -1:].argmax(-1)
            del out
            times = []
            for step in range(new_tokens):  # kvpress's pipeline: true positions after the shorter cache
                position = torch.tensor([[ids.shape[1] + step]], device=ids.device)
                synchronize(self.device)
                started = time.perf_counter()
                token = model(input_ids=token, past_key_values=cache, position_ids=position,
                              use_cache=True).logits[:, -1:].argmax(-1)
                synchronize(self.device)
                times.append(time.perf_counter() - started)
            record["decode_per_token_s"] = median(times)
        finally:
            del cache
            for layer in model.model.layers:
                layer.self_attn.masked_key_indices = None
            if eager:
                self._attention("sdpa")
        return record


def measure(runner: Runner, length: int, presses: list[str], args) -> dict:
    """Medians and ratios of every press at one length, beside the uncompressed runs."""
    vocabulary = runner.model.config.vocab_size
    ids = torch.randint(3, vocabulary, (1, length), generator=torch.Generator().manual_seed(0)).to(args.device)
    names = ["none", *presses]
    if any(name in EAGER for name in presses):
        names.append("none-eager")
    names = [n for n in names if not ((n in EAGER or n == "none-eager") and length > args.eager_max_length)]
    records: dict[str, list[dict]] = {name: [] for name in names}
    errors = {}
    for name in names:  # warm-up: the allocator and kernels at this length
        try:
            runner.run(name, ids if args.device.startswith("cuda") else ids[:, :256], 2)
        except RuntimeError as error:
            errors[name] = f"{type(error).__name__}: {str(error)[:300]}"
            release_memory()
    for repeat in range(args.repeats):
        for name in (names if repeat % 2 == 0 else names[::-1]):
            if name in errors:
                continue
            try:
                records[name].append(runner.run(name, ids, args.new_tokens))
            except RuntimeError as error:
                errors[name] = f"{type(error).__name__}: {str(error)[:300]}"
                release_memory()
    summary = {}
    for name, runs in records.items():
        row = {key: median([r.get(key) for r in runs]) for key in
               ("prefill_s", "peak_bytes", "kv_bytes", "kv_bytes_effective", "decode_per_token_s")}
        summary[name] = row | {"n": len(runs), "error": errors.get(name)}
    full = summary.get("none", {})
    for name, row in summary.items():
        baseline = summary.get("none-eager", full) if name in EAGER else full
        row.update(prefill_x=ratio(row["prefill_s"], full.get("prefill_s")),
                   peak_x=ratio(row["peak_bytes"], full.get("peak_bytes")),
                   kv_x=ratio(row["kv_bytes"], full.get("kv_bytes")),
                   kv_effective_x=ratio(row["kv_bytes_effective"], full.get("kv_bytes")),
                   decode_x=ratio(row["decode_per_token_s"], full.get("decode_per_token_s")),
                   prefill_x_own_baseline=ratio(row["prefill_s"], baseline.get("prefill_s")))
    return summary


def markdown(results: dict) -> str:
    env = results["environment"]

    def f(value, pattern="{:.2f}"):
        return "—" if value is None else pattern.format(value)

    lines = [f"# kvpress {env['kvpress']}: {env['model']}", "", f"Command: `{env['command']}`", "",
             f"{env.get('gpu', env['device'])}, {env['dtype']}, transformers {env['transformers']}, torch "
             f"{env['torch']}, {env['date']}; {env['budget']} of the prompt kept, median of {env['repeats']} "
             "alternating repeats; × = against kvpress's uncompressed sdpa run in the same process (H2O: also against "
             "its eager uncompressed run); KV × effective: minus the entries kvpress masks instead of freeing.", "",
             "| length | threads | busy | press | prefill s | prefill × | × own baseline | peak × | KV × (effective) "
             "| decode ms/token | decode × | note |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for block in results["runs"]:
        for name, row in block["presses"].items():
            lines.append(
                f"| {block['length']} | {block['threads']} | {block['busy']} | {name} "
                f"| {f(row['prefill_s'], '{:.3f}')} "
                f"| {f(row['prefill_x'])} | {f(row['prefill_x_own_baseline'])} | {f(row['peak_x'])} "
                f"| {f(row['kv_x'], '{:.4f}')} ({f(row['kv_effective_x'], '{:.4f}')}) "
                f"| {f(row['decode_per_token_s'] and 1000 * row['decode_per_token_s'])} | {f(row['decode_x'])} "
                f"| {row['error'] or ''} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama-512", choices=list(SHAPES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="default: bfloat16 on a GPU, float32 on CPU")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096])
    parser.add_argument("--presses", nargs="+", default=["ObservedAttentionPress", "SnapKVPress"], choices=PRESSES)
    parser.add_argument("--all-presses", action="store_true", help="every press of PRESSES")
    parser.add_argument("--budget", type=float, default=0.2, help="fraction of the prompt kept")
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--busy", type=int, nargs="+", default=[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=0, help="greedy decode steps timed after each prefill")
    parser.add_argument("--eager-max-length", type=int, default=8192)
    parser.add_argument("--out", default=None, help="path stem for the .json and .md results")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    import kvpress
    import transformers

    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    runner = Runner(args.model, args.device, dtype, args.budget)
    presses = list(PRESSES) if args.all_presses else args.presses
    results = {"environment": {
        "command": "python " + " ".join(shlex.quote(a) for a in ["benchmarks/peer_kvpress_speed.py", *argv]),
        "model": describe_shape(args.model), "device": args.device, "dtype": str(dtype).removeprefix("torch."),
        "budget": args.budget, "repeats": args.repeats, "new_tokens": args.new_tokens,
        "kvpress": getattr(kvpress, "__version__", "0.5.5"), "transformers": transformers.__version__,
        "torch": torch.__version__, "machine": platform.machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        **gpu_description()}, "runs": []}
    for length in args.lengths:
        for threads in args.threads:
            torch.set_num_threads(threads)
            for busy in args.busy:
                with busy_processes(busy):
                    summary = measure(runner, length, presses, args)
                results["runs"].append({"length": length, "threads": threads, "busy": busy, "presses": summary})
                print(markdown(results).splitlines()[-1], flush=True)
                if args.out:  # after every block: a run cut short keeps what it measured
                    write_results(args.out, results, markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
