"""Copies between address ranges of this process, as cheaply as Python can make them.

The shm transport copies block by block between its registered memory and a
peer's mapped memory; a KV cache moves thousands of 16 KiB blocks, so what one
copy costs in Python matters as much as the copy itself. Three ways, cheapest
first:

- *Blocks of one length, one side back to back* (a cache pulled into, or pushed
  from, consecutive blocks; :func:`block_order` sorts a batch so that this shows):
  one numpy ``take`` (destinations back to back) or one fancy assignment
  (sources back to back) over views of the two ranges — numpy's C loop, about
  a fifth faster than any Python loop over the blocks.
- A small block: a slice assignment between two ``memoryview``\\s of the whole
  address space, the cheapest memcpy Python offers (about half a
  ``ctypes.memmove`` call: no argument conversion).
- A large block: ``ctypes.memmove``, which releases the GIL for the copy, so
  the engine's other threads (heartbeats, replies) run meanwhile.

Nothing here checks an address: callers copy only ranges they checked against
registrations and mappings first.
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np

__all__ = ["GIL_FREE_FROM", "block_order", "copy", "copy_many"]

GIL_FREE_FROM = 64 << 10
"""Blocks of at least this many bytes are copied with the GIL released."""
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


def block_order(dsts: np.ndarray, srcs: np.ndarray, lens: np.ndarray) -> np.ndarray | None:
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
