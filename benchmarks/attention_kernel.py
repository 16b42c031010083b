"""One layer's attention call, each way kvcompress can make it, against torch's sdpa on the same shapes.

Why beside ``speed_memory.py``: end to end, a prefill or a decode step mixes the attention call with the model's
linear layers, hooks and Python; here the calls are timed alone, so a kernel change shows its own effect, in
each condition a user meets (1 or 2 threads, idle or beside busy processes). Shapes are SmolLM2-135M's
(9 query heads, 3 KV heads, head_dim 64), random inputs, one sequence. The calls:

* ``prefill`` (H2O): causal attention of T queries over T slots, output + column sums (the fused kernel), against
  sdpa's causal output alone;
* ``reconstruction`` (KVzip): 2,060 queries over a T-slot prefix and their own block, output + column maxima
  (the kernel's maximum mode), against torch's flash attention + one float32 product for the scores
  (``prefix_max_attention``, the path without the kernel) and sdpa's output alone (one call over prefix + block);
* ``decode``: one query over T slots, output + column sums, against sdpa.

Each call runs ``--repeats`` rounds, alternating the candidates; the table gives the fastest round per call
(the least disturbed one; the busy processes disturb every round alike) and the ratio to sdpa.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import busy_processes, write_results  # noqa: E402
from kvcompress.kernels import native  # noqa: E402
from kvcompress.kernels.attention import observed_attention  # noqa: E402
from kvcompress.kernels.reconstruction import prefix_max_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
RECONSTRUCTION_QUERIES = 2060  # a 2,048-token chunk and its request
SCALE = HEAD_DIM**-0.5
EMPTY = torch.empty(0)  # no dead slots, every row observed, not a folded layer


def candidates(call: str, slots: int, dtype: torch.dtype) -> dict:
    """The timed functions of one call at one cache size: name -> (function, calls per round)."""
    generator = torch.Generator().manual_seed(0)
    length = {"prefill": slots, "reconstruction": RECONSTRUCTION_QUERIES, "decode": 1}[call]
    total = slots + (length if call == "reconstruction" else 0)
    queries = torch.randn(1, HEADS, length, HEAD_DIM, generator=generator).to(dtype)
    keys = torch.randn(1, KV_HEADS, total, HEAD_DIM, generator=generator).to(dtype)
    values = torch.randn(1, KV_HEADS, total, HEAD_DIM, generator=generator).to(dtype)
    live = torch.ones(1, total, dtype=torch.bool)
    observed = torch.ones(1, length, dtype=torch.bool)
    reduce = "max" if call == "reconstruction" else "sum"
    calls = 200 if call == "decode" else 3

    def kernel():
        return observed_attention(queries, keys, live, observed, SCALE, values=values, all_live=True, reduce=reduce)

    # a reconstruction pass sees the prefix and its own block causally: sdpa's is_causal is top-left aligned, so a mask
    mask = torch.ones(length, total, dtype=torch.bool).tril_(total - length) if call == "reconstruction" else None

    def plain():
        return torch.nn.functional.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, is_causal=call == "prefill", enable_gqa=True
        )

    functions = {"kernel": (kernel, calls), "sdpa": (plain, calls)}
    if dtype == torch.bfloat16:  # how the kernel took bfloat16 layers before it multiplied them as they are

        def float32_copies():
            copies = [tensor.float() for tensor in (queries, keys, values)]
            return native.kernel().fused_attention(*copies, SCALE, EMPTY, EMPTY, reduce == "max", native.ROW_BLOCK,
                                                   native.KEY_BLOCK, EMPTY, [], 0)

        functions["kernel on float32 copies"] = (float32_copies, calls)
    if call == "reconstruction":
        functions["flash + float32 scores"] = (lambda: prefix_max_attention(queries, keys, values, SCALE), calls)
    return functions


def measure(args) -> list[dict]:
    rows = []
    for call in args.calls:
        for slots in args.slots:
            functions = candidates(call, slots, getattr(torch, args.dtype))
            best = {name: float("inf") for name in functions}
            for name, (function, _) in functions.items():  # warm-up (buffers, oneDNN kernels)
                function()
            for round_number in range(args.repeats):
                order = list(functions) if round_number % 2 == 0 else list(functions)[::-1]
                for name in order:
                    function, calls = functions[name]
                    started = time.perf_counter()
                    for _ in range(calls):
                        function()
                    best[name] = min(best[name], (time.perf_counter() - started) / calls)
            rows.append({"call": call, "slots": slots, "seconds": best})
            print(call, slots, {name: f"{1e3 * seconds:.3f} ms" for name, seconds in best.items()}, flush=True)
    return rows


def markdown(results: dict) -> str:
    environment = results["environment"]
    lines = [
        "# One layer's attention call: the kernel against sdpa",
        "",
        f"Command: `python benchmarks/attention_kernel.py {' '.join(environment['argv'])}`",
        "",
        f"{environment['dtype']}, torch {environment['torch']}, {environment['threads']} thread(s), "
        f"{environment['busy']} busy process(es) beside, kernel inputs in {environment['kernel_input_dtype']}, "
        f"{environment['date']}. Fastest of {environment['repeats']} alternating rounds, ms per call; × = / sdpa.",
        "",
        "| call | slots | sdpa ms | kernel ms | kernel × | flash + float32 scores ms | × "
        "| kernel on float32 copies ms | × |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        seconds = row["seconds"]
        base = seconds["sdpa"]
        cells = [f"{1e3 * base:.3f}", f"{1e3 * seconds['kernel']:.3f}", f"{seconds['kernel'] / base:.2f}"]
        for other in ("flash + float32 scores", "kernel on float32 copies"):
            value = seconds.get(other)
            cells += [f"{1e3 * value:.3f}", f"{value / base:.2f}"] if value else ["—", "—"]
        lines.append(f"| {row['call']} | {row['slots']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", nargs="+", default=["prefill", "reconstruction", "decode"],
                        choices=["prefill", "reconstruction", "decode"])
    parser.add_argument("--slots", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--busy", type=int, default=0, help="busy processes (a Python loop each) beside")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="results/attention_kernel")
    args = parser.parse_args(argv)
    kernel = native.kernel()
    if kernel is None:
        raise SystemExit("the fused CPU kernel is not available on this machine: nothing to compare")
    for threads in args.threads:
        torch.set_num_threads(threads)
        with busy_processes(args.busy):
            rows = measure(args)
        results = {"rows": rows, "environment": {
            "argv": list(sys.argv[1:] if argv is None else argv), "dtype": args.dtype, "torch": torch.__version__,
            "threads": threads, "busy": args.busy, "repeats": args.repeats,
            "kernel_input_dtype": str(native.input_dtype(kernel, getattr(torch, args.dtype))).removeprefix("torch."),
            "date": time.strftime("%Y-%m-%d %H:%M"),
        }}
        write_results(f"{args.out}_{args.dtype}_t{threads}_busy{args.busy}", results, markdown(results))
        print(markdown(results))


if __name__ == "__main__":
    main()
