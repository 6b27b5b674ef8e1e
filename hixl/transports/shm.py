"""Same-host transport for peers cma cannot reach: pool memory handed over a Unix socket.

Cross-memory attach needs ptrace permission, which another user, another pid
namespace or a container's seccomp profile withholds. Two engines on one host
can still move bytes with one copy if the target's registered memory comes
from hixl's shared-memory pool (``hixl.empty(..., shared=True)``, one memfd
per allocation, see :mod:`hixl._shm_pool`):

*Target half.* When a connection's WELCOME is made and some registered memory
is pool memory, the transport listens on a Unix socket (a path in
``socket_dir``, created on first need) and names it in the WELCOME. A client
of that socket must send the 16-byte binding of an authenticated TCP
connection this engine serves right now — only the two ends of that connection
can compute it — and may be held to a uid allow-list (``SO_PEERCRED``); it is
then sent, with ``SCM_RIGHTS``, the memfds of the pool allocations that the
registrations cover *in full* (writable ones writable; the rest read-only and
sealed against writes), and a proof that the answer comes from this engine.
Everything else — READ and WRITE frames for memory outside the pool — is
served as TCP serves it. See :mod:`hixl.transports._shm_socket`.

*Initiator half.* :meth:`ShmTransport.probe` checks the boot id, fetches and
verifies the grants and maps them (:mod:`._shm_maps`), all within ``connect``'s
deadline: only memfds that the process listening on the socket made itself (the
kernel names that process, and every pool memfd is named after its maker: see
:mod:`._shm_socket`), within what the peer registered and within
``max_grants`` / ``max_grant_bytes``; it fails, and the
engine moves on to TCP, when the peer is on another host, its socket cannot
be reached (another mount namespace), it refuses us, or it has no pool memory
registered (then TCP moves the same bytes; a connection made before the pool
memory was registered stays on TCP). :class:`ShmChannel` then decides per
request: one whose every remote range lies in mapped memory (writably mapped,
for a WRITE) is copied here, block by block under the link's lease; any other
goes over TCP whole, on the same link. Requests still take effect in the order
they were started: an shm copy first waits for the TCP requests started before
it. The mappings follow the peer's registrations (:mod:`._shm_peer`): a REVOKE
unmaps what it withdrew before the link confirms it.

What a peer can do with a memfd once it has it is the limit of all this: see
docs/engine.md ("Same host (shm)").
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _accel, _shm_pool
from .._exceptions import HixlError, PeerDisconnected
from .._memory import RemoteRegions
from .._protocol import shm as shm_proto
from .._session.address import boot_id as _boot_id
from .._session.initiator import INPUT_CHECK, LinkState
from .._types import CheckedRows, MemType, Op
from ._shm_maps import GrantLimits
from ._shm_peer import RECHECK, PeerMemory
from ._shm_socket import (
    Credentials,
    Message,
    SessionSocket,
    default_socket_dir,
    probe_timeout,
    usable_path,
)
from .base import Capabilities, Channel, Transport
from .tcp import TcpChannel, TcpTransport

if TYPE_CHECKING:
    from .._request import TransferReq
    from .base import LinkSession, ServedSession

__all__ = ["ShmChannel", "ShmTransport"]

log = logging.getLogger("hixl")

CHUNK = 16 << 20
"""Most bytes one lease hold copies: a REVOKE or a cancel waits for at most one such chunk (a
millisecond or two). Smaller chunks cost a batch of 16 KiB blocks a few percent (each chunk is one
numpy call, or one Python loop, of its own)."""
_WINDOW = 1024
"""Most descriptors one lease hold copies."""
# (For the latency path: a module global is read ten times faster than an Enum member.)
_WRITE, _CONNECTED = Op.WRITE, LinkState.CONNECTED
_LANE_FROM = _accel.LANE_FROM
_YIELD = 50e-6
"""Seconds the latency path sleeps per look when its copies hold the GIL (see ShmChannel.run_small)."""
_LOOK_EVERY = min(RECHECK, INPUT_CHECK)
"""Seconds between two looks of the latency path at the socket and the target's liveness: as often
as either would look anyway."""


def _shareable(table: RemoteRegions) -> list[tuple[_shm_pool.PoolMapping, bool]]:
    """The pool allocations ``table`` registers in full, and whether also in full writably."""
    found: dict[int, tuple[_shm_pool.PoolMapping, bool]] = {}
    for addr, nbytes in table.regions:
        for entry in _shm_pool.overlapping(addr, nbytes):
            if entry.addr not in found and table.contains(entry.addr, entry.length, False):
                found[entry.addr] = (entry, table.contains(entry.addr, entry.length, True))
    return [found[a] for a in sorted(found)]


def _memory_size() -> int:
    """This machine's memory, in bytes: more than a peer can have allocated to grant."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class ShmTransport(Transport):
    """Shared memory between processes on one host (see the module docstring).

    ``socket_dir``: where targets put their Unix socket; both peers must see it
    at the same path (containers: mount one host directory at the same place in
    both). Default: ``$HIXL_SHM_DIR``, else ``/tmp``. It must not be writable by
    others unless it is sticky (like ``/tmp``); a missing one is created so.
    ``allowed_uids``: target side, the uids (``SO_PEERCRED``) that may fetch
    grants; None (default) lets any uid that proves the binding of an
    authenticated connection. ``timeout``: the longest one exchange on the
    socket may take, for both halves. ``copy_lanes``: threads (the caller's
    included) a large copy is split over (see :func:`hixl._accel.copy_pieces`).
    ``max_grants`` / ``max_grant_bytes``: initiator side, the most allocations of one peer it
    maps, and the most bytes in all (default: this machine's memory); a peer that grants more
    is refused all of them (see :mod:`._shm_maps`).
    """

    capabilities = Capabilities(
        name="shm",
        same_host_only=True,
        mem_types=frozenset({MemType.HOST}),
        serves=TcpTransport.capabilities.serves,
        serve_blocks=TcpTransport.capabilities.serve_blocks,  # (it serves as TCP does)
    )

    def __init__(
        self,
        socket_dir: str | os.PathLike[str] | None = None,
        allowed_uids: Iterable[int] | None = None,
        timeout: float = 2.0,
        copy_lanes: int = 1,
        max_grants: int = 1024,
        max_grant_bytes: int | None = None,
    ) -> None:
        self._lanes = max(1, min(int(copy_lanes), _accel.MAX_LANES))
        self.socket_dir = default_socket_dir(socket_dir)
        self.allowed_uids = None if allowed_uids is None else frozenset(int(u) for u in allowed_uids)
        self.timeout = float(timeout)
        self.limits = GrantLimits(int(max_grants), _memory_size() if max_grant_bytes is None else int(max_grant_bytes))
        if self.limits.grants < 1 or self.limits.nbytes < 1:
            raise ValueError(f"max_grants and max_grant_bytes must be positive, not {max_grants!r}, {max_grant_bytes!r}")
        self._tcp = TcpTransport()
        self._socket = SessionSocket("shm", self.socket_dir, "shm", self._grants, self.timeout, self.allowed_uids)
        self._lock = threading.Lock()
        self._liveness: tuple[int, int] | None = None  # the pipe initiators watch: (read, write)
        self._proven: weakref.WeakKeyDictionary[LinkSession, PeerMemory] = weakref.WeakKeyDictionary()

    # -- target half ----------------------------------------------------------------------------
    def advertise(self, session: ServedSession) -> dict[str, Any]:
        """The boot id, and the socket path if some registered memory is pool memory."""
        info: dict[str, Any] = {"boot_id": _boot_id()}
        if _shareable(session.regions()):
            path = self._socket.offer(session)
            if path is not None:
                info["socket"] = path
        return info

    def _grants(self, session: ServedSession, cred: Credentials) -> list[Message]:
        """A client that proved ``session``'s binding, on the socket's thread: its grants."""
        session.mark_one_sided()  # whatever it said at the handshake: from now on it maps our memory
        liveness = self._liveness_end()
        grants: list[shm_proto.Grant] = []
        fds: list[int] = []
        try:
            for entry, writable in _shareable(session.regions()):
                opened = _shm_pool.open_for_peer(entry, writable)
                if opened is not None:
                    fds.append(opened[0])
                    grants.append(shm_proto.Grant(entry.addr, entry.length, opened[1]))
            messages = shm_proto.encode_grants(session.binding("shm-target"), grants)
            alive = os.dup(liveness)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        log.info("hixl: shm: %d region(s) shared with %s, for the connection from %s", len(grants), cred, session.peer)
        per = shm_proto.MAX_PER_MESSAGE
        answer = [(m, fds[i * per : (i + 1) * per]) for i, m in enumerate(messages)]
        answer[-1][1].append(alive)
        return answer

    def _liveness_end(self) -> int:
        """The read end of the pipe initiators watch (made on first need): it hangs up once this
        process is gone, as the write end is never written and held till :meth:`close`."""
        with self._lock:
            if self._liveness is None:
                self._liveness = os.pipe2(os.O_CLOEXEC)
            return self._liveness[0]

    def serve(self, session: ServedSession, message: Any) -> None:
        """READ and WRITE frames (memory outside the pool, or a peer that maps nothing): as TCP."""
        self._tcp.serve(session, message)

    def serve_small(
        self, session: ServedSession, write: bool, req_id: int, deadline: int, pairs: list[tuple[int, int]], data_len: int
    ) -> None:
        """A small READ or WRITE from its fields: as TCP."""
        self._tcp.serve_small(session, write, req_id, deadline, pairs, data_len)

    def serves_plainly(self) -> bool:
        """As TCP's, which serves them: not for a subclass that serves its own way."""
        return self._serves_as(ShmTransport) and self._tcp.serves_plainly()

    def close(self) -> None:
        """Stop listening and remove the socket; idempotent."""
        self._socket.close()
        with self._lock:
            liveness, self._liveness = self._liveness, None
        for fd in liveness or ():
            os.close(fd)  # initiators' liveness pipes hang up now

    # -- initiator half -------------------------------------------------------------------------
    def probe(self, link: LinkSession) -> str | None:
        """Map the peer's pool memory; ``None`` if some is mapped, else why not (see module docstring)."""
        info = link.welcome.get("transports", {}).get("shm")
        if not isinstance(info, dict):
            return "the peer does not offer shm"
        ours = _boot_id()
        if not ours or info.get("boot_id") != ours:
            return "the peer runs under another kernel (different boot id)"
        path = info.get("socket")
        if path is None:
            return "the peer has no pool memory registered (hixl.empty(..., shared=True)); TCP moves its regions as well"
        if not usable_path(path):
            return "the peer's shm socket path is malformed"
        timeout = probe_timeout(link, self.timeout)
        if timeout <= 0:
            return "no time left before connect's deadline"
        memory = PeerMemory(link, path, self.timeout, self.limits)
        try:
            problem = memory.sync(timeout)
            if problem is None and not memory.maps.items:
                problem = "the peer shared none of its memory with us"
        except BaseException:
            memory.close()
            raise
        if problem is not None:
            memory.close()
            return problem
        self._proven[link] = memory
        return None

    def open(self, link: LinkSession) -> Channel:
        """A channel over the memory :meth:`probe` mapped (and TCP for the rest)."""
        return ShmChannel(self._proven.pop(link), TcpChannel(link), self._lanes)


def _pieces(descs: np.ndarray) -> np.ndarray:
    """``descs`` with every descriptor longer than :data:`CHUNK` cut into pieces of at most that."""
    lens = descs[:, 2]
    if int(lens.max()) <= CHUNK:
        return descs
    counts = (lens + np.uint64(CHUNK - 1)) // np.uint64(CHUNK)
    which = np.repeat(np.arange(len(descs)), counts.astype(np.int64))
    firsts = np.repeat(np.cumsum(counts) - counts, counts.astype(np.int64))
    offsets = (np.arange(len(which), dtype=np.uint64) - firsts) * np.uint64(CHUNK)
    pieces = descs[which].copy()
    pieces[:, 0] += offsets
    pieces[:, 1] += offsets
    pieces[:, 2] = np.minimum(np.uint64(CHUNK), lens[which] - offsets)
    return pieces


class ShmChannel(Channel):
    """Copies through the peer's mapped pool memory; sends everything else over TCP.

    Every copy holds the link's lease from its last check — the mappings are in
    step with the link's table, and the ranges lie in them — to its last byte, and
    checks ``req.cancelled`` under ``req.io_lock`` first, like cma: a REVOKE is
    confirmed (and the mappings it withdrew unmapped) only between two copies.
    """

    def __init__(self, memory: PeerMemory, tcp: TcpChannel, lanes: int = 1) -> None:
        self.link = memory.link
        self._lanes = lanes
        self._small_max = CHUNK * lanes  # the most run_small takes: one window of the general path
        self._memory = memory
        self._tcp = tcp
        self._over_tcp: list[TransferReq] = []  # started over TCP and maybe unfinished
        self._over_tcp_lock = threading.Lock()
        self._next_look = 0.0  # when run_small next polls the socket and the target's liveness

    def start(self, req: TransferReq, op: Op, descs: np.ndarray) -> None:
        """Copy here if every range is mapped, else hand the request to TCP."""
        self._move(req, op, descs, wait=False)

    def run(self, req: TransferReq, op: Op, descs: np.ndarray) -> None:
        """As :meth:`start`; a request that goes over TCP reads its reply on this thread."""
        self._move(req, op, descs, wait=True)

    def _move(self, req: TransferReq, op: Op, descs: np.ndarray, wait: bool) -> None:
        link, memory, write, lanes = self.link, self._memory, op is Op.WRITE, self._lanes
        try:
            link.ensure_alive()
            if not memory.in_step():
                memory.sync(req.remaining())
            pieces = np.ascontiguousarray(_pieces(descs), dtype=np.uint64)  # (as copy_pieces takes them)
            # An order in which blocks of a batch copy faster (see hixl._accel); the remote column
            # stands for where it is mapped here (the same order within one mapping).
            order = _accel.batch_order(*((pieces[:, 1], pieces[:, 0]) if write else (pieces[:, 0], pieces[:, 1])), pieces[:, 2])
            if order is not None:
                pieces = pieces[order]
            ends = np.cumsum(pieces[:, 2], dtype=np.uint64)
            stream = len(ends) > 0 and int(ends[-1]) >= _accel.STREAM_FROM  # each window past the caches
            done, plan, fenced = 0, None, False
            while done < len(pieces):
                if req.deadline is not None and time.monotonic() >= req.deadline:
                    req.done()  # looking at it past its deadline makes it TIMEOUT
                    return
                stale = unmapped = False
                link.poll_input()
                with req.io_lock:
                    if req.cancelled:
                        return
                    with link.regions.lease.shared(req.deadline):
                        if not memory.alive():
                            raise PeerDisconnected(f"{link.remote_engine}: the target process is gone")
                        if not memory.in_step():
                            stale = True
                        else:
                            if plan is None or plan[0] != memory.maps.version:
                                here = memory.maps.translate(pieces[done:, 1], pieces[done:, 2], write)
                                plan = None if here is None else (memory.maps.version, done, here)
                            if plan is None:
                                unmapped = True
                            elif fenced:
                                # Up to CHUNK bytes a lane under one hold, split over the lanes inside
                                # one call (it returns once every lane has ended): a REVOKE or a
                                # cancel waits for about one chunk's time, as with one lane.
                                start = int(ends[done - 1]) if done else 0
                                end = min(done + _WINDOW, int(np.searchsorted(ends, start + CHUNK * lanes, side="right")))
                                end = max(end, done + 1)
                                _accel.copy_pieces(pieces[done:end], plan[2][done - plan[1] : end - plan[1]], write, lanes, stream)
                                done = end
                                continue
                if stale:
                    # The peer's regions changed under the request: catch up (outside the locks: it
                    # may ask the peer), and go on only if what is left is still registered.
                    memory.sync(req.remaining())
                    link.regions.check(pieces[done:, 1], pieces[done:, 2], write)
                elif unmapped:
                    self._over_tcp_start(req, op, pieces[done:], wait)
                    return
                else:
                    self._wait_for_earlier_tcp(req)
                    fenced = True
        except HixlError as exc:
            req.fail(exc)
        else:
            req.complete()

    def read_rows(
        self, req: TransferReq, local_addr: int, remote_addr: int, stride: int, rows: np.ndarray, span: tuple[int, int],
        checked: CheckedRows | None = None,
    ) -> int:
        """A gather whose span lies in one mapping: one :func:`~hixl._accel.gather_rows` call under
        one hold of the lease (as one window of the general path, so at most ``CHUNK`` bytes a lane),
        or with ``checked``, on a machine that keeps loads in order, one
        :func:`~hixl._accel.gather_checked_rows` (each row checked as it is copied, straight into
        ``checked.out``);
        anything else as the descriptors it stands for.

        A parameter server's batch is a thousand rows of a few hundred bytes: per descriptor, the
        general path's steps (pieces, order, translation) cost several times the copy. Here the
        span is found in the mappings once, and the C call finds each row from its number.
        """
        memory, link = self._memory, self.link
        torn = -1
        if len(rows) * stride <= self._small_max and not (self._over_tcp and self._tcp_unfinished()):
            try:
                link.ensure_alive()
                if not memory.in_step():  # (as the general path: catch up first, outside the locks)
                    memory.sync(req.remaining())
                link.poll_input()  # (a REVOKE waiting on the socket is taken first)
                with req.io_lock:
                    if req.cancelled:
                        return -1
                    lease = link.regions.lease
                    token = lease.enter()  # (its context manager's steps, without one: a batch is ~0.1 ms)
                    if not token:  # a REVOKE is under way: wait it out
                        lease.wait_out_revoke(req.deadline)
                        token = lease.enter()
                    try:
                        here = memory.maps.find(*span, False) if token and memory.alive() and memory.in_step() else -1
                        if here >= 0:  # (where row 0 would be mapped, modulo 2**64: rows start at span's)
                            base = (here - span[0] + remote_addr) % (1 << 64)
                            if checked is not None and _accel.ORDERED_ROW_READS and not base % 8:
                                torn = _accel.gather_checked_rows(
                                    base, stride, rows, checked.limit, checked.row_bytes, checked.out, checked.versions,
                                    checked.torn, checked.check,
                                )
                            else:
                                if checked is not None and (int(rows.min()) < 0 or int(rows.max()) >= checked.limit):
                                    raise ValueError(f"rows must be in [0, {checked.limit})")
                                _accel.gather_rows(local_addr, base, stride, rows)
                    finally:
                        lease.leave(token)
            except HixlError as exc:
                req.fail(exc)
                return -1
            if here >= 0:
                req.complete()
                return torn
        return super().read_rows(req, local_addr, remote_addr, stride, rows, span, checked)

    def _over_tcp_start(self, req: TransferReq, op: Op, descs: np.ndarray, wait: bool) -> None:
        with self._over_tcp_lock:
            self._over_tcp = [r for r in self._over_tcp if not r.done()]
            self._over_tcp.append(req)
        (self._tcp.run if wait else self._tcp.start)(req, op, descs)

    def _tcp_unfinished(self) -> list[TransferReq]:
        with self._over_tcp_lock:
            self._over_tcp = [r for r in self._over_tcp if not r.done()]
            return list(self._over_tcp)

    def _wait_for_earlier_tcp(self, req: TransferReq) -> None:
        """Let the TCP requests started before ``req`` finish first (so they take effect first)."""
        for earlier in self._tcp_unfinished():
            if earlier is not req:
                try:
                    earlier.wait(req.remaining())
                except HixlError:
                    pass  # its own failure is its caller's; this request still goes ahead

    def run_small(
        self, op: Op, descs: list[tuple[int, int, int]], nbytes: int, timeout: float, checked: RemoteRegions
    ) -> bool:
        """The latency path: a few ranges, all mapped, copied at once; none mapped: TCP's latency path.

        Every step is on the path of an 8-byte ``transfer_sync``, and at 1 MiB the Python around
        the copy still shows (the two buffers just fit in a core's L2, and the copy leaves the
        interpreter's own data cold), hence the inlined checks and one call for find-and-copy.
        It takes as much as one window of the general path (``CHUNK`` bytes a lane), split over
        the lanes inside that call: the general path's Python, ~80 us, was half of a 4 MiB copy.
        """
        memory = self._memory
        if nbytes > self._small_max or (self._over_tcp and self._tcp_unfinished()):
            return False  # the general path cuts it into windows / waits for those first
        link = self.link
        now = time.monotonic()
        if now >= self._next_look:  # (both look at most once a millisecond themselves: one clock read)
            self._next_look = now + _LOOK_EVERY
            link.poll_input()  # a REVOKE must not wait for a reader thread this loop keeps from the GIL
            if not memory.alive():
                return False  # the general path reports it
            if nbytes < _accel.GIL_FREE_FROM:
                # A loop of small copies never blocks, and CPython hands the GIL to a thread that
                # waits for it only every 5 ms: one that needs it a few times (the link's reader
                # with a REVOKE, the application's other threads) would wait seconds. Asleep a
                # moment every millisecond, this one lets them run.
                time.sleep(_YIELD)
        regions = link.regions
        token = regions.lease.enter()
        if not token:
            return False  # a REVOKE is under way: the general path waits for it
        try:
            if regions.table is not memory.synced or link.state is not _CONNECTED:
                return False  # the general path catches up first (or reports what happened)
            # From LANE_FROM, over the lanes, as one window of the general path; below, one lane
            # without saying so (one more argument after the * costs a small copy ~15 ns).
            if nbytes < _LANE_FROM:
                copied = _accel.mapped_copy(descs, op is _WRITE, *memory.maps.index)
            else:
                copied = _accel.mapped_copy(descs, op is _WRITE, *memory.maps.index, self._lanes)
        finally:
            regions.lease.leave(token)
        if copied == 0:
            return self._tcp.run_small(op, descs, nbytes, timeout, checked)
        return copied == 1  # (-1: some mapped, some not: the general path sends it all over TCP)

    def close(self) -> None:
        """Unmap the peer's memory."""
        self._memory.close()
        self._tcp.close()

    def __repr__(self) -> str:
        return f"<ShmChannel {self.link.remote_engine} {self._memory!r}>"
