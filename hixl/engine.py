"""The Engine: registration, connections, one-sided transfers and notifications.

An engine plays two roles at once. As a *target* (when given ``"ip:port"``) it
listens and lets connected initiators read and write the memory it
registered; its application code never takes part. As an *initiator* it
connects to targets and moves bytes with :meth:`Engine.transfer_sync` /
:meth:`Engine.transfer_async`, over the best transport that passes its probe
for that peer (cross-memory attach on the same host, else shared memory, else TCP).

Every argument is validated — addresses, op, descriptor shape, and every
descriptor's local *and* remote range against the registrations on each side
— before any byte moves. Every blocking call takes a timeout.
"""

from __future__ import annotations

import collections
import json
import logging
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import _accel
from . import _protocol as proto
from ._aio import Wakes, wait_until
from ._exceptions import (
    AlreadyConnected,
    HixlError,
    HixlTimeout,
    MemoryRangeError,
    NotConnected,
    ParamInvalid,
    ProtocolError,
    ResourceExhausted,
    Unsupported,
)
from ._memory import OwnView, Registry, as_desc_array, merge_adjacent
from ._options import DEFAULT_OPTIONS, EngineOptions, is_loopback
from ._protocol.connection import Connection, Role
from ._request import TransferReq
from ._session.address import boot_id as _boot_id
from ._session.address import format_address, parse_address
from ._session.initiator import LinkState, PeerLink, handshake
from ._session.backend import NetworkBackend, TcpBackend
from ._session.target import ServerLimits, TargetServer
from ._session.wire import Wire
from ._types import (
    CheckedRows,
    MemDesc,
    MemHandle,
    MemType,
    NotifyDesc,
    Op,
    TransferOpDesc,
    TransferStatus,
)
from .discovery import MetadataStore, open_store
from .transports import default_transports
from .transports.base import Channel, Transport, row_descs

__all__ = ["DEFAULT_OPTIONS", "ENGINES_PREFIX", "Engine"]

log = logging.getLogger("hixl")

#: Up to this many descriptors, ``transfer_sync`` takes the latency path: checked
#: in one call of hixl._accel, without numpy, whose per-call overhead would cost more than the copy.
#: (Any size: up to IOV_MAX descriptors are one syscall on either path.)
_SMALL_BATCH = proto.frames.SMALL_DESCS

#: Where a listening engine with a ``metadata_server`` publishes ``{address, incarnation, boot_id}``
#: (JSON), under the key ``ENGINES_PREFIX + "ip:port"``, for as long as it lives.
ENGINES_PREFIX = "/hixl/engines/"
_DESC_TYPES = (list, tuple, TransferOpDesc)
_SMALL_TYPES = (np.ndarray, *_DESC_TYPES)
_READ, _WRITE = Op.READ, Op.WRITE  # (a module global is read ten times faster than an Enum member)

class _Peer:
    """What the engine keeps per connected target: link, channel, async queue."""

    def __init__(
        self, link: PeerLink, channel: Channel, transport: Transport, max_inflight: int, registry: OwnView
    ) -> None:
        self.link = link
        self.channel = channel
        self.latency_path = channel.latency_path(registry)
        """The channel's whole latency path in one call, if it has one (see Channel.latency_path)."""
        self.transport = transport
        self.max_inflight = max_inflight
        self.checked_span: tuple[object, int, int] | None = None
        """(the peer's regions table, start, length) of the last read_rows span found inside them."""
        self._inflight: set[TransferReq] = set()
        self._queue: queue.SimpleQueue[list[tuple[TransferReq, Op, np.ndarray]] | threading.Event | None] = (
            queue.SimpleQueue()
        )
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, transfers: list[tuple[TransferReq, Op, np.ndarray]]) -> None:
        """Queue validated async transfers (descriptors not yet merged); they start in order.

        Raises :class:`ResourceExhausted` (queuing nothing) if that would put more than
        ``max_inflight`` unfinished requests in flight to this peer.
        """
        with self._lock:
            self._inflight = {r for r in self._inflight if not r.done()}
            if len(self._inflight) + len(transfers) > self.max_inflight:
                raise ResourceExhausted(
                    f"{len(self._inflight)} requests to {self.link.remote_engine} are still in flight "
                    f"(max_inflight={self.max_inflight}); wait for some first"
                )
            self._inflight.update(req for req, _, _ in transfers)
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._work, name=f"hixl-async-{self.link.remote_engine}", daemon=True
                )
                self._worker.start()
            self._queue.put(transfers)

    def flush(self, timeout: float) -> None:
        """Wait until every async transfer queued so far has been started."""
        if self._worker is None:
            return
        marker = threading.Event()
        self._queue.put(marker)
        if not marker.wait(timeout):
            raise HixlTimeout(f"earlier transfers to {self.link.remote_engine} did not start within {timeout} s")

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, threading.Event):
                item.set()
                continue
            for req, op, descs in item:
                if req.status is TransferStatus.WAITING:
                    try:
                        # Merged here, not by the caller: the caller returns sooner.
                        self.channel.start(req, op, merge_adjacent(descs))
                    except Exception as exc:  # never leave a request WAITING forever
                        log.exception("hixl: transfer crashed")
                        req.fail(HixlError(f"internal error: {exc!r}"))

    def close(self) -> None:
        """Stop the async worker and close the link."""
        self.link.close()
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(5.0)
        self.channel.close()


class Engine:
    """A hixl engine; see the module docstring. Use as a context manager or call :meth:`finalize`.

    ``local_engine`` is ``"ip:port"`` to listen on exactly that address (port 0
    picks a free one; :attr:`local_engine` then reports it) or ``"ip"`` alone for
    a client-only engine. ``options`` override :data:`DEFAULT_OPTIONS`.
    ``transports`` replaces the built-in list (most preferred first).
    ``network_backend`` is where the engine gets its sockets (connect and listen;
    default: :class:`hixl.TcpBackend`; see :class:`hixl.NetworkBackend`).
    """

    def __init__(
        self,
        local_engine: str,
        options: dict[str, Any] | None = None,
        *,
        transports: Sequence[Transport] | None = None,
        network_backend: NetworkBackend | None = None,
    ) -> None:
        self._server: TargetServer | None = None
        self._network = network_backend if network_backend is not None else TcpBackend()
        self._finalized = True  # until constructed: nothing for finalize() to do
        parsed = EngineOptions.parse(options)
        self.options = parsed.public
        """The options in force (``auth_secret`` shows as a redacted placeholder)."""
        self._secret = parsed.secret
        host, port = parse_address(local_engine)
        if port is not None and self._secret is None and not is_loopback(host) and not self.options["allow_unauthenticated"]:
            raise ParamInvalid(
                f"refusing to listen on {local_engine!r} without a shared secret: anyone who can reach it could "
                "read and write registered memory. Set the auth_secret option (or HIXL_AUTH_SECRET) on every "
                "engine, listen on a loopback address, or pass allow_unauthenticated=True to accept the risk"
            )
        self._transports = list(transports) if transports is not None else default_transports(int(self.options["copy_lanes"]))
        try:
            self._check_transport_option()
        except ParamInvalid:
            for transport in self._transports:  # they may hold descriptors (cma's generation page)
                transport.close()
            raise
        self._id = secrets.token_hex(8)
        self._registry = Registry(int(self.options["max_registrations"]))
        self._registry.listeners.append(self._regions_changed)
        self._notifies: collections.deque[NotifyDesc] = collections.deque()
        self._notify_bytes = 0
        # What each connection (NotifyDesc.sender) holds of the queue: its count and bytes.
        self._notifies_of: collections.Counter[str] = collections.Counter()
        self._notify_bytes_of: collections.Counter[str] = collections.Counter()
        self._handlers: dict[str, Callable[[NotifyDesc], None]] = {}
        # One condition over the deque: blocking waiters sleep on it; asyncio waiters
        # subscribe a wake-up instead, so no thread is spent on them.
        self._notify_lock = threading.Condition()
        self._notify_wakes = Wakes()
        self._peers: dict[str, _Peer] = {}
        self._peers_lock = threading.Lock()
        if port is not None:
            o = self.options
            limits = ServerLimits(
                heartbeat_interval=o["heartbeat_interval"],
                heartbeat_misses=o["heartbeat_misses"],
                hello_timeout=o["hello_timeout"],
                handshake_timeout=o["handshake_timeout"],
                frame_timeout=o["frame_timeout"],
                request_time_cap=o["transfer_timeout"],
                max_handshakes=o["max_handshakes"],
                max_handshakes_per_source=o["max_handshakes_per_source"],
                max_connections=o["max_connections"],
                max_connections_per_peer=o["max_connections_per_peer"],
                serve_threads=o["serve_threads"],
                busy_poll=o["busy_poll"],
                allowed_networks=parsed.networks,
            )
            identity = {"engine_id": self._id, "boot_id": _boot_id()}
            try:
                self._server = TargetServer(
                    host,
                    port,
                    self._registry,
                    self._accept_notify,
                    self._handlers.__contains__,
                    self._transports,
                    limits,
                    self._secret,
                    identity,
                    self._network,
                    encrypt=self.options["encrypt"],
                )
            except OSError as exc:
                for transport in self._transports:
                    transport.close()
                raise ParamInvalid(f"cannot listen on {local_engine!r}: {exc}") from exc
        self.local_engine = self._server.address if self._server else host
        """The real ``"ip:port"`` this engine listens on (or ``"ip"`` if client-only)."""
        self._store: MetadataStore | None = None
        try:
            self._store = self._open_store()
        except BaseException:
            if self._server is not None:
                self._server.close()
            for transport in self._transports:
                transport.close()
            raise
        self._finalized = False

    def _open_store(self) -> MetadataStore | None:
        """Connect to the ``metadata_server`` (if any) and publish this engine there (if it listens)."""
        url = self.options["metadata_server"]
        if url is None:
            return None
        store = open_store(url, self.options["lease_ttl"], float(self.options["connect_timeout"]))
        if self._server is not None:
            record = {"address": self.local_engine, "incarnation": self._id, "boot_id": _boot_id()}
            try:
                store.put_owned(ENGINES_PREFIX + self.local_engine, json.dumps(record).encode())
            except BaseException:
                store.close()
                raise
        return store

    @property
    def metadata_store(self) -> MetadataStore | None:
        """The metadata store this engine publishes itself in (the ``metadata_server`` option), or None."""
        return self._store

    def _check_transport_option(self) -> None:
        wanted = self.options["transport"]
        names = [t.capabilities.name for t in self._transports]
        if wanted != "auto" and wanted not in names:
            raise ParamInvalid(f"unknown transport {wanted!r}; choose 'auto' or one of {names}")

    # -- memory --------------------------------------------------------------------------
    def register_mem(self, buf: Any, mem_type: MemType = MemType.HOST, access: str = "rw") -> MemHandle:
        """Register memory that connected peers may read and (with ``access="rw"``) write.

        ``buf`` is a numpy array, a torch CPU tensor, a bytearray/memoryview/mmap,
        or a :class:`MemDesc`. ``access="r"`` lets peers only READ it (a WRITE into
        it is refused with :class:`AccessDenied`, on every transport) and accepts
        read-only buffers; this engine may still WRITE *from* it, and READ *into*
        it unless the buffer itself is read-only (a raw :class:`MemDesc` counts
        as writable: the caller's word). Idempotent for
        the same range. Peers already connected see the new region too. The
        caller keeps ``buf`` alive while it is registered (hixl holds a
        reference for objects, not for a raw :class:`MemDesc`).
        """
        self._check_open()
        return self._registry.register(buf, mem_type, access)

    def deregister_mem(self, handle: MemHandle) -> None:
        """Withdraw a registration. When this returns, no peer moves a byte into or out of it.

        New requests for the range are refused at once. Then every connected peer
        is told and must confirm within the ``deregister_timeout`` option that its
        same-host copies have stopped (one that does not is disconnected), and
        requests this engine is serving in the range (TCP) are waited for, or cut
        off (their connection closed) once the timeout has passed.
        """
        self.deregister_mems([handle])

    def deregister_mems(self, handles: Sequence[MemHandle]) -> None:
        """Withdraw several registrations at once, with :meth:`deregister_mem`'s guarantee for each.

        One change of the registrations and one round of confirmations from the
        peers, however many handles: withdrawing a hundred small ranges costs
        about what withdrawing one does. All or nothing: if one handle is not
        registered (or is named twice), :class:`ParamInvalid` and none is
        withdrawn. An empty list does nothing.
        """
        self._check_open()
        handles = list(handles)
        for handle in handles:
            if not isinstance(handle, MemHandle):
                raise ParamInvalid(f"expected MemHandles, got a {type(handle).__name__}")
        if not handles:
            return
        self._registry.deregister_many(handles)
        if self._server is not None:
            self._server.revoke(
                self._registry.generation, [(h.addr, h.len) for h in handles], float(self.options["deregister_timeout"])
            )

    def _regions_changed(self, table: object, generation: int) -> None:
        for transport in self._transports:
            transport.regions_changed(generation)

    def local_mems(self) -> list[MemDesc]:
        """This engine's registered regions."""
        return [MemDesc(a, n) for a, n, _ in self._registry.regions()]

    # -- connections ---------------------------------------------------------------------
    def connect(self, remote_engine: str, timeout: float | None = None) -> None:
        """Connect to the target ``"ip:port"``, authenticate, and pick a transport for it.

        A refused connection (the target not listening yet) is retried until
        ``timeout`` (default: the ``connect_timeout`` option) unless the
        ``connect_fail_fast`` option is set. Connecting again to a peer whose link broke
        replaces that link. Raises :class:`ParamInvalid` for a
        malformed address or for this engine itself, :class:`AlreadyConnected`,
        :class:`NotConnected` if nobody answers, :class:`AuthenticationFailed` if
        either side fails the shared-secret proof, :class:`EncryptionMismatch` if only
        one of the two engines has the ``encrypt`` option, :class:`HixlTimeout` if the
        handshake is too slow, :class:`ResourceExhausted` if the target is at its
        connection limit, and :class:`Unsupported` if a forced transport can't
        reach the peer.
        """
        self._check_open()
        host, port = parse_address(remote_engine, require_port=True)
        assert port is not None
        name = format_address(host, port)
        if self._server is not None and name == self.local_engine:
            raise ParamInvalid(f"an engine cannot connect to itself ({name})")
        timeout = float(self.options["connect_timeout"] if timeout is None else timeout)
        if timeout <= 0:
            raise ParamInvalid(f"timeout must be positive, not {timeout}")
        with self._peers_lock:
            stale = self._peers.get(name)
            if name in self._peers and (stale is None or stale.link.state is LinkState.CONNECTED):
                raise AlreadyConnected(f"already connected to {name}")
            self._peers[name] = None  # type: ignore[assignment]  # reserve the name
        if stale is not None:
            # The link broke (the peer died, or restarted): a new connection is a new peer —
            # its incarnation, regions and everything learned from the old one start afresh.
            stale.close()
        try:
            peer = self._open_peer(name, host, port, timeout)
        except BaseException:
            with self._peers_lock:
                self._peers.pop(name, None)
            raise
        with self._peers_lock:
            self._peers[name] = peer

    def _dial(self, name: str, host: str, port: int, deadline: float) -> socket.socket:
        """A connected socket, retrying a refused connection until ``deadline`` (unless fail-fast)."""
        pause = 0.01
        while True:
            left = deadline - time.monotonic()
            try:
                return self._network.connect(host, port, max(0.001, left))
            except TimeoutError as exc:
                raise HixlTimeout(f"connecting to {name} timed out") from exc
            except ConnectionRefusedError as exc:
                if self.options["connect_fail_fast"] or time.monotonic() + pause >= deadline:
                    raise NotConnected(f"cannot connect to {name}: nobody listens there ({exc.strerror})") from exc
            except OSError as exc:
                raise NotConnected(f"cannot connect to {name}: {exc.strerror or exc}") from exc
            time.sleep(pause)
            pause = min(0.2, pause * 2)

    def _open_peer(self, name: str, host: str, port: int, timeout: float) -> _Peer:
        deadline = time.monotonic() + timeout
        sock = self._dial(name, host, port, deadline)
        interval, misses = float(self.options["heartbeat_interval"]), int(self.options["heartbeat_misses"])
        wire = Wire(sock, Connection(Role.INITIATOR, self._secret, encrypt=self.options["encrypt"]), name, interval, misses)
        wire.busy_poll = float(self.options["busy_poll"])
        try:
            hello = self._hello_info()
            handshake(wire, hello, deadline)
            if wire.conn.peer_info.get("engine_id") == self._id:
                raise ParamInvalid(f"an engine cannot connect to itself ({name})")
        except BaseException:
            wire.close()
            raise
        link = PeerLink(name, wire, deadline)
        try:
            transport = self._choose_transport(link)
            channel = transport.open(link)
        except BaseException:
            link.close()
            raise
        # An idle link may ping slowly only if all its traffic goes through the socket, and only if
        # the target knows it will (it allows for that when we said we are two-sided, or are on
        # another host): see Wire.idle_ping and the target's liveness check.
        said_two_sided = not hello["one_sided"]
        elsewhere = link.welcome.get("boot_id") != _boot_id()
        if not transport.capabilities.one_sided and (said_two_sided or elsewhere):
            wire.idle_ping = float(self.options["idle_ping_interval"])
        return _Peer(link, channel, transport, int(self.options["max_inflight"]), self._registry.own)

    def _hello_info(self) -> dict[str, Any]:
        """What this initiator tells a target about itself once proven: who it is, its host, and
        whether it may reach the target's memory one-sidedly (so must confirm deregistrations)."""
        wanted = self.options["transport"]
        one_sided = any(t.capabilities.one_sided for t in self._transports if wanted in ("auto", t.capabilities.name))
        return {
            "engine": self.local_engine,
            "engine_id": self._id,
            "boot_id": _boot_id(),
            "one_sided": one_sided,
            "idle_ping": float(self.options["idle_ping_interval"]),
        }

    def _choose_transport(self, link: PeerLink) -> Transport:
        """The first transport, in order of preference, whose declared capabilities fit and whose probe passes."""
        wanted = self.options["transport"]
        same_host = link.welcome.get("boot_id") == _boot_id()
        reasons: list[str] = []
        for transport in self._transports:
            caps = transport.capabilities
            if wanted not in ("auto", caps.name):
                continue
            if caps.same_host_only and not same_host:
                reason: str | None = "the peer runs on another host"
            elif MemType.HOST not in caps.mem_types:
                reason = "it moves no host memory"
            else:
                reason = transport.probe(link)
            if reason is None:
                if reasons:
                    log.info("hixl: %s uses %s (%s)", link.remote_engine, caps.name, "; ".join(reasons))
                return transport
            reasons.append(f"{caps.name} unusable: {reason}")
            log.info("hixl: %s: %s unusable: %s", link.remote_engine, caps.name, reason)
        raise Unsupported(f"no transport reaches {link.remote_engine}: {'; '.join(reasons)}")

    def disconnect(self, remote_engine: str) -> None:
        """Close the connection to ``remote_engine``; pending transfers fail."""
        self._check_open()
        name = self._canonical(remote_engine)
        with self._peers_lock:
            peer = self._peers.get(name)
            if peer is None:
                raise NotConnected(f"not connected to {name}")
            del self._peers[name]
        peer.close()

    def remote_mems(self, remote_engine: str) -> list[MemDesc]:
        """The regions ``remote_engine`` has registered, fetched fresh from it."""
        peer = self._peer(remote_engine)
        peer.link.refresh_regions(float(self.options["connect_timeout"]))
        return list(peer.link.regions.table.regions)

    @property
    def incarnation(self) -> str:
        """This engine's incarnation: a fresh random id for every engine ever started, so a
        peer restarted at the same ``"ip:port"`` is told apart from the one before it."""
        return self._id

    def peer_incarnation(self, remote_engine: str) -> str:
        """The incarnation of the connected ``remote_engine`` (as its authenticated WELCOME said)."""
        return str(self._peer(remote_engine).link.welcome.get("engine_id", ""))

    def transport_of(self, remote_engine: str) -> str:
        """Name of the transport chosen for ``remote_engine`` (``"cma"``, ``"tcp"``, ...)."""
        return self._peer(remote_engine).transport.capabilities.name

    def connected_engines(self) -> list[str]:
        """Names of the targets this engine is connected to."""
        with self._peers_lock:
            return [name for name, peer in self._peers.items() if peer is not None]

    # -- transfers -----------------------------------------------------------------------
    def transfer_sync(
        self, remote_engine: str, op: Op, op_descs: Any, timeout: float | None = None
    ) -> None:
        """Move the bytes of ``op_descs`` and return once they have all landed.

        ``op_descs`` is a list of :class:`TransferOpDesc` or an (N, 3) integer
        array of (local_addr, remote_addr, len). Raises :class:`MemoryRangeError`
        before any byte moves if a range is outside registered memory,
        :class:`TransferTimeout` past ``timeout`` seconds, and
        :class:`PeerDisconnected` if the peer goes away.
        """
        # The latency path, inline (a call costs a few hundred ns once a large copy left the caches
        # cold): a few descriptors checked in one call of hixl._accel and handed to the channel at
        # once, or (a channel with a latency path of its own, cma) handed over unchecked, for it to
        # check and copy in that one call. Anything it does not take — bad input included — goes
        # the general way, which also produces every error message; the channel raises only what
        # the transfer itself ran into.
        peer = self._peers.get(remote_engine)
        if peer is not None and (timeout is None or timeout > 0) and not self._finalized:
            whole = peer.latency_path
            if whole is not None and type(op_descs) is list:
                if whole(op, op_descs):
                    return
            elif type(op_descs) in _SMALL_TYPES and 0 < len(op_descs) <= _SMALL_BATCH and (op is _READ or op is _WRITE):
                small = op_descs
                if type(small) is np.ndarray:
                    small = small.tolist() if small.ndim == 2 and small.shape[1] == 3 and small.dtype.kind in "iu" else None
                if whole is not None:
                    if whole(op, small):
                        return
                else:
                    # A READ writes into local memory, a WRITE into the peer's: those sides must be writable.
                    checked = peer.link.regions.table
                    if op is _WRITE:
                        local, remote = self._registry.own.table.readable, checked.writable
                    else:
                        local, remote = self._registry.own.table.writable, checked.readable
                    total = _accel.check_small(small, *local.intervals, *remote.intervals)
                    limit = float(self.options["transfer_timeout"]) if timeout is None else timeout
                    if total is not None and peer.channel.run_small(op, small, total, limit, checked):
                        return
        peer, req, op, descs = self._prepare(remote_engine, op, op_descs, timeout)
        peer.channel.run(req, op, merge_adjacent(descs))
        req.wait()

    def read_rows(
        self,
        remote_engine: str,
        local_addr: int,
        remote_addr: int,
        stride: int,
        rows: Any,
        timeout: float | None = None,
        *,
        checked: CheckedRows | None = None,
    ) -> int | None:
        """READ rows ``rows`` of the peer's table of ``stride``-byte rows at ``remote_addr`` into
        consecutive ``stride``-byte slots from ``local_addr`` (row ``rows[i]`` into slot ``i``);
        return once all have landed.

        A gather — a parameter server's worker fetching a batch of rows — moves exactly what
        :meth:`transfer_sync` of the descriptors ``(local_addr + i * stride, remote_addr + rows[i] *
        stride, stride)`` moves, with its guarantees and errors, but is checked as two ranges: the
        slots here (registered) and the peer's span from the lowest row asked for to the end of the
        highest (inside one of its regions). A transport may then move it its own way (shm: one
        copy call under one hold of the link's lease). A batch that passes neither check takes
        :meth:`transfer_sync`'s path, which names the descriptor outside. ``rows``: integers in an
        array of one dimension; :class:`ParamInvalid` for anything else, a negative row, a
        ``stride`` < 1 or ranges past the 64-bit address space.

        With ``checked`` (:class:`CheckedRows`: rows that say whether they were read whole), the
        peer's span is its whole table, ``checked.limit`` rows (:class:`ParamInvalid` for a row
        number past it), and the rows are checked and handed over as they are copied where the
        transport can (shm on x86-64): returns how many are torn, else -1 (see :class:`CheckedRows`).
        Without, returns None.
        """
        self._check_open()
        numbers = np.asarray(rows)
        if numbers.ndim != 1 or (len(numbers) and numbers.dtype.kind not in "iu"):
            raise ParamInvalid("rows must be an integer array of one dimension")
        numbers = np.ascontiguousarray(numbers, dtype=np.int64)
        if not isinstance(stride, int) or stride < 1:
            raise ParamInvalid(f"stride must be a positive int, not {stride!r}")
        if not len(numbers):
            return None if checked is None else 0
        if checked is None:
            lo, hi = int(numbers.min()), int(numbers.max())
        else:  # the whole table: the copy checks each row number against the limit (no pass over them here)
            if not isinstance(checked.limit, int) or checked.limit < 1:
                raise ParamInvalid(f"checked.limit must be a positive int, not {checked.limit!r}")
            lo, hi = 0, checked.limit - 1
        first, span, nbytes = remote_addr + lo * stride, (hi - lo + 1) * stride, len(numbers) * stride
        if lo < 0 or min(local_addr, remote_addr) < 0 or max(local_addr + nbytes, first + span) > 1 << 64:
            raise ParamInvalid(f"rows {lo}..{hi} of {stride} bytes at {remote_addr:#x} into {local_addr:#x} are not addresses")
        peer = self._peer(remote_engine)
        limit = float(self.options["transfer_timeout"] if timeout is None else timeout)
        if not limit > 0:
            raise ParamInvalid(f"timeout must be positive, not {timeout}")
        if self._registry.own.table.writable.contains(local_addr, nbytes):
            try:
                # A parameter server's worker gathers from the same table batch after batch: the span is
                # checked again only once the peer's regions (a new table, never one changed in place) did.
                regions = peer.link.regions.table
                if peer.checked_span != (regions, first, span):
                    peer.channel.check_remote(np.array([first], np.uint64), np.array([span], np.uint64), limit, False)
                    peer.checked_span = (peer.link.regions.table, first, span)
            except MemoryRangeError:
                pass  # rows in several regions (or some outside): transfer_sync's checks tell which
            else:
                req = TransferReq(peer.link.remote_engine, Op.READ, len(numbers), nbytes, limit)
                try:
                    torn = peer.channel.read_rows(req, local_addr, remote_addr, stride, numbers, (first, span), checked)
                except ValueError as exc:  # a row number the copy refused: nothing was copied
                    raise ParamInvalid(str(exc)) from None
                req.wait()
                return None if checked is None else torn
        if checked is not None and (int(numbers.min()) < 0 or int(numbers.max()) >= checked.limit):
            raise ParamInvalid(f"rows must be in [0, {checked.limit})")
        self.transfer_sync(remote_engine, Op.READ, row_descs(local_addr, remote_addr, stride, numbers), limit)
        return None if checked is None else -1

    def transfer_async(
        self, remote_engine: str, op: Op, op_descs: Any, timeout: float | None = None
    ) -> TransferReq:
        """Start a transfer and return its :class:`TransferReq` at once.

        Validation errors are raised here, synchronously; failures later are
        reported by the request's status and ``wait()``. Requests to one peer
        start in submission order.
        """
        peer, req, op, descs = self._prepare(remote_engine, op, op_descs, timeout)
        peer.submit([(req, op, descs)])
        return req

    def transfer_async_split(
        self, remote_engine: str, op: Op, op_descs: Any, counts: Sequence[int], timeout: float | None = None
    ) -> list[TransferReq]:
        """Start consecutive groups of ``op_descs`` as separate requests, in order, in one call.

        Group ``i`` is the next ``counts[i]`` descriptors. Everything is validated
        at once, here, and handed to the peer's async worker as one item: the
        call returns at once and the first group starts while later ones are
        still queued behind it. This is how DataDist streams a cache layer by
        layer — ``reqs[i].wait()`` returns as soon as group ``i`` landed.
        """
        peer, op, descs, timeout = self._validate(remote_engine, op, op_descs, timeout)
        sizes = np.asarray(counts, dtype=np.int64)
        if sizes.ndim != 1 or len(sizes) == 0 or (sizes <= 0).any() or int(sizes.sum()) != len(descs):
            raise ParamInvalid(f"counts must be positive and add up to the {len(descs)} descriptors")
        groups = np.split(descs, np.cumsum(sizes)[:-1])
        name = peer.link.remote_engine
        reqs = [TransferReq(name, op, len(g), int(g[:, 2].sum()), timeout) for g in groups]
        peer.submit([(req, op, group) for req, group in zip(reqs, groups)])
        return reqs

    def get_transfer_status(self, req: TransferReq) -> TransferStatus:
        """The current status of ``req`` (same as ``req.status``)."""
        if not isinstance(req, TransferReq):
            raise ParamInvalid(f"expected a TransferReq, got {type(req).__name__}")
        return req.status

    def _prepare(
        self, remote_engine: str, op: Op, op_descs: Any, timeout: float | None
    ) -> tuple[_Peer, TransferReq, Op, np.ndarray]:
        """Validate a transfer and make its request; descriptors come back not yet merged."""
        peer, op, descs, timeout = self._validate(remote_engine, op, op_descs, timeout)
        req = TransferReq(peer.link.remote_engine, op, len(descs), int(descs[:, 2].sum()), timeout)
        return peer, req, op, descs

    def _validate(
        self, remote_engine: str, op: Op, op_descs: Any, timeout: float | None
    ) -> tuple[_Peer, Op, np.ndarray, float]:
        peer = self._peer(remote_engine)
        try:
            op = Op(op)
        except ValueError:
            raise ParamInvalid(f"op must be Op.READ or Op.WRITE, not {op!r}") from None
        timeout = float(self.options["transfer_timeout"] if timeout is None else timeout)
        if timeout <= 0:
            raise ParamInvalid(f"timeout must be positive, not {timeout}")
        descs = as_desc_array(op_descs)
        self._registry.own.table.check(
            descs[:, 0], descs[:, 2], op is Op.READ, "local", hint="did you register it with register_mem?"
        )
        peer.channel.check_remote(descs[:, 1], descs[:, 2], timeout, op is Op.WRITE)
        return peer, op, descs, timeout

    # -- published metadata ------------------------------------------------------------
    def set_metadata(self, key: str, value: bytes) -> None:
        """Publish ``value`` under ``key`` for connected peers to fetch (target side).

        For what a peer must know beyond raw regions — e.g. the layout of the KV
        caches behind them — without a side channel or a metadata server.
        """
        self._check_open()
        if self._server is None:
            raise Unsupported("a client-only engine has no peers to publish to")
        if not isinstance(key, str) or not isinstance(value, (bytes, bytearray)):
            raise ParamInvalid("metadata key must be str and value bytes")
        if len(value) > proto.frames.MAX_META:
            raise ParamInvalid(f"metadata value of {len(value)} bytes is too large")
        self._server.publish(key, bytes(value))

    def get_remote_metadata(self, remote_engine: str, key: str, timeout: float | None = None) -> bytes:
        """Fetch what ``remote_engine`` published under ``key``; :class:`ParamInvalid` if nothing."""
        peer = self._peer(remote_engine)
        timeout = float(self.options["connect_timeout"] if timeout is None else timeout)
        reply = peer.link.call(proto.QueryMeta(peer.link.next_id(), key), timeout)
        if not isinstance(reply, proto.Meta):
            raise ProtocolError(f"expected META, got {type(reply).__name__}")
        return reply.value

    # -- notifications -------------------------------------------------------------------
    def send_notify(self, remote_engine: str, notify: NotifyDesc, timeout: float | None = None) -> None:
        """Deliver a small message to ``remote_engine``'s :meth:`get_notifies` (or its handler).

        It is delivered after the data of every transfer to that peer started
        before it (async ones included). Raises :class:`ResourceExhausted` if
        the peer's queue, or this connection's share of it, is full, and what
        the peer's handler raised if it refused the notification (see
        :meth:`handle_notifies`).
        """
        if not isinstance(notify, NotifyDesc) or not isinstance(notify.name, str) or not isinstance(notify.msg, str):
            raise ParamInvalid("send_notify takes a NotifyDesc(name: str, msg: str)")
        peer = self._peer(remote_engine)
        timeout = float(self.options["transfer_timeout"] if timeout is None else timeout)
        deadline = time.monotonic() + timeout
        limit = proto.frames.MAX_NAME
        if len(notify.name.encode()) > limit or len(notify.msg.encode()) > limit:
            raise ParamInvalid(f"notify name and msg must each be at most {limit} bytes of UTF-8")
        peer.flush(timeout)
        message = proto.Notify(peer.link.next_id(), notify.name, notify.msg)
        peer.link.call(message, max(0.001, deadline - time.monotonic()))

    def handle_notifies(self, name: str, handler: Callable[[NotifyDesc], None]) -> None:
        """Give the notifications named ``name`` to ``handler`` as they arrive, instead of queuing them.

        ``handler(notify)`` runs on one of the engine's serve threads (the
        ``serve_threads`` option), in the sender's connection's order (so after the
        data of the transfers it started before), with no engine lock held. Returning accepts the notification: the
        sender's :meth:`send_notify` returns. Raising a :class:`HixlError` refuses it:
        the sender's ``send_notify`` raises the same kind of error, with its message.
        Anything else it raises is logged and refused as a plain ``HixlError``. Until
        it returns, nothing else from that connection is served and it holds one of
        those threads: it must be quick and must not block. Handled notifications never enter the :meth:`get_notifies`
        queue, so they are neither counted against its limits nor refused by them.
        A second handler for ``name`` replaces the first.
        """
        self._check_open()
        if self._server is None:
            raise Unsupported("a client-only engine receives no notifications")
        if not isinstance(name, str) or len(name.encode()) > proto.frames.MAX_NAME or not callable(handler):
            raise ParamInvalid("handle_notifies takes a notification name (str, at most 1 KiB) and a callable")
        self._handlers[name] = handler

    def served_connections(self) -> dict[str, str]:
        """The authenticated connections this engine serves as a target right now:
        connection id (what ``NotifyDesc.sender`` says) -> the peer's ``"ip:port"``."""
        return self._server.open_connections() if self._server is not None else {}

    def get_notifies(self) -> list[NotifyDesc]:
        """Every notification received since the last call (oldest first); drains the queue."""
        with self._notify_lock:
            return self._drain_notifies()

    def wait_notifies(self, timeout: float | None = None) -> list[NotifyDesc]:
        """Block until a notification arrives, then drain like :meth:`get_notifies`.

        Returns ``[]`` if ``timeout`` seconds (None: no limit) pass first, or if
        the engine is finalized meanwhile. Sleeps on a condition: no polling.
        """
        self._check_open()
        with self._notify_lock:
            self._notify_lock.wait_for(lambda: self._notifies or self._finalized, timeout)
            return self._drain_notifies()

    async def wait_notifies_async(self, timeout: float | None = None) -> list[NotifyDesc]:
        """:meth:`wait_notifies` for asyncio: ``await engine.wait_notifies_async(timeout)``.

        The event loop is woken by the thread that receives the notification (no
        thread per await). Each notification goes to exactly one waiter.
        """
        self._check_open()
        got: list[NotifyDesc] = []

        def take() -> bool:
            got.extend(self.get_notifies())
            return bool(got) or self._finalized

        await wait_until(take, self._notify_wakes.subscribe, self._notify_wakes.unsubscribe, timeout)
        return got

    def _drain_notifies(self) -> list[NotifyDesc]:
        drained = list(self._notifies)
        self._notifies.clear()
        self._notify_bytes = 0
        self._notifies_of.clear()
        self._notify_bytes_of.clear()
        return drained

    def _accept_notify(self, notify: NotifyDesc) -> None:
        """Called by a serving thread for each NOTIFY; raising refuses it (the sender is told why)."""
        handler = self._handlers.get(notify.name)
        if handler is not None:
            try:
                handler(notify)
            except HixlError:
                raise
            except Exception as exc:
                log.exception("hixl: the handler of %r notifications failed", notify.name)
                raise HixlError(f"{self.local_engine} failed to handle the notification") from exc
            return
        size = len(notify.name.encode()) + len(notify.msg.encode())
        sender, o = notify.sender, self.options
        with self._notify_lock:
            # The connection's share first: a peer that fills it is refused while others are not.
            if self._notifies_of[sender] >= int(o["max_notifies_per_connection"]):
                raise ResourceExhausted(
                    f"{self.local_engine} holds {self._notifies_of[sender]} unread notifications from this "
                    "connection (max_notifies_per_connection)"
                )
            if self._notify_bytes_of[sender] + size > int(o["max_notify_bytes_per_connection"]):
                raise ResourceExhausted(
                    f"{self.local_engine} holds {self._notify_bytes_of[sender]} bytes of unread notifications "
                    "from this connection (max_notify_bytes_per_connection)"
                )
            if len(self._notifies) >= int(o["max_notifies"]):
                raise ResourceExhausted(f"{self.local_engine} holds {len(self._notifies)} unread notifications")
            if self._notify_bytes + size > int(o["max_notify_bytes"]):
                raise ResourceExhausted(f"{self.local_engine} holds {self._notify_bytes} bytes of unread notifications")
            self._notifies.append(notify)
            self._notify_bytes += size
            self._notifies_of[sender] += 1
            self._notify_bytes_of[sender] += size
        self._wake_notify_waiters()

    def _wake_notify_waiters(self) -> None:
        with self._notify_lock:
            self._notify_lock.notify_all()
        self._notify_wakes.wake_all()

    # -- lifecycle -----------------------------------------------------------------------
    def finalize(self) -> None:
        """Close every connection, stop listening, drop registrations; idempotent."""
        with self._peers_lock:
            if self._finalized:
                return
            self._finalized = True
            peers, self._peers = list(self._peers.values()), {}
        if self._store is not None:
            self._store.close()  # first: watchers hear at once that this engine is going
        for peer in peers:
            if peer is not None:
                peer.close()
        regions = [(addr, nbytes) for addr, nbytes, _ in self._registry.regions()]
        self._registry.clear()
        if self._server is not None:
            # Like deregistering everything: when finalize returns, no peer touches this memory.
            self._server.revoke(self._registry.generation, regions, float(self.options["deregister_timeout"]))
            self._server.close()
        for transport in self._transports:
            transport.close()
        self._handlers.clear()  # nothing arrives any more; don't keep the handlers' owners alive
        self._wake_notify_waiters()  # they return what they have (nothing more will come)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.finalize()

    def __del__(self) -> None:
        if not getattr(self, "_finalized", True):
            self.finalize()

    def _check_open(self) -> None:
        if self._finalized:
            raise HixlError(f"engine {self.local_engine} is finalized")

    def _canonical(self, remote_engine: str) -> str:
        host, port = parse_address(remote_engine, require_port=True)
        assert port is not None
        return format_address(host, port)

    def _peer(self, remote_engine: str) -> _Peer:
        self._check_open()
        peer = self._peers.get(remote_engine)  # the usual spelling: skip parsing
        if peer is None:
            name = self._canonical(remote_engine)
            with self._peers_lock:
                peer = self._peers.get(name)
        if peer is None:
            raise NotConnected(f"not connected to {name}; call connect() first")
        if peer.link.state is not LinkState.CONNECTED:
            peer.link.ensure_alive()
        return peer

    def __repr__(self) -> str:
        role = "target+initiator" if self._server else "initiator"
        state = "finalized" if self._finalized else f"{len(self._peers)} peer(s)"
        return f"<Engine {self.local_engine} {role} {state} regions={len(self._registry.table)}>"

