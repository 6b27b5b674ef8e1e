"""The hixl command: one-sided, zero-copy data transfer for PD-disaggregated LLM inference.

  hixl demo    prefill/decode-disaggregated generation on a small real transformer
  hixl bench   the engine measured against the raw calls it is built on
  hixl proxy   an OpenAI-compatible front door for vLLM prefill and decode instances

Run "hixl COMMAND --help" for a command's options ("python3 -m hixl" works too).
"""

from __future__ import annotations

import argparse
import sys

from . import __version__, _accel


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hixl`` command; returns its exit status."""
    # The module docstring is the help text, so it is written as plain text, not reStructuredText.
    parser = argparse.ArgumentParser(
        prog="hixl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"hixl {__version__}; hot path: {_accel.IMPLEMENTATION}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
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
