"""The initiator's mappings of a peer's shared memory: verified, looked up, unmapped on time.

A descriptor the peer hands over is taken on trust for nothing. Before it is
mapped it must be a memfd (it has seals), sealed against shrinking — a file the
peer could truncate under us would turn our next copy into a SIGBUS — and at
least as large as the grant says. It is mapped writable only if the grant says
so *and* the descriptor was opened read-write *and* no seal forbids writing;
otherwise read-only. Mappings are ``MAP_SHARED | MAP_POPULATE`` (no page fault
inside a transfer) and made with libc's ``mmap`` directly, so that unmapping
is immediate and unconditional (Python's mmap objects refuse to close while a
view exists).

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
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from .._memory import RemoteRegions
from .._protocol.shm import Grant
from ._shm_socket import Received

__all__ = ["Mapped", "Prepared", "SharedMappings", "covered", "map_grant", "unmap"]

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_mmap.restype = ctypes.c_void_p
_munmap = _libc.munmap
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_munmap.restype = ctypes.c_int
_MAP_FAILED = ctypes.c_void_p(-1).value
_NO_WRITES = fcntl.F_SEAL_WRITE | 0x0010  # F_SEAL_FUTURE_WRITE


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


def map_grant(grant: Grant, fd: int) -> Mapped:
    """Verify ``fd`` against ``grant`` and map it (see the module docstring); ``ValueError`` if it
    is not what it must be, ``OSError`` if it cannot be mapped. Does not close ``fd``."""
    st = os.fstat(fd)
    size = -(-grant.length // mmap.PAGESIZE) * mmap.PAGESIZE
    if not stat.S_ISREG(st.st_mode) or st.st_size < size:
        raise ValueError(f"the descriptor for {grant.addr:#x} is not a file of at least {size} bytes")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise ValueError(f"the descriptor for {grant.addr:#x} is not a memfd") from None
    if not seals & fcntl.F_SEAL_SHRINK:
        raise ValueError(f"the memfd for {grant.addr:#x} may be shrunk under us (no F_SEAL_SHRINK)")
    read_write = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
    writable = grant.writable and read_write and not seals & _NO_WRITES
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    here = _mmap(None, size, prot, mmap.MAP_SHARED | mmap.MAP_POPULATE, fd, 0)
    if here in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"cannot map the memfd for {grant.addr:#x}: {os.strerror(err)}")
    return Mapped(grant.addr, grant.length, int(here), size, writable, (st.st_dev, st.st_ino))


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

    def prepare(self, received: Sequence[Received]) -> Prepared:
        """Map what was received, reusing what is mapped already; closes every descriptor.

        Runs outside the lease (mapping takes time); hand the result to :meth:`install`.
        """
        current = {(m.there, m.length, m.file): m for m in self._items}
        prepared = Prepared([], [], [])
        try:
            for grant, fd in received:
                try:
                    same = current.get((grant.addr, grant.length, _identity(fd)))
                    # Kept if it grants no more than the grant: a writable mapping of memory granted
                    # read-only now is made anew (read-only) instead.
                    if same is not None and same.writable <= grant.writable:
                        prepared.reused.append(same)
                    else:
                        prepared.fresh.append(map_grant(grant, fd))
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
