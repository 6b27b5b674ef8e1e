"""``hixl proxy`` command registration."""

from __future__ import annotations

import argparse
import logging
from typing import Any

__all__ = ["add_parser"]


def add_parser(subparsers: Any) -> None:
    """Register ``hixl proxy``."""
    parser = subparsers.add_parser(
        "proxy", help="OpenAI-compatible front door for a prefill and a decode vLLM instance (hixl connector)"
    )
    parser.add_argument("--prefill", action="append", required=True, metavar="URL", help="prefill instance base URL (repeatable)")
    parser.add_argument("--decode", action="append", required=True, metavar="URL", help="decode instance base URL (repeatable)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait on an upstream (default %(default)s)")
    parser.set_defaults(run=_main)


def _main(args: argparse.Namespace) -> int:
    try:
        from aiohttp import web
    except ImportError:
        print("hixl proxy needs aiohttp: pip install 'hixl[vllm]'")
        return 2
    from .app import create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = create_app(args.prefill, args.decode, args.timeout)
    web.run_app(app, host=args.host, port=args.port, print=lambda _: print(f"hixl proxy on http://{args.host}:{args.port}", flush=True))
    return 0
