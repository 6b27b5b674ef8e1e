"""The target's side: a listener, its limits, and what its connections share.

:class:`TargetServer` listens and owns what every connection shares: their
admission, the holds on this engine's memory, the I/O loop and the workers. Its
parts, one module each: :mod:`.serve_loop` (one I/O loop for every connection),
:mod:`.served` (one initiator's connection: its handshake, then its requests in
order), :mod:`.admission` (connection slots), :mod:`.outbox` (non-blocking sends)
and :mod:`.pool` (the few workers for what may block); what it needs of the
transports is :mod:`.contract`.

Every accepted socket is checked against the allow-list of peer networks and
the handshake slots (see :mod:`hixl._session.admission`: handshakes are counted apart
from authenticated peers, so a flood of them cannot take a peer's slot) before
anything else; a refusal is one ERROR frame, then close. A peer that passes its
handshake takes an authenticated slot just before its WELCOME — when all are
taken, an idle connection of an address holding more is closed to make room (see
the admission module) — or is refused if there is none. Accepting survives running
out of file descriptors: it logs, pauses and goes on.

Other threads ask the server, which asks the loop: a registration change is one
word to the loop, which sends the newest table to every peer; a deregistration
(:meth:`TargetServer.revoke`) has the loop queue every peer's REVOKE at once and
waits for the confirmations — and for the requests being served that hold the
memory it removes (:class:`_Holds`) — bounded by ``deregister_timeout``.
"""

from __future__ import annotations

import errno
import ipaddress
import itertools
import logging
import resource
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _protocol as proto
from .._exceptions import ResourceExhausted
from .._memory import Registry, RemoteRegions
from .._protocol.auth import Secret
from .._protocol.connection import Connection, Role
from .._types import NotifyDesc, Status
from .admission import Admission
from .backend import NetworkBackend
from .contract import TargetHalf
from .pool import WorkerPool
from .serve_loop import _Loop
from .served import _ServedConnection

__all__ = ["ServerLimits", "TargetServer", "check_fd_limit"]

log = logging.getLogger("hixl")

_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_SPARE_FDS = 256
"""Descriptors kept free beyond one per connection: the listener, the loop's, the transports', files."""


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
        transports: Sequence[TargetHalf],
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
        self.servers_of: dict[proto.FrameType, TargetHalf] = {}
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


def _refuse_now(sock: socket.socket, status: int, reason: str) -> None:
    """Refuse a connection before its handshake: one ERROR frame, then close."""
    try:
        sock.setblocking(False)
        sock.send(Connection(Role.TARGET).refuse(status, reason))
    except OSError:
        pass
    sock.close()
