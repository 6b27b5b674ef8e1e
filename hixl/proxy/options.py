"""The proxy's options, apart from the app so that ``hixl --help`` needs no aiohttp."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ProxyOptions"]


@dataclass(frozen=True)
class ProxyOptions:
    """How long the proxy waits on upstreams and clients, how often it retries and checks (``hixl proxy``'s options of these names)."""

    #: The longest an upstream may keep the proxy waiting, seconds: a whole prefill, decode's
    #: first byte, and each gap between decode's chunks (a whole generation may take longer).
    timeout: float = 600.0
    #: Seconds to open a connection to an upstream.
    connect_timeout: float = 5.0
    #: Attempts a request may make after its first failed (each one from prefill).
    retries: int = 2
    #: Seconds from one round of health checks to the next.
    health_interval: float = 2.0
    #: Seconds one health check may take.
    health_timeout: float = 1.0
    #: Consecutive failed health checks that mark an upstream down.
    down_after: int = 3
    #: Seconds a client has for a request's headers: from its connection's opening, or from the first
    #: byte of its next request on a kept-alive connection (a slowloris is dropped after this long).
    header_timeout: float = 30.0
    #: Seconds a client has for a request's body, from the end of its headers.
    body_timeout: float = 60.0
    #: Seconds a client may take no data while the proxy has some for it: then its connection is
    #: dropped, and with it the upstream request it was holding (decode's blocks are released).
    write_timeout: float = 60.0

    def __post_init__(self) -> None:
        for name in ("timeout", "connect_timeout", "health_interval", "health_timeout", "header_timeout", "body_timeout", "write_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, not {getattr(self, name)!r}")
        if self.retries < 0 or self.down_after < 1:
            raise ValueError(f"retries must be >= 0 and down_after >= 1, not {self.retries!r} and {self.down_after!r}")
