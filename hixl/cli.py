"""The ``hixl`` command: ``hixl bench``, ``hixl demo`` and ``hixl proxy``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hixl`` command."""
    parser = argparse.ArgumentParser(prog="hixl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from .bench.cli import add_parser as add_bench

    add_bench(sub)
    from .demo.cli import add_parser as add_demo

    add_demo(sub)
    from .proxy import add_parser as add_proxy

    add_proxy(sub)
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
