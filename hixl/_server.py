"""The target's side: a listener, limits, and one I/O thread per connection.

Every accepted socket is checked against the allow-list of peer networks and
the handshake slots (see :mod:`hixl._admission`: handshakes are counted apart
from authenticated peers, so a flood of them cannot take a peer's slot) before
anything else; a refusal is one ERROR frame, then close. The handshake (see
:mod:`hixl._protocol.connection`) must deliver its HELLO within
``hello_timeout`` and finish within ``handshake_timeout``, both counted from
``accept``; a peer that fails the shared-secret proof is refused and logged,
and learns nothing about this engine. One that passes takes an authenticated
slot just before its WELCOME, or is refused if there is none. Then each
:class:`_ServedConnection` serves frames in arrival order: the data frames
(READ, WRITE) go to the transport that declares it serves them; NOTIFY,
QUERY_REGIONS, QUERY_META and PING are answered here. Because a connection is
served strictly in order, a notification sent after a transfer is seen after
that transfer's data. A bad request gets an ERROR reply and the connection
stays usable; a malformed frame, or a frame that does not complete within
``frame_timeout``, ends only that connection. The accept loop survives running
out of file descriptors: it logs, backs off and keeps accepting.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _protocol as proto
from ._admission import Admission
from ._exceptions import AuthenticationFailed, HixlError, ProtocolError, TransferTimeout
from ._memory import Registry, RemoteRegions
from ._protocol.auth import Secret
from ._protocol.connection import Connection, ConnectionClosed, Role
from ._types import NotifyDesc, Status
from ._wire import Wire
from .transports.base import Transport

__all__ = ["ServerLimits", "TargetServer"]

log = logging.getLogger("hixl")

_serials = itertools.count(1)
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


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
    allowed_networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]


class _Holds:
    """The ranges of this engine's memory that requests being served right now touch.

    A serving thread takes a hold *before* it checks a request against the registrations;
    deregistration swaps the registrations *before* it looks at the holds. So either the
    request sees the region gone, or deregistration sees the request and waits for it.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active: dict[int, tuple[_ServedConnection, np.ndarray]] = {}
        self._keys = itertools.count()

    def hold(self, conn: _ServedConnection, descs: np.ndarray) -> _Hold:
        """A context manager that holds ``descs`` ((N, 2): addr, len) for the duration of the block."""
        return _Hold(self, conn, descs)

    def add(self, conn: _ServedConnection, descs: np.ndarray) -> int:
        """Record a hold; its key, for :meth:`drop`."""
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
        for conn, descs in self._active.values():
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
        transports: Sequence[Transport],
        limits: ServerLimits,
        secret: Secret | None,
        identity: dict[str, Any],
    ) -> None:
        self.identity = identity
        self.metadata: dict[str, bytes] = {}
        self.registry = registry
        self.on_notify = on_notify
        self.transports = transports
        self.limits = limits
        self.secret = secret
        self.servers_of: dict[proto.FrameType, Transport] = {}
        for transport in transports:
            for kind in transport.capabilities.serves:
                self.servers_of.setdefault(kind, transport)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
        except OSError:
            self._listener.close()
            raise
        self._listener.listen(128)
        bound_port = self._listener.getsockname()[1]
        self.address = f"[{host}]:{bound_port}" if family == socket.AF_INET6 else f"{host}:{bound_port}"
        self._lock = threading.Lock()
        self._connections: set[_ServedConnection] = set()
        """Every connection whose thread runs (evicted ones still ending included): close() joins them."""
        self._admission: Admission[_ServedConnection] = Admission(
            limits.max_handshakes, limits.max_handshakes_per_source, limits.max_connections, limits.max_connections_per_peer
        )
        self._closed = False
        self.holds = _Holds()
        self._acks = threading.Condition()
        registry.listeners.append(self._push_regions)
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"hixl-accept-{self.address}", daemon=True)
        self._acceptor.start()

    def publish(self, key: str, value: bytes) -> None:
        """Publish ``value`` under ``key`` for connected peers' QUERY_META (replacing what was there)."""
        self.metadata[key] = value

    def open_connections(self) -> dict[str, str]:
        """Authenticated connections being served: id (as in ``NotifyDesc.sender``) -> the peer's address."""
        with self._lock:
            return {c.id: c.wire.peer for c in self._connections if c.id}

    def _accept_loop(self) -> None:
        backoff = 0.05
        while True:
            try:
                sock, peer = self._listener.accept()
            except OSError as exc:
                if self._closed:
                    return  # the listener was shut down by close()
                if exc.errno in _OUT_OF_RESOURCES:
                    log.warning("hixl: %s cannot accept (%s); retrying in %.2f s", self.address, exc.strerror, backoff)
                    time.sleep(backoff)
                    backoff = min(1.0, backoff * 2)
                    continue
                log.warning("hixl: %s: accept failed: %s", self.address, exc)
                time.sleep(backoff)
                continue
            backoff = 0.05
            self._admit(sock, peer[0], f"{peer[0]}:{peer[1]}")

    def _admit(self, sock: socket.socket, host: str, name: str) -> None:
        reason = self._network_refusal(host)
        victim, evictions = None, 0
        with self._lock:
            if self._closed:
                sock.close()
                return
            if reason is None:
                reason = self._admission.refusal(host)
            if reason is None:
                conn = _ServedConnection(self, sock, name)
                self._connections.add(conn)
                victim = self._admission.admit(conn, host)
                evictions = self._admission.evictions
        if reason is not None:
            log.warning("hixl: %s refused a connection from %s: %s", self.address, name, reason)
            _refuse_now(sock, Status.RESOURCE_EXHAUSTED if "limit" in reason else Status.AUTH_FAILED, reason)
            return
        if victim is not None:
            log.debug(
                "hixl: %s evicted the handshake of %s (%.2f s old) for %s; %d evictions so far",
                self.address, victim.wire.peer, time.monotonic() - victim.accepted_at, name, evictions,
            )
            # A shutdown, not a close: the victim's thread is in poll on that socket, wakes, and
            # closes it itself (closing it here could hand its descriptor number to another socket).
            victim.wire.mark_dead("evicted: the handshake slots are full")
        conn.thread.start()

    def _network_refusal(self, host: str) -> str | None:
        networks = self.limits.allowed_networks
        if networks:
            address = ipaddress.ip_address(host.split("%")[0])
            if not any(address in net for net in networks):
                return f"{host} is not in allowed_networks"
        return None

    def promote(self, conn: _ServedConnection) -> str | None:
        """Give ``conn``, whose peer just proved itself, an authenticated slot; why not, if there is none."""
        with self._lock:
            return self._admission.promote(conn)

    def forget(self, conn: _ServedConnection) -> None:
        """Called by a connection thread when it ends."""
        with self._lock:
            self._connections.discard(conn)
            self._admission.forget(conn)

    def _push_regions(self, table: RemoteRegions, generation: int) -> None:
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            conn.push_regions()

    def welcome_info(self, session: _ServedConnection) -> dict[str, Any]:
        """What an authenticated initiator learns about this engine."""
        return {
            **self.identity,
            "engine": self.address,
            "generation": self.registry.generation,
            "regions": self.registry.table.rows.tolist(),
            "transports": {t.capabilities.name: t.advertise(session) for t in self.transports},
        }

    def revoke(self, generation: int, removed: list[tuple[int, int]], timeout: float) -> None:
        """Make sure no peer touches ``removed`` any more; return once that is certain.

        Every open connection is sent REVOKE with the registrations of ``generation``
        and must answer REVOKED within ``timeout`` (its same-host copies, which this
        engine cannot see, have stopped); one that does not is disconnected. Requests
        this engine serves itself (TCP) that touch ``removed`` are waited for, and cut
        off (their connection closed) if they outlast ``timeout``.
        """
        deadline = time.monotonic() + timeout
        table = self.registry.table
        with self._lock:
            connections = list(self._connections)
        peers = [conn for conn in connections if conn.send_revoke(generation, table, deadline)]
        with self._acks:
            self._acks.wait_for(
                lambda: all(c.acked >= generation or c.wire.dead_reason for c in peers),
                max(0.0, deadline - time.monotonic()),
            )
        for conn in peers:
            if conn.acked < generation and not conn.wire.dead_reason:
                log.warning("hixl: %s did not confirm a deregistration within %.1f s: disconnected", conn.wire.peer, timeout)
                conn.wire.mark_dead("did not confirm a deregistration in time")
        for conn in self.holds.wait_clear(removed, deadline):
            log.warning("hixl: cutting off %s: its request outlasted a deregistration of its memory", conn.wire.peer)
            conn.wire.mark_dead("its request touched memory being deregistered")
        # A cut-off request fails at its next chunk: the socket is shut down.
        self.holds.wait_clear(removed, time.monotonic() + timeout)

    def confirmed(self) -> None:
        """Called by a connection that received REVOKED."""
        with self._acks:
            self._acks.notify_all()

    def close(self, timeout: float = 2.0) -> None:
        """Stop accepting, end every connection and join every thread; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            connections = list(self._connections)
        self.registry.listeners.remove(self._push_regions)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._acceptor.join(timeout)
        for conn in connections:
            conn.wire.try_send(proto.Bye(0, "target finalized"))
            conn.wire.mark_dead("target finalized")
        for conn in connections:
            conn.thread.join(timeout)

    def __repr__(self) -> str:
        state = "closed" if self._closed else repr(self._admission)
        return f"<TargetServer {self.address} {state}>"


def _refuse_now(sock: socket.socket, status: int, reason: str) -> None:
    """Refuse a connection before its handshake: one ERROR frame, then close."""
    try:
        sock.setblocking(False)
        sock.send(Connection(Role.TARGET).refuse(status, reason))
    except OSError:
        pass
    sock.close()


class _ServedConnection:
    """One initiator's connection, served on its own thread (a :class:`ServedSession`)."""

    def __init__(self, server: TargetServer, sock: socket.socket, peer: str) -> None:
        self.server = server
        self.accepted_at = time.monotonic()
        limits = server.limits
        self.conn = Connection(Role.TARGET, server.secret)
        # Initiators ping every ``interval`` when idle; allow twice their patience.
        self.wire = Wire(sock, self.conn, peer, limits.heartbeat_interval, limits.heartbeat_misses * 2)
        self.keepalive: list[Any] = []
        self.id = ""
        """This connection's identity once open: the peer's engine id and a serial."""
        self.acked = 0
        """The newest registration generation the peer confirmed (REVOKED)."""
        self._regions_gate = threading.Lock()
        # Held while this engine's registrations are read and sent to the peer (WELCOME, REGIONS,
        # REVOKE): on the wire, whatever follows a REVOKE was read after the change it announces.
        self.thread = threading.Thread(target=self._run, name=f"hixl-serve-{peer}", daemon=True)
        self._regions_dirty = False

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

    def send_revoke(self, generation: int, table: RemoteRegions, deadline: float) -> bool:
        """Tell an open peer the registrations of ``generation``; False if it is not open yet
        (its WELCOME, still to come, names them). A peer we cannot tell is cut off."""
        with self._regions_gate:
            if not self.id:
                return False
            with self.wire.conn_lock:
                covered = generation <= self.conn.newest_revoke
            if covered:
                return True  # a REVOKE sent meanwhile by a concurrent deregistration lists what is left
            try:
                self.wire.send(proto.Revoke(generation, table.rows), deadline=deadline)
            except (HixlError, OSError) as exc:
                self.wire.mark_dead(f"could not be told of a deregistration: {exc}")
        return True

    def local_deadline(self, deadline_us: int) -> float:
        """A carried deadline in ``time.monotonic()`` seconds, capped by ``request_time_cap``."""
        cap = time.monotonic() + self.server.limits.request_time_cap
        return min(cap, deadline_us / 1e6) if deadline_us else cap

    def is_open(self) -> bool:
        """Whether the connection is open and not cut off (its wire not marked dead)."""
        return self.conn.state is proto.ConnState.OPEN and not self.wire.dead_reason

    # -- serving ----------------------------------------------------------------------------------
    def push_regions(self) -> None:
        """Tell the initiator about changed registrations, without waiting on a busy socket."""
        if not self._regions_gate.acquire(blocking=False):
            self._regions_dirty = True  # sent by the serving thread after its current reply
            return
        try:
            table = self.server.registry.table
            if self.conn.state is not proto.ConnState.OPEN or not self.wire.try_send(proto.Regions(table.rows)):
                self._regions_dirty = True
        finally:
            self._regions_gate.release()

    def _run(self) -> None:
        wire = self.wire
        try:
            if not self._handshake():
                return
            frame_timeout = self.server.limits.frame_timeout
            while self._serve(wire.next_event(frame_timeout=frame_timeout)):
                if self._regions_dirty:
                    self._regions_dirty = False
                    self.push_regions()
        except ProtocolError as exc:
            log.warning("hixl: dropping connection from %s: %s", wire.peer, exc)
            _send_fatal(wire, Status.FAILED, f"protocol error: {exc}")
        except TransferTimeout as exc:
            log.warning("hixl: dropping connection from %s: %s", wire.peer, exc)
        except HixlError:
            pass  # the peer went away; nothing to tell anyone
        except Exception:
            log.exception("hixl: serving %s crashed", wire.peer)
        finally:
            wire.close()
            self.server.forget(self)

    def _handshake(self) -> bool:
        """Run the target's side of the handshake; False if the peer was refused."""
        wire, conn, limits = self.wire, self.conn, self.server.limits
        deadline = self.accepted_at + limits.handshake_timeout
        try:
            try:
                hello = wire.next_event(self.accepted_at + limits.hello_timeout)
            except TransferTimeout:
                log.warning("hixl: dropped %s: no HELLO within %.1f s", wire.peer, limits.hello_timeout)
                return False
            if not isinstance(hello, proto.Hello):
                return False
            wire.send_raw(conn.challenge(), deadline)
            try:
                if not isinstance(wire.next_event(deadline), proto.Auth):
                    log.warning(
                        "hixl: refused %s: it hung up after our challenge (it did not accept our proof: "
                        "a different shared secret?)",
                        wire.peer,
                    )
                    return False
            except AuthenticationFailed as exc:
                log.warning("hixl: refused %s: %s", wire.peer, exc)
                _send_fatal(wire, Status.AUTH_FAILED, "authentication failed")
                return False
            refusal = self.server.promote(self)
            if refusal is not None:
                if not wire.dead_reason:  # an evicted handshake is gone already
                    log.warning("hixl: refused %s after its handshake: %s", wire.peer, refusal)
                    with wire.conn_lock:
                        frame = conn.refuse(Status.RESOURCE_EXHAUSTED, refusal)
                    wire.send_raw(frame, deadline)
                return False
            # Under the gate: a deregistration either comes before the WELCOME is made (which
            # then lists what is left) or waits for it to be sent, and sends its REVOKE after.
            with self._regions_gate:
                with wire.conn_lock:
                    frame = conn.welcome(self.server.welcome_info(self))
                wire.send_raw(frame, deadline)
                self.id = f"{conn.peer_info.get('engine_id', '?')}/{next(_serials)}"
        except TransferTimeout:
            log.warning("hixl: dropped %s: no complete handshake within %.1f s", wire.peer, limits.handshake_timeout)
            return False
        except ProtocolError as exc:
            if wire.dead_reason:  # evicted (its socket was shut down mid-frame), or the server is closing
                return False
            log.warning("hixl: refused %s: %s", wire.peer, exc)
            _send_fatal(wire, Status.UNSUPPORTED if "version" in str(exc) else Status.FAILED, f"protocol error: {exc}")
            return False
        return True

    def _serve(self, message: Any) -> bool:
        wire = self.wire
        kind = proto.kind_of(message) if not isinstance(message, ConnectionClosed) else None
        if kind is None or kind is proto.FrameType.BYE:
            return False
        transport = self.server.servers_of.get(kind)
        if transport is not None:
            transport.serve(self, message)
        elif kind in (proto.FrameType.READ, proto.FrameType.WRITE):
            wire.drain()
            wire.send(proto.Error(message.req_id, Status.UNSUPPORTED, f"this engine serves no {kind.name}"))
        elif kind is proto.FrameType.NOTIFY:
            self._serve_notify(message)
        elif kind is proto.FrameType.QUERY_REGIONS:
            with self._regions_gate:
                wire.send(proto.Regions(self.server.registry.table.rows, message.req_id))
        elif kind is proto.FrameType.QUERY_META:
            value = self.server.metadata.get(message.key)
            if value is None:
                wire.send(proto.Error(message.req_id, Status.PARAM_INVALID, f"no metadata {message.key!r}"))
            else:
                # Sent from the stored value, one answer at a time: a peer asking again and again
                # while it reads slowly costs this engine no memory (see Wire.send_split).
                wire.send_split(proto.Meta(message.req_id, value))
        elif kind is proto.FrameType.PING:
            wire.send(proto.Pong(message.req_id, time.monotonic()))
        elif kind is proto.FrameType.REVOKED:
            self.acked = max(self.acked, message.generation)
            self.server.confirmed()
        return True

    def _serve_notify(self, message: proto.Notify) -> None:
        try:
            self.server.on_notify(NotifyDesc(message.name, message.msg, self.id))
        except HixlError as exc:  # refused (a full queue, a handler's verdict): the sender is told why
            self.wire.send(proto.Error(message.req_id, exc.status, str(exc)))
            return
        self.wire.send(proto.Ack(message.req_id))


def _send_fatal(wire: Wire, status: int, message: str) -> None:
    """A last ERROR (request id 0) before the connection closes; best effort."""
    try:
        wire.send_raw(proto.encode(proto.Error(0, status, message)))
    except (HixlError, OSError):
        pass
