"""The ``kvcompress`` command.

``kvcompress demo`` is the main job: the embedded default model answers a question about a long built-in
document twice, with the full KV cache and with a compressed one, and a short report shows what compression
saved and whether the answer survived. ``kvcompress generate`` does one compressed (or full-cache) answer for
the user's own text.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import torch
import yaml

from . import context_cli
from .budget import budget_slots, parse_budget
from .cache import kv_cache_bytes, kv_cache_length
from .compressor import KVCacheCompressor
from .parameters import AGGREGATIONS, KV_BITS, KVCacheCompressionParameters
from .presets import preset
from .scoring.registry import SCORERS

DEMO_DOCUMENT = "demo_report.txt"
DEMO_QUESTION = "According to the report, in which city will the new battery factory be built?"
DEMO_ANSWER = "Trondheim"
DEFAULT_BUDGET = "20%"
# KVzip keeps what the model needs to reproduce the document: on the demo in bfloat16 it answers where SnapKV at the
# same budget names the wrong city, and on RULER's needles it keeps the most
# (results/ruler_runner_smollm2_2k/scores.md).
DEFAULT_METHOD = "kvzip"
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}
SIZE_OPTIONS = ("start_size", "intermediate_size", "recent_size")
# Options that --config replaces: combining them with a config file would leave it unclear which one wins.
CONFIG_EXCLUSIVE = ("method", "budget", "score_aggregation", "window_size", "kv_bits", *SIZE_OPTIONS)


def budget_option(text: str) -> int | float:
    """``--budget``: the forms ``kvcompress.compress`` takes (400, 0.2, 20%)."""
    try:
        return parse_budget(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    return 0 if text == "0" else positive_int(text)


def _compression_options() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group(f"compression (defaults: {DEFAULT_METHOD}, a budget of 20% of the prompt)")
    group.add_argument("--method", "--algorithm", dest="method", choices=list(SCORERS),
                       help=f"default: {DEFAULT_METHOD} (--algorithm: its old name)")
    group.add_argument("--budget", type=budget_option,
                       help="slots kept per layer: a count (400) or a fraction of the prompt (0.2 or 20%%); "
                            "the method's preset splits it (kvcompress.presets)")
    for name in SIZE_OPTIONS:
        group.add_argument(f"--{name.replace('_', '-')}", dest=name, type=non_negative_int,
                           help="the three sizes are given together, instead of --budget")
    group.add_argument("--score-aggregation", choices=AGGREGATIONS, help="default: norm_sum")
    group.add_argument("--window-size", type=positive_int, help="SnapKV observation window (default 8)")
    group.add_argument("--kv-bits", type=int, choices=KV_BITS, help="bits per kept key and value element (default 16: "
                                                                    "the model's dtype)")
    group.add_argument("--config", type=Path, help="a YAML file of KVCacheCompressionParameters fields")
    return parent


def _model_options() -> argparse.ArgumentParser:
    from .models import DEFAULT_ALIAS, model_names

    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--model", choices=[DEFAULT_ALIAS, *model_names()], default=DEFAULT_ALIAS,
                        help="an embedded model (kvcompress.models; default: SmolLM2-135M-Instruct)")
    parent.add_argument("--dtype", choices=list(DTYPES), default="auto",
                        help="auto (default): bfloat16 where the CPU computes it natively (AVX512-BF16 or AMX, about "
                             "3x faster there), else float32 (bfloat16 is emulated and 5x slower on AVX2-only CPUs)")
    parent.add_argument("--threads", type=positive_int, help="torch threads (default: torch's choice)")
    return parent


def _run_options() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False, parents=[_model_options()])
    parent.add_argument("--question", help="appended to the prompt after a blank line")
    parent.add_argument("--max-new-tokens", type=positive_int)
    return parent


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcompress", description=__doc__.split("\n\n")[1].replace("\n", " "))
    commands = parser.add_subparsers(dest="command", required=True, metavar="{demo,generate,context}")
    parents = [_compression_options(), _run_options()]
    demo = commands.add_parser("demo", parents=parents, help="full vs compressed cache on a long document",
                               description="Answer a question about a long document with the full and with a "
                                           "compressed KV cache, and report cache size, time and both answers.")
    demo.add_argument("--prompt-file", type=Path,
                      help="your own prompt instead of the built-in report and question")
    demo.set_defaults(max_new_tokens=48)
    generate = commands.add_parser("generate", parents=parents, help="answer your own prompt",
                                   description="Answer the prompt in a file with a compressed KV cache.")
    generate.add_argument("--prompt-file", type=Path, required=True, help="a UTF-8 text file: the user message")
    generate.add_argument("--full-cache", action="store_true", help="do not compress (for comparison)")
    generate.set_defaults(max_new_tokens=256)
    context_cli.add_parser(commands, _model_options())
    return parser


def compression_parameters(args: argparse.Namespace, prompt_tokens: int) -> KVCacheCompressionParameters:
    """The parameters the options describe; raises ValueError naming the conflicting options."""
    given = [name for name in CONFIG_EXCLUSIVE if getattr(args, name) is not None]
    if args.config is not None:
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise ValueError(f"--config sets all compression parameters; do not combine it with {flags}")
        try:
            return KVCacheCompressionParameters.from_yaml(args.config)
        except OSError as error:
            raise ValueError(f"--config: cannot read {args.config}: {error.strerror}") from None
        except (yaml.YAMLError, TypeError, ValueError) as error:
            raise ValueError(f"--config {args.config}: {error}") from None
    sizes = [getattr(args, name) for name in SIZE_OPTIONS]
    overrides = {name: getattr(args, name) for name in ("method", "score_aggregation", "window_size", "kv_bits")}
    overrides = {name: value for name, value in overrides.items() if value is not None}
    method = overrides.pop("method", DEFAULT_METHOD)
    if any(size is not None for size in sizes):
        if None in sizes or args.budget is not None:
            raise ValueError("give either --budget or all three of --start-size, --intermediate-size, --recent-size")
        return KVCacheCompressionParameters(method=method, **dict(zip(SIZE_OPTIONS, sizes)), **overrides)
    budget = args.budget if args.budget is not None else parse_budget(DEFAULT_BUDGET)
    return preset(method, budget_slots(budget, prompt_tokens), **overrides)


@dataclass(frozen=True)
class GenerationResult:
    answer: str
    new_tokens: int
    prefill_seconds: float
    decode_seconds: float
    cache_slots: int
    cache_bytes: int
    compression_seconds: float


class _Clock:
    """A ``generate`` streamer that only keeps time: its second ``put`` is the first new token, so prefill is over."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        self.stamps.append(time.perf_counter())


def run_generation(model, tokenizer, input_ids: torch.Tensor, params: KVCacheCompressionParameters | None,
                   max_new_tokens: int) -> GenerationResult:
    """Greedy generation of one prompt, timed, with the cache compressed by ``params`` (None: the full cache)."""
    session = KVCacheCompressor(params, tokenizer=tokenizer)(model) if params else contextlib.nullcontext()
    clock = _Clock()
    start = time.perf_counter()
    with session:
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True,
                             streamer=clock)
    new = out.sequences[0, input_ids.shape[1]:]
    first_token = clock.stamps[1] if len(clock.stamps) > 2 else clock.stamps[-1]
    return GenerationResult(
        answer=tokenizer.decode(new, skip_special_tokens=True).strip(),
        new_tokens=len(new),
        prefill_seconds=first_token - start,
        decode_seconds=clock.stamps[-1] - first_token,
        cache_slots=kv_cache_length(out.cache),
        cache_bytes=kv_cache_bytes(out.cache),
        compression_seconds=session.report().compression_seconds if params else 0.0,
    )


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _load(args: argparse.Namespace):
    from .models import embedded_model, load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    _log(f"loading {embedded_model(args.model).title} (the first run converts it once, tens of seconds) ...")
    model, tokenizer = load_model(args.model, dtype=DTYPES[args.dtype])
    _log(f"  loaded in {time.perf_counter() - started:.1f} s ({str(model.dtype).removeprefix('torch.')}, "
         f"CPU kernels {torch.backends.cpu.get_cpu_capability()})")
    return model, tokenizer


def _prompt_ids(tokenizer, text: str) -> torch.Tensor:
    """The user turn of the chat template; a base model (no template) continues the text after "Answer:"."""
    if tokenizer.chat_template is None:
        return tokenizer(f"{text}\nAnswer:", return_tensors="pt")["input_ids"]
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file is None:
        text = files("kvcompress").joinpath("data", DEMO_DOCUMENT).read_text(encoding="utf-8")
        question = args.question or DEMO_QUESTION
    else:
        try:
            text = args.prompt_file.read_text(encoding="utf-8")
        except OSError as error:
            raise ValueError(f"--prompt-file: cannot read {args.prompt_file}: {error.strerror}") from None
        question = args.question
    if not text.strip():
        raise ValueError(f"--prompt-file: {args.prompt_file} is empty")
    return f"{text.rstrip()}\n\n{question}" if question else text


def _describe(params: KVCacheCompressionParameters) -> str:
    method = [params.method, params.score_aggregation] if params.scorer.combine == "add" else [params.method]
    shared = {"global": ", the layers sharing the scored slots by score",
              "adaptive": ", a layer's KV heads sharing its scored slots by score",
              "global_adaptive": ", every KV head of every layer sharing the scored slots by score",
              }.get(params.budget_allocation, "")
    bits = f", {params.kv_bits}-bit keys and values" if params.kv_bits != 16 else ""
    return (f"{', '.join([*method, params.strategy])}, {params.max_cache_size} slots per layer = {params.start_size} "
            f"start + {params.intermediate_size} scored + {params.recent_size} recent{shared}{bits}")


def _mib(count: int) -> str:
    return f"{count / 2**20:.1f} MiB"


def _report(prompt_tokens: int, params: KVCacheCompressionParameters, full: GenerationResult,
            compressed: GenerationResult, expected: str | None) -> str:
    def decode_rate(result: GenerationResult) -> str:
        rate = (result.new_tokens - 1) / result.decode_seconds if result.decode_seconds > 0 else float("nan")
        return f"{result.decode_seconds:.2f} s ({rate:.1f} tok/s)"

    rows = [
        ("", "full cache", "compressed"),
        ("cache slots per layer", f"{full.cache_slots:,}", f"{compressed.cache_slots:,}"),
        ("KV cache", _mib(full.cache_bytes),
         f"{_mib(compressed.cache_bytes)} ({compressed.cache_bytes / full.cache_bytes:.0%})"),
        ("prefill", f"{full.prefill_seconds:.2f} s",
         f"{compressed.prefill_seconds:.2f} s (compression {compressed.compression_seconds:.2f} s in total)"),
        ("decode", decode_rate(full), decode_rate(compressed)),
        ("new tokens", str(full.new_tokens), str(compressed.new_tokens)),
    ]
    width = max(len(row[0]) for row in rows)
    middle = max(len(row[1]) for row in rows)
    lines = [
        f"prompt: {prompt_tokens:,} tokens; compression: {_describe(params)}",
        "",
        *(f"{label:<{width}}  {left:<{middle}}  {right}" for label, left, right in rows),
        "",
        f"answer, full cache: {full.answer}",
        f"answer, compressed: {compressed.answer}",
    ]
    if expected:
        verdict = {True: "correct", False: "wrong"}
        lines.append(f"expected: {expected} -> full cache {verdict[expected.lower() in full.answer.lower()]}, "
                     f"compressed {verdict[expected.lower() in compressed.answer.lower()]}")
    return "\n".join(lines)


def demo(args: argparse.Namespace, text: str, model, tokenizer) -> None:
    input_ids = _prompt_ids(tokenizer, text)
    params = compression_parameters(args, input_ids.shape[1])
    # Warm-ups keep one-off costs out of both timings: the first prompt-sized forward pays for its fresh buffers,
    # the first compressed one for loading the compiled attention kernel and the compressor's first hooks.
    run_generation(model, tokenizer, input_ids, None, max_new_tokens=1)
    run_generation(model, tokenizer, input_ids[:, :64], compression_parameters(args, 64), max_new_tokens=2)
    _log(f"prompt: {input_ids.shape[1]:,} tokens; generating with the full cache ...")
    full = run_generation(model, tokenizer, input_ids, None, args.max_new_tokens)
    _log(f"  done in {full.prefill_seconds + full.decode_seconds:.1f} s; generating with {_describe(params)} ...")
    compressed = run_generation(model, tokenizer, input_ids, params, args.max_new_tokens)
    _log(f"  done in {compressed.prefill_seconds + compressed.decode_seconds:.1f} s\n")
    expected = DEMO_ANSWER if args.prompt_file is None and args.question is None else None
    print(_report(input_ids.shape[1], params, full, compressed, expected))


def generate(args: argparse.Namespace, text: str, model, tokenizer) -> None:
    input_ids = _prompt_ids(tokenizer, text)
    params = None if args.full_cache else compression_parameters(args, input_ids.shape[1])
    _log(f"prompt: {input_ids.shape[1]:,} tokens; " + (f"compression: {_describe(params)}" if params else "full cache"))
    result = run_generation(model, tokenizer, input_ids, params, args.max_new_tokens)
    print(result.answer)
    _log(f"prefill {result.prefill_seconds:.2f} s, decode {result.decode_seconds:.2f} s for {result.new_tokens} "
         f"tokens; cache {result.cache_slots:,} slots per layer, {_mib(result.cache_bytes)}")


COMMANDS = {"demo": demo, "generate": generate}


def _check_options(args: argparse.Namespace) -> None:
    """Rejects bad compression options before the model loads, so a typo costs no waiting.

    A percentage budget is checked against a nominal prompt length: ``from_budget`` accepts every budget >= 1.
    """
    if getattr(args, "full_cache", False):
        given = [name for name in (*CONFIG_EXCLUSIVE, "config") if getattr(args, name) is not None]
        if given:
            raise ValueError(f"--full-cache does not compress; drop --{given[0].replace('_', '-')}")
        return
    compression_parameters(args, prompt_tokens=1000)


def main(argv: list[str] | None = None) -> int:
    from .models import ModelUnavailableError

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "context":
        try:
            return context_cli.run(args, _load)
        except ModelUnavailableError as error:
            print(f"kvcompress: {error}", file=sys.stderr)
            return 1
        except (ValueError, KeyError) as error:  # a bad option, an unknown key, a file that cannot be loaded
            message = error.args[0] if isinstance(error, KeyError) else str(error)  # KeyError's str() quotes it
            print(f"kvcompress context {args.action}: {message}", file=sys.stderr)
            return 2
    try:
        text = _read_prompt(args)
        _check_options(args)
    except ValueError as error:
        parser.error(str(error))
    try:
        model, tokenizer = _load(args)
    except ModelUnavailableError as error:
        print(f"kvcompress: {error}", file=sys.stderr)
        return 1
    COMMANDS[args.command](args, text, model, tokenizer)
    return 0
