"""Which process is at the other end of a connection on this host, and how to touch it safely.

A same-host transport copies straight into another process's memory, so before
it does, it must know *which* process that is — not which one the peer says it
is, and not one that merely holds a descriptor the peer handed it: descriptors
can be passed on (``SCM_RIGHTS``, inheritance, ``pidfd_getfd``), so "this
process holds that socket" proves nothing about who the peer is.
:func:`listener` asks the kernel instead: on a connected Unix socket,
``SO_PEERCRED`` / ``SO_PEERPIDFD`` report the process that called ``listen()``
on the other end, fixed at that moment; passing any descriptor anywhere
afterwards does not change it. A same-host transport's side channel is such a
socket, and its first exchange proves the binding of the authenticated TCP
connection (see :mod:`._shm_socket`): the process the kernel names there is the
one that runs the peer engine. (Only the holder of the listening socket answers
there: the process that made it, which never hands it on, or one allowed to
ptrace that process and take it with ``pidfd_getfd`` — which may write that
process's memory anyway.) :func:`far_end_owner_error` checks besides that
this process also holds the far end of our TCP connection (found in
``/proc/<pid>/net/tcp*``, which shows that process's network namespace): no
relay or proxy sits between.

:class:`PeerProcess` then pins that process with a pidfd for the life of the
link, so a pid that the kernel hands to a new process after the peer died is
never mistaken for it, and may open its ``/proc/<pid>/mem``, which no pid reuse can redirect
(:meth:`PeerProcess.open_memory`). :func:`map_peer_file` opens a file the peer names (by fd
number) without ever blocking: what it is is checked with ``stat`` before the
open, which is non-blocking, and again with ``fstat`` after.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import mmap
import os
import select
import signal
import socket
import stat
import struct
import sys

__all__ = ["PeerProcess", "Watched", "far_end_owner_error", "listener", "map_peer_file"]

_ESTABLISHED = "01"
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5; Python names it from 3.13 on
_Endpoint = tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]


def _endpoint(address: tuple) -> _Endpoint:
    """A socket address as (ip, port), IPv4-mapped IPv6 addresses as IPv4."""
    ip = ipaddress.ip_address(address[0].split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip, int(address[1])


def _proc_endpoint(field: str) -> _Endpoint:
    """``/proc/net/tcp``'s ``HEXADDR:HEXPORT``: the address as 32-bit words in host byte order."""
    hex_addr, hex_port = field.split(":")
    raw = b"".join(int(hex_addr[i : i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, len(hex_addr), 8))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip, int(hex_port, 16)


def _far_end_inodes(pid: int, sock: socket.socket) -> set[int]:
    """Inodes of the established sockets, in ``pid``'s network namespace, whose local end is our
    peer's address and whose remote end is ours: the far end of ``sock``."""
    wanted = (_endpoint(sock.getpeername()), _endpoint(sock.getsockname()))
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                lines = f.readlines()[1:]
        except FileNotFoundError:  # no IPv6 in that kernel, or the process is gone
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == _ESTABLISHED:
                if (_proc_endpoint(fields[1]), _proc_endpoint(fields[2])) == wanted:
                    inodes.add(int(fields[9]))
    inodes.discard(0)
    return inodes


def far_end_owner_error(pid: int, sock: socket.socket) -> str | None:
    """``None`` if process ``pid`` holds the far end of the TCP connection ``sock``; else why not.

    Listing another process's fds needs the same permission as cross-memory
    attach, so a peer we could copy into can always be checked this way. (A
    process that names *us* passes only if we hold the far end ourselves — the
    target is an engine of this very process.)
    """
    try:
        inodes = _far_end_inodes(pid, sock)
    except (OSError, ValueError) as exc:
        return f"cannot read pid {pid}'s sockets: {exc}"
    if not inodes:
        return f"pid {pid} has no socket at the far end of this connection"
    names = {f"socket:[{inode}]" for inode in inodes}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError as exc:
        return f"cannot list pid {pid}'s open files: {exc.strerror}"
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in names:
                return None
        except PermissionError as exc:
            # The same check as cross-memory attach's: another user's process, without CAP_SYS_PTRACE.
            return f"not permitted to look at pid {pid}'s open files ({exc.strerror}): cross-memory attach would be refused too"
        except OSError:
            continue  # closed meanwhile
    return f"pid {pid} does not hold this connection's socket"


def listener(sock: socket.socket) -> tuple[int, int]:
    """The process that listens at the other end of the connected Unix socket ``sock``, as the
    kernel recorded it when that process called ``listen()``: its pid in our PID namespace (0 if
    outside it) and a pidfd pinning it (the caller's to close).

    The pidfd comes from ``SO_PEERPIDFD`` (Linux 6.5), which names the very process, never one
    given its pid later; older kernels give only the pid, which is opened at once (a process that
    exited and whose pid was reused within that instant would be taken for it). Raises
    :class:`OSError` if neither names a process here.
    """
    pid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))[0]
    try:
        pidfd = struct.unpack("i", sock.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD, 4))[0]
    except OSError as exc:
        if exc.errno != errno.ENOPROTOOPT:  # (EINVAL, ESRCH: it has exited; its pid may be another's)
            raise OSError(exc.errno, f"no process listens there any more ({exc.strerror})") from None
        if pid <= 0:
            raise OSError(errno.ESRCH, "the process listening there is outside our PID namespace") from None
        pidfd = os.pidfd_open(pid)
    return pid, pidfd


class Watched:
    """A descriptor that turns ready (readable, or hung up) once what it stands for is gone: a
    pidfd once its process exited, a pipe's read end once every write end is closed.
    :meth:`alive` until then; takes ownership of ``fd``."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    @property
    def fd(self) -> int:
        """The descriptor (-1 once closed), for a check made elsewhere (hixl._accel.cma_copy)."""
        return self._fd

    def alive(self) -> bool:
        """True until what the descriptor watches is gone (False once this is closed)."""
        if self._fd < 0:
            return False
        try:
            try:
                return not self._poll.poll(0)
            except RuntimeError:  # another thread polls it this instant (a poll object is not shared)
                own = select.poll()
                own.register(self._fd, select.POLLIN)
                return not own.poll(0)
        except (OSError, ValueError):  # closed
            return False

    def close(self) -> None:
        """Release the descriptor; idempotent."""
        if self._fd >= 0:
            self._poll.unregister(self._fd)
            os.close(self._fd)
            self._fd = -1


class PeerProcess(Watched):
    """A process pinned by a pidfd: :meth:`alive` is false once *it* has gone, even if its pid
    has since been given to another process."""

    def __init__(self, pid: int, pidfd: int | None = None) -> None:
        """Pin process ``pid`` (``ProcessLookupError`` if there is none), or take ownership of
        ``pidfd``, a pidfd of it already open."""
        self.pid = pid
        self.memory_fd = -1
        """Its ``/proc/<pid>/mem`` once :meth:`open_memory` proved it, else -1."""
        super().__init__(os.pidfd_open(pid) if pidfd is None else pidfd)

    def open_memory(self, addr: int, expected: bytes) -> bool:
        """Open ``/proc/<pid>/mem`` for reading and writing, and keep it (:attr:`memory_fd`) if it
        holds ``expected`` at ``addr``; whether it does.

        The open file is bound to the process's address space, not to its pid: a pid the kernel
        hands to another process later cannot redirect it, and once the process has exited it
        reads and writes nothing — so a copy through it needs no liveness check (see
        :class:`hixl._accel.CmaSmall`). Bytes only that process holds (a connection's probe bytes,
        already read there through ``process_vm_readv``), read through the file, prove that the
        ``/proc`` mounted here names that same process: one of another PID namespace would name
        another process, or none. Where ``/proc`` refuses (no ptrace permission, hidepid, a kernel
        that forbids the file) this is simply false.
        """
        try:
            fd = os.open(f"/proc/{self.pid}/mem", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            proven = os.pread(fd, len(expected), addr) == expected
        except (OSError, OverflowError):
            proven = False
        if not proven:
            os.close(fd)
            return False
        self.close_memory()
        self.memory_fd = fd
        return True

    def close_memory(self) -> None:
        """Close :attr:`memory_fd`; idempotent."""
        if self.memory_fd >= 0:
            os.close(self.memory_fd)
            self.memory_fd = -1

    def close(self) -> None:
        """Release the pidfd and the memory file; idempotent."""
        self.close_memory()
        super().close()

    def alive(self) -> bool:
        """True until the pinned process is gone (reaped: only then can its pid be reused).

        Signal 0 through the pidfd checks without signalling — cheaper than polling the
        pidfd (this is on every copy's path). A zombie still counts as alive, but nothing
        can be copied into it, and its pid is not free until it is reaped.
        """
        if self._fd < 0:
            return False
        try:
            signal.pidfd_send_signal(self._fd, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True  # it exists; signalling it is another permission than cma's
        except (OSError, ValueError):  # closed
            return False
        return True


def map_peer_file(pid: int, fd: int, name: str, size: int) -> mmap.mmap:
    """Map ``size`` bytes of the memfd ``name`` that process ``pid`` has open as ``fd``, read-only.

    Never blocks: a FIFO, socket or device there is refused by ``stat`` before
    any open, and the open itself is non-blocking (a file swapped in between is
    caught by ``fstat``). Raises :class:`ValueError` for anything but that memfd,
    :class:`OSError` if it cannot be reached.
    """
    path = f"/proc/{pid}/fd/{int(fd)}"
    target = os.readlink(path)
    if not target.startswith(f"/memfd:{name}"):
        raise ValueError(f"fd {fd} of pid {pid} is {target!r}, not the memfd {name!r}")
    before = os.stat(path)  # follows the link to the open file without opening it
    if not stat.S_ISREG(before.st_mode) or before.st_size < size:
        raise ValueError(f"fd {fd} of pid {pid} is not a regular file of at least {size} bytes")
    opened = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        after = os.fstat(opened)
        if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino) or not stat.S_ISREG(after.st_mode):
            raise ValueError(f"fd {fd} of pid {pid} changed while it was being opened")
        # A file its owner could still shrink would kill us with SIGBUS when we next read the
        # mapping: only one sealed against shrinking is mapped.
        if not fcntl.fcntl(opened, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
            raise ValueError(f"fd {fd} of pid {pid} is not sealed against shrinking (F_SEAL_SHRINK)")
        return mmap.mmap(opened, size, prot=mmap.PROT_READ)
    finally:
        os.close(opened)
