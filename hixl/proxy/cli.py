"""``hixl proxy`` command registration."""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import fields
from typing import Any

from .options import KV_MODES, EventsSource, ProxyOptions, unknown_sources

__all__ = ["add_parser"]

DESCRIPTION = """\
An OpenAI-compatible front door for prefill/decode-disaggregated vLLM (the hixl connector): each
completion or chat request goes to a prefill instance, then to a decode instance. With several of
each, every request goes to the one serving the fewest requests — or, with --kv-events for every
instance of a role, to the one with the longest cached prefix of its prompt, weighed against its
load; instances are health-checked, one that fails is skipped and the request retried, and
GET /metrics reports it all. With --kv-mode push (the instances' connectors in push mode too),
each request goes to prefill and decode at once, and prefill writes each layer of the prompt's KV
into decode's blocks as it computes it."""


#: The deadlines a client is held to (``server``): option -> what it bounds.
_CLIENT_DEADLINES = {
    "header_timeout": "seconds a client has to send a request's headers, from its connection's opening or its next request's first byte",
    "body_timeout": "seconds a client has to send a request's body, from the end of its headers",
    "write_timeout": "seconds a client may take none of what the proxy has for it before it is dropped, and its upstream request with it",
}


def add_parser(subparsers: Any) -> None:
    """Register ``hixl proxy``."""
    d = ProxyOptions()
    parser = subparsers.add_parser(
        "proxy",
        help="OpenAI-compatible front door for prefill and decode vLLM instances (hixl connector)",
        description=DESCRIPTION,
    )
    parser.add_argument("--prefill", action="append", required=True, metavar="URL", help="prefill instance base URL (repeatable)")
    parser.add_argument("--decode", action="append", required=True, metavar="URL", help="decode instance base URL (repeatable)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default %(default)s)")
    parser.add_argument(
        "--timeout", type=float, default=d.timeout, metavar="S",
        help="longest wait on an upstream: a whole prefill, decode's first byte, each gap in its stream (default %(default)s)",
    )
    parser.add_argument("--connect-timeout", type=float, default=d.connect_timeout, metavar="S", help="seconds to connect to an upstream (default %(default)s)")
    parser.add_argument(
        "--retries", type=int, default=d.retries, metavar="N",
        help="attempts a request may make after an upstream failed it before any byte reached the client (default %(default)s)",
    )
    parser.add_argument("--health-interval", type=float, default=d.health_interval, metavar="S", help="seconds between health checks (default %(default)s)")
    parser.add_argument("--health-timeout", type=float, default=d.health_timeout, metavar="S", help="seconds a health check may take (default %(default)s)")
    parser.add_argument(
        "--down-after", type=int, default=d.down_after, metavar="N",
        help="consecutive failed health checks that mark an upstream down (default %(default)s)",
    )
    for name, meaning in _CLIENT_DEADLINES.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name), metavar="S", help=f"{meaning} (default %(default)s)")
    parser.add_argument(
        "--kv-events", action="append", type=_events_source, default=[], metavar="URL=ENDPOINT,REPLAY",
        help="follow the KV-cache events of the instance at URL (as given to --prefill/--decode) from its ZMQ PUB ENDPOINT "
        "and its REPLAY endpoint (vLLM's --kv-events-config endpoint and replay_endpoint, as the proxy reaches them); "
        "repeatable. A role whose instances all have them is routed by cached prefix",
    )
    parser.add_argument(
        "--prefix-load-weight", type=float, default=d.prefix_load_weight, metavar="TOKENS",
        help="prompt tokens each outstanding request on an instance weighs against its cached prefix (default %(default)s)",
    )
    parser.add_argument(
        "--events-timeout", type=float, default=d.events_timeout, metavar="S",
        help="seconds without an event or an answer from an instance's replay socket before its role is routed by load (default %(default)s)",
    )
    parser.add_argument(
        "--tokenize-timeout", type=float, default=d.tokenize_timeout, metavar="S",
        help="seconds an instance's /tokenize may take for a text prompt before the request is routed by load (default %(default)s)",
    )
    parser.add_argument(
        "--kv-mode", choices=KV_MODES, default=d.kv_mode,
        help="pull: prefill first, then decode pulls its KV; push: both at once, prefill writes each layer into decode's "
        "blocks as it computes it (needs the instances' kv_connector_extra_config mode push) (default %(default)s)",
    )
    parser.add_argument(
        "--otlp-traces-endpoint", metavar="URL",
        help="send each request's spans (the request, each hop) here over OTLP, as vLLM's option of this name; off by default",
    )
    parser.set_defaults(run=_main)


def _events_source(text: str) -> EventsSource:
    try:
        return EventsSource.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _main(args: argparse.Namespace) -> int:
    try:
        import aiohttp  # noqa: F401  (the proxy's one dependency)
    except ImportError:
        print("hixl proxy needs aiohttp: pip install 'hixl[vllm]'")
        return 2
    from .server import run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        # Each option's dest is the field's name.
        options = ProxyOptions(**{f.name: getattr(args, f.name) for f in fields(ProxyOptions)})
    except ValueError as exc:
        print(f"hixl proxy: {exc}")
        return 2
    unknown = unknown_sources(options.kv_events, [*args.prefill, *args.decode])
    if unknown:
        print(f"hixl proxy: --kv-events names no --prefill or --decode instance: {', '.join(unknown)}")
        return 2
    if options.kv_events:
        try:
            import msgspec  # noqa: F401
            import zmq  # noqa: F401  (what following KV events takes: both come with vLLM)
        except ImportError:
            print("hixl proxy --kv-events needs pyzmq and msgspec: pip install pyzmq msgspec")
            return 2
    asyncio.run(run(args.prefill, args.decode, options, args.host, args.port))
    return 0
