"""iovec batches for the kernel's scatter/gather calls, built from numpy with no Python loop.

An ``(N, 2)`` uint64 array *is* an array of ``struct iovec {void *base; size_t len}``
on 64-bit Linux, so descriptor columns become syscall arguments by slicing.
:class:`IovCursor` walks such a batch IOV_MAX entries at a time and resumes
after a partial completion (sockets return short counts all the time; the
cross-memory calls do so at an iovec boundary when a page faults);
:class:`IovWindows` cuts a pair of them into windows up front, for a copy loop.
"""

from __future__ import annotations

import ctypes
import errno
import os
import time

import numpy as np

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_IOVEC_BYTES = 16

_libc = ctypes.CDLL(None, use_errno=True)
_ssize = ctypes.c_ssize_t

process_vm_readv = _libc.process_vm_readv
process_vm_writev = _libc.process_vm_writev
for _fn in (process_vm_readv, process_vm_writev):
    _fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    _fn.restype = _ssize

_readv = _libc.readv
_writev = _libc.writev
for _fn in (_readv, _writev):
    _fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    _fn.restype = _ssize


def iovecs(addrs: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Pack address and length columns into a C-contiguous iovec array."""
    iov = np.empty((len(addrs), 2), dtype=np.uint64)
    iov[:, 0] = addrs
    iov[:, 1] = lens
    return iov


class IovCursor:
    """Position inside one or two iovec arrays that share the same lengths.

    ``sides`` are iovec arrays (e.g. local and remote); they are copied, since
    resuming after a partial completion rewrites the first pending entry.
    """

    def __init__(self, *sides: np.ndarray) -> None:
        self._orig = sides
        self._work = [np.array(s, dtype=np.uint64, order="C") for s in sides]
        lens = sides[0][:, 1]
        self._ends = np.cumsum(lens, dtype=np.uint64)
        self.total = int(self._ends[-1]) if len(lens) else 0
        self.done = 0
        self._index = 0
        self.keepalive: object = None

    @property
    def count(self) -> int:
        """How many iovecs the batch has."""
        return len(self._ends)

    def pending_ranges(self) -> list[tuple[int, int]]:
        """The ``(addr, len)`` ranges of the first side not yet moved."""
        return [(int(a), int(n)) for a, n in self._work[0][self._index :]]

    def pending_rows(self) -> tuple[np.ndarray, int]:
        """The first side's iovec array as it stands (its first pending row already shortened by
        what moved of it) and that row's index: for a compiled loop that moves bytes into it,
        :meth:`advance` by what it moved afterwards."""
        return self._work[0], self._index

    @property
    def finished(self) -> bool:
        """True once every byte has been moved."""
        return self.done >= self.total

    def window(self, limit: int = IOV_MAX) -> tuple[list[int], int, int]:
        """Pointers to the next ``count`` pending iovecs of each side, their count and byte size."""
        i = self._index
        count = min(limit, len(self._ends) - i)
        end = int(self._ends[i + count - 1])
        ptrs = [int(w.ctypes.data) + i * _IOVEC_BYTES for w in self._work]
        return ptrs, count, end - self.done

    def vector_call(self, call: object, fd: int, limit: int, deadline: float | None = None) -> int:
        """One ``readv``/``writev`` (``call``) on ``fd`` over at most ``limit`` pending bytes.

        Returns the bytes moved, 0 if the socket was not ready, -1 (moving nothing) if
        ``deadline`` (``time.monotonic()``) has passed: checked as the very last step
        before the syscall, to keep the instant between check and copy as short as
        Python allows. ``ConnectionError`` at end of stream (a read of 0), ``OSError``
        on errors.
        """
        ptrs, count, nbytes = self.window()
        trimmed = -1
        if nbytes > limit:
            # The kernel takes a count of iovecs, not bytes: shorten the last one for this call.
            i = self._index
            count = int(np.searchsorted(self._ends[i : i + count], self.done + limit, side="left")) + 1
            trimmed = i + count - 1
            saved = int(self._work[0][trimmed, 1])
            self._work[0][trimmed, 1] = saved - (int(self._ends[trimmed]) - (self.done + limit))
        try:
            if deadline is not None and time.monotonic() >= deadline:
                return -1
            moved = call(fd, ptrs[0], count)  # type: ignore[operator]
            err = ctypes.get_errno()
        finally:
            if trimmed >= 0:
                self._work[0][trimmed, 1] = saved
        if moved > 0:
            self.advance(moved)
            return int(moved)
        if moved == 0:
            raise ConnectionError("peer closed the connection")
        if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
            return 0
        raise OSError(err, os.strerror(err))

    def copy_in(self, data: bytes) -> None:
        """Copy ``data`` (bytes already received) into the pending memory and advance past it."""
        base = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0
        offset = 0
        while offset < len(data):
            addr, room = (int(v) for v in self._work[0][self._index])
            n = min(room, len(data) - offset)
            ctypes.memmove(addr, base + offset, n)
            offset += n
            self.advance(n)

    def advance(self, nbytes: int) -> None:
        """Record that the kernel moved ``nbytes`` more bytes."""
        self.done += nbytes
        if self.done >= self.total:
            self._index = len(self._ends)
            return
        i = int(np.searchsorted(self._ends, self.done, side="right"))
        self._index = i
        start = int(self._ends[i - 1]) if i else 0
        skip = self.done - start
        for orig, work in zip(self._orig, self._work):
            work[i, 0] = int(orig[i, 0]) + skip
            work[i, 1] = int(orig[i, 1]) - skip


class IovWindows:
    """iovec pairs of equal lengths (``local``, ``remote``) cut, once and before anything moves,
    into windows of at most ``limit`` bytes and ``max_count`` entries, in order: an entry that
    straddles a window's end is split in two there.

    What a cursor would work out between two windows (where the next one ends, cutting an entry;
    stepping past what moved) is worked out up front, so the step from one window to the next is a
    few integer operations: after a large copy the interpreter's caches are cold, and the cursor's
    numpy calls took ~135 µs a window there (~10 µs warm) while the copy lanes waited. A short count
    (a fault at an iovec boundary) is still taken: :meth:`advance` rewrites the entry it stopped in.
    """

    def __init__(self, local: np.ndarray, remote: np.ndarray, limit: int, max_count: int = IOV_MAX) -> None:
        if limit <= 0 or max_count <= 0:
            raise ValueError("limit and max_count must be positive")
        lens = np.asarray(local[:, 1], dtype=np.uint64)
        ends = np.cumsum(lens, dtype=np.uint64)
        self.total = int(ends[-1]) if len(ends) else 0
        # Where each piece ends: every entry's end, and every window's end that falls inside an
        # entry (one that meets an entry's end cuts nothing). Inserted at their place in one pass,
        # not sorted in: a union of the two (a sort) took ~5 ms for a 40 000-block KV pull.
        cuts = np.arange(limit, self.total, limit, dtype=np.uint64)
        inside = np.searchsorted(ends, cuts, side="left")  # (the first entry ending at or after a cut)
        straddled = ends[inside] != cuts
        cuts, inside = cuts[straddled], inside[straddled]
        bounds = np.insert(ends, inside, cuts)
        entry = np.insert(np.arange(len(ends)), inside, inside)  # (the entry each piece is of)
        starts = np.empty_like(bounds)
        starts[:1], starts[1:] = 0, bounds[:-1]
        kept = bounds > starts  # (empty entries make no piece)
        bounds, starts, entry = bounds[kept], starts[kept], entry[kept]
        skip = starts - (ends[entry] - lens[entry])
        pieces = bounds - starts
        self._sides = [
            np.ascontiguousarray(np.column_stack((np.asarray(side[:, 0], dtype=np.uint64)[entry] + skip, pieces)))
            for side in (local, remote)
        ]
        self._bases = [int(side.ctypes.data) for side in self._sides]
        in_window = starts // np.uint64(limit)
        edges = [0, *(np.flatnonzero(in_window[1:] != in_window[:-1]) + 1).tolist(), len(pieces)]
        self._windows: list[tuple[int, int, int]] = []  # (first piece, pieces, bytes)
        for low, high in zip(edges, edges[1:]):
            for first in range(low, high, max_count):
                last = min(high, first + max_count)
                self._windows.append((first, last - first, int(bounds[last - 1]) - int(starts[first])))
        self._next = 0

    @property
    def finished(self) -> bool:
        """True once every window has moved."""
        return self._next >= len(self._windows)

    def current(self) -> tuple[int, int, int, int]:
        """The window to move next: the addresses of its local and remote iovecs, their count and its bytes."""
        first, count, nbytes = self._windows[self._next]
        local, remote = self._bases
        return local + first * _IOVEC_BYTES, remote + first * _IOVEC_BYTES, count, nbytes

    def advance(self, moved: int) -> None:
        """Record that the current window moved ``moved`` bytes (0 < moved <= its bytes)."""
        first, count, nbytes = self._windows[self._next]
        if moved == nbytes:
            self._next += 1
            return
        if not 0 < moved < nbytes:
            raise ValueError(f"a window of {nbytes} bytes cannot have moved {moved}")
        piece, left = first, moved
        while left >= int(self._sides[0][piece, 1]):  # (a short count: rare, so a plain loop)
            left -= int(self._sides[0][piece, 1])
            piece += 1
        for side in self._sides:
            side[piece, 0] += np.uint64(left)
            side[piece, 1] -= np.uint64(left)
        self._windows[self._next] = (piece, first + count - piece, nbytes - moved)


def readv(fd: int, cursor: IovCursor, limit: int, deadline: float | None = None) -> int:
    """One non-blocking ``readv`` of at most ``limit`` bytes into ``cursor``; 0 if none were ready,
    -1 if ``deadline`` passed (nothing read).

    Raises ``ConnectionError`` at end of stream and ``OSError`` on errors.
    """
    return cursor.vector_call(_readv, fd, limit, deadline)


def writev(fd: int, cursor: IovCursor, limit: int) -> int:
    """One non-blocking ``writev`` of at most ``limit`` bytes from ``cursor``; 0 if the socket is full."""
    return cursor.vector_call(_writev, fd, limit)


def bytes_cursor(*chunks: bytes) -> IovCursor:
    """A cursor over in-memory byte strings (frame headers), keeping them alive."""
    views = [np.frombuffer(c, dtype=np.uint8) for c in chunks if c]
    addrs = np.array([v.ctypes.data for v in views], dtype=np.uint64)
    lens = np.array([v.nbytes for v in views], dtype=np.uint64)
    cursor = IovCursor(iovecs(addrs, lens))
    cursor.keepalive = views
    return cursor
