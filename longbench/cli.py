"""``kvcompress-longbench``: ``kvcompress-eval`` with LongBench as the default benchmark of the experiment file."""

from __future__ import annotations

import sys

from kvbench.cli import main as evaluation_main

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    return evaluation_main(argv, prog="kvcompress-longbench", default_benchmark="longbench")


if __name__ == "__main__":
    sys.exit(main())
