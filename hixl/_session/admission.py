"""A target's connection slots: handshakes and authenticated peers, counted apart.

Theory of operation. A connection still in the handshake has proved nothing,
so it must not be able to take what authenticated peers need. Two pools:

- *Handshakes* (``max_handshakes`` in all, ``max_handshakes_per_source`` from one
  source address). A source over its share is refused at once. When the pool is
  full, a newcomer is admitted anyway and the handshake it displaces is *evicted*:
  the oldest one of the source that holds the most. A flood of slow handshakes
  therefore churns among itself: an honest handshake, which takes milliseconds
  and comes from a source holding fewer than the flood's busiest, is never the
  one chosen; against a flood from more sources than there are slots, one each,
  it is chosen only once every older one went, i.e. if ``max_handshakes`` newer
  connections arrive while it runs. Nobody waits for a slot to time out.
- *Open* connections (``max_connections`` in all, ``max_connections_per_peer``
  from one address) are counted only once the peer proved itself, just before
  WELCOME (:meth:`Admission.promote`). Nothing unauthenticated ever holds one.
  When they are all taken, a newcomer from address S is admitted anyway if an
  *idle* connection (nothing in hand: no request arriving, served or answered,
  no deregistration unconfirmed) from an address T holding at least two more
  than S does is closed for it: of the largest holder that has one idle, the
  one idle longest. Afterwards T still holds at least as many as S, so an
  eviction never makes the shares less even, and is never undone by the
  evicted peer coming back (that could only take a slot from an address
  holding more than T did). An insider filling every slot from many addresses
  therefore yields to a peer from any address holding two fewer; a peer is
  closed only while its address holds two more than the newcomer's, and never
  with work in hand. If no connection qualifies — the shares are even, or the
  larger holders' connections are all busy — the newcomer is refused, as before.

Pure accounting, no sockets: the caller evicts, says from its connections which
are idle (``idle_since``), and holds its own lock around every call (the server's
lock guards this and its set of live connections as one).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["Admission"]

C = TypeVar("C", bound=Hashable)


class Admission(Generic[C]):
    """Slot accounting for connections of type ``C`` (see the module docstring); not thread-safe."""

    def __init__(
        self,
        max_handshakes: int,
        max_handshakes_per_source: int,
        max_connections: int,
        max_per_peer: int,
        idle_since: Callable[[C], float | None],
    ) -> None:
        """``idle_since(conn)``: when an open connection's last request came, if it has nothing in
        hand now (its ``time.monotonic()``); None while it has (it may not be evicted)."""
        self.max_handshakes = max_handshakes
        self.max_handshakes_per_source = max_handshakes_per_source
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self._idle_since = idle_since
        self._handshakes: dict[C, str] = {}
        """In the handshake -> its source address; in order of arrival (oldest first)."""
        self._handshakes_from: Counter[str] = Counter()
        self._open: dict[C, str] = {}
        self._open_from: Counter[str] = Counter()
        self.evictions = 0
        """Handshakes evicted so far to make room for newer ones."""
        self.idle_evictions = 0
        """Idle open connections closed so far to make room for a newcomer."""

    @property
    def handshakes(self) -> int:
        """Connections in the handshake right now."""
        return len(self._handshakes)

    @property
    def open(self) -> int:
        """Authenticated connections right now."""
        return len(self._open)

    def refusal(self, source: str) -> str | None:
        """Why a new connection from ``source`` may not start a handshake (None: it may)."""
        if self._handshakes_from[source] >= self.max_handshakes_per_source:
            return f"max_handshakes_per_source limit ({self.max_handshakes_per_source}) reached for {source}"
        return None

    def admit(self, conn: C, source: str) -> C | None:
        """Give ``conn`` (which :meth:`refusal` let in) a handshake slot; the handshake it evicts, if any.

        The evicted one no longer counts; the caller ends it (its thread then calls :meth:`forget`).
        """
        victim = self._victim() if len(self._handshakes) >= self.max_handshakes else None
        if victim is not None:
            self._release(self._handshakes, self._handshakes_from, victim)
            self.evictions += 1
        self._handshakes[conn] = source
        self._handshakes_from[source] += 1
        return victim

    def _victim(self) -> C:
        """The oldest handshake of the source holding the most (see the module docstring)."""
        most = max(self._handshakes_from.values())
        return next(conn for conn, source in self._handshakes.items() if self._handshakes_from[source] == most)

    def promote(self, conn: C) -> tuple[str | None, C | None]:
        """Move ``conn``, whose peer just proved itself, to the open pool: why not, if it may not;
        and the idle connection it evicts to make room, if any (it no longer counts; the caller
        closes it, and then calls :meth:`forget`)."""
        source = self._handshakes.get(conn)
        if source is None:
            return "its handshake was evicted", None
        self._release(self._handshakes, self._handshakes_from, conn)
        if self._open_from[source] >= self.max_per_peer:
            return f"max_connections_per_peer limit ({self.max_per_peer}) reached for {source}", None
        victim = None
        if len(self._open) >= self.max_connections:
            victim = self._idle_victim(source)
            if victim is None:
                return (
                    f"max_connections limit ({self.max_connections}) reached (and no idle connection of an "
                    f"address holding two more than {source} to close for it)"
                ), None
            self._release(self._open, self._open_from, victim)
            self.idle_evictions += 1
        self._open[conn] = source
        self._open_from[source] += 1
        return None, victim

    def _idle_victim(self, source: str) -> C | None:
        """The open connection to close for a newcomer from ``source`` (see the module docstring):
        idle, of an address holding at least two more than ``source``; of those, of the address
        holding the most, the one idle longest. None if there is none. (One pass over the open
        connections, only when they are all taken.)"""
        least = self._open_from[source] + 2
        best: tuple[int, float] | None = None
        victim = None
        for conn, held_by in self._open.items():
            held = self._open_from[held_by]
            if held < least or (best is not None and -held > best[0]):
                continue
            since = self._idle_since(conn)
            if since is not None and (best is None or (-held, since) < best):
                best, victim = (-held, since), conn
        return victim

    def forget(self, conn: C) -> None:
        """``conn`` ended: free whatever slot it holds (none, if it was evicted or refused)."""
        if conn in self._handshakes:
            self._release(self._handshakes, self._handshakes_from, conn)
        elif conn in self._open:
            self._release(self._open, self._open_from, conn)

    @staticmethod
    def _release(pool: dict[C, str], per_source: Counter[str], conn: C) -> None:
        source = pool.pop(conn)
        per_source[source] -= 1
        if not per_source[source]:
            del per_source[source]

    def __repr__(self) -> str:
        return (
            f"<Admission handshakes={len(self._handshakes)}/{self.max_handshakes} "
            f"open={len(self._open)}/{self.max_connections} evictions={self.evictions} idle_evictions={self.idle_evictions}>"
        )
