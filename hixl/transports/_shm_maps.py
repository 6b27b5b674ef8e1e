"""The initiator's mappings of a peer's shared memory: verified, looked up, unmapped on time.

A descriptor the peer hands over is taken on trust for nothing. It arrives here
only if it is a pool memfd made by the very process that runs the peer (see
:func:`._shm_socket.fetch`); the grants it comes with must lie in what the peer
registered, not overlap, and stay within :class:`GrantLimits` (how many bytes in all,
and how many grants, which :func:`._shm_socket.fetch` counts as they come: past either,
every grant of the exchange is refused). Before it is
mapped it must be a memfd (it has seals), sealed against shrinking — a file the
peer could truncate under us would turn our next copy into a SIGBUS — at
least as large as the grant says, and with every page of that allocated already
(the pool allocates its pages up front): so nothing here allocates memory because
a peer said so. It is mapped writable only if the grant says
so *and* the descriptor was opened read-write *and* no seal forbids writing;
otherwise read-only. Mappings are made with libc's ``mmap`` directly, so that unmapping
is immediate and unconditional (Python's mmap objects refuse to close while a
view exists), and then populated (``MADV_POPULATE_*``, Linux 5.14: no page fault
inside a transfer, which costs a first copy several times what populating does)
chunk by chunk, while the pages are still allocated and until the deadline of the
exchange; what is left then faults in on first touch. All of it within that deadline.

:class:`SharedMappings` holds one peer's set. It is not locked: its owner (the
shm channel) mutates and reads it under the link's lease only, so a copy
through a mapping never overlaps the unmapping of it.
"""

from __future__ import annotations

import bisect
import ctypes
import fcntl
import mmap
import os
import stat
import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from .._memory import RemoteRegions
from .._protocol.shm import Grant
from ._shm_socket import Received

__all__ = ["GrantLimits", "Mapped", "Prepared", "SharedMappings", "covered", "map_grant", "unmap"]

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_mmap.restype = ctypes.c_void_p
_munmap = _libc.munmap
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_munmap.restype = ctypes.c_int
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int
_MAP_FAILED = ctypes.c_void_p(-1).value
_NO_WRITES = fcntl.F_SEAL_WRITE | 0x0010  # F_SEAL_FUTURE_WRITE
_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23  # <linux/mman.h>, Linux 5.14
_POPULATE = 64 << 20
"""Bytes populated at once (~10 ms): between two such chunks the deadline and the pages are looked at."""


class GrantLimits(NamedTuple):
    """The most an initiator maps of one peer: ``grants`` allocations, ``nbytes`` bytes in all."""

    grants: int
    nbytes: int


class Mapped(NamedTuple):
    """One grant mapped here: the peer's ``[there, there + length)`` is ours at ``here``."""

    there: int
    length: int
    here: int
    size: int
    writable: bool
    file: tuple[int, int]
    """(st_dev, st_ino) of the memfd: the same grant fetched again is recognised, not mapped twice."""


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _pages(nbytes: int) -> int:
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


def _allocated(fd: int, size: int) -> bool:
    """Whether the first ``size`` bytes of the memfd ``fd`` may all be allocated already (its
    allocated blocks cover that much): touching them then allocates nothing."""
    return os.fstat(fd).st_blocks * 512 >= size


def map_grant(grant: Grant, fd: int, deadline: float | None = None) -> Mapped:
    """Verify ``fd`` against ``grant``, map it and populate it until ``deadline`` (see the module
    docstring); ``ValueError`` if it is not what it must be, ``OSError`` if it cannot be mapped.
    Does not close ``fd``."""
    st = os.fstat(fd)
    size = _pages(grant.length)
    if not stat.S_ISREG(st.st_mode) or st.st_size < size:
        raise ValueError(f"the descriptor for {grant.addr:#x} is not a file of at least {size} bytes")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise ValueError(f"the descriptor for {grant.addr:#x} is not a memfd") from None
    if not seals & fcntl.F_SEAL_SHRINK:
        raise ValueError(f"the memfd for {grant.addr:#x} may be shrunk under us (no F_SEAL_SHRINK)")
    if not _allocated(fd, size):
        raise ValueError(f"the memfd for {grant.addr:#x} has pages not allocated (mapping it would allocate them here)")
    read_write = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
    writable = grant.writable and read_write and not seals & _NO_WRITES
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    here = _mmap(None, size, prot, mmap.MAP_SHARED, fd, 0)
    if here in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"cannot map the memfd for {grant.addr:#x}: {os.strerror(err)}")
    mapped = Mapped(grant.addr, grant.length, int(here), size, writable, (st.st_dev, st.st_ino))
    _populate(mapped, fd, deadline)
    return mapped


def _populate(mapped: Mapped, fd: int, deadline: float | None) -> None:
    """Fault ``mapped`` in, a chunk at a time while its pages are all still allocated (the peer may
    punch holes in a writable memfd meanwhile: then at most one chunk is allocated here) and until
    ``deadline``. Best effort: what is left faults in on first touch."""
    advice = _MADV_POPULATE_WRITE if mapped.writable else _MADV_POPULATE_READ
    for start in range(0, mapped.size, _POPULATE):
        if (deadline is not None and time.monotonic() >= deadline) or not _allocated(fd, mapped.size):
            return
        if _madvise(mapped.here + start, min(_POPULATE, mapped.size - start), advice) != 0:
            return  # a kernel before 5.14, or a page gone (the peer punched a hole): left to first touch


class Prepared(NamedTuple):
    """What :meth:`SharedMappings.prepare` made of the grants received."""

    fresh: list[Mapped]
    """Mapped just now."""
    reused: list[Mapped]
    """Mapped already (the same memfd, the same grant)."""
    refused: list[str]
    """Why each grant that was not mapped was not."""


def unmap(mapped: Mapped) -> None:
    """Unmap ``mapped`` (at once: nothing here keeps it)."""
    _munmap(mapped.here, mapped.size)


def covered(mapped: Mapped, table: RemoteRegions) -> bool:
    """Whether ``table`` still registers all of ``mapped`` (writable too, if it is mapped so)."""
    return table.contains(mapped.there, mapped.length, False) and (
        not mapped.writable or table.contains(mapped.there, mapped.length, True)
    )


class SharedMappings:
    """One peer's shared memory as mapped here (see the module docstring)."""

    def __init__(self) -> None:
        self._items: tuple[Mapped, ...] = ()
        self.index: tuple[list[int], list[int], list[int], list[bool]] = ([], [], [], [])
        """The mappings as plain lists — the peer's starts and ends, where each is mapped here, and
        whether writably — in the form :func:`hixl._accel.mapped_copy` takes."""
        self._there = np.empty(0, np.uint64)
        self._ends = np.empty(0, np.uint64)
        self._delta = np.empty(0, np.uint64)  # here - there, modulo 2**64
        self._writable = np.empty(0, bool)
        self.version = 0
        """Counts the changes; a copy planned against one version re-plans if it moved."""

    @property
    def items(self) -> tuple[Mapped, ...]:
        """The mappings, in the peer's address order."""
        return self._items

    def prepare(
        self, received: Sequence[Received], table: RemoteRegions, limits: GrantLimits, deadline: float | None = None
    ) -> Prepared:
        """Map what was received that ``table`` registers, within ``limits`` and by ``deadline``,
        reusing what is mapped already; closes every descriptor.

        Runs outside the lease (mapping takes time); hand the result to :meth:`install`.
        """
        current = {(m.there, m.length, m.file): m for m in self._items}
        prepared = Prepared([], [], [])
        try:
            total = sum(_pages(grant.length) for grant, _ in received)  # (how many: fetch() counted)
            if total > limits.nbytes:
                prepared.refused.append(f"the peer granted {total} bytes in all, more than max_grant_bytes ({limits.nbytes})")
                return prepared
            end = 0  # of the last grant taken: they come in the peer's address order, and may not overlap
            for grant, fd in received:
                try:
                    if deadline is not None and time.monotonic() >= deadline:
                        raise TimeoutError(f"no time was left to map the grant at {grant.addr:#x}")
                    if grant.addr < end or not table.contains(grant.addr, grant.length, False):
                        raise ValueError(f"the grant at {grant.addr:#x} (+{grant.length}) is not a region the peer registered")
                    end = grant.addr + grant.length
                    # Writable only where it is registered writable, whatever the grant says.
                    grant = grant._replace(writable=grant.writable and table.contains(grant.addr, grant.length, True))
                    same = current.get((grant.addr, grant.length, _identity(fd)))
                    # Kept if it grants no more than the grant: a writable mapping of memory granted
                    # read-only now is made anew (read-only) instead.
                    if same is not None and same.writable <= grant.writable:
                        prepared.reused.append(same)
                    else:
                        prepared.fresh.append(map_grant(grant, fd, deadline))
                except (OSError, ValueError) as exc:
                    prepared.refused.append(str(exc))
        finally:
            for _, fd in received:
                os.close(fd)
        return prepared

    def install(self, prepared: Prepared, table: RemoteRegions) -> None:
        """Make the prepared mappings the set, less what ``table`` does not register in full (or
        what overlaps another); unmap everything else. Under the lease."""
        alive = set(self._items)
        # A reused mapping dropped since prepare() (by a REVOKE) is unmapped already: not again.
        candidates = sorted({*prepared.fresh, *(m for m in prepared.reused if m in alive)})
        keep: list[Mapped] = []
        for m in candidates:
            if covered(m, table) and not (keep and keep[-1].there + keep[-1].length > m.there):
                keep.append(m)
        self._replace(keep, extra=prepared.fresh)

    def keep_covered(self, table: RemoteRegions) -> None:
        """Unmap every mapping ``table`` does not register in full any more. Under the lease."""
        keep = [m for m in self._items if covered(m, table)]
        if len(keep) != len(self._items):
            self._replace(keep)

    def _replace(self, keep: list[Mapped], extra: Sequence[Mapped] = ()) -> None:
        kept = set(keep)
        for m in {*self._items, *extra} - kept:
            unmap(m)
        self._items = tuple(keep)
        starts = [m.there for m in keep]
        self.index = (starts, [m.there + m.length for m in keep], [m.here for m in keep], [m.writable for m in keep])
        self._there = np.array(starts, np.uint64)
        self._ends = np.array([m.there + m.length for m in keep], np.uint64)
        self._delta = np.array([(m.here - m.there) % (1 << 64) for m in keep], np.uint64)
        self._writable = np.array([m.writable for m in keep], bool)
        self.version += 1

    def find(self, there: int, nbytes: int, write: bool) -> int:
        """Where the peer's ``[there, there + nbytes)`` is mapped here; -1 if it is not (or not writably)."""
        i = bisect.bisect_right(self.index[0], there) - 1
        if i < 0:
            return -1
        m = self._items[i]
        if there + nbytes > m.there + m.length or (write and not m.writable):
            return -1
        return m.here + (there - m.there)

    def translate(self, there: np.ndarray, lens: np.ndarray, write: bool) -> np.ndarray | None:
        """Where each of the peer's ranges is mapped here, as a uint64 array; None unless all are."""
        if not self._items:
            return None
        slot = np.searchsorted(self._there, there, side="right").astype(np.int64) - 1
        if (slot < 0).any():
            return None
        inside = there + lens <= self._ends[slot]
        if write:
            inside &= self._writable[slot]
        if not inside.all():
            return None
        return there + self._delta[slot]

    def explains(self, table: RemoteRegions, elsewhere: frozenset[tuple[int, int]]) -> bool:
        """Whether every region of ``table`` is mapped, or known (``elsewhere``) not to be shared."""
        for addr, nbytes in table.regions:
            if (addr, nbytes) not in elsewhere and self.find(addr, nbytes, False) < 0:
                return False
        return True

    def close(self) -> None:
        """Unmap everything. Under the lease."""
        self._replace([])
