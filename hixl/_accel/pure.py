"""hixl's hot path in pure Python: the twin of the C extension (see :mod:`hixl._accel`).

Used when the extension is not built or cannot be loaded, or when
``HIXL_PURE_PYTHON=1``; every function does exactly what its C twin does, and
the tests run both.

The shm transport copies block by block between its registered memory and a
peer's mapped memory; a KV cache moves thousands of 16 KiB blocks, so what one
copy costs in Python matters as much as the copy itself. Three ways, cheapest
first:

- *Blocks of one length, one side back to back* (a cache pulled into, or pushed
  from, consecutive blocks; :func:`batch_order` sorts a batch so that this shows):
  one numpy ``take`` (destinations back to back) or one fancy assignment
  (sources back to back) over views of the two ranges — numpy's C loop, about
  a fifth faster than any Python loop over the blocks.
- A small block: a slice assignment between two ``memoryview``\\s of the whole
  address space, the cheapest memcpy Python offers (about half a
  ``ctypes.memmove`` call: no argument conversion).
- A large block: ``ctypes.memmove``, which releases the GIL for the copy, so
  the engine's other threads (heartbeats, replies) run meanwhile.

Nothing here checks an address except :func:`check_small`: callers copy only
ranges they checked against registrations and mappings first.
"""

from __future__ import annotations

import array
import bisect
import ctypes
import operator
import os
import platform
import errno
import fcntl
import select
import signal
import socket
import struct
import sys
import termios
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
import time

import numpy as np

from .._iov import IOV_MAX, IovCursor, IovWindows, process_vm_readv, process_vm_writev, readv

__all__ = [
    "CMA_CANCELLED",
    "CMA_GONE",
    "CMA_INELIGIBLE",
    "CMA_REVOKING",
    "CMA_STALE",
    "CMA_STUCK",
    "CmaSmall",
    "GIL_FREE_FROM",
    "ORDERED_ROW_READS",
    "PROC_MEM_MAX",
    "SMALL_MAX",
    "STREAM_FROM",
    "TCP_EOF",
    "TCP_LOWAT",
    "TCP_LOWAT_FROM",
    "TCP_RANGES",
    "TCP_SERVE_MAX",
    "TCP_WAIT",
    "batch_order",
    "check_small",
    "cma_copy",
    "cma_window",
    "cma_windows",
    "copy",
    "copy_hash",
    "copy_many",
    "copy_pieces",
    "gather_checked_rows",
    "mapped_copy",
    "tcp_land",
    "tcp_reply",
    "tcp_request",
    "tcp_send",
    "weights_hash",
]

GIL_FREE_FROM = 256 << 10
"""Blocks of at least this many bytes are copied with the GIL released."""
ORDERED_ROW_READS = int(platform.machine() in ("x86_64", "AMD64"))
"""Whether this machine keeps loads in order (x86-64), so that :func:`gather_checked_rows`'s check holds."""
LANE_FROM = 4 << 20
"""A copy (one call of :func:`cma_window` or :func:`copy_pieces`) of fewer bytes stays in one lane:
below it, handing a part to another thread costs more than the second core gains."""
MAX_LANES = 16
"""The most lanes one copy is split over."""
STREAM_FROM = 16 << 20
"""From this many bytes — in one call, or in the transfer a :func:`copy_pieces` call is part of
(its ``stream``) — the C extension's memory copies (:func:`mapped_copy`, :func:`copy_pieces`)
write ranges of a page or more with streaming stores, past the caches; the same bytes land. Here
numpy's copies are what they are: glibc's memcpy, which streams only from a threshold of its own."""
_LANE_ALIGN = 4096  # every cut but the last on a page of the copy: no page copied by two lanes
SMALL_MAX = 64
"""The most descriptors :func:`check_small` and :func:`mapped_copy` take."""
PROC_MEM_MAX = 4096
"""A copy of one descriptor of at most this many bytes goes through the peer's ``/proc/<pid>/mem``
where :class:`CmaSmall` has it (one system call, no liveness check); above a page the kernel's copy
through a bounce page costs more than the second call it saves (docs/internals.md)."""
CMA_INELIGIBLE = -(1 << 20)
"""What :func:`cma_copy` answers when it tried nothing: ``descs`` is not a small list, or the
generation page is closed."""
CMA_STALE = CMA_INELIGIBLE - 1
"""... the peer's generation is not the one given (our regions are out of date)."""
CMA_GONE = CMA_INELIGIBLE - 2
"""... the pinned process has gone."""
CMA_REVOKING = CMA_INELIGIBLE - 3
"""What :func:`cma_windows` answers when it stopped before a window for a REVOKE under way."""
CMA_CANCELLED = CMA_INELIGIBLE - 4
"""... for the request's cancellation (or expiry)."""
CMA_STUCK = CMA_INELIGIBLE - 5
"""... because a window moved nothing."""
_NUMPY_FROM = 16
"""Fewest blocks worth one numpy call (it costs a few microseconds to set up)."""

_memmove = ctypes.memmove
# Every address a process can have is an index into this view (nothing is read by making it).
_ALL = memoryview((ctypes.c_char * sys.maxsize).from_address(0)).cast("B")


class _Rows:
    """``rows`` rows of ``length`` bytes at ``addr``, as numpy sees an array (``np.asarray`` of it)."""

    def __init__(self, addr: int, rows: int, length: int) -> None:
        self.__array_interface__ = {"data": (addr, False), "shape": (rows, length), "typestr": "|u1", "version": 3}


def copy(dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``src`` to address ``dst``."""
    if nbytes >= GIL_FREE_FROM:
        _memmove(dst, src, nbytes)
    else:
        _ALL[dst : dst + nbytes] = _ALL[src : src + nbytes]


def batch_order(dsts: np.ndarray, srcs: np.ndarray, lens: np.ndarray) -> np.ndarray | None:
    """An order to copy a batch in that lets :func:`copy_many` use numpy; None: keep it as it is.

    Only for blocks of one length whose destinations do not overlap (so the order
    changes nothing): sorted by destination if those are then back to back, else by
    source if those are.
    """
    if len(lens) < _NUMPY_FROM or (lens != lens[0]).any():
        return None
    length = lens[0]
    by_dst = np.argsort(dsts, kind="stable")
    gaps = np.diff(dsts[by_dst])
    if (gaps < length).any():
        return None  # destinations overlap: the given order decides what lands last
    if (gaps == length).all():
        return by_dst
    by_src = np.argsort(srcs, kind="stable")
    return by_src if (np.diff(srcs[by_src]) == length).all() else None


def _triples(descs: object) -> list[tuple[int, int, int]] | None:
    """``descs`` as (local, remote, len) int triples if it is a small list of them with every
    len > 0 and no range past 2**64; None otherwise."""
    if type(descs) is not list or not 0 < len(descs) <= SMALL_MAX:
        return None
    triples = []
    for desc in descs:
        if not (isinstance(desc, tuple) or type(desc) is list) or len(desc) != 3:
            return None
        local, remote, nbytes = desc
        if not (type(local) is int and type(remote) is int and type(nbytes) is int):
            return None
        if nbytes <= 0 or local < 0 or remote < 0 or max(local, remote) + nbytes >= 1 << 64:
            return None
        triples.append((local, remote, nbytes))
    return triples


def _interval(starts: list[int], ends: list[int], addr: int, nbytes: int) -> int:
    """The index of the interval of sorted, disjoint ``starts``/``ends`` holding the range; -1: none."""
    slot = bisect.bisect_right(starts, addr) - 1
    return slot if slot >= 0 and addr + nbytes <= ends[slot] else -1


def check_small(
    descs: object, local_starts: list[int], local_ends: list[int], remote_starts: list[int], remote_ends: list[int]
) -> int | None:
    """The total length of ``descs`` if it is a small list of (local, remote, len) int triples,
    every local range inside one local interval and every remote one inside one remote interval;
    else None."""
    triples = _triples(descs)
    return None if triples is None else _inside(triples, local_starts, local_ends, remote_starts, remote_ends)


def _inside(
    triples: list[tuple[int, int, int]], local_starts: list[int], local_ends: list[int], remote_starts: list[int], remote_ends: list[int]
) -> int | None:
    """:func:`check_small` of descriptors already made triples."""
    total = 0
    for local, remote, nbytes in triples:
        if _interval(local_starts, local_ends, local, nbytes) < 0 or _interval(remote_starts, remote_ends, remote, nbytes) < 0:
            return None
        total += nbytes
    return total if total < 1 << 64 else None


def mapped_copy(
    descs: object, write: bool, starts: list[int], ends: list[int], heres: list[int], writable: list[bool], lanes: int = 1
) -> int:
    """Copy a small list of (local, remote, len) descriptors through the peer's memory mapped here
    (mapping ``i`` covers the peer's ``[starts[i], ends[i])`` at ``heres[i]``, writable if
    ``writable[i]``). 1: all were mapped (writably, for a write) and are copied (from
    :data:`LANE_FROM` bytes, split over up to ``lanes`` threads); 0: none was, nothing copied; -1:
    some were, or ``descs`` is not such a list, nothing copied."""
    triples = _triples(descs)
    if triples is None:
        return -1
    theres = []  # where each remote range is mapped here
    for local, remote, nbytes in triples:
        m = _interval(starts, ends, remote, nbytes)
        if m >= 0 and (not write or writable[m] is True):
            theres.append(heres[m] + (remote - starts[m]))
    if len(theres) != len(triples):
        return 0 if not theres else -1
    if lanes > 1 and sum(nbytes for _, _, nbytes in triples) >= LANE_FROM:
        copy_pieces(np.array(triples, dtype=np.uint64), np.array(theres, dtype=np.uint64), write, lanes)
        return 1
    for (local, _, nbytes), there in zip(triples, theres):
        if write:
            copy(there, local, nbytes)
        else:
            copy(local, there, nbytes)
    return 1


_GENERATION = struct.Struct("<Q")
_IOVEC = 16
_REMOTE_OFFSET = _IOVEC * SMALL_MAX
_iov_pack = [struct.Struct(f"<{2 * n}Q") for n in range(SMALL_MAX + 1)]
_ONE_PAIR = struct.Struct(f"<2Q{_REMOTE_OFFSET - _IOVEC}x2Q")  # one local and one remote iovec


class _Scratch(threading.local):
    """Per-thread iovec buffers for :func:`cma_copy` (no allocation per call)."""

    def __init__(self) -> None:
        self.buf = ctypes.create_string_buffer(2 * _REMOTE_OFFSET)
        self.local = ctypes.addressof(self.buf)  # local iovecs, then remote ones
        self.remote = self.local + _REMOTE_OFFSET


_scratch = _Scratch()


def cma_copy(pid: int, pidfd: int, write: bool, descs: object, generation_page: object, generation: int) -> int:
    """One ``process_vm_writev`` (``write``) or ``process_vm_readv`` of a small list of (local,
    remote, len) descriptors with process ``pid``, if the 8-byte generation at the start of
    ``generation_page`` (the peer's mapped page) is ``generation`` and the process ``pidfd`` pins
    still exists. The bytes moved; -errno if the call failed; :data:`CMA_INELIGIBLE`,
    :data:`CMA_STALE` or :data:`CMA_GONE` if nothing was tried."""
    triples = _triples(descs)
    if triples is None:
        return CMA_INELIGIBLE
    refused = _refusal(pidfd, generation_page, generation)
    if refused:
        return refused
    return _cma_call(pid, write, triples, 1)


def _refusal(pidfd: int, generation_page: object, generation: int) -> int:
    """:func:`cma_copy`'s answer if the page or the process refuses a copy; 0 if neither does."""
    return _page_refusal(generation_page, generation) or (0 if _alive(pidfd) else CMA_GONE)


def _page_refusal(generation_page: object, generation: int) -> int:
    """:data:`CMA_INELIGIBLE` if the generation page is closed, :data:`CMA_STALE` if it is not at
    ``generation``; else 0."""
    try:
        current = _GENERATION.unpack_from(generation_page)[0]  # type: ignore[arg-type]
    except (TypeError, ValueError):  # unmapped by close()
        return CMA_INELIGIBLE
    return CMA_STALE if current != generation else 0


def _proc_mem_call(proc_mem: int, write: bool, here: int, there: int, nbytes: int) -> int:
    """One ``pwrite`` (``write``) or ``pread`` of ``nbytes`` between local ``here`` and the peer's
    ``there`` on its ``/proc/<pid>/mem``: the bytes moved (0 once the process has exited), or -errno."""
    view = (ctypes.c_char * nbytes).from_address(here)
    try:
        return os.pwritev(proc_mem, [view], there) if write else os.preadv(proc_mem, [view], there)
    except OSError as exc:
        return -(exc.errno or errno.EIO)


def _alive(pidfd: int) -> bool:
    """Whether the process ``pidfd`` pins still exists (signal 0 through it). The C extension
    polls the pidfd instead (cheaper there, not here: a poll object per call, or one shared by
    threads, which it refuses), and so also counts a process that exited, not yet reaped, as gone:
    here its copy fails instead (its memory is gone), and the general path reports it the same."""
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except PermissionError:
        return True  # it exists; signalling it is another permission than cma's
    except (OSError, ValueError):
        return False
    return True


def _cma_call(pid: int, write: bool, triples: list[tuple[int, int, int]], lanes: int) -> int:
    """The ``process_vm_*`` call of :func:`cma_copy` (over :func:`cma_window`'s lanes if
    ``lanes`` > 1: for :data:`LANE_FROM` bytes or more)."""
    scratch, count = _scratch, len(triples)
    if count == 1:  # the common latency case: both iovecs in one call, no argument lists
        local, remote, length = triples[0]
        _ONE_PAIR.pack_into(scratch.buf, 0, local, length, remote, length)
    else:
        pack = _iov_pack[count]
        pack.pack_into(scratch.buf, 0, *[v for d in triples for v in (d[0], d[2])])
        pack.pack_into(scratch.buf, _REMOTE_OFFSET, *[v for d in triples for v in (d[1], d[2])])
    if lanes > 1:
        return cma_window(pid, write, scratch.local, scratch.remote, count, lanes)
    moved = (process_vm_writev if write else process_vm_readv)(pid, scratch.local, count, scratch.remote, count, 0)
    return int(moved) if moved >= 0 else -ctypes.get_errno()


class CmaSmall:
    """cma's latency path to one peer in one call (:meth:`run`); the twin of the C ``CmaSmall``.

    ``pid``/``pidfd``: the peer's process and the pidfd pinning it; ``generation_page``: its
    mapped generation page; ``registry``: this engine's registrations (``.table``); ``link``: the
    link to the peer (its ``.state`` must be ``connected``; ``.regions`` holds the peer's table,
    generation and lease); ``read``/``write``: the two ops; ``chunk``: the most bytes one call
    may move; ``lanes``: threads a copy of :data:`LANE_FROM` bytes or more is split over;
    ``proc_mem``: the peer's ``/proc/<pid>/mem``, open for reading and writing and proven to be
    its memory, for a copy of one descriptor of up to :data:`PROC_MEM_MAX` bytes (-1: none).
    """

    def __init__(
        self, pid: int, pidfd: int, generation_page: object, registry: Any, link: Any, connected: object,
        read: object, write: object, chunk: int, lanes: int = 1, proc_mem: int = -1,
    ) -> None:
        self._pid, self._pidfd, self._page, self._lanes = pid, pidfd, generation_page, max(1, lanes)
        self._proc_mem = proc_mem
        self._registry, self._link, self._regions = registry, link, link.regions
        self._connected, self._read, self._write, self._chunk = connected, read, write, chunk

    def run(self, op: object, descs: object) -> bool:
        """True once every byte of ``descs`` (a list of up to :data:`SMALL_MAX` (local, remote, len)
        int triples, at most ``chunk`` bytes) moved in one ``process_vm_*`` call (or one ``pread`` or
        ``pwrite`` on ``proc_mem``); False if nothing was tried or the call fell short (the general
        path then checks, explains, retries)."""
        if op is self._write:
            write = True
        elif op is self._read:
            write = False
        else:
            return False
        # A READ lands in local memory, a WRITE in the peer's: those sides must be writable.
        table = self._registry.table
        local = table.readable if write else table.writable
        regions = self._regions
        checked = regions.table
        remote = checked.writable if write else checked.readable
        triples = _triples(descs)
        if triples is None:
            return False
        if len(triples) == 1:  # the latency case, inlined: every call here costs a tenth of a µs
            here, there, total = triples[0]
            starts, ends = local.intervals
            slot = bisect.bisect_right(starts, here) - 1
            if slot < 0 or here + total > ends[slot]:
                return False
            starts, ends = remote.intervals
            slot = bisect.bisect_right(starts, there) - 1
            if slot < 0 or there + total > ends[slot]:
                return False
        else:
            inside = _inside(triples, *local.intervals, *remote.intervals)
            if inside is None:
                return False
            total = inside
        if total > self._chunk or self._link.state is not self._connected:
            return False
        # Python may switch threads between any two steps: a token holds the lease (the C twin
        # holds the GIL instead for a small copy, which comes to the same).
        lease = regions.lease
        token = lease.enter()
        if not token:
            return False  # a REVOKE is under way: the general path waits for it
        try:
            if regions.table is not checked:
                return False  # replaced since we checked: the general path checks again
            if self._proc_mem >= 0 and len(triples) == 1 and total <= PROC_MEM_MAX:
                # The file holds the process's memory, not its pid: no liveness check (see the C twin).
                here, there, _ = triples[0]
                moved = _page_refusal(self._page, regions.generation) or _proc_mem_call(
                    self._proc_mem, write, here, there, total
                )
            else:
                moved = _refusal(self._pidfd, self._page, regions.generation) or _cma_call(
                    self._pid, write, triples, self._lanes if total >= LANE_FROM else 1
                )
        finally:
            lease.leave(token)
        return moved == total


# -- copy lanes (see the C twin's comment on them) -------------------------------------------------

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:
    global _pool
    _pool = None  # (a child has none of its parent's threads)


os.register_at_fork(after_in_child=_forget_pool)


def _lane_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=MAX_LANES - 1, thread_name_prefix="hixl-lane")
        return _pool


def lane_parts(lens: np.ndarray, lanes: int) -> list[tuple[int, int, int]]:
    """How a copy of entries of ``lens`` bytes is split over ``lanes``: each part's first entry, its
    offset into that entry and its bytes, in order (one part below :data:`LANE_FROM` bytes)."""
    total = int(lens.sum(dtype=np.uint64))
    lanes = min(lanes, MAX_LANES)
    step = -(-(-(-total // lanes)) // _LANE_ALIGN) * _LANE_ALIGN if lanes > 1 else 0  # (never more than lanes parts)
    if lanes <= 1 or total < LANE_FROM or step == 0 or step >= total:
        return [(0, 0, total)]
    ends = np.cumsum(lens, dtype=np.uint64)
    parts = []
    for start in range(0, total, step):
        first = int(np.searchsorted(ends, np.uint64(start), side="right"))  # the entry holding byte ``start``
        parts.append((first, start - (int(ends[first - 1]) if first else 0), min(step, total - start)))
    return parts


def _part_rows(columns: list[np.ndarray], lens: np.ndarray, first: int, offset: int, nbytes: int) -> tuple[list[np.ndarray], np.ndarray]:
    """The address columns and lengths of one part (see :func:`lane_parts`)."""
    ends = np.cumsum(lens[first:], dtype=np.uint64) - np.uint64(offset)
    last = first + int(np.searchsorted(ends, np.uint64(nbytes), side="left")) + 1
    part_lens = lens[first:last].copy()
    part_lens[0] -= np.uint64(offset)
    part_lens[-1] -= ends[last - first - 1] - np.uint64(nbytes)
    cols = [c[first:last].copy() for c in columns]
    for c in cols:
        c[0] += np.uint64(offset)
    return cols, part_lens


def _run_lanes(parts: list[tuple[int, int, int]], copy_part: Callable[[int, int, int], int]) -> list[int]:
    """Each part's answer, the first copied here and the others on lane threads."""
    futures = [_lane_pool().submit(copy_part, *part) for part in parts[1:]]
    return [copy_part(*parts[0])] + [future.result() for future in futures]


def _cma_part(pid: int, write: bool, local: np.ndarray, remote: np.ndarray, lens: np.ndarray) -> int:
    """Every byte of one part through ``process_vm_*``: the bytes moved (fewer if the kernel moved no
    more), or -errno."""
    call = process_vm_writev if write else process_vm_readv
    iov_local = np.column_stack([local, lens]).astype(np.uint64)
    iov_remote = np.column_stack([remote, lens]).astype(np.uint64)
    cursor = IovCursor(iov_local, iov_remote)
    while not cursor.finished:
        (lp, rp), count, _ = cursor.window()
        moved = call(pid, lp, count, rp, count, 0)
        if moved < 0:
            return -ctypes.get_errno()
        if moved == 0:
            break
        cursor.advance(moved)
    return cursor.done


def cma_window(pid: int, write: bool, local_iovs: int, remote_iovs: int, count: int, lanes: int) -> int:
    """``process_vm_writev`` (``write``) or ``process_vm_readv`` of ``count`` iovec pairs at
    addresses ``local_iovs`` and ``remote_iovs`` (equal lengths pairwise), split over up to
    ``lanes`` threads from :data:`LANE_FROM` bytes. One lane: one call, its answer (the bytes
    moved, or -errno). Several: the bytes if every part moved all of its own, else -errno of a
    part that failed, or 0."""
    if not 1 <= count <= IOV_MAX:
        raise ValueError("count must be in [1, IOV_MAX]")
    parts = [(0, 0, 0)]
    if lanes > 1:
        local = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * count)).from_address(local_iovs)).reshape(count, 2)
        remote = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * count)).from_address(remote_iovs)).reshape(count, 2)
        lens = local[:, 1].copy()
        parts = lane_parts(lens, lanes)
    if len(parts) == 1:  # one call, as cma_copy makes it
        moved = (process_vm_writev if write else process_vm_readv)(pid, local_iovs, count, remote_iovs, count, 0)
        return int(moved) if moved >= 0 else -ctypes.get_errno()

    def part(first: int, offset: int, nbytes: int) -> int:
        (l_addr, r_addr), part_lens = _part_rows([local[:, 0], remote[:, 0]], lens, first, offset, nbytes)
        moved = _cma_part(pid, write, l_addr, r_addr, part_lens)
        return moved if moved < 0 or moved == nbytes else -_SHORT

    answers = _run_lanes(parts, part)
    failed = [a for a in answers if a < 0 and a != -_SHORT]
    if failed:
        return failed[0]
    return 0 if -_SHORT in answers else int(lens.sum(dtype=np.uint64))


_SHORT = 1 << 40  # (a part that fell short without an error: not an errno)


def _iov_rows(address: int, count: int) -> np.ndarray:
    """The ``count`` iovecs at ``address`` as a ``(count, 2)`` uint64 view."""
    return np.ctypeslib.as_array((ctypes.c_uint64 * (2 * count)).from_address(address)).reshape(count, 2)


def cma_windows(
    pid: int, write: bool, local_iovs: int, remote_iovs: int, count: int, lanes: int, pidfd: int, start: int,
    limit: int, generation_page: object, regions: Any, table: object, req: Any,
) -> tuple[int, int]:
    """``process_vm_writev`` (``write``) or ``process_vm_readv`` of ``count`` iovec pairs at
    addresses ``local_iovs`` and ``remote_iovs`` (equal lengths pairwise; any count) from byte
    ``start`` on, in windows of up to ``limit`` bytes split over up to ``lanes`` threads. Before
    each window: no REVOKE under way (``regions.lease``), ``req.io_lock`` taken and
    ``req.cancelled`` false, a lease token taken, ``regions.table`` still ``table`` and the
    generation on ``generation_page`` still ``regions.generation``, the process ``pidfd`` pins
    still there; the token and the lock given back after it. ``(moved, stop)``: the bytes moved
    from ``start``, and 0 once every byte moved, else why it stopped: -errno of a failed copy,
    :data:`CMA_REVOKING`, :data:`CMA_CANCELLED`, :data:`CMA_STALE`, :data:`CMA_GONE` or
    :data:`CMA_STUCK` (a window moved nothing)."""
    if count < 0:
        raise ValueError("count must be >= 0")
    if limit <= 0:
        raise ValueError("limit must be > 0")
    local, remote = _iov_rows(local_iovs, count), _iov_rows(remote_iovs, count)
    if start:  # (going on after a stop: the entries from byte `start` on)
        ends = np.cumsum(local[:, 1], dtype=np.uint64)
        if start > (int(ends[-1]) if count else 0):
            raise ValueError("start lies past the iovecs' end")
        first = int(np.searchsorted(ends, np.uint64(start), side="right"))  # (the entry holding byte `start`)
        local, remote = local[first:].copy(), remote[first:].copy()
        if len(local):
            skip = np.uint64(start - (int(ends[first]) - int(local[0, 1])))
            for side in (local, remote):
                side[0, 0] += skip
                side[0, 1] -= skip
    windows, done = IovWindows(local, remote, limit), 0
    while not windows.finished:
        lease = regions.lease
        if lease.revoking:
            return done, CMA_REVOKING
        with req.io_lock:
            if req.cancelled:
                return done, CMA_CANCELLED
            token = lease.enter()
            if not token:
                return done, CMA_REVOKING
            try:
                # The page first (closed: answered as stale, the caller's refresh then says the
                # channel closed); a process gone goes before a stale table.
                try:
                    current = _GENERATION.unpack_from(generation_page)[0]  # type: ignore[arg-type]
                except (TypeError, ValueError):
                    return done, CMA_STALE
                if not _alive(pidfd):
                    return done, CMA_GONE
                if regions.table is not table or current != regions.generation:
                    return done, CMA_STALE
                here, there, entries, nbytes = windows.current()
                moved = cma_window(pid, write, here, there, entries, lanes if nbytes >= LANE_FROM else 1)
            finally:
                lease.leave(token)
        if moved <= 0:
            return done, moved if moved < 0 else CMA_STUCK
        done += moved
        windows.advance(moved)
    return done, 0


def copy_pieces(pieces: np.ndarray, heres: np.ndarray, write: bool, lanes: int = 1, stream: bool = False) -> None:
    """For every row ``i`` of ``pieces`` ((n, 3) uint64: local, remote, len), copy ``len`` bytes
    between the local address and ``heres[i]`` (where the remote range is mapped here): to
    ``heres[i]`` if ``write``, from it otherwise; in row order (from :data:`LANE_FROM` bytes on,
    split over up to ``lanes`` threads: row order within each). ``stream`` (part of a transfer of
    :data:`STREAM_FROM` bytes or more): the C twin writes past the caches; numpy's copies here
    cannot be told to, and the same bytes land."""
    local, lens = pieces[:, 0], pieces[:, 2]
    # Python threads copy at once only while each memmove is long enough to release the GIL for;
    # many small rows go faster through copy_many's few numpy calls on one thread.
    laned = lanes > 1 and int(lens.sum(dtype=np.uint64)) >= len(lens) * GIL_FREE_FROM
    parts = lane_parts(lens, lanes) if laned else [(0, 0, 0)]
    if len(parts) > 1:

        def part(first: int, offset: int, nbytes: int) -> int:
            (l_addr, h_addr), part_lens = _part_rows([local, heres], lens, first, offset, nbytes)
            for dst, src, n in zip(*((h_addr, l_addr) if write else (l_addr, h_addr)), part_lens.tolist()):
                _memmove(int(dst), int(src), n)  # (releases the GIL: the lanes copy at once)
            return nbytes

        _run_lanes(parts, part)
    elif write:
        copy_many(heres, local, lens)
    else:
        copy_many(local, heres, lens)


def copy_many(dsts: np.ndarray, srcs: np.ndarray, lens: np.ndarray) -> None:
    """``copy(dsts[i], srcs[i], lens[i])`` for every ``i`` (uint64 arrays), in order.

    (Blocks of one length with one side back to back go as one numpy call; the
    other side must then lie on the same grid, and the destinations must not overlap.)
    """
    if len(lens) >= _NUMPY_FROM and not (lens != lens[0]).any() and _numpy_copy(dsts, srcs, int(lens[0])):
        return
    if int(lens.max()) >= GIL_FREE_FROM:
        for dst, src, nbytes in zip(dsts.tolist(), srcs.tolist(), lens.tolist()):
            copy(dst, src, nbytes)
        return
    whole = _ALL
    for dst, dst_end, src, src_end in zip(dsts.tolist(), (dsts + lens).tolist(), srcs.tolist(), (srcs + lens).tolist()):
        whole[dst:dst_end] = whole[src:src_end]


def _numpy_copy(dsts: np.ndarray, srcs: np.ndarray, length: int) -> bool:
    """The numpy way, if the blocks allow it (see :func:`copy_many`); False if they do not."""
    step = np.uint64(length)
    if (np.diff(dsts) == step).all():
        grid = _on_grid(srcs, length)
        if grid is None:
            return False
        base, index = grid
        source = np.asarray(_Rows(base, int(index.max()) + 1, length))
        np.take(source, index, axis=0, out=np.asarray(_Rows(int(dsts[0]), len(dsts), length)), mode="clip")
        return True
    if (np.diff(srcs) == step).all():
        grid = _on_grid(dsts, length)
        if grid is None or len(np.unique(grid[1])) != len(dsts):
            return False  # (two blocks to one place: the order decides, and numpy's is not defined)
        base, index = grid
        target = np.asarray(_Rows(base, int(index.max()) + 1, length))
        target[index] = np.asarray(_Rows(int(srcs[0]), len(srcs), length))
        return True
    return False


def _on_grid(addrs: np.ndarray, length: int) -> tuple[int, np.ndarray] | None:
    """``(base, rows)``: ``addrs`` as row numbers of ``length``-byte rows from the lowest; None if
    one is not on that grid."""
    base = int(addrs.min())
    offsets = addrs - np.uint64(base)
    if (offsets % np.uint64(length)).any():
        return None
    return base, (offsets // np.uint64(length)).astype(np.intp)


# -- TCP's latency path (see the C block of the same name) --------------------------------------------
TCP_WAIT = -1
""":func:`tcp_reply`'s kind when no header came in time."""
TCP_EOF = -2
""":func:`tcp_reply`'s kind when the peer closed its end."""
TCP_RANGES = 16
"""The most (addr, len) ranges :func:`tcp_send` and :func:`tcp_land` take."""
TCP_SERVE_MAX = 64 << 10
"""The most bytes a READ or WRITE the C twin's :func:`tcp_request` serves itself moves (this one serves none)."""
TCP_LOWAT = 256 << 10
"""The low-water mark (``SO_RCVLOWAT``) :func:`tcp_land` waits for a large DATA's next bytes at."""
TCP_LOWAT_FROM = 4 << 20
"""The smallest DATA :func:`tcp_land` waits for so (a 1 MiB one ran slower with the mark raised)."""
_TCP_HEADER = struct.Struct("<4sBBHQIQ")  # as hixl._protocol.frames lays a header out
_TCP_DATA, _TCP_ACK = 7, 8


def _ranges(ranges: object) -> list[tuple[int, int]]:
    """``ranges`` checked as the C twin checks them: a short list of (addr, len) int tuples."""
    if type(ranges) is not list or len(ranges) > TCP_RANGES:
        raise ValueError(f"ranges must be a list of at most {TCP_RANGES} (addr, len) tuples")
    for item in ranges:
        if not (isinstance(item, tuple) and len(item) == 2 and all(type(v) is int and 0 <= v < 1 << 64 for v in item)):
            raise ValueError("ranges must be (addr, len) tuples of ints in [0, 2**64)")
        if item[0] + item[1] >= 1 << 64:
            raise ValueError("ranges must be (addr, len) tuples of ints in [0, 2**64)")
    return ranges  # type: ignore[return-value]


def _views(ranges: list[tuple[int, int]]) -> list[memoryview]:
    return [_ALL[addr : addr + n] for addr, n in ranges]


def _skip(views: list[memoryview], n: int) -> list[memoryview]:
    """``views`` without their first ``n`` bytes."""
    while views and n >= len(views[0]):
        n -= len(views[0])
        views = views[1:]
    if views and n:
        views = [views[0][n:], *views[1:]]
    return views


def _wait(sock: socket.socket, events: int, until: float) -> bool:
    """Whether ``sock`` turned ready for ``events`` before ``until`` (time.monotonic())."""
    left = until - time.monotonic()
    if left <= 0:
        return False
    poller = select.poll()
    poller.register(sock.fileno(), events)
    return bool(poller.poll(min(left, 3600.0) * 1000 + 1))


def _wait_for_lowat(sock: socket.socket, until: float) -> bool:
    """Asleep until :data:`TCP_LOWAT` bytes have come (or ``until``): a large DATA lands in a
    few large reads, not one per few segments. The mark is 1 again before this returns."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, TCP_LOWAT)
    try:
        return _wait(sock, select.POLLIN, until)
    finally:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)


def _spin_or_wait(sock: socket.socket, events: int, until: float, spin_until: float) -> bool:
    """As :func:`_wait`, but before ``spin_until`` only yield the CPU once (releasing the GIL) and
    answer True, for the caller to try again."""
    if time.monotonic() < spin_until:
        os.sched_yield()
        return True
    return _wait(sock, events, until)


def tcp_send(
    sock: socket.socket, frame: bytes, ranges: list[tuple[int, int]], offset: int, until: float, spin: float = 0.0
) -> int:
    """Send ``frame`` then the memory of ``ranges`` on the non-blocking ``sock``, from byte
    ``offset`` of the whole on, waiting for room until ``until`` (for ``spin`` seconds after the
    last bytes went by trying again, then asleep); the bytes sent in all (``offset`` included):
    fewer than the whole once ``until`` passed."""
    views = [memoryview(frame).cast("B"), *_views(_ranges(ranges))]
    total = sum(len(v) for v in views)
    if not 0 <= offset <= total:
        raise ValueError("offset outside what is to be sent")
    views = _skip(views, offset)
    sent = offset
    spin_until = time.monotonic() + spin
    while sent < total:
        try:
            n = sock.sendmsg(views)
        except (BlockingIOError, InterruptedError):
            n = 0
        if n:
            sent += n
            views = _skip(views, n)
            spin_until = time.monotonic() + spin
        elif not _spin_or_wait(sock, select.POLLOUT, until, spin_until):
            break
    return sent


def tcp_reply(
    sock: socket.socket, scratch: bytearray, have: int, req_id: int, until: float, spin: float = 0.0
) -> tuple[int, int, int]:
    """Read into ``scratch`` (holding ``have`` bytes) until it holds a frame header, until ``until``
    at most (the first ``spin`` seconds trying again, yielding the CPU between tries; then asleep):
    ``(kind, have, data_len)`` with kind 7 (DATA) / 8 (ACK) for a well-formed bodiless one of those
    for ``req_id``, 0 for anything else, :data:`TCP_WAIT` or :data:`TCP_EOF`."""
    if type(req_id) is not int or not 0 <= req_id < 1 << 64 or not 0 <= have <= len(scratch) or len(scratch) < _TCP_HEADER.size:
        raise ValueError("tcp_reply: bad req_id, have or scratch")
    view = memoryview(scratch)
    spin_until = time.monotonic() + spin if spin > 0 else 0.0
    while have < _TCP_HEADER.size:
        try:
            n = sock.recv_into(view[have:])
        except (BlockingIOError, InterruptedError):
            if spin_until and time.monotonic() < spin_until:
                os.sched_yield()  # (releases the GIL)
                continue
            if not _wait(sock, select.POLLIN, until):
                return TCP_WAIT, have, 0
            continue
        if not n:
            return TCP_EOF, have, 0
        have += n
    magic, kind, flags, reserved, rid, body, data_len = _TCP_HEADER.unpack_from(scratch)
    if (
        magic == b"HXL1"
        and kind in (_TCP_DATA, _TCP_ACK)
        and not (flags or reserved or body)
        and rid == req_id
        and (kind == _TCP_DATA or not data_len)
    ):
        return kind, have, data_len
    return 0, have, 0


def tcp_land(
    sock: socket.socket,
    scratch: bytearray,
    start: int,
    have: int,
    ranges: list[tuple[int, int]],
    until: float,
    spin: float = 0.0,
) -> tuple[int, int]:
    """Land a reply's data into ``ranges``: first what ``scratch[start:have]`` holds of it, then
    straight from ``sock``, waiting until ``until`` at most (for ``spin`` seconds after the last
    bytes came by trying again, then asleep; data of :data:`TCP_LOWAT_FROM` bytes or more
    asleep, :data:`TCP_LOWAT` at a time, but for its last bytes) and reading nothing once it
    passed; ``(landed, end)``, ``end`` where what ``scratch`` holds beyond the data begins."""
    views = _views(_ranges(ranges))
    if not 0 <= start <= have <= len(scratch):
        raise ValueError("tcp_land: start and have must lie in scratch, in order")
    total = sum(len(v) for v in views)
    buffered = min(have - start, total)
    held = memoryview(scratch)[start : start + buffered]
    landed = 0
    while landed < buffered:
        n = min(len(views[0]), buffered - landed)
        views[0][:n] = held[landed : landed + n]
        landed += n
        views = _skip(views, n)
    spin_until = time.monotonic() + spin
    while landed < total and time.monotonic() < until:
        try:
            n = sock.recvmsg_into(views)[0]
        except (BlockingIOError, InterruptedError):
            if total >= TCP_LOWAT_FROM and total - landed > TCP_LOWAT:
                _wait_for_lowat(sock, until)
            else:
                _spin_or_wait(sock, select.POLLIN, until, spin_until)
            continue
        if not n:
            raise ConnectionResetError(errno.ECONNRESET, "peer closed the connection mid-data")
        landed += n
        views = _skip(views, n)
        spin_until = time.monotonic() + spin
    return landed, start + buffered


def tcp_land_words(
    sock: socket.socket,
    iovs: np.ndarray,
    first: int,
    want: int,
    done: int,
    left: int,
    until: float,
    piece: int,
    spin: float = 0.0,
) -> int:
    """The target's side of a WRITE's data: land up to ``want`` bytes of it straight from the
    non-blocking ``sock`` into the iovecs ``iovs[first:]`` ((N, 2) uint64: addr, len; only read),
    ``done`` bytes of the data landed before and ``left`` still due (these included). Each
    ``readv`` takes at most ``piece`` bytes, only what the socket holds already (FIONREAD) and,
    except for the data's last bytes, only whole 8-byte words of the data. ``until`` is checked
    before each, nothing read once it passed; a dry socket (or one holding only part of a word)
    is tried again for ``spin`` seconds after the last bytes came, never slept on. The bytes landed: fewer than ``want`` when the
    socket ran dry, held only part of a word, or ``until`` passed; ConnectionResetError at the
    stream's end (which FIONREAD alone cannot tell from a dry socket)."""
    if not isinstance(iovs, np.ndarray) or iovs.dtype != np.uint64 or iovs.ndim != 2 or iovs.shape[1] != 2:
        raise TypeError("iovs must be a C-contiguous uint64 array of shape (n, 2)")
    if not 0 <= first <= len(iovs) or not 0 <= want <= left or piece < 8 or done < 0:
        raise ValueError("tcp_land_words: bad iovs, first, want or piece")
    rows = iovs[first:]
    if not len(rows):
        return 0
    cursor = IovCursor(rows)
    want = min(want, cursor.total)
    fd = sock.fileno()
    unread = array.array("i", [0])
    spin_until = time.monotonic() + spin if spin > 0 else 0.0
    moved = 0
    while moved < want:
        fcntl.ioctl(fd, termios.FIONREAD, unread, True)
        n = min(unread[0], want - moved, piece)
        if moved + n < left:
            n -= (done + moved + n) % 8  # (not the data's last bytes: whole words only)
        if n <= 0:
            spun = not spin_until or time.monotonic() >= spin_until
            if unread[0]:
                if spun:
                    break  # a part-word, and the rest of it did not come: the caller keeps it
                os.sched_yield()  # (mid-stream the rest of a part-word is due with the next segment)
                continue
            if spun:
                try:  # dry, or at its end? (FIONREAD says 0 for both)
                    if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                        continue  # (it came just now)
                except (BlockingIOError, InterruptedError):
                    break
                raise ConnectionResetError(errno.ECONNRESET, "peer closed the connection mid-data")
            os.sched_yield()
            continue
        try:
            got = readv(fd, cursor, n, until)
        except ConnectionError as exc:
            raise ConnectionResetError(errno.ECONNRESET, "peer closed the connection mid-data") from exc
        if got <= 0:
            break  # (-1: until passed; 0: a signal)
        moved += got
        if spin > 0:
            spin_until = time.monotonic() + spin
    return moved


_TCP_READ, _TCP_WRITE = 5, 6
_TCP_SMALL_DESCS = 8
_TCP_DEADLINE = struct.Struct("<q")
_TCP_BODIES = {8 + 16 * n: struct.Struct(f"<{2 * n}Q") for n in range(1, _TCP_SMALL_DESCS + 1)}
_U64 = (1 << 64) - 1


def tcp_request(
    sock: socket.socket, scratch: bytearray, registry: object = None
) -> tuple[int, int, int, int, int, list[tuple[int, int]] | None, int, bytes | None]:
    """One non-blocking ``recv`` into ``scratch``; ``(kind, have, end, req_id, deadline, pairs,
    data_len, unsent)``: kind 5 (READ) / 6 (WRITE) if ``scratch`` starts with a whole, well-formed
    one of those of 1 to 8 descriptors (``end``: where it ends), else 0, :data:`TCP_WAIT` (nothing
    to read) or :data:`TCP_EOF`. ``unsent`` is always None: this twin serves no READ or WRITE
    itself, whatever ``registry`` is (the C twin may). Python may switch threads between any two steps, so a
    deregistration could come between the look at the registrations and the send; the caller's
    path takes a hold on the ranges first."""
    if len(scratch) < _TCP_HEADER.size + 8 + 16 * _TCP_SMALL_DESCS:
        raise ValueError("tcp_request: scratch too small")
    try:
        have = sock.recv_into(scratch)
    except (BlockingIOError, InterruptedError):
        return TCP_WAIT, 0, 0, 0, 0, None, 0, None
    if not have:
        return TCP_EOF, 0, 0, 0, 0, None, 0, None
    other = (0, have, 0, 0, 0, None, 0, None)
    if have < _TCP_HEADER.size + 8:
        return other
    magic, kind, flags, reserved, req_id, body, data_len = _TCP_HEADER.unpack_from(scratch)
    unpack = _TCP_BODIES.get(body)
    if magic != b"HXL1" or kind not in (_TCP_READ, _TCP_WRITE) or flags or reserved or unpack is None:
        return other
    end = _TCP_HEADER.size + body
    (deadline,) = _TCP_DEADLINE.unpack_from(scratch, _TCP_HEADER.size)
    if end > have or deadline < 0 or (kind == _TCP_READ and data_len):
        return other
    words = unpack.unpack_from(scratch, _TCP_HEADER.size + 8)
    pairs = []
    total = 0
    for i in range(0, len(words), 2):
        addr, length = words[i], words[i + 1]
        if not length or addr > _U64 - length or total > _U64 - length:
            return other
        total += length
        pairs.append((addr, length))
    if kind == _TCP_WRITE and total != data_len:
        return other
    return kind, have, end, req_id, deadline, pairs, data_len, None


# ---- weights_hash, copy_hash: hixl.weights' checksum (why this one: hixl/weights/_checks.py) ----

_HASH_KEYS = 256
"""Word i takes the key and multiplier of i mod this; one more pair is the byte length's."""
_HASH_SEED = 0x68786C2D6D6C6836  # "hxl-mlh6": SplitMix64's sequence from here, as the C draws it
_HASH_CHUNK = 8192
"""Words per numpy step (a multiple of _HASH_KEYS): 64 KiB, so its temporary stays in the L2 cache."""


def _splitmix64(state: int) -> tuple[int, int]:
    """SplitMix64's next state and output."""
    state = (state + 0x9E3779B97F4A7C15) & _U64
    z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return state, z ^ (z >> 31)


def _hash_tables() -> tuple[np.ndarray, np.ndarray, int, int]:
    """The keys and multipliers of one chunk's words (repeated every _HASH_KEYS), and the length's pair."""
    keys, mults, state = [], [], _HASH_SEED
    for _ in range(_HASH_KEYS + 1):
        state, k = _splitmix64(state)
        state, m = _splitmix64(state)
        keys.append(k)
        mults.append(m | 1)  # odd: multiplying by it loses no difference
    repeat = _HASH_CHUNK // _HASH_KEYS
    return (np.tile(np.array(keys[:-1], dtype=np.uint64), repeat), np.tile(np.array(mults[:-1], dtype=np.uint64), repeat),
            keys[-1], mults[-1])


_HASH_K, _HASH_M, _HASH_LEN_K, _HASH_LEN_M = _hash_tables()


def _hash_buffer(obj: object, writable: bool, what: str) -> np.ndarray:
    """``obj``'s bytes as a uint8 array, refused as the C twin refuses it (the same buffer request)."""
    view = memoryview(obj)  # type: ignore[arg-type]
    if not view.c_contiguous or (writable and view.readonly):
        raise TypeError(f"{what} must be a C-contiguous{' writable' if writable else ''} buffer")
    if not view.nbytes:  # (memoryview will not cast a shape with a zero in it)
        return np.empty(0, dtype=np.uint8)
    return np.frombuffer(view.cast("B") if view.ndim != 1 or view.format != "B" else view, dtype=np.uint8)


def _hash_chunk(data: np.ndarray, scratch: np.ndarray) -> int:
    """The sum over a chunk's whole words (its first word at a multiple of _HASH_KEYS), mod 2**64."""
    n = len(data) // 8
    words, out = data[: 8 * n].view("<u8"), scratch[:n]
    np.bitwise_xor(words, _HASH_K[:n], out=out)
    np.multiply(out, _HASH_M[:n], out=out)
    return int(out.sum(dtype=np.uint64))


def _hash_end(h: int, data: np.ndarray, nbytes: int) -> int:
    """``h`` with the zero-padded tail of ``data`` (the last ``nbytes % 8`` bytes) and the length added."""
    words, tail = divmod(nbytes, 8)
    if tail:
        last = int.from_bytes(data[8 * words :].tobytes(), "little")
        h += (last ^ int(_HASH_K[words % _HASH_KEYS])) * int(_HASH_M[words % _HASH_KEYS])
    return (h + (nbytes ^ _HASH_LEN_K) * _HASH_LEN_M) & _U64


def weights_hash(buffer: object) -> int:
    """The 64-bit checksum of a C-contiguous buffer's bytes (hixl.weights' "mlh64")."""
    data = _hash_buffer(buffer, False, "buffer")
    scratch, h = np.empty(_HASH_CHUNK, dtype=np.uint64), 0
    for start in range(0, len(data), 8 * _HASH_CHUNK):
        h += _hash_chunk(data[start : start + 8 * _HASH_CHUNK], scratch)
    return _hash_end(h, data, len(data))


def copy_hash(dst: object, src: object) -> int:
    """Copy ``src``'s bytes into ``dst`` (C-contiguous, one size, not overlapping); :func:`weights_hash`
    of what landed, each chunk hashed right after it was copied (while it is in the cache)."""
    out, data = _hash_buffer(dst, True, "dst"), _hash_buffer(src, False, "src")
    if len(out) != len(data):
        raise ValueError(f"copy_hash: dst has {len(out)} bytes, src {len(data)}")
    scratch, h = np.empty(_HASH_CHUNK, dtype=np.uint64), 0
    for start in range(0, len(data), 8 * _HASH_CHUNK):
        chunk = out[start : start + 8 * _HASH_CHUNK]
        np.copyto(chunk, data[start : start + 8 * _HASH_CHUNK])
        h += _hash_chunk(chunk, scratch)
    return _hash_end(h, out, len(out))


# ---- row_hashes: the hash a hixl.weights table row carries (the format: hixl/weights/_rows.py) ----
_ROW_MAX_WORDS = 4096
_MIX_M1, _MIX_M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer, in place on a uint64 array."""
    x ^= x >> np.uint64(30)
    x *= _MIX_M1
    x ^= x >> np.uint64(27)
    x *= _MIX_M2
    x ^= x >> np.uint64(31)
    return x


def row_hashes(rows: object, width: int, out: object) -> None:
    """The hash of each row of ``rows`` (C-contiguous native uint64 words, ``width`` a row: the
    sequence word, the hash word, the payload) into ``out`` (one uint64 a row): the sum of
    SplitMix64's finalizer of each word xor its position's key, the hash word left out."""
    width = operator.index(width)
    if not 2 <= width <= _ROW_MAX_WORDS:
        raise ValueError(f"row_hashes: width must be 2 to {_ROW_MAX_WORDS} words, not {width}")
    data, dst = _hash_buffer(rows, False, "rows"), _hash_buffer(out, True, "out")
    n = len(dst) // 8
    if len(data) % (8 * width) or len(dst) % 8 or len(data) // (8 * width) != n:
        raise ValueError(
            f"row_hashes: {len(data)} bytes of rows of {width} words need {len(data) // (8 * width) * 8} bytes of out, not {len(dst)}"
        )
    words = data.view(np.uint64).reshape(n, width)
    keys = _mix64(np.arange(1, width, dtype=np.uint64) * _GOLDEN)  # [0]: the sequence word's
    payload = _mix64(words[:, 2:] ^ keys[1:])
    dst.view(np.uint64)[:] = payload.sum(axis=1, dtype=np.uint64) + _mix64(words[:, 0] ^ keys[0])


def _i64_array(obj: object, writable: bool, what: str) -> np.ndarray:
    """``obj`` as a numpy int64 array, refused as the C twin refuses it (the same buffer request)."""
    view = memoryview(obj)  # type: ignore[arg-type]
    if (
        view.itemsize != 8
        or view.format.lstrip("<=@") not in ("q", "l")
        or view.ndim != 1
        or not view.c_contiguous
        or (writable and view.readonly)
    ):
        raise TypeError(f"{what} must be a C-contiguous{' writable' if writable else ''} int64 array of one dimension")
    return np.frombuffer(view, dtype=np.int64) if len(view) else np.empty(0, dtype=np.int64)


def gather_rows(dst: int, src: int, stride: int, rows: object) -> None:
    """Copy row ``rows[i]`` of the table of ``stride``-byte rows at address ``src`` (``rows[i] *
    stride`` bytes on, in 64-bit arithmetic) to address ``dst + i * stride``, for every ``i``.
    ValueError, nothing copied, if a row number is negative or ``stride`` is not positive. Nothing
    else is checked: see the C twin."""
    dst, src, stride = operator.index(dst), operator.index(src), operator.index(stride)
    if dst < 0 or src < 0 or dst >= 1 << 64 or src >= 1 << 64:
        raise OverflowError("gather_rows: addresses are unsigned 64-bit integers")
    if stride < 1:
        raise ValueError(f"gather_rows: stride must be positive, not {stride}")
    numbers = _i64_array(rows, False, "rows")
    negative = np.flatnonzero(numbers < 0)
    if len(negative):
        i = int(negative[0])
        raise ValueError(f"gather_rows: row {i} is {int(numbers[i])}: row numbers are >= 0")
    if not len(numbers):
        return
    srcs = (np.uint64(src) + numbers.astype(np.uint64) * np.uint64(stride)).astype(np.uint64)
    dsts = np.uint64(dst) + np.arange(len(numbers), dtype=np.uint64) * np.uint64(stride)
    copy_many(dsts, srcs, np.full(len(numbers), stride, dtype=np.uint64))


def gather_checked_rows(
    src: int, stride: int, rows: object, limit: int, row_bytes: int, out: object, versions: object, torn: object,
    check: bool,
) -> int:
    """A gather of table rows whose first word is a sequence number, odd while the row is written, from the
    table of ``stride``-byte rows at address ``src`` straight into ``out``: row ``rows[i]``'s ``row_bytes``
    payload bytes (from its third word) into ``out``, its version (the word halved) into ``versions``. With
    ``check``, a row whose word, loaded before and after the copy, differs or is odd is torn (its ``out``
    and version are not to be used): returns how many are, their positions, ascending, in ``torn``.
    ValueError, nothing copied, for a row number outside ``[0, limit)`` or sizes that disagree. Here every
    row's word is loaded before any payload and again after all (each numpy step loads in order): the C
    twin's check with a wider window, valid where :data:`ORDERED_ROW_READS`."""
    src, stride, limit, row_bytes = operator.index(src), operator.index(stride), operator.index(limit), operator.index(row_bytes)
    if stride < 16 or stride % 8 or not 0 <= row_bytes <= stride - 16:
        raise ValueError(f"gather_checked_rows: {row_bytes} payload bytes do not fit rows of {stride} bytes (a multiple of 8, >= 16)")
    if src % 8:
        raise ValueError("gather_checked_rows: the table's address must be a multiple of 8")
    numbers = _i64_array(rows, False, "rows")
    landing = _hash_buffer(out, True, "out")
    seen = _i64_array(versions, True, "versions")
    positions = _i64_array(torn, True, "torn")
    n = len(numbers)
    if len(landing) != row_bytes * n or len(seen) != n or len(positions) != n:
        raise ValueError(
            f"gather_checked_rows: {n} rows need {row_bytes * n} bytes of out and {8 * n} of versions and torn, not "
            f"{len(landing)}, {8 * len(seen)}, {8 * len(positions)}"
        )
    outside = np.flatnonzero((numbers < 0) | (numbers >= limit))
    if len(outside):
        i = int(outside[0])
        raise ValueError(f"gather_checked_rows: row {i} is {int(numbers[i])}, not in [0, {limit})")
    if not n:
        return 0
    table = np.ctypeslib.as_array((ctypes.c_uint8 * (stride * (int(numbers.max()) + 1))).from_address(src)).reshape(-1, stride)
    words = table.view(np.uint64)
    before = words[numbers, 0]
    landing.reshape(n, row_bytes)[:] = table[numbers, 16 : 16 + row_bytes]
    after = words[numbers, 0]
    seen[:] = (before >> np.uint64(1)).astype(np.int64)
    bad = np.flatnonzero(((before & np.uint64(1)) != 0) | (before != after)) if check else np.empty(0, np.int64)
    positions[: len(bad)] = bad
    return len(bad)


def accept_rows(words: object, width: int, row_bytes: int, out: object, versions: object, torn: object) -> int:
    """Check a gather of table rows (``words``: C-contiguous native uint64, ``width`` words a row: the
    sequence word, the hash word, the payload) and, if every row is whole, hand them over. Returns
    how many rows are not (an odd sequence word, or a hash word other than :func:`row_hashes` of
    the row); their positions, ascending, in ``torn`` (int64, one a row). If that is 0, each row's
    first ``row_bytes`` payload bytes are in ``out`` and its version (the sequence word halved) in
    ``versions``; else ``out`` and ``versions`` are as they were. ValueError, nothing written, if
    the sizes disagree."""
    width, row_bytes = operator.index(width), operator.index(row_bytes)
    if not 2 <= width <= _ROW_MAX_WORDS or not 0 <= row_bytes <= 8 * (width - 2):
        raise ValueError(
            f"accept_rows: {row_bytes} payload bytes do not fit rows of {width} words (2 to {_ROW_MAX_WORDS})"
        )
    data = _hash_buffer(words, False, "words")
    landing = _hash_buffer(out, True, "out")
    seen = _i64_array(versions, True, "versions")
    positions = _i64_array(torn, True, "torn")
    n = len(positions)
    if len(data) != 8 * width * n or len(landing) != row_bytes * n or len(seen) != n:
        raise ValueError(
            f"accept_rows: {n} rows (torn) need {8 * width * n} bytes of words, {row_bytes * n} of out and "
            f"{8 * n} of versions, not {len(data)}, {len(landing)}, {8 * len(seen)}"
        )
    if not n:
        return 0
    rows = data.view(np.uint64).reshape(n, width)
    hashes = np.empty(n, dtype=np.uint64)
    row_hashes(rows, width, hashes)
    bad = np.flatnonzero((rows[:, 0] & np.uint64(1)).astype(bool) | (hashes != rows[:, 1]))
    positions[: len(bad)] = bad
    if not len(bad):
        landing.reshape(n, row_bytes)[:] = data.reshape(n, 8 * width)[:, 16 : 16 + row_bytes]
        seen[:] = (rows[:, 0] >> np.uint64(1)).astype(np.int64)
    return len(bad)
