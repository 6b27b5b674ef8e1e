"""What a served connection has to send, waiting for its socket: sent by the I/O loop, never blocking.

The target's I/O loop answers every request without ever waiting on a socket:
each frame — and a READ's data, straight from registered memory — goes into the
connection's outbox and out with non-blocking ``sendmsg``/``writev`` calls as
far as the socket takes it; the rest goes when the socket is writable again.
Entries keep their order and never interleave: a READ's DATA frame and its
bytes are two entries back to back.

An entry may carry a ``done`` callback, called once it is all sent, or dropped
(the connection ended): a READ releases its hold on the memory it sends from
then. The outbox references what it is given — a META's stored value, a REGIONS
frame shared by every connection, registered memory — and copies nothing; it
counts the bytes queued, so that the loop can stop reading from a peer that
does not read its answers (:attr:`Outbox.nbytes`), and the time of its last
progress, so that a peer that takes nothing for its whole liveness budget is
found out (:meth:`Outbox.stalled`).

On an encrypted connection (:attr:`Outbox.sealer` set) each entry put from then on goes out as
sealed records (:class:`~hixl._session.sealed.RecordSource`), each sealed only when it is next to
go: records leave in the order they are numbered, whatever was queued when. A record the socket
takes only part of keeps its rest (a copy: it was sealed in the thread's scratch, which the next
connection served uses).
"""

from __future__ import annotations

import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._iov import IOV_MAX, IovCursor, writev
from .._protocol.seal import Sealer
from .sealed import RecordSource

__all__ = ["Outbox"]

_Buffer = bytes | memoryview


@dataclass
class _Entry:
    views: list[memoryview] | None  # a frame, or a few ranges: one sendmsg
    cursor: IovCursor | None  # many ranges of registered memory: writev
    data: bool  # the peer taking it is a sign of its life (a frame alone is not: its kernel buffers it)
    done: Callable[[], None] | None
    source: RecordSource | None = None  # sealed: the records of the views (or cursor)
    record: bytes | memoryview = b""  # sealed: what the socket has not taken yet of the record being sent


class Outbox:
    """Frames and data for one socket, in order (see the module docstring); one thread uses it."""

    __slots__ = ("_entries", "last_progress", "nbytes", "sealer")

    def __init__(self) -> None:
        self._entries: deque[_Entry] = deque()
        self.nbytes = 0
        """Bytes queued and not yet taken by the socket."""
        self.last_progress = time.monotonic()
        """When the socket last took a byte (or the outbox last was empty)."""
        self.sealer: Sealer | None = None
        """Set once the connection's stream is sealed records: entries put from then on are sealed."""

    def __bool__(self) -> bool:
        return bool(self._entries)

    def put(self, parts: Sequence[_Buffer], data: bool = False, done: Callable[[], None] | None = None) -> None:
        """Queue buffers sent back to back (a frame, or a frame and a few ranges of data)."""
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        source = RecordSource(self.sealer, views) if self.sealer is not None else None
        self._add(_Entry(views, None, data, done, source), sum(len(v) for v in views))

    def put_cursor(self, cursor: IovCursor, done: Callable[[], None] | None = None) -> None:
        """Queue the memory ``cursor`` covers (data: ``writev``-ed from where it lies)."""
        source = RecordSource(self.sealer, [], cursor) if self.sealer is not None else None
        self._add(_Entry(None, cursor, True, done, source), cursor.total - cursor.done)

    def _add(self, entry: _Entry, nbytes: int) -> None:
        if not self._entries:
            self.last_progress = time.monotonic()  # the clock starts with the first byte waiting
        self._entries.append(entry)
        self.nbytes += nbytes

    def stalled(self, now: float, budget: float) -> bool:
        """Whether something waits and the socket has taken nothing for ``budget`` seconds."""
        return bool(self._entries) and now - self.last_progress > budget

    def flush(self, sock: socket.socket) -> bool:
        """Send as much as the socket takes now; whether data (not only frames) went out. Raises
        what the system calls raise (a full socket only stops it)."""
        moved_data = False
        while self._entries:
            entry = self._entries[0]
            if entry.source is not None:
                sent = self._send_sealed(sock, entry)
                unfinished = bool(entry.record) or entry.source.left > 0
            else:
                sent = self._send(sock, entry)
                self.nbytes -= sent
                unfinished = not entry.cursor.finished if entry.cursor is not None else bool(entry.views)
            if sent:
                self.last_progress = time.monotonic()
                moved_data = moved_data or entry.data
            if unfinished:
                break  # the socket is full
            self._entries.popleft()
            if entry.done is not None:
                entry.done()
        return moved_data

    @staticmethod
    def _send(sock: socket.socket, entry: _Entry) -> int:
        if entry.cursor is not None:
            return writev(sock.fileno(), entry.cursor, entry.cursor.total - entry.cursor.done)
        views = entry.views
        assert views is not None
        try:
            sent = sock.sendmsg(views[:IOV_MAX])
        except (BlockingIOError, InterruptedError):
            return 0
        left = sent
        while left and views:
            if left >= len(views[0]):
                left -= len(views.pop(0))
            else:
                views[0] = views[0][left:]
                left = 0
        return sent

    def _send_sealed(self, sock: socket.socket, entry: _Entry) -> int:
        """Send ``entry``'s records as far as the socket takes them: the bytes it took."""
        source = entry.source
        assert source is not None
        taken = 0
        while True:
            if not entry.record:
                before = source.left
                record = source.next_record()
                if record is None:
                    return taken
                self.nbytes -= before - source.left
                entry.record = record
            try:
                sent = sock.send(entry.record)
            except (BlockingIOError, InterruptedError):
                sent = 0
            taken += sent
            if sent < len(entry.record):
                entry.record = bytes(entry.record[sent:])  # (out of the thread's scratch, see the module docstring)
                return taken
            entry.record = b""

    def clear(self) -> None:
        """Drop everything (the connection ended); every ``done`` is called."""
        entries, self._entries = self._entries, deque()
        self.nbytes = 0
        for entry in entries:
            if entry.done is not None:
                entry.done()
