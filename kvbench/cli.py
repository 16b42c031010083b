"""``kvcompress-eval`` (and its benchmark-named aliases): run, predict or evaluate a YAML experiment.

Under ``torchrun`` / ``accelerate launch`` every rank runs the same command; each predicts its share and rank 0
merges and evaluates. ``kvcompress-longbench`` and ``kvcompress-ruler run`` are this command with their benchmark
as the default of the file's ``benchmark`` key.
"""

from __future__ import annotations

import argparse
import logging
import sys

from .config import ConfigError
from .experiment import DEFAULT_BENCHMARK, load_experiment
from .predictions import PredictionError
from .sharding import Shard

__all__ = ["add_commands", "main", "run"]

COMMANDS = (
    ("run", "predict, then evaluate"),
    ("predict", "generate the predictions (resumes where an earlier run stopped)"),
    ("evaluate", "score existing predictions and write scores.json/.csv/.md/.png"),
)


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Adds ``run``, ``predict`` and ``evaluate`` to a parser's subcommands."""
    for name, help_text in COMMANDS:
        command = commands.add_parser(name, help=help_text)
        command.add_argument("config", help="experiment YAML file (see configs/, docs/longbench.md, docs/ruler.md)")
        command.add_argument(
            "--settings", nargs="+", metavar="NAME", help="only these compression settings (default: all)"
        )
        if name != "evaluate":
            command.add_argument(
                "--tasks", nargs="+", metavar="NAME", help="predict only these tasks (default: all of the file's)"
            )


def run(arguments: argparse.Namespace, prog: str, default_benchmark: str) -> int:
    """Carries out a parsed ``run`` / ``predict`` / ``evaluate``; errors in the experiment print without a
    traceback and return 2."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        shard = Shard.from_env()
        experiment = load_experiment(arguments.config, default_benchmark)
        settings = experiment.select_settings(arguments.settings)
        tasks = experiment.select_tasks(getattr(arguments, "tasks", None))
    except (ConfigError, ValueError, FileNotFoundError) as error:  # ValueError: a bad RANK / WORLD_SIZE
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    try:
        if arguments.command in ("run", "predict"):
            from .predict import predict_experiment  # torch and transformers load only when generating

            predict_experiment(experiment, settings, shard, tasks)
        if arguments.command in ("run", "evaluate") and shard.is_main:
            from .evaluate import evaluate_experiment

            # `run --settings` adds its settings to the report of everything predicted so far.
            evaluate_experiment(experiment, experiment.settings if arguments.command == "run" else settings)
            report = experiment.output_dir / "scores.md"
            print(f"{report.read_text(encoding='utf-8')}\n(written to {report} with scores.json/.csv/.png)")
    except (ConfigError, PredictionError, FileNotFoundError, TimeoutError, *experiment.benchmark.errors) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None, prog: str = "kvcompress-eval",
         default_benchmark: str = DEFAULT_BENCHMARK) -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description="Evaluation of KV-cache compression settings on LongBench or RULER."
    )
    add_commands(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(argv), prog, default_benchmark)


if __name__ == "__main__":
    sys.exit(main())
