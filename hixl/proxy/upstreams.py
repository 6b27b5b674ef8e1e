"""The proxy's upstreams: each vLLM instance's state, and the choice of one for a request.

An upstream is one instance in one role (prefill or decode); a URL given for
both roles is two upstreams, each with its own state. It is UP or DOWN:

- it starts DOWN: not known to serve until its first health check passes
  (that round starts with the proxy), so that the proxy's own ``/health``
  means "can serve" from the start, also while vLLM is still loading;
- UP -> DOWN after ``down_after`` consecutive failed health checks, or at once
  when a request to it fails (unreachable, too slow, 5xx): the next requests
  should not have to find that out again;
- DOWN -> UP on the first health check that passes.

An upstream's URL may carry credentials (``http://user:password@host:port``):
they go to it as HTTP Basic authentication and nowhere else. What the proxy
shows of an upstream is :attr:`Upstream.url` (the URL less them: metrics
labels, logs) or, to clients, :attr:`Upstream.name` (its role, index and
host:port only: no scheme, path or credentials).

A :class:`Pool` picks, among a role's UP upstreams, the one serving the fewest
requests right now (ties: round robin). Everything here runs on the proxy's
event loop thread, so nothing is locked: a pick and the lease that counts it
happen with no ``await`` between them.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from urllib.parse import unquote, urlsplit, urlunsplit

from aiohttp import BasicAuth

__all__ = ["Pool", "Role", "Upstream", "UpstreamState", "describe"]

log = logging.getLogger("hixl.proxy")


class Role(str, enum.Enum):
    """What an upstream does for a request."""

    PREFILL = "prefill"
    DECODE = "decode"


class UpstreamState(enum.Enum):
    """Whether new requests may go to an upstream."""

    UP = "up"
    DOWN = "down"


class Upstream:
    """One vLLM instance in one role: its state and how many requests it is serving now.

    ``url``: its base URL as given, credentials and all; ``index``: its place among its role's."""

    def __init__(self, url: str, role: Role, index: int = 0) -> None:
        parts = urlsplit(url.rstrip("/"))
        address = parts.netloc.rpartition("@")[2]
        self.url = urlunsplit(parts._replace(netloc=address))
        """The base URL requests go to, less any ``user:password@``: safe to show an operator."""
        user, password = parts.username, parts.password or ""
        # UTF-8 (RFC 7617's charset): aiohttp's default, Latin-1, cannot encode every password.
        self.auth = None if user is None else BasicAuth(unquote(user), unquote(password), encoding="utf-8")
        """The URL's credentials, sent as HTTP Basic authentication (in place of a client's ``Authorization``)."""
        self.name = f"{role.value}[{index}] {address}"
        """How clients' error messages name it: ``decode[1] 10.0.0.4:8200``."""
        self.role = role
        self.state = UpstreamState.DOWN
        self.outstanding = 0
        self.failed_checks = 0  # consecutive

    @property
    def up(self) -> bool:
        """Whether new requests may come here."""
        return self.state is UpstreamState.UP

    @contextmanager
    def lease(self) -> Iterator[None]:
        """Count one request as outstanding here for the duration of the ``with`` block."""
        self.outstanding += 1
        try:
            yield
        finally:
            self.outstanding -= 1

    def check_passed(self) -> None:
        """A health check answered 200."""
        self.failed_checks = 0
        self._become(UpstreamState.UP, "its health check passes")

    def check_failed(self, reason: str, down_after: int) -> None:
        """A health check failed for ``reason``; the ``down_after``-th in a row marks it down."""
        self.failed_checks += 1
        if self.failed_checks >= down_after:
            self._become(UpstreamState.DOWN, f"{self.failed_checks} health checks failed, the last: {reason}")

    def request_failed(self, reason: str) -> None:
        """A request to it failed for ``reason``: down until a health check passes."""
        self._become(UpstreamState.DOWN, f"a request failed: {reason}")

    def _become(self, state: UpstreamState, why: str) -> None:
        if state is not self.state:
            log.warning("%s %s is %s: %s", self.role.value, self.url, state.value, why)
            self.state = state

    def __repr__(self) -> str:
        return f"<Upstream {self.role.value} {self.url} {self.state.value}, {self.outstanding} outstanding>"


class Pool:
    """A role's upstreams and the choice among them: fewest outstanding requests, ties in turn."""

    def __init__(self, role: Role, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError(f"the proxy needs at least one {role.value} URL")
        self.role = role
        self.upstreams = tuple(Upstream(url, role, i) for i, url in enumerate(urls))
        self._next = 0  # where the round robin among equally busy upstreams resumes

    def pick(self, exclude: Collection[Upstream] = ()) -> Upstream | None:
        """The UP upstream, not in ``exclude``, with the fewest outstanding requests; None if there is none.

        Lease it (:meth:`Upstream.lease`) before the next ``await``, or the next
        pick will not see it busy."""
        n = len(self.upstreams)
        turn = [self.upstreams[(self._next + i) % n] for i in range(n)]
        candidates = [u for u in turn if u.up and u not in exclude]
        if not candidates:
            return None
        chosen = min(candidates, key=lambda u: u.outstanding)  # min keeps the first of equals: the turn order
        self._next = (self.upstreams.index(chosen) + 1) % n
        return chosen

    @property
    def any_up(self) -> bool:
        """Whether some upstream of this role takes new requests."""
        return any(u.up for u in self.upstreams)

    def __repr__(self) -> str:
        return f"<Pool {self.role.value} {list(self.upstreams)}>"


def describe(exc: BaseException, timeout: float | None) -> str:
    """Why a call to an upstream failed, for logs and error messages (``timeout``: the limit it ran under)."""
    # A whole-call timeout is a bare TimeoutError that says nothing; aiohttp's connect
    # and read timeouts are TimeoutErrors too, but say which they are.
    if isinstance(exc, asyncio.TimeoutError) and not str(exc):
        return f"no answer within {timeout} s"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
