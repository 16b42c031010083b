"""``kvcompress-longbench``: ``kvcompress-eval`` for LongBench experiment files only (``benchmark: longbench``, the
default of the file's ``benchmark`` key); a RULER file is refused with the command that runs it."""

from __future__ import annotations

import sys

from kvbench.cli import main as evaluation_main

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    return evaluation_main(argv, prog="kvcompress-longbench", benchmark="longbench")


if __name__ == "__main__":
    sys.exit(main())
