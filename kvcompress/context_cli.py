"""``kvcompress context``: store a document's compressed context once, then ask about it from any later process.

``add FILE`` compresses the document (the model's chat template around it, as ``session.prefill_text`` does) into a
``ContextStore`` and prints its key, the kept bytes and the time; ``ask KEY "question"`` loads it and answers;
``ls`` lists the store, ``rm KEY`` removes an entry. The store is ``--store``, else ``$KVCOMPRESS_STORE``, else
``~/.cache/kvcompress/contexts``; any fsspec URL works (``s3://bucket/contexts`` with s3fs installed).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import datetime
from pathlib import Path

STORE_VARIABLE = "KVCOMPRESS_STORE"


def default_store() -> str:
    return os.environ.get(STORE_VARIABLE) or str(Path.home() / ".cache" / "kvcompress" / "contexts")


def add_parser(commands, model_options: argparse.ArgumentParser) -> None:
    """The ``context`` command and its four subcommands, under ``commands`` (the CLI's subparsers);
    ``model_options``: the model's options (--model, --dtype, --threads)."""
    from .cli import DEFAULT_BUDGET, DEFAULT_METHOD, budget_option, positive_int
    from .presets import method_names

    context = commands.add_parser("context", help="store a compressed document, ask about it later",
                                  description=__doc__.split("\n\n")[0])
    actions = context.add_subparsers(dest="action", required=True, metavar="{add,ask,ls,rm}")
    store = argparse.ArgumentParser(add_help=False)
    store.add_argument("--store", default=None, help=f"a folder or fsspec URL (default: ${STORE_VARIABLE}, else "
                                                     "~/.cache/kvcompress/contexts)")
    add = actions.add_parser("add", parents=[model_options, store], help="compress a document into the store")
    add.add_argument("file", type=Path, help="a UTF-8 text file: the document")
    add.add_argument("--method", choices=method_names(), default=DEFAULT_METHOD, help=f"default: {DEFAULT_METHOD}")
    add.add_argument("--budget", type=budget_option, default=budget_option(DEFAULT_BUDGET),
                     help=f"a count of slots per layer (400) or a fraction of the document (0.2 or 20%%; default "
                          f"{DEFAULT_BUDGET.replace('%', '%%')})")
    add.add_argument("--chunk-size", type=positive_int, help="prefill the document this many tokens at a time")
    ask = actions.add_parser("ask", parents=[model_options, store], help="answer a question about a stored document")
    ask.add_argument("key", help="the key `add` printed (`ls` lists them)")
    ask.add_argument("question")
    ask.add_argument("--max-new-tokens", type=positive_int, default=128)
    actions.add_parser("ls", parents=[store], help="list the stored contexts")
    remove = actions.add_parser("rm", parents=[store], help="remove a stored context")
    remove.add_argument("key")


def run(args: argparse.Namespace, load) -> int:
    """Carry out ``args.action``; ``load(args)`` gives (model, tokenizer) for the actions that need them."""
    from .context_store import ContextStore

    store = ContextStore(args.store or default_store())
    if args.action == "ls":
        entries = store.list()
        for entry in entries:
            used = datetime.fromtimestamp(entry.last_used).strftime("%Y-%m-%d %H:%M") if entry.last_used else "-"
            print(f"{entry.key}  {entry.method:<18} {entry.tokens:>8,} tokens  {entry.kv_bytes / 2**20:8.2f} MiB kept"
                  f"  {entry.file_bytes / 2**20:8.2f} MiB file  used {used}  {entry.model}")
        print(f"{len(entries)} contexts in {store.url}", file=sys.stderr)
        return 0
    if args.action == "rm":
        store.delete(args.key)
        print(f"removed {args.key}", file=sys.stderr)
        return 0
    model, tokenizer = load(args)
    if args.action == "add":
        return _add(args, store, model, tokenizer)
    started = time.perf_counter()
    session = store.load(model, args.key, tokenizer)
    loaded = time.perf_counter() - started
    with session:
        print(session.ask(args.question, max_new_tokens=args.max_new_tokens))
    print(f"loaded in {loaded:.2f} s, answered in {time.perf_counter() - started - loaded:.2f} s", file=sys.stderr)
    return 0


def _add(args: argparse.Namespace, store, model, tokenizer) -> int:
    try:
        document = args.file.read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"FILE: cannot read {args.file}: {error.strerror}") from None
    if not document.strip():
        raise ValueError(f"FILE: {args.file} is empty")
    method, budget = args.method, args.budget
    started = time.perf_counter()
    session = store.get_or_compress(model, document, method=method, budget=budget, tokenizer=tokenizer,
                                    chunk_size=args.chunk_size)
    seconds = time.perf_counter() - started
    key = store.key_for(model, session.context_ids, method, budget, args.chunk_size, document=True)
    report = session.report()
    print(key)
    print(f"{report.tokens:,} tokens, {report.kv_bytes / 2**20:.2f} MiB kept of {report.full_kv_bytes / 2**20:.2f} "
          f"MiB ({report.kept_fraction:.1%}) with {method} at {budget}, in {seconds:.1f} s; stored in {store.url}",
          file=sys.stderr)
    return 0
