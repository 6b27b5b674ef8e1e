"""Sealed I/O: records between a socket and what an encrypted connection sends and receives.

:mod:`hixl._protocol.seal` makes and opens records; this module moves them, for the
initiator's :class:`~hixl._session.wire.Wire` and the target's outbox alike.

Receiving: :func:`receive` takes what the socket holds into the connection's
:class:`~hixl._protocol.seal.Opener` (straight into its buffer), and :func:`open_records` opens
every whole record there, each into this thread's scratch, where its tag is checked before a
byte of it goes anywhere. The bulk data a record carries (a READ's DATA, a WRITE's payload) is
then copied from the scratch into the destination's memory; frames go to the connection's
parser. So a record that fails its tag lands nothing (the scratch holds the garbage), and
registered memory only ever receives bytes that passed — at the cost of one copy from a buffer
that fits the caches, where plaintext TCP lands bytes straight from the kernel. Callers open
every whole record before they return: what the opener keeps is the start of a record whose
rest is still to come, which the socket then announces.

Sending: :class:`RecordSource` cuts what one frame sends (the frame, its data) into records,
sealing each only when it is next to go — records leave in the order they are numbered, and a
large reply is encrypted as the socket takes it, not all up front. A record is sealed from the
memory where its bytes lie if they lie in one piece, else gathered into the scratch first.
"""

from __future__ import annotations

import ctypes
import socket
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

from .._iov import IovCursor
from .._memory import memory_view
from .._protocol.connection import Connection
from .._protocol.seal import HEADER, OVERHEAD, RECORD_MAX, Opener, Sealer

__all__ = ["RecordSource", "open_records", "receive"]

_WORD = 8


class _Scratch(threading.local):
    """A thread's record buffers: plaintext (opened into, gathered in) and one sealed record."""

    def __init__(self) -> None:
        self.plain = bytearray(RECORD_MAX)
        self.plain_view = memoryview(self.plain)
        self.plain_addr = ctypes.addressof(ctypes.c_char.from_buffer(self.plain))
        self.sealed = bytearray(RECORD_MAX + OVERHEAD)
        self.sealed_view = memoryview(self.sealed)


_SCRATCH = _Scratch()


def receive(sock: socket.socket, opener: Opener) -> int:
    """One non-blocking ``recv`` into ``opener``: the bytes it took, -1 if none waited, 0 at the end
    of the stream. Raises what ``recv`` raises otherwise. It asks for the rest of the record in
    front, once its length is known, else for a whole record's worth: a stream of large records
    then comes one record a call, each landing at the start of the opener's buffer (nothing of a
    record already there to move aside for the next)."""
    want = (opener.needed if opener.held >= HEADER else 0) or RECORD_MAX + OVERHEAD - opener.held
    try:
        got = sock.recv_into(opener.space(want), want)
    except (BlockingIOError, InterruptedError):
        return -1
    opener.filled(got)
    return got


def open_records(
    conn: Connection, opener: Opener, lock: threading.Lock, cursor: IovCursor | None = None, limit: int = 0, words: bool = False
) -> int:
    """Open every whole record ``opener`` holds, in order: of the bulk data ``conn`` has due, up to
    ``limit`` bytes land in ``cursor``'s memory (with ``words``, only whole 8-byte words of the data
    but for its last bytes: see the target's landing); every other byte goes to ``conn``'s buffer.
    The bytes landed. :class:`~hixl.IntegrityError` for a record that fails its check, before any
    byte of it moved. ``lock`` guards ``conn``."""
    scratch = _SCRATCH
    plain = scratch.plain_view
    landed = 0
    if cursor is not None:  # (where each piece lands, walked here: the cursor moves once, at the end)
        rows, row = cursor.pending_rows()
        at, room = 0, cursor.total - cursor.done
    try:
        while (size := opener.next_size()) is not None:
            opener.open_into(plain)
            take = 0
            with lock:
                # Straight into memory only where the buffer holds nothing before it (order) and
                # only the data's own bytes; what follows them (the next frame) is the parser's.
                if cursor is not None and conn.data_left and not conn.buffered:
                    take = min(size, limit - landed, conn.data_left, room - landed)
                    if words and take < conn.data_left:
                        take = max(0, take - (cursor.done + landed + take) % _WORD)
                    src, left = scratch.plain_addr, take
                    while left:
                        n = min(int(rows[row, 1]) - at, left)
                        ctypes.memmove(int(rows[row, 0]) + at, src, n)
                        src, left, at = src + n, left - n, at + n
                        if at == int(rows[row, 1]):
                            row, at = row + 1, 0
                    if take:
                        conn.data_moved(take)
                        landed += take
                if take < size:
                    conn.receive_data(plain[take:size])
    finally:
        if landed:
            cursor.advance(landed)  # type: ignore[union-attr]
    return landed


class RecordSource:
    """The records of what one frame sends: ``parts`` (the frame, and a few buffers of its data),
    then the memory ``cursor`` covers, in records of up to :data:`RECORD_MAX` bytes, each sealed
    by ``sealer`` only when :meth:`next_record` asks for it.

    All of it in one record where it fits (a small request or reply: one AES call, one segment);
    else the frame, the first part, goes alone, so that the data's records begin where the data
    does — a receiver then lands each whole record at once, in whole words, rather than every
    record's first bytes after the last one's."""

    __slots__ = ("_cursor", "_first", "_parts", "_row", "_sealer", "left")

    def __init__(self, sealer: Sealer, parts: Sequence[Any], cursor: IovCursor | None = None) -> None:
        self._sealer = sealer
        self._parts = deque(memoryview(p).cast("B") for p in parts if len(p))
        self._cursor = cursor
        self._row: tuple[int, memoryview] | None = None  # (row index, a view of its rest): one view per row
        self._first = True
        self.left = sum(len(p) for p in self._parts) + (cursor.total - cursor.done if cursor is not None else 0)
        """Plaintext bytes not yet sealed."""

    def next_record(self) -> memoryview | None:
        """The next record, sealed now into this thread's scratch (valid until this thread seals
        another); None once everything is sealed."""
        if not self.left:
            return None
        n = min(RECORD_MAX, self.left)
        if self._first:
            self._first = False
            if n < self.left and self._parts:
                n = min(n, len(self._parts[0]))
        scratch = _SCRATCH
        pieces = self._take(n)
        if len(pieces) == 1:
            source = pieces[0]  # (in one piece: sealed from where it lies)
        else:
            offset = 0
            for piece in pieces:
                scratch.plain_view[offset : offset + len(piece)] = piece
                offset += len(piece)
            source = scratch.plain_view[:n]
        size = self._sealer.seal_into(source, scratch.sealed_view)
        self.left -= n
        return scratch.sealed_view[:size]

    def _take(self, n: int) -> list[memoryview]:
        """The next ``n`` bytes, as views of where they lie."""
        pieces: list[memoryview] = []
        while n and self._parts:
            part = self._parts[0]
            if len(part) > n:
                pieces.append(part[:n])
                self._parts[0] = part[n:]
                return pieces
            pieces.append(self._parts.popleft())
            n -= len(part)
        cursor = self._cursor
        while n:
            assert cursor is not None
            rows, i = cursor.pending_rows()
            if self._row is None or self._row[0] != i:
                self._row = (i, memory_view(int(rows[i, 0]), int(rows[i, 1])))
            view = self._row[1]
            piece = view[:n]
            pieces.append(piece)
            cursor.advance(len(piece))
            self._row = (i, view[len(piece) :]) if len(piece) < len(view) else None
            n -= len(piece)
        return pieces
