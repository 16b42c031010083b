"""``kvcompress-longbench``: run, predict or evaluate a YAML experiment.

Under ``torchrun`` / ``accelerate launch`` every rank runs the same command; each predicts its share and rank 0
merges and evaluates.
"""

from __future__ import annotations

import argparse
import logging
import sys

from .data import DataError
from .experiment import ConfigError, load_experiment
from .predictions import PredictionError
from .sharding import Shard

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvcompress-longbench", description="LongBench evaluation of KV-cache compression settings."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("run", "predict, then evaluate"),
        ("predict", "generate the predictions (resumes where an earlier run stopped)"),
        ("evaluate", "score existing predictions and write scores.json/.csv/.md/.png"),
    ):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("config", help="experiment YAML file (see configs/ and docs/longbench.md)")
        command.add_argument(
            "--settings", nargs="+", metavar="NAME", help="only these compression settings (default: all)"
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    arguments = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        shard = Shard.from_env()
        experiment = load_experiment(arguments.config)
        settings = experiment.select_settings(arguments.settings)
        if arguments.command in ("run", "predict"):
            from .predict import predict_experiment  # torch and transformers load only when generating

            predict_experiment(experiment, settings, shard)
        if arguments.command in ("run", "evaluate") and shard.is_main:
            from .evaluate import evaluate_experiment

            # `run --settings` adds its settings to the report of everything predicted so far.
            evaluate_experiment(experiment, experiment.settings if arguments.command == "run" else settings)
            report = experiment.output_dir / "scores.md"
            print(f"{report.read_text(encoding='utf-8')}\n(written to {report} with scores.json/.csv/.png)")
    except (ConfigError, DataError, PredictionError, FileNotFoundError, TimeoutError) as error:
        print(f"kvcompress-longbench: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
