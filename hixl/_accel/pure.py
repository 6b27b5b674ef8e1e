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

import bisect
import ctypes
import signal
import struct
import sys
import threading

import numpy as np

from .._iov import process_vm_readv, process_vm_writev

__all__ = [
    "CMA_GONE",
    "CMA_INELIGIBLE",
    "CMA_STALE",
    "GIL_FREE_FROM",
    "SMALL_MAX",
    "batch_order",
    "check_small",
    "cma_copy",
    "copy",
    "copy_many",
    "copy_pieces",
    "mapped_copy",
]

GIL_FREE_FROM = 64 << 10
"""Blocks of at least this many bytes are copied with the GIL released."""
SMALL_MAX = 64
"""The most descriptors :func:`check_small` and :func:`mapped_copy` take."""
CMA_INELIGIBLE = -(1 << 20)
"""What :func:`cma_copy` answers when it tried nothing: ``descs`` is not a small list, or the
generation page is closed."""
CMA_STALE = CMA_INELIGIBLE - 1
"""... the peer's generation is not the one given (our regions are out of date)."""
CMA_GONE = CMA_INELIGIBLE - 2
"""... the pinned process has gone."""
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
    if triples is None:
        return None
    total = 0
    for local, remote, nbytes in triples:
        if _interval(local_starts, local_ends, local, nbytes) < 0 or _interval(remote_starts, remote_ends, remote, nbytes) < 0:
            return None
        total += nbytes
    return total if total < 1 << 64 else None


def mapped_copy(
    descs: object, write: bool, starts: list[int], ends: list[int], heres: list[int], writable: list[bool]
) -> int:
    """Copy a small list of (local, remote, len) descriptors through the peer's memory mapped here
    (mapping ``i`` covers the peer's ``[starts[i], ends[i])`` at ``heres[i]``, writable if
    ``writable[i]``). 1: all were mapped (writably, for a write) and are copied; 0: none was,
    nothing copied; -1: some were, or ``descs`` is not such a list, nothing copied."""
    triples = _triples(descs)
    if triples is None:
        return -1
    plan = []
    for local, remote, nbytes in triples:
        m = _interval(starts, ends, remote, nbytes)
        if m >= 0 and (not write or writable[m] is True):
            there = heres[m] + (remote - starts[m])
            plan.append((there, local, nbytes) if write else (local, there, nbytes))
    if len(plan) != len(triples):
        return 0 if not plan else -1
    for dst, src, nbytes in plan:
        copy(dst, src, nbytes)
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
    try:
        current = _GENERATION.unpack_from(generation_page)[0]  # type: ignore[arg-type]
    except (TypeError, ValueError):  # unmapped by close()
        return CMA_INELIGIBLE
    if current != generation:
        return CMA_STALE
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except PermissionError:
        pass  # it exists; signalling it is another permission than cma's
    except (OSError, ValueError):
        return CMA_GONE
    scratch, count = _scratch, len(triples)
    if count == 1:  # the common latency case: both iovecs in one call, no argument lists
        local, remote, length = triples[0]
        _ONE_PAIR.pack_into(scratch.buf, 0, local, length, remote, length)
    else:
        pack = _iov_pack[count]
        pack.pack_into(scratch.buf, 0, *[v for d in triples for v in (d[0], d[2])])
        pack.pack_into(scratch.buf, _REMOTE_OFFSET, *[v for d in triples for v in (d[1], d[2])])
    moved = (process_vm_writev if write else process_vm_readv)(pid, scratch.local, count, scratch.remote, count, 0)
    return int(moved) if moved >= 0 else -ctypes.get_errno()


def copy_pieces(pieces: np.ndarray, heres: np.ndarray, write: bool) -> None:
    """For every row ``i`` of ``pieces`` ((n, 3) uint64: local, remote, len), copy ``len`` bytes
    between the local address and ``heres[i]`` (where the remote range is mapped here): to
    ``heres[i]`` if ``write``, from it otherwise; in row order."""
    local, lens = pieces[:, 0], pieces[:, 2]
    if write:
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
