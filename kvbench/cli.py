"""``kvcompress-eval`` (and its benchmark-named aliases): run, predict or evaluate a YAML experiment.

Under ``torchrun`` / ``accelerate launch`` every rank runs the same command; each predicts its share and rank 0
merges and evaluates. ``kvcompress-eval`` runs either benchmark, the one the file's ``benchmark`` key names
(LongBench without one); ``kvcompress-longbench`` and ``kvcompress-ruler run`` run only their own, so that a file
of the other fails at once with the command that runs it, not with an "unknown key".
"""

from __future__ import annotations

import argparse
import logging
import sys

from .benchmark import get_benchmark
from .config import ConfigError
from .experiment import DEFAULT_BENCHMARK, OtherBenchmarkError, load_experiment
from .predictions import PredictionError
from .sharding import Shard

__all__ = ["BENCHMARK_COMMANDS", "add_commands", "description", "main", "run"]

PROG = "kvcompress-eval"
# the command (and the module torchrun starts) that runs each benchmark's files
BENCHMARK_COMMANDS = {"longbench": "kvcompress-longbench", "ruler": "kvcompress-ruler"}
_MODULES = {None: "kvbench.cli", "longbench": "longbench.cli", "ruler": "ruler.cli"}
COMMANDS = (
    ("run", "predict, then evaluate"),
    ("predict", "generate the predictions (resumes where an earlier run stopped)"),
    ("evaluate", "score existing predictions and write scores.json/.csv/.md/.png and scores_summary.csv"),
)


def description(benchmark: str | None) -> str:
    """What the entry point of ``benchmark`` runs (None: ``kvcompress-eval``, either benchmark), for its help."""
    if benchmark is None:
        names = ", ".join(f"{get_benchmark(name).title} ({command})" for name, command in BENCHMARK_COMMANDS.items())
        return (
            "Evaluation of KV-cache compression settings on LongBench or RULER: `run`, `predict` and `evaluate` take "
            "an experiment file (a YAML: a model, compression settings, a benchmark's tasks) of the benchmark its "
            f"`benchmark` key names (default: {DEFAULT_BENCHMARK}). Each benchmark also has a command of its own: "
            f"{names}. docs/longbench.md, docs/ruler.md"
        )
    title = get_benchmark(benchmark).title
    others = "; ".join(f"{get_benchmark(name).title} files: {command}" for name, command in BENCHMARK_COMMANDS.items()
                       if name != benchmark)
    return (
        f"Evaluation of KV-cache compression settings on {title}: `run`, `predict` and `evaluate` take a {title} "
        f"experiment file (a YAML: a model, compression settings, {title} tasks). `benchmark: {benchmark}` is the "
        f"default of the file's `benchmark` key and the only benchmark this command runs ({others}; files of "
        f"either benchmark: {PROG}). docs/{benchmark}.md"
    )


def sharding_note(benchmark: str | None) -> str:
    """How to spread a run over several processes, as the help's closing line."""
    module = _MODULES[benchmark]
    return (f"Sharded over N processes or GPUs: torchrun --nproc_per_node N -m {module} run CONFIG "
            f"(or accelerate launch --num_processes N -m {module} run CONFIG)")


def add_commands(commands: argparse._SubParsersAction, benchmark: str | None = None) -> None:
    """Adds ``run``, ``predict`` and ``evaluate`` to a parser's subcommands, for ``benchmark``'s files (None:
    either)."""
    config_help = (
        "experiment YAML file (configs/longbench/, configs/ruler/)" if benchmark is None
        else f"{get_benchmark(benchmark).title} experiment YAML file (configs/{benchmark}/)"
    )
    for name, help_text in COMMANDS:
        command = commands.add_parser(name, help=help_text, description=help_text, epilog=sharding_note(benchmark))
        command.add_argument("config", help=config_help)
        command.add_argument(
            "--settings", nargs="+", metavar="NAME", help="only these compression settings (default: all)"
        )
        if name != "evaluate":
            command.add_argument(
                "--tasks", nargs="+", metavar="NAME",
                help="predict only these tasks (default: all of the file's): names as the file's `tasks` gives them "
                     "(a RULER task runs at every length) or a RULER task at one length (niah_single_1_4096)",
            )


def _other_benchmark_hint(error: OtherBenchmarkError, arguments: argparse.Namespace, prog: str,
                          benchmark: str | None) -> str:
    """The command that runs the file, appended to the error."""
    command = f"`{BENCHMARK_COMMANDS[error.benchmark]} {arguments.command} {arguments.config}`"
    if benchmark is None:
        return f"Add `benchmark: {error.benchmark}` to the file, or run it with {command}"
    return f"{prog} runs {get_benchmark(benchmark).title} files only: run it with {command} (or {PROG})"


def run(arguments: argparse.Namespace, prog: str, benchmark: str | None) -> int:
    """Carries out a parsed ``run`` / ``predict`` / ``evaluate`` of ``benchmark``'s files (None: the file's
    ``benchmark`` key picks); errors in the experiment print without a traceback and return 2. ``run`` and
    ``predict`` check that the model can be loaded before any record is made."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        shard = Shard.from_env()
        experiment = load_experiment(
            arguments.config, benchmark or DEFAULT_BENCHMARK, exclusive=benchmark is not None,
            check_model=arguments.command != "evaluate",
        )
        settings = experiment.select_settings(arguments.settings)
        tasks = experiment.select_tasks(getattr(arguments, "tasks", None))
    except OtherBenchmarkError as error:
        print(f"{prog}: error: {error}. {_other_benchmark_hint(error, arguments, prog, benchmark)}", file=sys.stderr)
        return 2
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
            print(f"{report.read_text(encoding='utf-8')}\n(written to {report} with scores.json/.csv, "
                  "scores_summary.csv and scores.png)")
    except (ConfigError, PredictionError, FileNotFoundError, TimeoutError, *experiment.benchmark.errors) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None, prog: str = PROG, benchmark: str | None = None) -> int:
    """The command line of ``benchmark``'s files (None: ``kvcompress-eval``, the file's ``benchmark`` key picks)."""
    parser = argparse.ArgumentParser(prog=prog, description=description(benchmark), epilog=sharding_note(benchmark))
    add_commands(parser.add_subparsers(dest="command", required=True), benchmark)
    return run(parser.parse_args(argv), prog, benchmark)


if __name__ == "__main__":
    sys.exit(main())
