"""Peer yardstick for prefill speed under load: kvpress 0.5.5's H2O (ObservedAttentionPress, eager attention) and
SnapKV on the model shape of ``speed_memory.py --model tiny-llama-512`` (random weights, 6 layers, hidden 512,
8 heads), against kvpress's own uncompressed sdpa prefill in the same process.

Runs under the peer's virtualenv (kvpress pins transformers < 5.3; see ``peer_kvpress.py`` for its set-up)::

    /work/peer-venv/bin/python benchmarks/peer_kvpress_speed.py --threads 1 2 --busy 0 1 \
        --out benchmarks/results/peer_kvpress/speed_tiny512.md

For each thread count and each number of busy processes beside (a Python loop each, started and stopped here),
the uncompressed sdpa prefill and each press alternate (order reversed on every other repeat) and the median
prefill times give the ratios; 20 % of the 4,096 tokens are kept (``compression_ratio=0.8``). ObservedAttentionPress
needs the attention weights, so it runs on an eager-attention copy of the same weights, as kvpress requires; the
ratio is against the sdpa prefill, as ``speed_memory.py`` reports ours (and, in its own column, against the
eager uncompressed prefill, which is how kvpress's H2O compares with kvpress without a press). Timings are medians on whatever machine
runs this; nothing here asserts on them.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import platform
import statistics
import subprocess
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvpress import ObservedAttentionPress, SnapKVPress


def build_models() -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """The tiny-llama-512 shape of speed_memory.py (same config, seed 0), with sdpa and with eager attention."""
    config = LlamaConfig(
        vocab_size=1024, hidden_size=512, intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=65536, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    sdpa = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", torch_dtype=torch.float32).eval()
    eager = copy.deepcopy(sdpa)
    eager.config._attn_implementation = "eager"
    for layer in eager.model.layers:
        layer.self_attn.config._attn_implementation = "eager"
    return sdpa, eager


@contextlib.contextmanager
def busy_processes(count: int):
    processes = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        if processes:
            time.sleep(1.0)
        yield
    finally:
        for process in processes:
            process.kill()
            process.wait()


@torch.no_grad()
def prefill_seconds(model, ids, press) -> float:
    context = press(model) if press is not None else contextlib.nullcontext()
    with context:
        started = time.perf_counter()
        model(input_ids=ids, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - started


def measure(threads: int, busy: int, length: int, repeats: int) -> dict[str, float]:
    torch.set_num_threads(threads)
    sdpa, eager = build_models()
    ids = torch.randint(3, 1024, (1, length), generator=torch.Generator().manual_seed(0))
    runs = {"none": (sdpa, None), "none (eager)": (eager, None),
            "h2o (eager)": (eager, ObservedAttentionPress(compression_ratio=0.8)),
            "snapkv": (sdpa, SnapKVPress(compression_ratio=0.8))}
    for model, press in runs.values():  # warm-up
        prefill_seconds(model, ids[:, :256], press)
    times: dict[str, list[float]] = {name: [] for name in runs}
    with busy_processes(busy):
        for repeat in range(repeats):
            order = list(runs) if repeat % 2 == 0 else list(runs)[::-1]
            for name in order:
                model, press = runs[name]
                times[name].append(prefill_seconds(model, ids, press))
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratios = {name: medians[name] / medians["none"] for name in runs if name != "none"}
    return ratios | {"none_s": medians["none"], "h2o_vs_eager": medians["h2o (eager)"] / medians["none (eager)"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="Markdown file for the table")
    args = parser.parse_args(argv)
    import kvpress
    import transformers

    lines = [
        "# kvpress prefill under load (tiny-llama-512 shape, float32)", "",
        f"Command: `python benchmarks/peer_kvpress_speed.py {' '.join(sys.argv[1:] if argv is None else argv)}`", "",
        f"kvpress {kvpress.__version__ if hasattr(kvpress, '__version__') else '0.5.5'}, transformers "
        f"{transformers.__version__}, torch {torch.__version__}, {platform.machine()}, {time.strftime('%Y-%m-%d')}; "
        f"{args.length} tokens, 20 % kept, median of {args.repeats} alternating repeats; ratio = prefill time / "
        "kvpress's uncompressed sdpa prefill in the same process.", "",
        "| threads | busy processes | uncompressed sdpa s | uncompressed eager × | H2O (ObservedAttentionPress, "
        "eager) × | H2O × its eager uncompressed | SnapKV × |",
        "|---|---|---|---|---|---|---|",
    ]
    for threads in args.threads:
        for busy in args.busy:
            ratios = measure(threads, busy, args.length, args.repeats)
            lines.append(f"| {threads} | {busy} | {ratios['none_s']:.2f} | {ratios['none (eager)']:.2f} | "
                         f"{ratios['h2o (eager)']:.2f} | {ratios['h2o_vs_eager']:.2f} | {ratios['snapkv']:.2f} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text)
    print(text)


if __name__ == "__main__":
    main()
