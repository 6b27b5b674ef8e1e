"""Serving the proxy: its listening socket, and the deadlines aiohttp does not keep for a client.

aiohttp's server waits as long as a client likes for a request's headers and
body, and for the client to take what it is sent. So one client could hold a
connection — streaming, the decode request behind it too, KV blocks and all —
for as long as it liked, by sending slowly (a slowloris) or by not reading.
Each client connection is therefore aiohttp's protocol wrapped in a
:class:`ConnectionGuard`, which keeps three deadlines with one timer each
(no task or thread per connection):

- **headers**: ``header_timeout`` from the connection's opening, or from the
  first byte of a next request on a kept-alive one, to its handler starting;
  between requests a connection is idle, and ending idle ones is aiohttp's
  keep-alive timeout's job (so is a connection whose next request came whole
  or in part while the last was handled, pipelined, and then nothing more:
  it holds no more than an idle one);
- **body**: ``body_timeout`` from the handler starting to the body's last byte;
- **writes**: ``write_timeout`` while the connection's send buffer stays over
  its high-water mark — the client takes nothing of what the proxy has for it.

Past one, the connection is aborted. The server cancels a request's handler
when its connection goes (handler cancellation), as for a client that leaves:
that closes the handler's upstream connection, vLLM aborts a request whose
connection closes, and an aborted decode releases the KV prefill holds for it.
A handler tells its connection's guard when it starts and ends through a
middleware (:func:`_tell_the_guard`): aiohttp says so nowhere else.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import cast

from aiohttp import StreamReader, web

from .app import create_app
from .options import ProxyOptions

__all__ = ["ConnectionGuard", "ConnectionState", "run", "serve"]

log = logging.getLogger("hixl.proxy")


class ConnectionState(enum.Enum):
    """Where a client connection is, as its read deadlines see it."""

    HEADERS = "reading a request's headers"  # due within header_timeout
    REQUEST = "handling a request"  # its body due within body_timeout of this state's start
    IDLE = "idle"  # between requests; the next one's first byte makes it HEADERS


class ConnectionGuard(asyncio.Protocol):
    """One client connection's protocol: aiohttp's (``inner``), with the module's deadlines kept around it."""

    def __init__(self, inner: asyncio.Protocol, options: ProxyOptions) -> None:
        self._inner, self._options = inner, options
        self.state = ConnectionState.HEADERS
        self._transport: asyncio.Transport | None = None
        self._peer = "?"
        self._body: StreamReader | None = None  # the handled request's, while REQUEST
        self._read_timer: asyncio.TimerHandle | None = None  # the headers' or the body's deadline, by state
        self._write_timer: asyncio.TimerHandle | None = None  # armed while writing is paused

    # asyncio's calls: each passed on to aiohttp's protocol.

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """The client connected: its first request's headers are due."""
        self._transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self._peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self._inner.connection_made(transport)
        self._arm_read(self._options.header_timeout)

    def data_received(self, data: bytes) -> None:
        """Bytes from the client; on an idle connection, a next request's first: its headers are due."""
        if self.state is ConnectionState.IDLE:
            self.state = ConnectionState.HEADERS
            self._arm_read(self._options.header_timeout)
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        """The client will send nothing more."""
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        """The send buffer is over its high-water mark: the client has this long to take some."""
        loop = asyncio.get_running_loop()
        timeout = self._options.write_timeout
        self._write_timer = loop.call_later(timeout, self._drop, f"took nothing of what it was sent for {timeout} s")
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        """The client took enough: no write deadline until the buffer fills again."""
        self._cancel_write_timer()
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        """The connection is closed, whoever closed it."""
        self._cancel_read_timer()
        self._cancel_write_timer()
        self._body = None
        self._inner.connection_lost(exc)

    # The middleware's calls.

    def request_started(self, body: StreamReader) -> None:
        """A request's handler starts (its headers are in); ``body``: its body, due within ``body_timeout``."""
        self.state, self._body = ConnectionState.REQUEST, body
        self._arm_read(self._options.body_timeout)

    def request_ended(self) -> None:
        """The handler is done (its answer may still be going out, under the write deadline)."""
        self.state, self._body = ConnectionState.IDLE, None
        self._cancel_read_timer()

    def _arm_read(self, timeout: float) -> None:
        self._cancel_read_timer()
        self._read_timer = asyncio.get_running_loop().call_later(timeout, self._read_deadline)

    def _read_deadline(self) -> None:
        self._read_timer = None
        if self.state is ConnectionState.HEADERS:
            self._drop(f"sent no whole request headers within {self._options.header_timeout} s")
        elif self.state is ConnectionState.REQUEST and self._body is not None and not self._body.is_eof():
            self._drop(f"sent no whole request body within {self._options.body_timeout} s")

    def _drop(self, why: str) -> None:
        log.warning("client %s %s: its connection is closed", self._peer, why)
        if self._transport is not None:
            self._transport.abort()  # (close() would wait to send what the client does not take)

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _cancel_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def __repr__(self) -> str:
        paused = ", writing paused" if self._write_timer is not None else ""
        return f"<ConnectionGuard {self._peer} {self.state.value}{paused}>"


_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _tell_the_guard(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """Tell the request's connection guard when its handler starts and ends."""
    transport = request.transport
    guard = transport.get_protocol() if transport is not None else None
    if not isinstance(guard, ConnectionGuard):  # the connection is gone already
        return await handler(request)
    guard.request_started(request.content)
    try:
        return await handler(request)
    finally:
        guard.request_ended()


@asynccontextmanager
async def serve(
    prefill: Sequence[str], decode: Sequence[str], options: ProxyOptions, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[int]:
    """The proxy for these upstreams (``create_app``), listening on ``host``:``port`` for the ``async with``
    block; yields the port it listens on (``port`` 0: a free one). Every client connection is guarded."""
    app = create_app(prefill, decode, options)
    app.middlewares.append(_tell_the_guard)
    # Handler cancellation: a client that goes away (or is dropped) cancels its request at once, so
    # that its upstream hop ends (vLLM aborts a request whose connection closes) instead of running
    # on for nobody.
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    try:
        server = runner.server
        assert server is not None  # (set up)
        listener = await asyncio.get_running_loop().create_server(lambda: ConnectionGuard(server(), options), host, port)
        try:
            yield listener.sockets[0].getsockname()[1]
        finally:
            listener.close()
    finally:
        await runner.cleanup()  # ends the connections, then the app (its health checks, its client session)


async def run(prefill: Sequence[str], decode: Sequence[str], options: ProxyOptions, host: str, port: int) -> None:
    """``hixl proxy``: serve until SIGINT or SIGTERM, saying where once listening."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with serve(prefill, decode, options, host, port) as bound:
        print(f"hixl proxy on http://{host}:{bound}", flush=True)
        await stop.wait()
