"""Where the session layer gets its sockets: the network backend, injected into the Engine.

As httpcore takes a ``network_backend``, :class:`~hixl.Engine` takes one
(``Engine(..., network_backend=...)``): the only place that opens sockets. The
default, :class:`TcpBackend`, connects and listens with plain TCP sockets; a
test can give one that refuses, delays or wraps them to inject faults, and
another stack can be put under hixl without touching the rest. What comes back
must behave as a connected (or listening) TCP socket: the session layer sets
its own options on it (non-blocking, ``TCP_NODELAY``, ``TCP_USER_TIMEOUT``).
"""

from __future__ import annotations

import socket

__all__ = ["NetworkBackend", "TcpBackend"]


class NetworkBackend:
    """How the engine opens its sockets (see the module docstring); subclass both methods."""

    def connect(self, host: str, port: int, timeout: float) -> socket.socket:
        """A socket connected to ``(host, port)`` within ``timeout`` seconds; raises what
        ``socket.create_connection`` raises (``TimeoutError``, ``ConnectionRefusedError``, ...)."""
        raise NotImplementedError

    def listen(self, host: str, port: int, backlog: int) -> socket.socket:
        """A socket bound to ``(host, port)`` (port 0: any free one) and listening; raises ``OSError``."""
        raise NotImplementedError


class TcpBackend(NetworkBackend):
    """Plain TCP sockets (the default)."""

    def connect(self, host: str, port: int, timeout: float) -> socket.socket:
        """``socket.create_connection`` to ``(host, port)``."""
        return socket.create_connection((host, port), timeout=timeout)

    def listen(self, host: str, port: int, backlog: int) -> socket.socket:
        """A TCP socket on ``(host, port)`` with ``SO_REUSEADDR``, listening with ``backlog``."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(backlog)
        except BaseException:
            sock.close()
            raise
        return sock

    def __repr__(self) -> str:
        return "<TcpBackend>"
