"""The shared-memory pool: registrable memory that another process on this host can map.

``hixl.empty(..., shared=True)`` allocates from here. Each allocation is one
memfd — page-aligned, its pages allocated up front (``posix_fallocate``: an
out-of-memory shows here, not as a SIGBUS in a later copy) and mapped
``MAP_SHARED | MAP_POPULATE`` (no page fault inside a timed transfer). The shm
transport hands the memfds of registered pool memory to an authenticated peer,
which maps them and copies straight into or out of them (see
:mod:`hixl.transports.shm`).

The memfds are sealed against shrinking and growing from the start: a peer
holding one could otherwise truncate it under this process and turn its next
access into a SIGBUS. Memory registered read-only is handed out through a
read-only descriptor *and* sealed with ``F_SEAL_FUTURE_WRITE``, because a
read-only memfd descriptor can be reopened read-write through
``/proc/self/fd`` by anyone who holds it; the seal makes every new writable
mapping or ``write`` fail, while this process keeps writing through the mapping
it already has. That seal is permanent: memory once shared read-only is never
shared writable again (a peer then writes it over TCP).

Each memfd is named after the process that made it (:func:`identity`; a memfd
cannot be renamed): a peer handed one can tell whether it comes from the process
it authenticated, or was passed on by it from a third one (:func:`creator`).

A process-wide table maps address ranges to their memfd, so a transport can
tell which registered regions are pool memory. An allocation leaves the table,
and its memfd is closed, when its mapping is garbage-collected (the last array
or view of it gone).
"""

from __future__ import annotations

import bisect
import ctypes
import fcntl
import mmap
import os
import re
import threading
import weakref
from dataclasses import dataclass

__all__ = ["PoolMapping", "allocate", "creator", "identity", "memfd_name", "open_for_peer", "overlapping"]

_NAME = "hixl-pool"
_NAMED = re.compile(r"/memfd:hixl-pool:([ip][0-9.]+) \(deleted\)")
"""What ``/proc/self/fd/N`` reads for a pool memfd (a memfd's file is always "deleted")."""
_PIDFS_MAGIC = 0x50494446
_STATFS = ctypes.c_long * 32  # room for a struct statfs (120 bytes on 64-bit Linux); f_type comes first
_libc = ctypes.CDLL(None, use_errno=True)
F_SEAL_FUTURE_WRITE = 0x0010  # <linux/fcntl.h>; not in Python's fcntl module
_SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


@dataclass(frozen=True)
class PoolMapping:
    """One pool allocation: ``length`` usable bytes at ``addr`` (its memfd holds ``size``, whole pages)."""

    addr: int
    length: int
    size: int
    fd: int


class _Mapping(mmap.mmap):
    """An mmap that can be weakly referenced (to drop its table entry when it is collected)."""


_lock = threading.Lock()
_starts: list[int] = []  # sorted addresses of the live allocations
_by_start: dict[int, PoolMapping] = {}


def allocate(nbytes: int) -> mmap.mmap:
    """A new pool allocation of at least ``nbytes`` bytes (one page at least), zero-filled.

    Raises :class:`MemoryError` if the kernel cannot give the pages (tmpfs or
    memory-cgroup limits), :class:`OSError` if memfds are unavailable.
    """
    size = max(mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    fd = os.memfd_create(memfd_name(), os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            raise MemoryError(f"cannot allocate {size} bytes of shared memory: {exc.strerror}") from exc
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SIZE_SEALS)
        mapping = _Mapping(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    except BaseException:
        os.close(fd)
        raise
    addr = _address_of(mapping)
    entry = PoolMapping(addr, max(nbytes, 1), size, fd)
    with _lock:
        bisect.insort(_starts, addr)
        _by_start[addr] = entry
    weakref.finalize(mapping, _release, entry)
    return mapping


def identity(pidfd: int, pid: int) -> str | None:
    """How the process that ``pidfd`` pins (``pid`` in this PID namespace, 0 if outside it) names
    the memfds it makes; None if that cannot be told from here.

    Where pidfds live in pidfs (Linux 6.9), its inode number: one per process for as long as the
    kernel runs, never reused, the same seen from any PID namespace. Elsewhere its pid and start
    time, which match only within one PID namespace (a process outside ours, or in a namespace
    below it, numbers itself otherwise: its memfds are then refused, and its peers use TCP).
    Raises :class:`OSError` if its ``/proc`` entry cannot be read; as a pid may have been given to
    another process meanwhile, the caller checks through ``pidfd`` that it is still alive.
    """
    statfs = _STATFS()
    if _libc.fstatfs(pidfd, ctypes.byref(statfs)) == 0 and statfs[0] == _PIDFS_MAGIC:
        return f"i{os.fstat(pidfd).st_ino}"
    if pid <= 0:
        return None
    with open(f"/proc/{pid}/stat", "rb") as f:
        start = f.read().rsplit(b")", 1)[1].split()[19]  # field 22, starttime; the name before may hold anything
    return f"p{pid}.{int(start)}"


_own: tuple[int, str] = (0, "")  # (pid, the name): a forked child names its memfds anew


def memfd_name() -> str:
    """The name this process gives its pool memfds: ``hixl-pool:`` and its :func:`identity`."""
    global _own
    pid = os.getpid()
    if _own[0] != pid:
        pidfd = os.pidfd_open(pid)
        try:
            _own = (pid, f"{_NAME}:{identity(pidfd, pid)}")
        finally:
            os.close(pidfd)
    return _own[1]


def creator(fd: int) -> str | None:
    """The identity (see :func:`identity`) of the process that made the pool memfd open as ``fd``
    here; None if ``fd`` is not a pool memfd."""
    try:
        named = _NAMED.fullmatch(os.readlink(f"/proc/self/fd/{int(fd)}"))
    except OSError:
        return None
    return named.group(1) if named else None


def _address_of(mapping: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(mapping)
    try:
        return ctypes.addressof(view)
    finally:
        del view  # releases the buffer export at once


def _release(entry: PoolMapping) -> None:
    with _lock:
        # By identity: an allocation made after this one was unmapped may sit at the same address.
        if _by_start.get(entry.addr) is entry:
            del _by_start[entry.addr]
            _starts.remove(entry.addr)
        os.close(entry.fd)  # under the lock: open_for_peer never duplicates a closed descriptor


def overlapping(addr: int, nbytes: int) -> list[PoolMapping]:
    """The live allocations that overlap ``[addr, addr + nbytes)``, lowest first."""
    with _lock:
        i = max(0, bisect.bisect_right(_starts, addr) - 1)
        found = []
        for start in _starts[i:]:
            if start >= addr + nbytes:
                break
            entry = _by_start[start]
            if start + entry.length > addr:
                found.append(entry)
        return found


def open_for_peer(entry: PoolMapping, writable: bool) -> tuple[int, bool] | None:
    """A new descriptor of ``entry``'s memfd to hand to a peer (the caller closes it), and whether
    it is writable; None if the allocation is gone.

    Writable if asked for and the memfd was never shared read-only; otherwise it is
    sealed against new writes (see the module docstring) and reopened read-only.
    """
    with _lock:
        if _by_start.get(entry.addr) is not entry:
            return None
        if writable and not fcntl.fcntl(entry.fd, fcntl.F_GET_SEALS) & F_SEAL_FUTURE_WRITE:
            return os.dup(entry.fd), True
        fcntl.fcntl(entry.fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)
        return os.open(f"/proc/self/fd/{entry.fd}", os.O_RDONLY | os.O_CLOEXEC), False
