"""The target's side: a listener, limits, one I/O loop for every connection, and a few workers.

Every accepted socket is checked against the allow-list of peer networks and
the handshake slots (see :mod:`hixl._session.admission`: handshakes are counted apart
from authenticated peers, so a flood of them cannot take a peer's slot) before
anything else; a refusal is one ERROR frame, then close. The handshake (see
:mod:`hixl._protocol.connection`) must deliver its HELLO within
``hello_timeout`` and finish within ``handshake_timeout``, both counted from
``accept``; a peer that fails the shared-secret proof is refused and logged,
and learns nothing about this engine. One that passes takes an authenticated
slot just before its WELCOME — when all are taken, an idle connection of an
address holding more is closed to make room (see the admission module) — or is
refused if there is none. Then each
:class:`_ServedConnection` serves frames in arrival order: the data frames
(READ, WRITE) go to the transport that declares it serves them, on a worker;
NOTIFY, QUERY_REGIONS, QUERY_META and PING are answered on the loop. Because a
connection is served strictly in order, a notification sent after a transfer
is seen after that transfer's data. A bad request gets an ERROR reply and the
connection stays usable; a malformed frame, or a frame that does not complete
within ``frame_timeout``, ends only that connection. Accepting survives running
out of file descriptors: it logs, pauses and goes on.

Threads. However many peers: one I/O loop (:class:`_Loop`: a selector over the
listener and every socket, timers as one sweep, every send through a
connection's non-blocking :class:`~hixl._session.outbox.Outbox`), and at most
``serve_threads`` workers (:class:`~hixl._session.pool.WorkerPool`) for requests that
move data, which may wait on a slow peer up to their deadlines. Nothing another
thread wants sent waits on a socket: a registration change is one word to the
loop, which sends the newest table to every peer (encoded once); a
deregistration has the loop queue every peer's REVOKE at once and waits for the
confirmations, so it takes one round trip plus the slowest peer, bounded by
``deregister_timeout``.
"""

from __future__ import annotations

import array
import collections
import contextlib
import ctypes
import errno
import fcntl
import ipaddress
import itertools
import logging
import os
import resource
import selectors
import socket
import termios
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _accel
from .. import _protocol as proto
from .._exceptions import (
    AuthenticationFailed,
    HixlError,
    IntegrityError,
    PeerDisconnected,
    ProtocolError,
    ResourceExhausted,
    TransferTimeout,
)
from .._iov import IovCursor
from .._memory import Registry, RemoteRegions, memory_view
from .._protocol.auth import Secret
from .._protocol.connection import NEED_DATA, Connection, ConnectionClosed, ConnState, Role
from .._types import IdentityEnum, NotifyDesc, Status
from ..transports.base import Transport
from .admission import Admission
from .backend import NetworkBackend
from .outbox import Outbox
from .pool import WorkerPool
from .wire import CHUNK, READ_SIZE, SENDMSG_RANGES, Wire

__all__ = ["ServerLimits", "TargetServer", "check_fd_limit"]

log = logging.getLogger("hixl")

_serials = itertools.count(1)
_NO_ROWS = np.empty((0, 3), dtype=np.uint64)
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_SPARE_FDS = 256
"""Descriptors kept free beyond one per connection: the listener, the loop's, the transports', files."""
_OUTBOX_READ_LIMIT = 4 << 20
"""A connection with this many bytes of answers unsent is not read until it takes them."""
_FRAMES_PER_ROUND = 32
_MAX_IDLE_PING = 60.0
"""The longest idle silence a peer may announce (idle_ping): a peer that says more gets this."""
_LOWAT = 256 << 10
"""Most bytes a landing WRITE waits to have arrived before its next ``readv`` (see _landing_window)."""
_WORD = 8
"""A landing WRITE never leaves a word of this many bytes half-written while it waits (see _land)."""
_DROPPED = bytearray(64 << 10)
_DROPPED_VIEW = memoryview(_DROPPED)
"""Where the loop reads data it drops (refused or late WRITEs): one buffer, one thread."""
_FLUSHES_PER_ROUND = 128
"""Most connections the loop sends pushed updates to before it looks at its sockets again."""
_BUFFERED = 1 << 8
"""An ``on_ready`` mask bit besides the selector's: frames are buffered, the socket was not polled."""
"""Most frames of one connection served before the loop turns to the others."""
_HEARTBEATS = frozenset({proto.FrameType.PING, proto.FrameType.PONG})
"""Frames that are no request: they do not make a connection recently used (see ``last_request``)."""


@dataclass(frozen=True)
class ServerLimits:
    """What a target accepts; each field is an engine option (see ``DEFAULT_OPTIONS``)."""

    heartbeat_interval: float
    heartbeat_misses: int
    hello_timeout: float
    handshake_timeout: float
    frame_timeout: float
    request_time_cap: float
    max_handshakes: int
    max_handshakes_per_source: int
    max_connections: int
    max_connections_per_peer: int
    serve_threads: int
    busy_poll: float
    allowed_networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]


def _whole_words(done: int, n: int, left: int) -> int:
    """Of ``n`` bytes that could land now, after ``done`` landed and with ``left`` still due: all
    of them if they are the last, else as many as end on a word boundary of the data."""
    return left if n >= left else max(0, n - (done + n) % _WORD)


class _Holds:
    """The ranges of this engine's memory that requests being served right now touch.

    A serving thread takes a hold *before* it checks a request against the registrations;
    deregistration swaps the registrations *before* it looks at the holds. So either the
    request sees the region gone, or deregistration sees the request and waits for it.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active: dict[int, tuple[_ServedConnection, np.ndarray | list[tuple[int, int]]]] = {}
        self._keys = itertools.count()

    def hold(self, conn: _ServedConnection, descs: np.ndarray) -> _Hold:
        """A context manager that holds ``descs`` ((N, 2): addr, len) for the duration of the block."""
        return _Hold(self, conn, descs)

    def add(self, conn: _ServedConnection, descs: np.ndarray | list[tuple[int, int]]) -> int:
        """Record a hold of ``descs`` ((N, 2) addr, len: an array, or a list of pairs); its key, for :meth:`drop`."""
        with self._cond:
            key = next(self._keys)
            self._active[key] = (conn, descs)
        return key

    def drop(self, key: int) -> None:
        """Release the hold ``key``."""
        with self._cond:
            del self._active[key]
            self._cond.notify_all()

    def _touching(self, removed: list[tuple[int, int]]) -> list[_ServedConnection]:
        touching = []
        for conn, held in self._active.values():
            descs = np.asarray(held, dtype=np.uint64).reshape(-1, 2)  # (the latency path holds (addr, len) pairs)
            starts, ends = descs[:, 0], descs[:, 0] + descs[:, 1]
            if any(bool(((starts < addr + n) & (ends > addr)).any()) for addr, n in removed):
                touching.append(conn)
        return touching

    def wait_clear(self, removed: list[tuple[int, int]], deadline: float) -> list[_ServedConnection]:
        """Wait until no request touches ``removed``; the connections still touching it at ``deadline``."""
        with self._cond:
            while touching := self._touching(removed):
                left = deadline - time.monotonic()
                if left <= 0:
                    return touching
                self._cond.wait(left)
        return []


class _Hold:
    """One request's hold on its ranges (a class, not a generator: it is on every request's path)."""

    __slots__ = ("_conn", "_descs", "_holds", "_key")

    def __init__(self, holds: _Holds, conn: _ServedConnection, descs: np.ndarray) -> None:
        self._holds, self._conn, self._descs, self._key = holds, conn, descs, -1

    def __enter__(self) -> None:
        self._key = self._holds.add(self._conn, self._descs)

    def __exit__(self, *exc_info: object) -> None:
        self._holds.drop(self._key)


class TargetServer:
    """Accepts connections on ``(host, port)`` and serves them (see module docstring)."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: Registry,
        on_notify: Callable[[NotifyDesc], None],
        handles_notifies: Callable[[str], bool],
        transports: Sequence[Transport],
        limits: ServerLimits,
        secret: Secret | None,
        identity: dict[str, Any],
        backend: NetworkBackend,
        encrypt: bool = False,
    ) -> None:
        self.identity = identity
        self._metadata: dict[str, bytes] = {}
        self.registry = registry
        self.on_notify = on_notify
        self.handles_notifies = handles_notifies
        """Whether the application handles notifications of a name itself (they are served on a worker)."""
        self.transports = transports
        self.limits = limits
        self.secret = secret
        self.encrypt = encrypt
        """Every connection is sealed after its handshake's proofs (``encrypt=True``); a peer that does not encrypt is refused."""
        self.servers_of: dict[proto.FrameType, Transport] = {}
        for transport in transports:
            for kind in transport.capabilities.serves:
                self.servers_of.setdefault(kind, transport)
        servers = [self.servers_of.get(kind) for kind in (proto.FrameType.READ, proto.FrameType.WRITE)]
        self.plain = all(t is not None and not t.capabilities.serve_blocks and t.serves_plainly() for t in servers)
        """Whether the loop may serve a small READ or WRITE in the C call that reads it
        (:meth:`_ServedConnection._serve_straight`)."""
        check_fd_limit(limits.max_connections + limits.max_handshakes)
        self._listener = backend.listen(host, port, min(4096, limits.max_handshakes * 4))
        try:
            self._listener.setblocking(False)
            bound_port = self._listener.getsockname()[1]
        except OSError:
            self._listener.close()
            raise
        self.address = f"[{host}]:{bound_port}" if ":" in host else f"{host}:{bound_port}"
        self._lock = threading.Lock()
        self._connections: set[_ServedConnection] = set()
        """Every connection not yet ended (the loop's and the workers'); guarded by ``_lock``."""
        self._admission: Admission[_ServedConnection] = Admission(
            limits.max_handshakes,
            limits.max_handshakes_per_source,
            limits.max_connections,
            limits.max_connections_per_peer,
            _ServedConnection.idle_since,
        )
        self._closed = False
        self.holds = _Holds()
        self._acks = threading.Condition()
        self.loop = _Loop(self)
        self.workers = WorkerPool(limits.serve_threads, f"hixl-serve-{self.address}")
        registry.listeners.append(self._regions_changed)
        self.loop.start()

    # -- what other threads ask -----------------------------------------------------------------------
    def publish(self, key: str, value: bytes) -> None:
        """Publish ``value`` under ``key`` for connected peers' QUERY_META (replacing what was there)."""
        self._metadata[key] = value

    def metadata(self, key: str) -> bytes | None:
        """What is published under ``key`` (None: nothing)."""
        return self._metadata.get(key)

    def open_connections(self) -> dict[str, str]:
        """Authenticated connections being served: id (as in ``NotifyDesc.sender``) -> the peer's address."""
        with self._lock:
            return {c.id: c.wire.peer for c in self._connections if c.id}

    def _regions_changed(self, table: RemoteRegions, generation: int) -> None:
        # On the registering thread, under the registry's lock: no I/O here, only a word to the loop,
        # which sends the newest table to every peer (one encoding shared by all).
        self.loop.call_soon(self.loop.push_regions)

    def revoke(self, generation: int, removed: list[tuple[int, int]], timeout: float) -> None:
        """Make sure no peer touches ``removed`` any more; return once that is certain.

        Every open connection that may reach this memory one-sidedly (cma, shm) is
        sent REVOKE with the registrations of ``generation`` (or newer), all at
        once by the I/O loop, and must answer REVOKED within ``timeout`` (its
        same-host copies, which this engine cannot see, have stopped); one that
        does not is disconnected. The others (TCP: this engine checks and serves
        each of their requests) are sent the new registrations and not waited for. Requests this engine serves
        itself (TCP) that touch ``removed`` are waited for, and cut off (their
        connection closed) if they outlast ``timeout``.
        """
        deadline = time.monotonic() + timeout
        asked: list[_ServedConnection] = []
        decided = threading.Event()

        def ask_all() -> None:
            # On the loop: a connection whose WELCOME is made already is asked; one still in its
            # handshake will be welcomed with the new table (the loop makes WELCOMEs too).
            try:
                asked.extend(c for c in self.loop.connections() if c.want_revoke(generation, deadline))
            finally:
                decided.set()

        if self.loop.call_soon(ask_all):
            decided.wait(max(0.0, deadline - time.monotonic()))
        with self._acks:
            self._acks.wait_for(
                lambda: all(c.acked >= generation or c.ended for c in asked), max(0.0, deadline - time.monotonic())
            )
        for conn in asked:
            if conn.acked < generation and not conn.ended:
                log.warning("hixl: %s did not confirm a deregistration within %.1f s: disconnected", conn.wire.peer, timeout)
                conn.wire.mark_dead("did not confirm a deregistration in time")
        for conn in self.holds.wait_clear(removed, deadline):
            log.warning("hixl: cutting off %s: its request outlasted a deregistration of its memory", conn.wire.peer)
            conn.wire.mark_dead("its request touched memory being deregistered")
        # A cut-off request fails at its next chunk: the socket is shut down.
        self.holds.wait_clear(removed, time.monotonic() + timeout)

    def confirmed(self) -> None:
        """Called (on the loop) when a connection received REVOKED, or ended."""
        with self._acks:
            self._acks.notify_all()

    # -- what the loop asks ---------------------------------------------------------------------------
    def accept(self) -> list[_ServedConnection]:
        """Accept what is waiting (at most a batch: the loop serves others in between); the admitted."""
        admitted = []
        for _ in range(64):
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if exc.errno in _OUT_OF_RESOURCES:
                    log.warning("hixl: %s cannot accept (%s); retrying shortly", self.address, exc.strerror)
                    self.loop.pause_accepting(0.05)
                else:
                    log.warning("hixl: %s: accept failed: %s", self.address, exc)
                break
            conn = self._admit(sock, peer[0], f"{peer[0]}:{peer[1]}")
            if conn is not None:
                admitted.append(conn)
        return admitted

    @property
    def listener(self) -> socket.socket:
        """The listening socket (the loop polls it)."""
        return self._listener

    def _admit(self, sock: socket.socket, host: str, name: str) -> _ServedConnection | None:
        reason = self._network_refusal(host)
        victim, evictions, conn = None, 0, None
        with self._lock:
            if self._closed:
                sock.close()
                return None
            if reason is None:
                reason = self._admission.refusal(host)
            if reason is None:
                conn = _ServedConnection(self, sock, name)
                self._connections.add(conn)
                victim = self._admission.admit(conn, host)
                evictions = self._admission.evictions
        if conn is None:
            log.warning("hixl: %s refused a connection from %s: %s", self.address, name, reason)
            _refuse_now(sock, Status.RESOURCE_EXHAUSTED if "limit" in (reason or "") else Status.AUTH_FAILED, reason or "")
            return None
        if victim is not None:
            log.debug(
                "hixl: %s evicted the handshake of %s (%.2f s old) for %s; %d evictions so far",
                self.address, victim.wire.peer, time.monotonic() - victim.accepted_at, name, evictions,
            )
            victim.end("evicted: the handshake slots are full")
        return conn

    def _network_refusal(self, host: str) -> str | None:
        networks = self.limits.allowed_networks
        if networks:
            address = ipaddress.ip_address(host.split("%")[0])
            if not any(address in net for net in networks):
                return f"{host} is not in allowed_networks"
        return None

    def promote(self, conn: _ServedConnection) -> str | None:
        """Give ``conn``, whose peer just proved itself, an authenticated slot — closing an idle one
        to make room if they are all taken (see :class:`Admission`); why not, if there is none.
        On the loop (the connections' idleness is the loop's to read, and a victim's to end)."""
        with self._lock:
            refusal, victim = self._admission.promote(conn)
            evictions = self._admission.idle_evictions
        if victim is not None:
            log.info(
                "hixl: %s closed %s, idle %.1f s, to make room for %s (max_connections is full); %d so far",
                self.address, victim.wire.peer, time.monotonic() - victim.last_request, conn.wire.peer, evictions,
            )
            reason = "closed to make room for another peer: max_connections is full and this connection was idle"
            victim.say_bye(reason)
            victim.end(reason)
        return refusal

    def forget(self, conn: _ServedConnection) -> None:
        """Called when a connection ended."""
        with self._lock:
            self._connections.discard(conn)
            self._admission.forget(conn)
        self.confirmed()  # a revoke waiting for it need not

    def welcome_info(self, session: _ServedConnection) -> dict[str, Any]:
        """What an authenticated initiator learns about this engine."""
        generation, table = self.registry.current()
        return {
            **self.identity,
            "engine": self.address,
            "generation": generation,
            "regions": table.rows.tolist(),
            "transports": {t.capabilities.name: t.advertise(session) for t in self.transports},
        }

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self, timeout: float = 2.0) -> None:
        """Stop accepting, end every connection (BYE), stop the loop and the workers; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            connections = list(self._connections)
        self.registry.listeners.remove(self._regions_changed)
        for conn in connections:
            if conn.busy:
                conn.wire.mark_dead("target finalized")  # its worker's next syscall fails; it ends it
        self.loop.stop(timeout)
        self.workers.close(timeout)
        self._listener.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else repr(self._admission)
        return f"<TargetServer {self.address} {state}>"


def check_fd_limit(connections: int) -> None:
    """Make sure this process may hold a descriptor per connection (and some to spare): raise the
    soft limit up to the hard one if needed; :class:`ResourceExhausted` if even that is too low."""
    needed = connections + _SPARE_FDS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard == resource.RLIM_INFINITY or hard >= needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
        log.info("hixl: raised this process's open-file limit from %d to %d (for max_connections)", soft, needed)
        return
    raise ResourceExhausted(
        f"max_connections + max_handshakes ({connections}) need about {needed} open files, but this process may "
        f"open at most {hard} (ulimit -Hn): raise that limit or lower max_connections"
    )


class _Loop:
    """The target's one I/O thread: accept, handshakes, control frames, heartbeats, outboxes.

    Every socket is non-blocking and watched by one selector; timers are a sweep
    (handshake deadlines, partial frames, liveness and PINGs) at least every
    :attr:`tick` seconds. Other threads talk to it only through :meth:`call_soon`.
    A connection whose request went to a worker is not watched until it comes back.
    """

    def __init__(self, server: TargetServer) -> None:
        self.server = server
        limits = server.limits
        # Handshakes are timed to a quarter of their timeouts; open connections' liveness, partial
        # frames and outboxes to half an interval (a peer is dead only after several).
        self.tick = max(0.01, min(0.25, limits.hello_timeout / 4, limits.handshake_timeout / 4))
        self.open_tick = max(self.tick, min(limits.heartbeat_interval / 2, limits.frame_timeout / 4))
        self._next_open_sweep = 0.0
        self.busy_poll = limits.busy_poll
        self._polling_until = 0.0  # (see _events)
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._selector.register(server.listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._calls: collections.deque[Callable[[], None]] = collections.deque()
        self._calls_lock = threading.Lock()
        self._stopped = False
        """The thread has ended: calls are refused (guarded by ``_calls_lock``)."""
        self._woken = False
        self._ready: collections.deque[_ServedConnection] = collections.deque()
        """Connections with complete frames buffered (the selector cannot see those)."""
        self._handshaking: set[_ServedConnection] = set()
        """Connections watched while in their handshake (swept more often than open ones)."""
        self._to_flush: collections.deque[_ServedConnection] = collections.deque()
        """Connections with something to send made elsewhere (a REGIONS push), a batch per round."""
        self._conns: set[_ServedConnection] = set()
        self._accept_paused_until = 0.0
        self._stopping = False
        self._next_sweep = 0.0
        self._shared: dict[tuple[proto.FrameType, int], tuple[proto.Message, bytes]] = {}
        self._shared_generation = -1  # the registrations generation _shared's frames are of
        self.thread = threading.Thread(target=self._run, name=f"hixl-loop-{server.address}", daemon=True)

    def start(self) -> None:
        """Start the loop's thread."""
        self.thread.start()

    # -- from any thread ------------------------------------------------------------------------------
    def call_soon(self, fn: Callable[[], None]) -> bool:
        """Run ``fn`` on the loop's thread soon; False if the loop has stopped (it will not run)."""
        with self._calls_lock:
            if self._stopped:
                return False
            self._calls.append(fn)
        if not self._woken:
            self._woken = True
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass  # closed: the loop has stopped
        return True

    def stop(self, timeout: float) -> None:
        """End every connection (BYE first), stop and join the thread."""
        if self.thread.is_alive() and self.call_soon(self._begin_stop):
            self.thread.join(timeout)
        self._selector.close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    # -- on the loop's thread -------------------------------------------------------------------------
    def connections(self) -> list[_ServedConnection]:
        """The connections the loop serves now (busy ones included)."""
        return list(self._conns)

    def watch(self, conn: _ServedConnection) -> None:
        """Serve ``conn``: a new one, or one back from a worker."""
        if conn.ended:
            return  # (evicted by a newer one accepted in the same batch)
        self._conns.add(conn)
        if not conn.is_open():
            self._handshaking.add(conn)
        self.update(conn)
        if conn.wire.conn.buffered:
            self._ready.append(conn)

    def update(self, conn: _ServedConnection) -> None:
        """Watch ``conn``'s socket for what it waits for now (nothing while a worker has it)."""
        events = conn.interest()
        if events == conn.watched and events:
            return  # (the common case, on every frame: nothing to change)
        conn.watched = events
        key = self._selector.get_map().get(conn.wire.fd)
        if key is not None and key.data is not conn:
            self._selector.unregister(conn.wire.fd)  # (a descriptor number reused since: not ours)
            key = None
        if events and key is None:
            self._selector.register(conn.wire.fd, events, conn)
        elif events and key is not None and key.events != events:
            self._selector.modify(conn.wire.fd, events, conn)
        elif not events and key is not None:
            self._selector.unregister(conn.wire.fd)

    def ended(self, conn: _ServedConnection) -> None:
        """``conn`` is over: stop watching it (before its socket closes)."""
        self._conns.discard(conn)
        key = self._selector.get_map().get(conn.wire.fd)
        if key is not None and key.data is conn:
            self._selector.unregister(conn.wire.fd)

    def pause_accepting(self, seconds: float) -> None:
        """Out of descriptors: stop accepting for a while (the sweep resumes it)."""
        self._accept_paused_until = time.monotonic() + seconds
        self._selector.unregister(self.server.listener)

    def push_regions(self) -> None:
        """Tell every open connection what changed in the registrations (one REGIONS frame for all
        that knew the same generation), in the next rounds: whatever else waits for the loop (a
        deregistration's decision) first."""
        for conn in self._conns:
            conn.regions_dirty = True
        self._to_flush.extend(self._conns)

    def shared_frame(self, kind: proto.FrameType, base: int) -> tuple[proto.Message, bytes]:
        """A REGIONS (pushed) or REVOKE taking a peer that knows generation ``base`` to the newest
        registrations — what changed, or all of them if that is shorter — and its frame: encoded
        once for every connection at ``base``, again only when the registrations change."""
        registry = self.server.registry
        if self._shared_generation != registry.generation:
            self._shared.clear()
        cached = self._shared.get((kind, base))
        if cached is None:
            update = registry.update_since(base)
            self._shared_generation = update.generation
            change = (update.generation, proto.WHOLE if update.base is None else update.base, update.added, update.removed)
            message = proto.Revoke(*change) if kind is proto.FrameType.REVOKE else proto.Regions(*change)
            cached = self._shared[(kind, base)] = (message, proto.encode(message))
        return cached

    def _run(self) -> None:
        try:
            while not (self._stopping and not self._conns):
                self._once()
        except Exception:
            log.exception("hixl: the I/O loop of %s crashed", self.server.address)
        finally:
            with self._calls_lock:
                self._stopped = True
                calls = list(self._calls)
            for fn in calls:  # (workers handing connections back, revokes asking: they are owed an answer)
                fn()
            for conn in list(self._conns):
                conn.end("target finalized")

    def _once(self) -> None:
        timeout = 0.0 if self._ready or self._calls or self._to_flush else max(0.0, self._next_sweep - time.monotonic())
        for key, mask in self._events(timeout):
            conn = key.data
            if conn is not None:
                conn.on_ready(mask)
            elif key.fileobj is self.server.listener:
                for new in self.server.accept():
                    self.watch(new)
            else:
                self._drain_wakes()
        for _ in range(len(self._ready)):
            self._ready.popleft().on_ready(_BUFFERED)
        while self._calls:
            self._calls.popleft()()
        for _ in range(min(len(self._to_flush), _FLUSHES_PER_ROUND)):
            conn = self._to_flush.popleft()
            conn.flush()
            if not conn.ended:
                self.update(conn)
        now = time.monotonic()
        if now >= self._next_sweep:
            self._next_sweep = now + self.tick
            self._sweep(now)

    def _events(self, timeout: float) -> list[tuple[selectors.SelectorKey, int]]:
        """The selector's events, waiting ``timeout`` at most. For ``busy_poll`` seconds after the
        last events it polls again and again (yielding the CPU between looks) before it sleeps: the
        next request of a peer that waits on its answer is often due within microseconds, and a
        sleeping thread's wake-up would cost more than that."""
        if timeout > 0.0 and self._polling_until:
            while not (events := self._selector.select(0)) and time.monotonic() < self._polling_until:
                os.sched_yield()
            if not events:
                self._polling_until = 0.0
                events = self._selector.select(timeout)
        else:
            events = self._selector.select(timeout)
        if events and self.busy_poll:
            self._polling_until = time.monotonic() + self.busy_poll
        return events

    def again(self, conn: _ServedConnection) -> None:
        """``conn`` stopped with complete frames still buffered (its share of this round): later."""
        self._ready.append(conn)

    def _drain_wakes(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        # Cleared after the pipe is empty, not before: a call_soon between the two would have
        # written a byte this drain swallowed and left the flag set with the pipe empty, and every
        # later call_soon (a worker handing its connection back) waited for the next sweep.
        # One that sees the flag still set queued its call before, and this round runs it.
        self._woken = False

    def _sweep(self, now: float) -> None:
        if self._accept_paused_until and now >= self._accept_paused_until and not self._stopping:
            self._accept_paused_until = 0.0
            self._selector.register(self.server.listener, selectors.EVENT_READ, None)
        full = now >= self._next_open_sweep
        if full:
            self._next_open_sweep = now + self.open_tick
        self._handshaking = {c for c in self._handshaking if c.phase in (_Phase.HELLO, _Phase.AUTH)}
        for conn in list(self._conns if full else self._handshaking):
            conn.on_timer(now, full)

    def _begin_stop(self) -> None:
        self._stopping = True
        if not self._accept_paused_until:
            self._selector.unregister(self.server.listener)
        for conn in list(self._conns):
            if not conn.busy:
                conn.say_bye("target finalized")
                conn.end("target finalized")


def _refuse_now(sock: socket.socket, status: int, reason: str) -> None:
    """Refuse a connection before its handshake: one ERROR frame, then close."""
    try:
        sock.setblocking(False)
        sock.send(Connection(Role.TARGET).refuse(status, reason))
    except OSError:
        pass
    sock.close()


@dataclass
class _Landing:
    """A WRITE's bulk data being landed (see :meth:`_ServedConnection.land_data`)."""

    cursor: IovCursor | None
    deadline: float
    landed: Callable[[bool], None]
    release: Callable[[], None]


class _Phase(IdentityEnum):
    HELLO = "waiting for HELLO"
    AUTH = "waiting for AUTH"
    OPEN = "open"
    ENDED = "ended"


class _ServedConnection:
    """One initiator's connection (a :class:`ServedSession`), driven by the server's I/O loop.

    The loop owns it — reads its frames, answers control frames through its
    :class:`~hixl._session.outbox.Outbox`, checks its timers — except while a worker
    serves one of its requests (``busy``): then the worker alone uses its socket,
    and the loop neither reads it nor sends on it until the worker hands it back.
    Frames are therefore served strictly in order (a notification sent after a
    transfer is seen after that transfer's data), and nothing another thread
    wants sent (a REGIONS update, a REVOKE) ever waits on a socket: it is a flag
    the loop turns into a frame when the socket is free.
    """

    def __init__(self, server: TargetServer, sock: socket.socket, peer: str) -> None:
        self.server = server
        self.accepted_at = time.monotonic()
        limits = server.limits
        self.conn = Connection(Role.TARGET, server.secret, encrypt=server.encrypt)
        # Initiators ping every ``interval`` when idle; allow twice their patience.
        self.wire = Wire(sock, self.conn, peer, limits.heartbeat_interval, limits.heartbeat_misses * 2)
        self.keepalive: list[Any] = []
        self.id = ""
        """This connection's identity once open: the peer's engine id and a serial."""
        self.acked = 0
        """The newest registration generation the peer confirmed (REVOKED)."""
        self.last_request = self.accepted_at
        """When the peer's last frame other than a heartbeat came (``time.monotonic()``; at first, its accept)."""
        self.phase = _Phase.HELLO
        self.busy = False
        """A worker serves one of its requests now (see the class docstring)."""
        self.regions_dirty = False
        """The peer is to be sent the newest registrations (set by the loop; sent when the socket is free)."""
        self._revoke_wanted = 0
        self._landing: _Landing | None = None
        """The bulk data of a WRITE being landed (or dropped) as it arrives."""
        self._inline: tuple[int, int] | None = None
        """Where in the loop thread's scratch the data that came with a WRITE begins, and where
        what came with it ends (see :meth:`_serve_straight`): landed from there, not via the connection."""
        self._lowat = 1  # the socket's SO_RCVLOWAT (see _landing_window)
        self._unread = array.array("i", [0])  # (FIONREAD's answer, see _socket_holds)
        self._outbox = Outbox()
        self._close_after_flush = ""
        self._marked_one_sided = False
        self.watched = 0
        """What the loop's selector watches its socket for (the loop's to keep)."""
        self._pending_job: Callable[[], None] | None = None
        """A request for a worker, waiting for the outbox to empty first (frames must not interleave)."""

    @property
    def ended(self) -> bool:
        """Whether the connection is over."""
        return self.phase is _Phase.ENDED

    # -- the ServedSession protocol ----------------------------------------------------------------
    def regions(self) -> RemoteRegions:
        """This engine's registrations as of now."""
        return self.server.registry.table

    def expired(self, deadline_us: int) -> bool:
        """Whether a carried deadline (our clock, microseconds; 0: none) has passed."""
        return bool(deadline_us) and time.monotonic() * 1e6 >= deadline_us

    def hold(self, descs: np.ndarray) -> contextlib.AbstractContextManager[None]:
        """Hold ``descs`` ((N, 2): addr, len) of this engine's memory while a request uses them."""
        return self.server.holds.hold(self, descs)

    def local_deadline(self, deadline_us: int) -> float:
        """A carried deadline in ``time.monotonic()`` seconds, capped by ``request_time_cap``."""
        cap = time.monotonic() + self.server.limits.request_time_cap
        return min(cap, deadline_us / 1e6) if deadline_us else cap

    def mark_one_sided(self) -> None:
        """The peer reaches this engine's memory one-sidedly from now on (see :meth:`one_sided`)."""
        self._marked_one_sided = True

    def one_sided(self) -> bool:
        """Whether the peer may touch this engine's memory without this engine serving the request
        (so a deregistration waits for it to confirm): unless it said at the handshake that none of
        its transports does, or runs under another kernel — and was not handed a way to since."""
        if self._marked_one_sided:
            return True
        info = self.conn.peer_info
        ours = self.server.identity.get("boot_id")
        elsewhere = bool(ours) and isinstance(info.get("boot_id"), str) and info["boot_id"] != ours
        return info.get("one_sided") is not False and not elsewhere

    def _peer_idle_ping(self) -> float:
        """How long an idle peer may stay silent before its first ping is due: what it said (capped
        at a minute), if it may ping slowly at all (it is two-sided, see :meth:`one_sided`); else 0."""
        said = self.conn.peer_info.get("idle_ping")
        if self.one_sided() or not isinstance(said, (int, float)) or isinstance(said, bool) or not said > 0:
            return 0.0
        return min(float(said), _MAX_IDLE_PING)

    @property
    def peer(self) -> str:
        """The peer's address, ``"ip:port"``."""
        return self.wire.peer

    def binding(self, label: str) -> bytes:
        """This connection's binding for ``label`` (see :meth:`Connection.binding`; the session key
        it derives from never changes once the proofs passed, so no lock is taken)."""
        return self.conn.binding(label)

    def is_open(self) -> bool:
        """Whether the connection is open and not cut off (its wire not marked dead)."""
        return self.conn.state is proto.ConnState.OPEN and not self.wire.dead_reason

    def idle_since(self) -> float | None:
        """:attr:`last_request` if the connection has nothing in hand — no request arriving (in
        our buffer or unread in the socket), being served or answered, no deregistration it has
        not confirmed — else None: then it may not be closed to make room (see :class:`Admission`).
        On the loop. Unread notifications it sent do not count: they stay queued when it closes,
        and counting them would let a peer that never has them read keep its slots for good."""
        if (
            self.phase is not _Phase.OPEN
            or self.busy
            or self._landing is not None
            or self._pending_job is not None
            or self._close_after_flush
            or self._outbox
            or self.conn.data_left
            or self.conn.buffered
            or self._revoke_wanted > self.acked
            or self._socket_holds()
        ):
            return None
        return self.last_request

    # What a transport that serves on the loop (``serve_blocks`` False) answers with: nothing here
    # blocks; each call queues, and the loop moves the bytes as the socket allows.
    def reply(self, message: proto.Message) -> None:
        """Send ``message`` (an ACK, an ERROR) after whatever is queued already."""
        with self.wire.conn_lock:
            frame = self.wire.frame_of(self.conn.send, message)
        self._send_now(frame, [], None)

    def acknowledge(self, req_id: int) -> None:
        """:meth:`reply` with the ACK of ``req_id``, its frame made directly (no message built)."""
        with self.wire.conn_lock:
            frame = self.wire.frame_of(self.conn.reply_frame, proto.FrameType.ACK, req_id)
        self._send_now(frame, [], None)

    def take_hold(self, descs: np.ndarray | list[tuple[int, int]]) -> Callable[[], None]:
        """Hold ``descs`` ((N, 2): addr, len) of this engine's memory (take it before checking
        them); the function that releases the hold (once; later calls do nothing)."""
        holds = self.server.holds
        key = holds.add(self, descs)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                holds.drop(key)

        return release

    def send_data(self, message: proto.Message, ranges: np.ndarray, release: Callable[[], None]) -> None:
        """Send ``message`` (a DATA), then the bytes of ``ranges`` ((N, 2): addr, len of registered
        memory) from where they lie; ``release()`` once they all went out, or the connection ended."""
        with self.wire.conn_lock:
            frame = self.wire.frame_of(self.conn.send, message)
        if len(ranges) <= SENDMSG_RANGES:  # a small reply: one segment, read by the peer in one recv
            views = [memory_view(int(a), int(n)) for a, n in ranges.tolist()]
            self._outbox.put([frame, *views], data=True, done=release)
        else:
            self._outbox.put([frame])
            self._outbox.put_cursor(IovCursor(np.ascontiguousarray(ranges, dtype=np.uint64)), done=release)
        self.flush()

    def send_small(self, req_id: int, pairs: list[tuple[int, int]], release: Callable[[], None]) -> None:
        """The DATA answering ``req_id`` and the bytes of a few (addr, len) ``pairs`` of registered
        memory (the latency path of :meth:`send_data`): one ``sendmsg`` when nothing is queued."""
        with self.wire.conn_lock:
            frame = self.wire.frame_of(self.conn.reply_frame, proto.FrameType.DATA, req_id, sum(n for _, n in pairs))
        self._send_now(frame, pairs, release)

    def _send_now(self, frame: bytes, pairs: list[tuple[int, int]], done: Callable[[], None] | None) -> None:
        """Send ``frame`` and the memory of ``pairs`` now, as far as the socket takes them without
        waiting, if nothing is queued before them (frames never interleave); the rest queued.
        ``done()`` once all went out, or the connection ended."""
        sent = 0
        if not self._outbox and not self.busy and self.phase is not _Phase.ENDED and self.wire.seal is None:
            try:
                sent = _accel.tcp_send(self.wire.sock, frame, pairs, 0, 0.0)
            except OSError as exc:
                if done is not None:
                    done()
                self.end(f"socket error: {exc}")
                return
            if pairs and sent > len(frame):
                self.wire.last_alive = time.monotonic()  # our data taken by a peer that reads it
            if sent == len(frame) + sum(n for _, n in pairs):
                if done is not None:
                    done()
                return
        views = [memoryview(frame), *(memory_view(a, n) for a, n in pairs)]
        while sent and sent >= len(views[0]):  # (what the socket took)
            sent -= len(views.pop(0))
        if sent:
            views[0] = views[0][sent:]
        self._outbox.put(views, data=bool(pairs), done=done)
        if self.wire.seal is not None:
            self.flush()  # (sealed as it goes out, in the order queued)

    def land_small(
        self, pairs: list[tuple[int, int]], deadline: float, landed: Callable[[bool], None], release: Callable[[], None]
    ) -> None:
        """:meth:`land_data` into a few (addr, len) ``pairs``: what of their data came with the frame
        copied from there at once (all of it, for a small WRITE), the rest as it arrives."""
        conn = self.conn
        total = sum(n for _, n in pairs)
        moved = self._land_inline(pairs, total, deadline)
        if moved == total:
            release()
            landed(True)
            return
        if not moved and conn.data_left == total and conn.buffered >= total and time.monotonic() < deadline:
            with self.wire.conn_lock:
                data = conn.take_data(total)
            offset = 0
            for addr, n in pairs:
                ctypes.memmove(addr, data[offset : offset + n], n)
                offset += n
            release()
            landed(True)
            return
        cursor = IovCursor(np.array(pairs, dtype=np.uint64).reshape(-1, 2))
        if moved:
            cursor.advance(moved)
        self.land_data(cursor, deadline, landed, release)

    def _land_inline(self, pairs: list[tuple[int, int]], total: int, deadline: float) -> int:
        """Land into ``pairs`` the whole words of the data :meth:`_serve_straight` left in the
        scratch unless ``deadline`` passed, one copy — all of it if all came, none of a WRITE of up
        to READ_SIZE that did not (that one lands once whole) — and the rest of what the scratch
        holds to the connection. The bytes landed."""
        if self._inline is None:
            return 0
        start, have = self._inline
        if self.conn.data_left != total or time.monotonic() >= deadline or have - start < total <= READ_SIZE:
            self._spill_inline()  # (a WRITE of up to READ_SIZE is gathered whole, then lands all at once)
            return 0
        self._inline = None
        wire = self.wire
        take = _whole_words(0, min(have - start, total), total)
        if take:
            _accel.tcp_land(wire.sock, wire.scratch, start, start + take, pairs, 0.0)  # (copies, reads nothing)
        with wire.conn_lock:
            self.conn.data_moved(take)
            if start + take < have:
                self.conn.receive_data(memoryview(wire.scratch)[start + take : have])
        return take

    def land_data(
        self,
        cursor: IovCursor | None,
        deadline: float,
        landed: Callable[[bool], None],
        release: Callable[[], None],
    ) -> None:
        """Land the bulk data that follows the current frame into ``cursor``'s memory as it
        arrives — none of it once ``deadline`` (``time.monotonic()``) passed: the rest is read and
        dropped, as all of it is if ``cursor`` is None — then ``release()`` and ``landed(all_of_it)``.
        If the connection ends first, only ``release()``."""
        self._spill_inline()
        self._landing = _Landing(cursor, deadline, landed, release)
        self._land()

    def _spill_inline(self) -> None:
        """Hand what :meth:`_serve_straight` left in the scratch (a small WRITE's data, and what came
        after it) to the connection, for the general path: before anything else reads the scratch."""
        if self._inline is not None:
            start, have = self._inline
            self._inline = None
            with self.wire.conn_lock:
                self.conn.receive_data(memoryview(self.wire.scratch)[start:have])

    def _land(self) -> bool:
        """Move what arrived of the data being landed; True once it is all in (or dropped).

        Every piece it lands ends on an 8-byte word boundary of the data, except its last: a word
        is never left half-written while the rest of it is awaited, so a concurrent reader of that
        memory (a cma peer, the application) sees each word old or new, never torn. The bytes of a
        word not yet whole wait in the connection's buffer.

        At most :data:`CHUNK` bytes a round: then the loop serves everyone else first and comes
        back (a WRITE streaming in without a pause would otherwise hold the loop to the end —
        a 512 MiB one kept another peer's 8 B READ waiting 300 ms)."""
        landing, wire, conn = self._landing, self.wire, self.conn
        assert landing is not None
        stop_at = max(0, conn.data_left - CHUNK)
        while conn.data_left:
            if conn.data_left <= stop_at:
                self.server.loop.again(self)  # its share of this round is used up
                return False
            cursor = landing.cursor
            if cursor is not None and not cursor.finished and time.monotonic() >= landing.deadline:
                landing.cursor = cursor = None  # past its deadline nothing lands: the rest is dropped
            if cursor is None or cursor.finished:
                if conn.buffered:
                    with wire.conn_lock:
                        conn.take_data(conn.data_left)
                elif not self._drop(min(conn.data_left, len(_DROPPED))):
                    return False
            elif not self._land_piece(cursor, min(CHUNK, cursor.total - cursor.done, conn.data_left), landing.deadline):
                return False
            wire.last_alive = time.monotonic()
        self._landing = None
        self._set_lowat(1)
        landing.release()
        landing.landed(landing.cursor is not None and landing.cursor.finished)
        return True

    def _land_piece(self, cursor: IovCursor, want: int, deadline: float) -> bool:
        """Land up to ``want`` bytes into ``cursor`` from the connection's buffer, or else straight
        from the socket, in whole words (see :meth:`_land`); False if none could land yet."""
        wire, conn = self.wire, self.conn
        if conn.buffered:
            if conn.buffered < want <= READ_SIZE:
                return self._gather(want - conn.buffered)  # a small rest: gathered whole, then copied once
            take = _whole_words(cursor.done, min(want, conn.buffered), conn.data_left)
            if not take:  # the first bytes of a word wait in the buffer: the rest of it first
                return self._gather(min(_WORD - (cursor.done + conn.buffered) % _WORD, conn.data_left - conn.buffered))
            with wire.conn_lock:
                data = conn.take_data(take)
            cursor.copy_in(data)
            return True
        if wire.seal is not None:
            return self._land_sealed(cursor, want)
        rows, first = cursor.pending_rows()
        try:
            moved = _accel.tcp_land_words(
                wire.sock, rows, first, want, cursor.done, conn.data_left, deadline, _LOWAT, wire.busy_poll
            )
        except OSError as exc:  # (ConnectionError included: the peer closed mid-data)
            raise PeerDisconnected(f"{wire.peer}: {exc}") from exc
        if moved:
            cursor.advance(moved)
            conn.data_moved(moved)
            wire.last_alive = time.monotonic()
        if moved == want or time.monotonic() >= deadline:
            return True  # (past the deadline: _land drops the rest)
        ready = self._socket_holds()
        if ready >= _WORD:
            return True  # (it came just after the last look)
        if ready:
            # Not one whole word: into the buffer with it, not left in the socket — a few bytes left
            # of a large segment hold all its memory there, and with enough of those the window
            # closes while the socket turns readable for them alone (a spin, no data).
            return self._gather(ready)
        # Dry: asleep until a piece of what is still due came — a mark set for more than that would
        # never be reached (the WRITE would stall).
        self._landing_window(cursor, want - moved)
        return False

    def _land_sealed(self, cursor: IovCursor | None, want: int) -> bool:
        """:meth:`_land_piece` on a sealed link (with no ``cursor``: :meth:`_gather` and :meth:`_drop`):
        one ``recv``, and every whole record opened — up to ``want`` bytes of the data landing in
        ``cursor`` in whole words, the rest into the connection's buffer, for :meth:`_land` to land
        or drop. False if nothing came: the socket is then asked to turn readable once the record
        in front is whole (it opens whole only)."""
        wire = self.wire
        got, _ = wire.receive_sealed(cursor, want, words=True)
        if got == 0:
            raise PeerDisconnected(f"{wire.peer} closed the connection mid-data")
        if got > 0:
            return True
        assert wire.seal is not None
        self._set_lowat(wire.sealed_lowat(_LOWAT))
        return False

    def _gather(self, nbytes: int) -> bool:
        """Receive up to ``nbytes`` more of the data into the connection's buffer (a few
        ``recv`` calls and one copy cost less than landing a small piece straight from the socket);
        False if none had come: the socket is then asked (SO_RCVLOWAT) to turn readable once all
        ``nbytes`` have."""
        wire = self.wire
        if wire.seal is not None:
            return self._land_sealed(None, 0)
        try:
            got = wire.sock.recv_into(wire.scratch, nbytes)
        except (BlockingIOError, InterruptedError):
            self._set_lowat(nbytes)
            return False
        except OSError as exc:
            raise PeerDisconnected(f"{wire.peer}: {exc}") from exc
        if not got:
            raise PeerDisconnected(f"{wire.peer} closed the connection mid-data")
        with wire.conn_lock:
            self.conn.receive_data(memoryview(wire.scratch)[:got])
        return True

    def _socket_holds(self) -> int:
        """Bytes waiting unread in the socket (FIONREAD): how much a ``readv`` takes now."""
        try:
            fcntl.ioctl(self.wire.fd, termios.FIONREAD, self._unread, True)
        except OSError:
            return 1 << 62  # (closed or failing: the readv reports it)
        return self._unread[0]

    def _landing_window(self, cursor: IovCursor, want: int) -> int:
        """How much of a WRITE's data to take in the next ``readv``: at most ``_LOWAT``, ending on a
        word boundary while more is to come — and the socket is asked (``SO_RCVLOWAT``) to turn
        readable only once that much has arrived. So the data lands in large pieces, as a blocking
        read would take it (not a ``readv`` per segment)."""
        window = _whole_words(cursor.done, min(want, _LOWAT), self.conn.data_left) or min(want, _LOWAT)
        self._set_lowat(window)
        return window

    def _set_lowat(self, nbytes: int) -> None:
        if nbytes != self._lowat:
            try:
                self.wire.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, max(1, nbytes))
            except OSError:
                return  # (closed: the next call reports it)
            self._lowat = nbytes

    def _drop(self, nbytes: int) -> bool:
        """Read and drop up to ``nbytes`` of the data from the socket; False if none had come."""
        if self.wire.seal is not None:
            return self._land_sealed(None, 0)  # (into the buffer, from where _land drops it)
        try:
            got = self.wire.sock.recv_into(_DROPPED_VIEW, nbytes)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            raise PeerDisconnected(f"{self.wire.peer}: {exc}") from exc
        if not got:
            raise PeerDisconnected(f"{self.wire.peer} closed the connection mid-data")
        self.conn.data_moved(got)
        return True

    # -- asked of it on the loop ------------------------------------------------------------------------
    def want_revoke(self, generation: int, deadline: float) -> bool:
        """Tell an open peer that reaches our memory one-sidedly the registrations of ``generation``
        (or newer) as soon as its socket is free, by ``deadline``; False if it is not open (its
        WELCOME, still to come, names them) or serves nothing itself (the REGIONS push tells it)."""
        if self.phase is not _Phase.OPEN or not self.one_sided():
            return False
        self._revoke_wanted = max(self._revoke_wanted, generation)
        self.flush()
        return True

    def interest(self) -> int:
        """What the loop should watch this socket for now."""
        if self.busy or self.phase is _Phase.ENDED:
            return 0
        events = selectors.EVENT_WRITE if self._outbox else 0
        if self._pending_job is not None:
            return events  # nothing more is read before that request is served
        if self._outbox.nbytes < _OUTBOX_READ_LIMIT and not self._close_after_flush:
            events |= selectors.EVENT_READ  # (a peer that does not read its answers is not read either)
        return events

    def on_ready(self, mask: int) -> None:
        """The socket is ready (or frames are buffered): send what waits, serve what arrived."""
        if self.phase is _Phase.ENDED or self.busy:
            return
        try:
            if mask & selectors.EVENT_WRITE:
                self.flush()
            if mask & (selectors.EVENT_READ | _BUFFERED):
                self._serve_arrived(bool(mask & selectors.EVENT_READ))
        except AuthenticationFailed as exc:
            log.warning("hixl: refused %s: %s", self.wire.peer, exc)
            self._fatal(Status.AUTH_FAILED, "authentication failed")
        except IntegrityError as exc:
            # Altered on the way: nothing of it landed. The peer is told (our direction still
            # seals), so that its request fails as what it is, not as a vanished peer.
            log.warning("hixl: dropping connection from %s: %s", self.wire.peer, exc)
            self._fatal(Status.AUTH_FAILED, f"what arrived failed its integrity check: {exc}")
        except ProtocolError as exc:
            if self.phase is _Phase.OPEN:
                log.warning("hixl: dropping connection from %s: %s", self.wire.peer, exc)
                self._fatal(Status.FAILED, f"protocol error: {exc}")
            else:
                log.warning("hixl: refused %s: %s", self.wire.peer, exc)
                self._fatal(Status.UNSUPPORTED if "version" in str(exc) else Status.FAILED, f"protocol error: {exc}")
        except HixlError as exc:
            self.end(str(exc))  # the peer went away; nothing to tell anyone
        except Exception:
            log.exception("hixl: serving %s crashed", self.wire.peer)
            self.end("crashed")
        else:
            if self.phase is not _Phase.ENDED:
                self.server.loop.update(self)

    def _serve_arrived(self, readable: bool) -> None:
        """Serve the frames that arrived (one ``recv`` if ``readable``), up to a fair share; the rest
        in the loop's next round."""
        wire = self.wire
        if self._landing is not None:
            if not self._land():
                return
            readable = False  # (it read the socket until it was empty, or the data was in)
        for _ in range(_FRAMES_PER_ROUND):
            if self.busy or self.phase is _Phase.ENDED or self._close_after_flush or self._pending_job is not None:
                return
            if self._landing is not None:
                if not self._land():
                    return  # the rest of the data when it comes
                continue
            if self._outbox.nbytes >= _OUTBOX_READ_LIMIT:
                return  # it reads its answers first
            if readable and self.phase is _Phase.OPEN and not (self.conn.buffered or self.conn.data_left or wire.seal):
                readable = False  # (one recv per readiness, here or in buffered_event)
                if self._serve_straight():
                    continue
            event = wire.buffered_event(readable)
            if event is NEED_DATA:
                return
            readable = False  # (what came with that recv is served; the socket says if more waits)
            if self.phase is _Phase.OPEN:
                self._serve(event)
            else:
                self._handshake_step(event)
        self.server.loop.again(self)  # its share is used up: the rest in the next round

    def _serve_straight(self) -> bool:
        """TCP's latency path: one ``recv``; a small READ or WRITE that arrived whole is accounted
        for by the connection (:meth:`Connection.took_frame`) and served from its fields, no
        message built — what came of a WRITE's data copied into memory from the scratch it was
        received into — and what came after it handed to the connection. False if what came is
        anything else: it is all the connection's then, for the general path to parse."""
        wire, conn = self.wire, self.conn
        # A READ or WRITE may be served in that very call (the C twin's, given the registry) when
        # nothing else would stand between it and its answer: the connection open, nothing queued
        # before it.
        serve = self.server.plain and conn.state is ConnState.OPEN and not (self._outbox or self.busy)
        try:
            kind, have, end, req_id, deadline, pairs, data_len, unsent = _accel.tcp_request(
                wire.sock, wire.scratch, self.server.registry if serve else None
            )
        except OSError as exc:
            raise PeerDisconnected(f"{wire.peer}: socket error: {exc}") from exc
        if have:
            wire.last_alive = time.monotonic()
        if unsent is not None:  # served: accounted for as any other, what the socket did not take queued
            self.last_request = wire.last_alive
            with wire.conn_lock:
                conn.took_frame(proto.FRAME_TYPES[kind], req_id, data_len)
                conn.data_moved(data_len)  # (a WRITE's, copied in from the scratch)
                if end + data_len < have:
                    conn.receive_data(memoryview(wire.scratch)[end + data_len : have])
            if unsent:
                self._outbox.put([unsent], data=True)  # (a copy: no hold on the memory needed)
                self.flush()
            return True
        frame_type = proto.FRAME_TYPES[kind] if kind > 0 else None
        transport = self.server.servers_of.get(frame_type) if frame_type is not None else None
        straight = transport is not None and not transport.capabilities.serve_blocks
        inline = straight and data_len and have > end  # (a WRITE's data came with it, some or all)
        with wire.conn_lock:
            if straight:
                assert frame_type is not None
                conn.took_frame(frame_type, req_id, data_len)
            else:
                end = 0
            if end < have and not inline:
                conn.receive_data(memoryview(wire.scratch)[end:have])
            if kind == _accel.TCP_EOF:
                conn.receive_data(b"")
        if not straight:
            return False
        self.last_request = wire.last_alive
        assert transport is not None and pairs is not None
        if inline:
            self._inline = (end, have)
        try:
            transport.serve_small(self, frame_type is proto.FrameType.WRITE, req_id, deadline, pairs, data_len)
        finally:
            self._spill_inline()  # (if it was not landed from there: refused, say)
        if self._outbox:
            self.flush()
        return True

    def on_timer(self, now: float, full: bool) -> None:
        """The sweep: handshake deadlines; with ``full``, an open connection's too: a frame arriving
        too slowly, liveness, PING, the outbox's deadline."""
        if self.busy or self.phase is _Phase.ENDED:
            return  # (a worker's waits keep the heartbeat while it has the socket)
        limits = self.server.limits
        wire = self.wire
        if self.phase is not _Phase.OPEN:
            if self.phase is _Phase.HELLO and now >= self.accepted_at + limits.hello_timeout:
                log.warning("hixl: dropped %s: no HELLO within %.1f s", wire.peer, limits.hello_timeout)
                self.end("no HELLO in time")
            elif now >= self.accepted_at + limits.handshake_timeout:
                log.warning("hixl: dropped %s: no complete handshake within %.1f s", wire.peer, limits.handshake_timeout)
                self.end("no complete handshake in time")
            return
        if wire.frame_overdue(now, limits.frame_timeout):
            log.warning("hixl: dropping connection from %s: a frame took over %.1f s to arrive", wire.peer, limits.frame_timeout)
            self.end("a frame arrived too slowly")
            return
        silent = now - wire.last_alive
        budget = wire.interval * wire.misses
        # A two-sided peer with nothing waiting on us pings only every idle_ping (it said how
        # often): its silence counts against the budget from then.
        idle = self._peer_idle_ping() if not (self._outbox or self._landing) else 0.0
        if wire.past_budget(now, wire.last_alive + idle, budget):
            self.end(f"no sign of life for {silent:.1f} s")
            return
        if self._outbox.stalled(now, budget):
            log.warning("hixl: dropping connection from %s: it has not read what it was sent", wire.peer)
            self.end("a send passed its deadline")
            return
        if silent >= idle + budget / 2 and wire.ping_due(now):  # (a last try before the end)
            wire.pinged(now)
            self._put(proto.Ping())
            self.flush()
            self.server.loop.update(self)

    # -- handshake -----------------------------------------------------------------------------------
    def _handshake_step(self, event: Any) -> None:
        wire, conn = self.wire, self.conn
        if self.phase is _Phase.HELLO:
            if not isinstance(event, proto.Hello):
                self.end("no HELLO")
                return
            self._send_raw(conn.challenge())
            if conn.encryption_mismatch:
                # After the CHALLENGE, which says whether we encrypt (the initiator refuses on reading
                # it): an ERROR, for an initiator that reads on.
                log.warning("hixl: refused %s: %s", wire.peer, conn.encryption_mismatch)
                with wire.conn_lock:
                    frame = conn.refuse(Status.UNSUPPORTED, conn.encryption_mismatch)
                self._send_raw(frame)
                self._close_after_flush = "refused"
                self.flush()
                return
            if conn.seal is not None:  # everything after the CHALLENGE is sealed, both ways
                wire.start_sealing()
                self._outbox.sealer = conn.seal.sealer
            self.phase = _Phase.AUTH
            return
        if not isinstance(event, proto.Auth):
            log.warning(
                "hixl: refused %s: it hung up after our challenge (it did not accept our proof: a different shared secret?)",
                wire.peer,
            )
            self.end("refused")
            return
        refusal = self.server.promote(self)
        if refusal is not None:
            log.warning("hixl: refused %s after its handshake: %s", wire.peer, refusal)
            with wire.conn_lock:
                frame = conn.refuse(Status.RESOURCE_EXHAUSTED, refusal)
            self._send_raw(frame)
            self._close_after_flush = "refused"
            self.flush()
            return
        # Made on the loop, as REVOKEs are decided: a deregistration either comes before this
        # WELCOME is made (which then lists what is left) or after (and its REVOKE follows it).
        info = self.server.welcome_info(self)  # (the transports' parts may ask for bindings)
        with wire.conn_lock:
            frame = conn.welcome(info)
        self._send_raw(frame)
        self.id = f"{conn.peer_info.get('engine_id', '?')}/{next(_serials)}"
        self.phase = _Phase.OPEN

    # -- serving ---------------------------------------------------------------------------------------
    def _serve(self, message: Any) -> None:
        kind = proto.kind_of(message) if not isinstance(message, ConnectionClosed) else None
        if kind is None or kind is proto.FrameType.BYE:
            self.end("closed by the peer")
            return
        if kind not in _HEARTBEATS:
            self.last_request = time.monotonic()
        transport = self.server.servers_of.get(kind)
        if transport is not None:
            if transport.capabilities.serve_blocks:
                self._to_worker(lambda: transport.serve(self, message))
            else:
                transport.serve(self, message)
        elif kind in (proto.FrameType.READ, proto.FrameType.WRITE):
            refusal = proto.Error(message.req_id, Status.UNSUPPORTED, f"this engine serves no {kind.name}")
            if kind is proto.FrameType.WRITE:
                self.land_data(None, 0.0, lambda _: self.reply(refusal), lambda: None)
            else:
                self.reply(refusal)
        elif kind is proto.FrameType.NOTIFY:
            if self.server.handles_notifies(message.name):
                # The application's handler: on a worker, so that a slow one holds up its own
                # connection (and a worker), never the loop that serves everyone.
                self._to_worker(lambda: self._serve_notify(message, lambda m: self.wire.send(m, deadline=self._worker_deadline())))
            else:
                self._serve_notify(message, self._put)
        elif kind is proto.FrameType.QUERY_REGIONS:
            generation, table = self.server.registry.current()
            self._put(proto.Regions(generation, proto.WHOLE, table.rows, _NO_ROWS, message.req_id))
        elif kind is proto.FrameType.QUERY_META:
            value = self.server.metadata(message.key)
            if value is None:
                self._put(proto.Error(message.req_id, Status.PARAM_INVALID, f"no metadata {message.key!r}"))
            else:
                # Queued as the stored value itself, behind a header: a peer asking again and
                # again while it reads slowly costs this engine no copies (and is not read
                # further while its answers pile up).
                with self.wire.conn_lock:
                    header, body = self.wire.frame_of(self.conn.send_split, proto.Meta(message.req_id, value))
                self._outbox.put([header, body])
        elif kind is proto.FrameType.PING:
            self._put(proto.Pong(message.req_id, time.monotonic()))
        elif kind is proto.FrameType.REVOKED:
            self.acked = max(self.acked, message.generation)
            self.server.confirmed()
        self.flush()

    def _serve_notify(self, message: proto.Notify, reply: Callable[[proto.Message], None]) -> None:
        try:
            self.server.on_notify(NotifyDesc(message.name, message.msg, self.id))
        except HixlError as exc:  # refused (a full queue, a handler's verdict): the sender is told why
            reply(proto.Error(message.req_id, exc.status, str(exc)))
            return
        reply(proto.Ack(message.req_id))

    def _to_worker(self, job: Callable[[], None]) -> None:
        """Serve one request on a worker (it may block, within its deadlines); the loop gets the
        connection back when it is done. Waits until what the loop queued has gone out."""
        if self._outbox:
            self.flush()
            if self._outbox:
                # Frames must not interleave: the worker sends on this socket directly.
                self._pending_job = job
                return
        self.busy = True
        self.server.loop.update(self)
        self.server.workers.submit(lambda: self._work(job))

    def _work(self, job: Callable[[], None]) -> None:
        """On a worker: the request, then the connection back to the loop (or its end)."""
        wire = self.wire
        ending = ""
        try:
            job()
        except ProtocolError as exc:
            log.warning("hixl: dropping connection from %s: %s", wire.peer, exc)
            _send_fatal(wire, Status.FAILED, f"protocol error: {exc}")
            ending = f"protocol error: {exc}"
        except TransferTimeout as exc:
            log.warning("hixl: dropping connection from %s: %s", wire.peer, exc)
            ending = str(exc)
        except HixlError as exc:
            ending = str(exc) or "the peer went away"
        except Exception:
            log.exception("hixl: serving %s crashed", wire.peer)
            ending = "crashed"
        if not self.server.loop.call_soon(lambda: self._back(ending or wire.dead_reason)):
            self._finish(ending or "target finalized")

    def _back(self, ending: str) -> None:
        """On the loop: the worker is done with this connection."""
        self.busy = False
        if ending or self.server.closed:
            self.end(ending or "target finalized")
            return
        self.server.loop.watch(self)
        self.flush()
        self.server.loop.update(self)

    # -- sending ----------------------------------------------------------------------------------------
    def _worker_deadline(self) -> float:
        wire = self.wire
        return time.monotonic() + wire.interval * wire.misses

    def _put(self, message: proto.Message) -> None:
        with self.wire.conn_lock:
            frame = self.wire.frame_of(self.conn.send, message)
        self._outbox.put([frame])

    def _send_raw(self, frame: bytes) -> None:
        self._outbox.put([frame])
        self.flush()

    def flush(self) -> None:
        """On the loop: turn what is wanted into frames and send what the socket takes now."""
        if self.busy or self.phase is _Phase.ENDED:
            return
        if self.phase is _Phase.OPEN:
            self._add_region_frames()
        was_full = self._outbox.nbytes >= _OUTBOX_READ_LIMIT
        try:
            if self._outbox.flush(self.wire.sock):
                self.wire.last_alive = time.monotonic()  # our data taken by a peer that reads it
        except OSError as exc:
            self.end(f"socket error: {exc}")
            return
        if was_full and self._outbox.nbytes < _OUTBOX_READ_LIMIT and self.conn.buffered:
            # Requests that came before the outbox filled wait in the connection's buffer, not the
            # socket: no readiness announces them (pipelined large READs waited for a PING).
            self.server.loop.again(self)
        if not self._outbox:
            if self._close_after_flush:
                self.end(self._close_after_flush)
                return
            job = self._pending_job
            if job is not None:
                self._pending_job = None
                self._to_worker(job)

    def _add_region_frames(self) -> None:
        """A REVOKE if one is wanted (it carries the table too), else a REGIONS if the table changed."""
        if self._revoke_wanted > self.conn.newest_revoke:
            # The newest generation: it covers the one asked for, and everything before it.
            self._put_shared(proto.FrameType.REVOKE)
            self.regions_dirty = False
        elif self.regions_dirty:
            self.regions_dirty = False
            if self.conn.regions_generation != self.server.registry.generation:  # (its WELCOME may be newer)
                self._put_shared(proto.FrameType.REGIONS)

    def _put_shared(self, kind: proto.FrameType) -> None:
        message, shared = self.server.loop.shared_frame(kind, self.conn.regions_generation)
        with self.wire.conn_lock:
            frame = self.wire.frame_of(self.conn.send_encoded, message, shared)
        self._outbox.put([frame])

    # -- ending ----------------------------------------------------------------------------------------
    def _fatal(self, status: int, message: str) -> None:
        """A last ERROR (request id 0), as far as the socket takes it at once, then the end."""
        self._send_last(proto.encode(proto.Error(0, status, message)))
        self.end(message)

    def say_bye(self, reason: str) -> None:
        """BYE, if the socket takes it at once (the connection ends right after)."""
        if self.phase is _Phase.OPEN:
            try:
                with self.wire.conn_lock:
                    frame = self.conn.send(proto.Bye(0, reason))
            except ProtocolError:
                return
            self._send_last(frame)

    def _send_last(self, frame: bytes) -> None:
        """One send of the last ``frame`` before the end, as far as the socket takes it: sealed on a
        sealed link, and there only if nothing is queued (a record part-way out would be cut)."""
        seal = self.wire.seal
        if seal is not None:
            if self._outbox:
                return
            frame = seal.sealer.seal(frame)
        try:
            self.wire.sock.send(frame)
        except OSError:
            pass

    def end(self, reason: str) -> None:
        """On the loop: the connection is over (a busy one ends when its worker hands it back)."""
        if self.phase is _Phase.ENDED:
            return
        if self.busy:
            self.wire.mark_dead(reason)  # the worker's next syscall fails; it hands the connection back
            return
        self.server.loop.ended(self)
        self._finish(reason)

    def _finish(self, reason: str) -> None:
        self.phase = _Phase.ENDED
        landing, self._landing = self._landing, None
        if landing is not None:
            landing.release()
        self._outbox.clear()
        self.wire.mark_dead(reason)
        self.wire.close()
        self.server.forget(self)

    def __repr__(self) -> str:
        return f"<_ServedConnection {self.wire.peer} {self.phase.value}{' busy' if self.busy else ''}>"


def _send_fatal(wire: Wire, status: int, message: str) -> None:
    """A last ERROR (request id 0) before the connection closes; best effort."""
    try:
        wire.send_raw(proto.encode(proto.Error(0, status, message)))
    except (HixlError, OSError):
        pass
