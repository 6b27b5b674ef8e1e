"""What a served connection has to send, waiting for its socket: sent by the I/O loop, never blocking.

The target's I/O loop answers control frames (PONG, ACK, REGIONS, META...) and
hands out region updates without ever waiting on a socket: each frame goes into
the connection's outbox and out with a non-blocking ``sendmsg`` as far as the
socket takes it; the rest goes when the socket is writable again. Frames keep
their order, and a frame never straddles another.

Each entry has a deadline: a peer that has not taken a frame by then has shown
no progress for the whole liveness budget, and its connection is ended. The
outbox holds buffers as they are given — a META's stored value or a REGIONS
frame shared by every connection are referenced, not copied — and counts its
bytes, so that the loop can stop reading from a peer that does not read its
answers (:attr:`Outbox.nbytes`).
"""

from __future__ import annotations

import socket
from collections import deque
from collections.abc import Sequence

__all__ = ["Outbox"]

_Buffer = bytes | memoryview


class Outbox:
    """Frames for one socket, in order (see the module docstring); used by one thread at a time."""

    __slots__ = ("_entries", "nbytes")

    def __init__(self) -> None:
        self._entries: deque[tuple[list[memoryview], float]] = deque()
        self.nbytes = 0
        """Bytes queued and not yet taken by the socket."""

    def __bool__(self) -> bool:
        return bool(self._entries)

    def put(self, parts: Sequence[_Buffer], deadline: float) -> None:
        """Queue one frame (its parts back to back on the wire) to be sent by ``deadline``."""
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        if views:
            self._entries.append((views, deadline))
            self.nbytes += sum(len(v) for v in views)

    def overdue(self, now: float) -> bool:
        """Whether the oldest frame should have been taken by now."""
        return bool(self._entries) and now >= self._entries[0][1]

    def flush(self, sock: socket.socket) -> int:
        """Send as much as the socket takes now; the bytes sent. Raises what ``sendmsg`` raises
        (but for a full socket: then it stops)."""
        sent_total = 0
        while self._entries:
            views, _ = self._entries[0]
            try:
                sent = sock.sendmsg(views)
            except (BlockingIOError, InterruptedError):
                break
            sent_total += sent
            self.nbytes -= sent
            while sent and views:
                if sent >= len(views[0]):
                    sent -= len(views.pop(0))
                else:
                    views[0] = views[0][sent:]
                    sent = 0
            if views:
                break  # the socket is full
            self._entries.popleft()
        return sent_total

    def clear(self) -> None:
        """Drop everything (the connection ended)."""
        self._entries.clear()
        self.nbytes = 0
