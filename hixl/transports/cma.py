"""Same-host transport: Linux cross-memory attach (``process_vm_readv/writev``).

The initiator copies straight between its registered buffer and the target
process's, in one kernel copy per byte; the target's CPU and threads take no
part — this is as one-sided as a host can be. Descriptors become two iovec
arrays by slicing numpy columns, IOV_MAX at a time.

Reachability is *proven*, not assumed, and nothing the peer says is taken on
trust. Which process to copy into is the kernel's word, not the peer's: the
target listens on a Unix socket of its own (a path in ``socket_dir``, named in
its WELCOME), and the initiator connects to it — through ``/proc/<pid>/root``, so
that a peer in another mount namespace is reached as well — and has it prove the
binding of this very authenticated TCP connection (only its two ends can compute
it). The kernel reports which process called ``listen()`` on that socket
(``SO_PEERCRED``, and ``SO_PEERPIDFD`` for a pidfd with no pid-reuse race): a fact
fixed when it listened, which no descriptor passed on afterwards changes. (Proving
"this process holds the far end of our socket" would not do: a peer can hand its
socket to a third process, see :mod:`._peerproc`.) The initiator copies into that
process only if (1) it is the pid the WELCOME names; (2) the kernel's own tables show that
it holds the far end of this TCP connection too (no relay sits between); (3) it holds, where it
says, 16 bytes only the two ends of this connection can compute (derived from the session key),
read through ``process_vm_readv``; and (4) it has its generation page open where it says (opened
without ever blocking). The process stays pinned with its pidfd, and every copy checks that it is
still alive, so a pid reused after the peer died is never copied into.
A copy of one descriptor of up to a page (``transfer_sync``'s latency case) goes
through the process's ``/proc/<pid>/mem`` instead, where that opens and holds the
same 16 bytes: that file is bound to the process's memory, not its pid, so it
needs no liveness check — one system call where ``process_vm_*`` needs two.
Before any of that, the peer must run under this kernel (its boot id) and in this
PID namespace (the pid it names means that process only there); network and mount namespaces
do not matter — two containers that share a kernel and a PID namespace but not a
network still use cma, as the socket's far end is looked up in the peer's own, and its
Unix socket reached through its own root.
The probe fails (and the engine falls back to TCP, logging why) across hosts,
across pid namespaces, behind a proxy or NAT, and where ptrace permission is
withheld (Yama, seccomp, containers without CAP_SYS_PTRACE, other users).

As the target takes no part, it can't refuse a copy into memory it has just
deregistered; so it counts its registration changes in a memfd page that the
initiator maps read-only, and the initiator re-fetches the regions before a
transfer whenever that count moved (see :meth:`CmaChannel.check_remote`).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import struct
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _accel
from .._exceptions import HixlError, PeerDisconnected, ProtocolError, TransferError
from .._iov import iovecs, process_vm_readv
from .._protocol import shm as shm_proto
from .._session.address import boot_id as _boot_id
from .._session.initiator import LinkState
from .._types import MemType, Op
from ._peerproc import PeerProcess, far_end_owner_error, map_peer_file
from ._shm_socket import (
    Credentials,
    Message,
    SessionSocket,
    default_socket_dir,
    probe_timeout,
    prove,
    usable_path,
)
from .base import Capabilities, Channel, Transport

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._memory import OwnView
    from .._request import TransferReq
    from .base import LinkSession, ServedSession

__all__ = ["CmaTransport"]

_NONCE_BYTES = 16


def _errno_error(err: int, pid: int) -> HixlError:
    if err == errno.ESRCH:
        return PeerDisconnected(f"target process {pid} no longer exists")
    if err == errno.EFAULT:
        return TransferError("address fault: a range is not mapped (deregistered or freed memory?)")
    return TransferError(f"cross-memory copy failed: {os.strerror(err)} (errno {err})")


_GENERATION = struct.Struct("<Q")


_GENERATION_NAME = "hixl-cma-generation"


def _pid_namespace() -> str:
    """This process's PID namespace (``pid:[inode]``): pids mean the same process only within one."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


CHUNK = 16 << 20
"""Most bytes one ``process_vm_*`` call moves under the lease (a few milliseconds): what a REVOKE or a
cancel waits for at most."""
# (For the latency path: a module global is read ten times faster than an Enum member.)
_WRITE, _CONNECTED = Op.WRITE, LinkState.CONNECTED


class CmaChannel(Channel):
    """Copies to and from one target process.

    Every copy holds a shared hold of the link's *lease* (``link.regions.lease``) from
    its last check to the end of its syscall, and checks first that our copy of the
    peer's regions is of the generation the peer publishes (its memfd page) and still
    contains the ranges. The peer bumps that generation before it tells anyone of a
    deregistration, and our link answers its REVOKE only under the exclusive lease,
    after installing the new regions: so once the peer has our confirmation, no copy
    of ours touches what it withdrew. Copies to one peer run in parallel (each holds
    the lease for one chunk at most), and a REVOKE waits for one chunk each.
    """

    def __init__(self, link: LinkSession, process: PeerProcess, generation: mmap.mmap, lanes: int) -> None:
        self.link = link
        self._lanes = lanes
        self.pid = process.pid
        self._process = process
        self._generation = generation

    def _current(self) -> int:
        try:
            return int(_GENERATION.unpack_from(self._generation)[0])
        except ValueError:  # unmapped by close()
            raise PeerDisconnected(f"channel to {self.link.remote_engine} is closed") from None

    def _fresh(self, timeout: float) -> None:
        """Make our copy of the peer's regions the one of its current generation."""
        if self._current() != self.link.regions.generation:
            self.link.refresh_regions(timeout)

    def check_remote(self, addrs: np.ndarray, lens: np.ndarray, timeout: float, write: bool) -> None:
        """Check against the peer's regions, fetched again if it changed them since we last did.

        The target's CPU takes no part in a CMA copy, so nothing on its side would stop
        one into memory it has just deregistered (or freed); its REVOKE may still be on
        the wire. The generation it bumps on every change is a plain memory load here,
        cheap enough for every transfer.
        """
        self._fresh(timeout)
        self.link.check_remote(addrs, lens, timeout, write)

    def start(self, req: TransferReq, op: Op, descs: np.ndarray) -> None:
        """Run the copy in the calling thread (no target involvement)."""
        try:
            self.link.ensure_alive()
            finished = self._copy(req, op, descs)
        except HixlError as exc:
            req.fail(exc)
        else:
            if finished:
                req.complete()

    def _copy(self, req: TransferReq, op: Op, descs: np.ndarray) -> bool:
        """Copy ``descs`` window by window, each under ``req.io_lock`` (checking cancellation first)
        and a shared hold of the lease; False if the request was cancelled (or expired) on the way.

        A window is up to CHUNK bytes per copy lane, split over the lanes (which all end before the
        next window begins): so the lock and the hold cover every lane's bytes, and a REVOKE or a
        cancel waits for about one chunk's time, as with one lane. The windows and every check
        before each run in :func:`hixl._accel.cma_windows`, which comes back here only where a check
        stops it: between two windows the caches are cold after the copy, and the Python steps
        took ~60-130 µs a window there while the lanes waited (~4 % of a 1.25 GiB KV pull).
        """
        write = op is Op.WRITE
        local, remote = iovecs(descs[:, 0], descs[:, 2]), iovecs(descs[:, 1], descs[:, 2])
        regions = self.link.regions
        done, stop, checked = 0, _accel.CMA_STALE, None
        while True:
            if stop == _accel.CMA_STALE:
                # Our copy of the peer's regions is not the current one, or was never checked against
                # (an async request may start well after the engine validated it, and a REVOKE may
                # have come in between): fetch them (outside the locks: that is a network round
                # trip), and go on only if the request still fits.
                self._fresh(req.remaining())
                checked = regions.table
                checked.check(descs[:, 1], descs[:, 2], write)
            elif stop == _accel.CMA_REVOKING:
                regions.lease.wait_out_revoke(req.deadline)  # (not under the lock: cancel would wait too)
            moved, stop = _accel.cma_windows(
                self.pid, write, int(local.ctypes.data), int(remote.ctypes.data), len(local), self._lanes,
                self._process.fd, done, CHUNK * self._lanes, self._generation, regions, checked, req,
            )
            done += moved
            if stop == 0:
                return True
            if stop == _accel.CMA_CANCELLED:
                return False
            if stop == _accel.CMA_GONE:
                raise PeerDisconnected(f"target process {self.pid} exited")
            if stop == _accel.CMA_STUCK:
                raise TransferError("copy made no progress")
            if stop not in (_accel.CMA_STALE, _accel.CMA_REVOKING):
                raise _errno_error(-stop, self.pid)

    def latency_path(self, registry: OwnView) -> Callable[[Op, object], bool]:
        """One call of hixl._accel per small ``transfer_sync``: both sides' region checks, the
        lease, the generation and liveness checks and the syscall (see :class:`hixl._accel.CmaSmall`);
        one descriptor of up to a page through the peer's ``/proc/<pid>/mem`` where the probe
        opened it (no liveness check needed: see the module docstring).

        An 8-byte copy is one system call of under two microseconds; every Python call on its way
        costs a tenth of a microsecond, and a second system call a third of the whole, so nothing
        else runs between the engine and it.
        """
        return _accel.CmaSmall(
            self.pid, self._process.fd, self._generation, registry, self.link, _CONNECTED, Op.READ, _WRITE,
            CHUNK * self._lanes, self._lanes, self._process.memory_fd,
        ).run

    def close(self) -> None:
        """Unmap the peer's generation page and let go of its process (and its memory file)."""
        self._generation.close()  # (first: the latency path reads it before it trusts the descriptors)
        self._process.close()


class CmaTransport(Transport):
    """Cross-memory attach between processes on one host (see module docstring)."""

    capabilities = Capabilities(
        name="cma",
        same_host_only=True,
        mem_types=frozenset({MemType.HOST}),
    )

    def __init__(
        self, copy_lanes: int = 1, socket_dir: str | os.PathLike[str] | None = None, timeout: float = 2.0
    ) -> None:
        """``copy_lanes``: threads a large copy is split over (the caller's included; see
        :func:`hixl._accel.cma_window`). ``socket_dir``: where the target's Unix socket goes
        (as :class:`~hixl.transports.ShmTransport`'s: default ``$HIXL_SHM_DIR``, else ``/tmp``).
        ``timeout``: the longest the exchange on it may take, for both halves."""
        self._lanes = max(1, min(int(copy_lanes), _accel.MAX_LANES))
        self.timeout = float(timeout)
        self._socket = SessionSocket("cma", default_socket_dir(socket_dir), "cma-socket", self._prove_to, self.timeout)
        # Registration generation, in a memfd that initiators map (see CmaChannel.check_remote).
        # Without one (memfd refused), initiators' probes fail and they use another transport.
        self._generation_fd = -1
        self._generation_map: mmap.mmap | None = None
        # What probe() proved about a link's peer, for open() to use: its pinned process
        # and its mapped generation page (proven once, never looked up again).
        self._proven: weakref.WeakKeyDictionary[LinkSession, tuple[PeerProcess, mmap.mmap]] = weakref.WeakKeyDictionary()
        try:
            self._generation_fd = os.memfd_create(_GENERATION_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(self._generation_fd, _GENERATION.size)
            # Its size fixed for good: initiators map it only if so (see map_peer_file), as a page
            # truncated under their mapping would kill them with SIGBUS on their next read.
            fcntl.fcntl(self._generation_fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._generation_map = mmap.mmap(self._generation_fd, _GENERATION.size)
        except OSError:
            self.close()

    def advertise(self, session: ServedSession) -> dict[str, Any]:
        """Pid, boot id, the socket that proves which process this is, where this connection's
        probe bytes live; the generation fd."""
        probe = ctypes.create_string_buffer(session.binding("cma"), _NONCE_BYTES)
        session.keepalive.append(probe)  # for as long as the connection lasts
        return {
            "pid": os.getpid(),
            "boot_id": _boot_id(),
            "pid_namespace": _pid_namespace(),
            "socket": self._socket.offer(session),
            "probe_addr": ctypes.addressof(probe),
            "generation_fd": self._generation_fd if self._generation_map is not None else None,
        }

    @staticmethod
    def _prove_to(session: ServedSession, cred: Credentials) -> list[Message]:
        """A client that proved ``session``'s binding on our socket: the proof that we serve it."""
        return [(session.binding("cma-socket-target"), [])]

    def regions_changed(self, generation: int) -> None:
        """Publish the generation that initiators compare before trusting their copy of our regions."""
        if self._generation_map is not None:
            _GENERATION.pack_into(self._generation_map, 0, generation)

    def close(self) -> None:
        """Stop listening, release the generation page; idempotent."""
        self._socket.close()
        if self._generation_map is not None:
            self._generation_map.close()
            self._generation_map = None
        if self._generation_fd >= 0:
            os.close(self._generation_fd)
            self._generation_fd = -1

    def probe(self, link: LinkSession) -> str | None:
        """Prove which process the peer is and that we may copy into it; ``None`` if all holds.

        Nothing the peer says is taken on trust: the process is the one the kernel names as the
        listener of the peer's socket, once that proved this connection's binding (see the
        module docstring); it must be the pid the peer names, must hold the far end of this very
        connection's socket (the kernel's tables say so, see :mod:`._peerproc`), must hold this
        connection's probe bytes where it says, and must have its generation page open where it
        says. All within ``connect``'s deadline.
        """
        info = link.welcome.get("transports", {}).get("cma")
        if not isinstance(info, dict):
            return "the peer does not offer cma"
        if info.get("boot_id") != _boot_id():
            return "the peer runs under another kernel (different boot id)"
        theirs, ours = info.get("pid_namespace"), _pid_namespace()
        if theirs is not None and theirs != ours:
            # Its pid names another process here, or none: nothing to attach to. (A peer that
            # does not say is left to the kernel's word below, which no wrong pid passes.)
            return f"the peer runs in another PID namespace ({theirs}, ours is {ours})"
        try:
            pid, addr, generation_fd = int(info["pid"]), int(info["probe_addr"]), int(info["generation_fd"])
        except (KeyError, TypeError, ValueError):
            return "the peer's cma advertisement is malformed"
        if pid <= 0 or not 0 <= generation_fd < 1 << 31 or not 0 < addr < 1 << 64:
            return "the peer's cma advertisement is out of range"
        path = info.get("socket")
        if path is None:
            return "the peer has no socket to prove which process it is (an older hixl, or it could not make one)"
        if not usable_path(path):
            return "the peer's cma socket path is malformed"
        timeout = probe_timeout(link, self.timeout)
        if timeout <= 0:
            return "no time left before connect's deadline"
        try:
            # Through its root, which is ours unless it runs in another mount namespace. Whatever
            # listens there, the kernel says which process that is.
            binding, proof = link.binding("cma-socket"), link.binding("cma-socket-target")
            process = prove(path, binding, proof, timeout, root=f"/proc/{pid}/root")
        except (OSError, ProtocolError, shm_proto.Refused) as exc:
            return f"the peer's cma socket did not prove which process it is: {exc}"
        generation = None
        try:
            if process.pid != pid:
                reason: str | None = f"the peer names pid {pid}, but pid {process.pid} listens on its socket"
            elif not process.alive():
                reason = f"pid {pid} exited during the probe"
            else:
                reason = far_end_owner_error(pid, link.socket) or self._probe_bytes_error(link, pid, addr)
            if reason is None:
                try:
                    generation = map_peer_file(pid, generation_fd, _GENERATION_NAME, _GENERATION.size)
                except (OSError, ValueError) as exc:
                    reason = f"cannot map pid {pid}'s registration generation: {exc}"
            if reason is None and not process.alive():
                reason = f"pid {pid} exited during the probe"
            if reason is None:
                process.open_memory(addr, link.binding("cma"))  # (where it cannot: process_vm_* alone)
        except BaseException:
            process.close()
            raise
        if reason is not None:
            process.close()
            if generation is not None:
                generation.close()
            return reason
        assert generation is not None
        self._proven[link] = (process, generation)
        return None

    @staticmethod
    def _probe_bytes_error(link: LinkSession, pid: int, addr: int) -> str | None:
        """Read this connection's probe bytes in ``pid`` through ``process_vm_readv``: proves we
        may copy into it, and that it is the process this session's key was shared with."""
        got = ctypes.create_string_buffer(_NONCE_BYTES)
        local = np.array([[ctypes.addressof(got), _NONCE_BYTES]], dtype=np.uint64)
        remote = np.array([[addr, _NONCE_BYTES]], dtype=np.uint64)
        moved = process_vm_readv(pid, local.ctypes.data, 1, remote.ctypes.data, 1, 0)
        if moved != _NONCE_BYTES:
            err = ctypes.get_errno()
            return f"process_vm_readv on pid {pid} failed: {os.strerror(err)} (errno {err})"
        expected = link.binding("cma")
        if got.raw != expected:
            return f"pid {pid} here does not hold this connection's probe bytes"
        return None

    def open(self, link: LinkSession) -> Channel:
        """A channel copying to and from the process :meth:`probe` proved."""
        process, generation = self._proven.pop(link)
        return CmaChannel(link, process, generation, self._lanes)
