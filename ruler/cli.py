"""``kvcompress-ruler``: ``generate`` RULER records for a tokenizer with the official generator scripts, ``run`` /
``predict`` / ``evaluate`` a RULER experiment file (``kvcompress-eval`` for RULER files only: ``benchmark: ruler``
is the default of the file's key, and a LongBench file is refused with the command that runs it), and ``report``
finished runs as a leaderboard (``ruler.leaderboard``).

``generate`` prints one line per task and length: where the records are, how many seconds they took and whether
they came from the cache. Tasks run one after another: each script is single-threaded and spends most of its time
starting up.
"""

from __future__ import annotations

import argparse
import sys

from kvbench.cli import add_commands, description, run, sharding_note

from .generate import DEFAULT_TOKENIZER, PREPARE_SEED, GenerationError, RulerUnavailableError, generate, task_names

__all__ = ["main"]


def _names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return names


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(name) for name in _names(text)]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"lengths must be integers: {text!r}") from error
    if any(length <= 0 for length in lengths):
        raise argparse.ArgumentTypeError(f"lengths must be positive: {text!r}")
    return lengths


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvcompress-ruler", epilog=sharding_note("ruler"),
        description=f"{description('ruler')} `generate` makes RULER records with the official generator scripts; "
                    "`report` shows finished runs as a leaderboard.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser(
        "generate", help="write OUT/<task>_<length>/validation.jsonl with the official generator scripts"
    )
    command.add_argument(
        "--tokenizer", required=True,
        help=f"tokenizer folder or hub name; '{DEFAULT_TOKENIZER}' is the embedded default model's",
    )
    command.add_argument("--tasks", type=_names, required=True, help="comma-separated, e.g. niah_single_1,vt")
    command.add_argument(
        "--lengths", type=_lengths, required=True, help="comma-separated max_seq_length values, e.g. 2048,4096"
    )
    command.add_argument("--samples", type=int, default=500, help="records per task (RULER's default: 500)")
    command.add_argument(
        "--seed", type=int, default=PREPARE_SEED, help=f"generator seed ({PREPARE_SEED}, prepare.py's, by default)"
    )
    command.add_argument("--out", required=True, help="output folder")
    command.add_argument(
        "--cache-dir", help="where generated records are kept for reruns (default: ~/.cache/kvcompress/ruler)"
    )
    command.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds one generator run may take (default: 1800)"
    )
    add_commands(commands, "ruler")
    report = commands.add_parser(
        "report", help="the leaderboard view of finished runs: means over the tasks the full cache solves, a plot"
    )
    report.add_argument("folders", nargs="+", help="runs' output folders (each with its scores.json)")
    report.add_argument("--out", required=True, help="writes OUT.md and OUT.png")
    report.add_argument("--calibration", help="the run whose full cache picks the counted tasks (default: the "
                                              "first with a full-cache setting)")
    return parser


def _report(arguments: argparse.Namespace) -> int:
    from .leaderboard import leaderboard

    try:
        print(leaderboard(arguments.folders, arguments.out, arguments.calibration))
    except (FileNotFoundError, ValueError) as error:
        print(f"kvcompress-ruler: error: {error}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    arguments = _parser().parse_args(argv)
    if arguments.command == "report":
        return _report(arguments)
    if arguments.command != "generate":
        return run(arguments, "kvcompress-ruler", "ruler")
    if arguments.samples <= 0:
        print("kvcompress-ruler: error: --samples must be positive", file=sys.stderr)
        return 2
    try:
        unknown = [task for task in arguments.tasks if task not in task_names()]
        if unknown:
            raise ValueError(f"unknown RULER task(s) {', '.join(unknown)}; known: {', '.join(task_names())}")
        for length in arguments.lengths:
            for task in arguments.tasks:
                result = generate(
                    arguments.tokenizer, task, length, arguments.samples, arguments.seed, arguments.out,
                    cache_dir=arguments.cache_dir, timeout=arguments.timeout,
                )
                source = "cached" if result.cached else "generated"
                print(f"{task} @ {length}: {result.samples} records {source} in {result.seconds:.1f} s: {result.path}")
    except (GenerationError, RulerUnavailableError, ValueError) as error:
        print(f"kvcompress-ruler: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
