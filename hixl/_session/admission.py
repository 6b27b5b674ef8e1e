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

Pure accounting, no sockets: the caller evicts, and holds its own lock around
every call (the server's lock guards this and its set of live connections as one).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["Admission"]

C = TypeVar("C", bound=Hashable)


class Admission(Generic[C]):
    """Slot accounting for connections of type ``C`` (see the module docstring); not thread-safe."""

    def __init__(self, max_handshakes: int, max_handshakes_per_source: int, max_connections: int, max_per_peer: int) -> None:
        self.max_handshakes = max_handshakes
        self.max_handshakes_per_source = max_handshakes_per_source
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self._handshakes: dict[C, str] = {}
        """In the handshake -> its source address; in order of arrival (oldest first)."""
        self._handshakes_from: Counter[str] = Counter()
        self._open: dict[C, str] = {}
        self._open_from: Counter[str] = Counter()
        self.evictions = 0
        """Handshakes evicted so far to make room for newer ones."""

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

    def promote(self, conn: C) -> str | None:
        """Move ``conn``, whose peer just proved itself, to the open pool; why not, if it may not."""
        source = self._handshakes.get(conn)
        if source is None:
            return "its handshake was evicted"
        self._release(self._handshakes, self._handshakes_from, conn)
        if len(self._open) >= self.max_connections:
            return f"max_connections limit ({self.max_connections}) reached"
        if self._open_from[source] >= self.max_per_peer:
            return f"max_connections_per_peer limit ({self.max_per_peer}) reached for {source}"
        self._open[conn] = source
        self._open_from[source] += 1
        return None

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
            f"open={len(self._open)}/{self.max_connections} evictions={self.evictions}>"
        )
