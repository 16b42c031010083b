"""Where a compressed decode step's time goes, against a same-size cache that never evicts.

Target (b) of the speed benchmark compares continuous eviction with an uncompressed cache as long as the budget.
This splits the gap in two, decoding three caches step by step in turn (so whatever the machine does hits all
three alike), each on its own copy of the model:

* ``same-size``: transformers' own cache, prefilled with the budget's first tokens, sdpa;
* ``session, no eviction``: the compressed cache inside the session with ``compress_during_decoding=False``: the
  session's fixed per-step cost (its two decoder hooks, the attention function and scorer call, the fused kernel
  in place of sdpa, the score bookkeeping), nothing evicted;
* ``continuous``: the same with eviction every ``decode_slack`` steps (the method's default), as a user runs it.

Each column is ms per step (median of ``--repeats`` rounds of ``--steps`` steps); the two differences are the
session's per-step cost and the evictions' amortised cost.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import build_model, write_results  # noqa: E402
from kvcompress import KVCacheCompressor  # noqa: E402
from kvcompress.budget import budget_slots  # noqa: E402
from kvcompress.parameters import BUDGET_ALLOCATIONS  # noqa: E402
from kvcompress.presets import preset  # noqa: E402


class Decoder:
    """A model copy prefilled with its prompt (inside a session when given parameters), decoding one token per call."""

    def __init__(self, model, tokenizer, prompt: torch.Tensor, parameters=None):
        self.model = model
        self.session = KVCacheCompressor(parameters, tokenizer=tokenizer)(model) if parameters is not None else None
        if self.session is not None:
            self.session.__enter__()
        self.cache = DynamicCache(config=model.config)
        with torch.no_grad():
            logits = model(input_ids=prompt, cache=self.cache, use_cache=True, logits_to_keep=1).logits
        self.token = logits[:, -1:].argmax(-1)

    def step(self) -> float:
        started = time.perf_counter()
        with torch.no_grad():
            self.token = self.model(input_ids=self.token, cache=self.cache, use_cache=True).logits[:, -1:].argmax(-1)
        return time.perf_counter() - started

    def close(self) -> None:
        if self.session is not None:
            self.session.__exit__(None, None, None)


def measure(args) -> dict:
    torch.set_num_threads(args.threads)
    model, tokenizer, (low, high), described = build_model(args.model, "cpu", getattr(torch, args.dtype))
    prompt = torch.randint(low, high, (1, args.length), generator=torch.Generator().manual_seed(0))
    budget = budget_slots(args.budget if args.budget < 1 else int(args.budget), args.length)
    allocation = {} if args.budget_allocation is None else {"budget_allocation": args.budget_allocation}
    decoders = {
        "same-size": Decoder(copy.deepcopy(model), tokenizer, prompt[:, :budget]),
        "session, no eviction": Decoder(copy.deepcopy(model), tokenizer, prompt,
                                        preset(args.method, budget, compress_during_decoding=False, **allocation)),
        "continuous": Decoder(model, tokenizer, prompt, preset(args.method, budget, **allocation)),
    }
    rounds = {name: [] for name in decoders}
    profile = None
    try:
        for decoder in decoders.values():  # warm-up
            decoder.step()
        for round_number in range(args.repeats):
            seconds = {name: 0.0 for name in decoders}
            order = list(decoders)
            for step in range(args.steps):
                for name in order if step % 2 == 0 else order[::-1]:
                    seconds[name] += decoders[name].step()
            for name in decoders:
                rounds[name].append(seconds[name] / args.steps)
            print(f"round {round_number + 1}: " + ", ".join(f"{n} {1e3 * s / args.steps:.2f} ms"
                                                           for n, s in seconds.items()), flush=True)
        if args.profile:  # the continuous decoder's steps under cProfile: which Python functions the session adds
            profiler = cProfile.Profile()
            profiler.runcall(lambda: [decoders["continuous"].step() for _ in range(args.steps)])
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
            profile = text.getvalue()
    finally:
        for decoder in decoders.values():
            decoder.close()
    return {"ms_per_step": {name: 1e3 * statistics.median(values) for name, values in rounds.items()},
            "rounds_ms": {name: [1e3 * v for v in values] for name, values in rounds.items()},
            "budget": budget, "budget_allocation": decoders["continuous"].session.parameters.budget_allocation,
            "model": described, "threads": args.threads, "dtype": args.dtype,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"), "profile": profile}


def markdown(result: dict, argv: list[str]) -> str:
    ms = result["ms_per_step"]
    same, fixed, continuous = ms["same-size"], ms["session, no eviction"], ms["continuous"]
    return "\n".join([
        "# A compressed decode step against a same-size cache",
        "",
        f"Command: `python benchmarks/decode_overhead.py {' '.join(argv)}`",
        "",
        f"{result['model']}, {result['dtype']}, {result['threads']} thread(s), budget {result['budget']} slots "
        f"({result['budget_allocation']}), "
        f"torch {result['torch']}, {result['date']}; median ms per step of the rounds.",
        "",
        "| same-size cache | session, no eviction | continuous eviction | (b) = same-size / continuous | "
        "session per step | evictions per step |",
        "|---|---|---|---|---|---|",
        f"| {same:.2f} | {fixed:.2f} | {continuous:.2f} | {same / continuous:.3f} | {fixed - same:+.2f} ms | "
        f"{continuous - fixed:+.2f} ms |",
        "",
    ])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", choices=["default", "tiny-llama", "tiny-llama-512"])
    parser.add_argument("--method", default="snapkv")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--budget-allocation", default=None, choices=BUDGET_ALLOCATIONS,
                        help="the budget's allocation (default: the method's preset)")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--profile", action="store_true",
                        help="also profile the continuous decoder's steps (cProfile, top 25 by own time)")
    parser.add_argument("--out", default=None, help="write <out>.json and <out>.md (and <out>_profile.txt)")
    args = parser.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    result = measure(args)
    table = markdown(result, argv)
    print(table)
    if args.out:
        out = write_results(args.out, result, table)
        if result["profile"]:
            out.with_name(out.name + "_profile.txt").write_text(result["profile"])


if __name__ == "__main__":
    main()
