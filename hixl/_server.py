"""The target's side: a listener and one I/O thread per accepted connection.

Each :class:`_ServedConnection` answers HELLO with WELCOME, then serves frames
in arrival order: READ (``writev`` from registered memory), WRITE (``readv``
into it), NOTIFY (queued for ``get_notifies``), QUERY_REGIONS, PING. Because a
connection is served strictly in order, a notification sent after a transfer
is seen after that transfer's data. Every descriptor is checked against this
engine's registrations before a byte moves; a bad request gets an ERROR reply
and the connection stays usable. A malformed frame ends only that connection.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import _protocol as proto
from ._exceptions import HixlError, ProtocolError, ResourceExhausted
from ._framed import FramedSocket
from ._memory import Registry, RegionTable
from ._types import NotifyDesc, Status
from ._iov import IovCursor, iovecs
from .transports.base import Transport

log = logging.getLogger("hixl")


class TargetServer:
    """Accepts connections on ``(host, port)`` and serves them (see module docstring)."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: Registry,
        on_notify: Callable[[NotifyDesc], None],
        transports: Sequence[Transport],
        heartbeat: tuple[float, int],
        handshake_timeout: float,
        engine_id: str,
    ) -> None:
        self.engine_id = engine_id
        self.metadata: dict[str, bytes] = {}
        self.registry = registry
        self.on_notify = on_notify
        self.transports = transports
        self.heartbeat = heartbeat
        self.handshake_timeout = handshake_timeout
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
        self._closed = False
        registry.listeners.append(self._push_regions)
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"hixl-accept-{self.address}", daemon=True)
        self._acceptor.start()

    def welcome_info(self) -> dict[str, Any]:
        """What a new initiator learns about this engine."""
        return {
            "engine": self.address,
            "engine_id": self.engine_id,
            "version": proto.frames.VERSION,
            "regions": self.registry.regions(),
            "transports": {t.capabilities.name: t.advertise() for t in self.transports},
        }

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return  # the listener was shut down by close()
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                conn = _ServedConnection(self, sock, f"{peer[0]}:{peer[1]}")
                self._connections.add(conn)
            conn.thread.start()

    def forget(self, conn: _ServedConnection) -> None:
        """Called by a connection thread when it ends."""
        with self._lock:
            self._connections.discard(conn)

    def _push_regions(self, table: RegionTable) -> None:
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            conn.push_regions(table)

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
            conn.framed.try_send(proto.encode(proto.Bye(0, "target finalized")))
            conn.framed.mark_dead("target finalized")
        for conn in connections:
            conn.thread.join(timeout)


class _ServedConnection:
    """One initiator's connection, served on its own thread."""

    def __init__(self, server: TargetServer, sock: socket.socket, peer: str) -> None:
        self.server = server
        interval, misses = server.heartbeat
        # Initiators ping every ``interval`` when idle; allow twice their patience.
        self.framed = FramedSocket(sock, peer, interval, misses * 2)
        self.thread = threading.Thread(target=self._run, name=f"hixl-serve-{peer}", daemon=True)
        self._regions_dirty = False

    def push_regions(self, table: RegionTable) -> None:
        """Tell the initiator about changed registrations, without waiting on a busy socket."""
        frame = proto.encode(proto.Regions(np.array(table.regions, dtype=np.uint64).reshape(-1, 2)))
        if not self.framed.try_send(frame):
            self._regions_dirty = True  # sent by the serving thread after its current reply

    def _run(self) -> None:
        try:
            self._handshake()
            while self._serve(self.framed.recv_frame()):
                if self._regions_dirty:
                    self._regions_dirty = False
                    self.push_regions(self.server.registry.table)
        except ProtocolError as exc:
            log.warning("hixl: dropping connection from %s: %s", self.framed.peer, exc)
            self.framed.try_send(proto.encode(proto.Error(0, Status.FAILED, f"protocol error: {exc}")))
        except HixlError:
            pass  # the peer went away; nothing to tell anyone
        except Exception:
            log.exception("hixl: serving %s crashed", self.framed.peer)
        finally:
            self.framed.close()
            self.server.forget(self)

    def _handshake(self) -> None:
        self.framed.sock.settimeout(self.server.handshake_timeout)
        try:
            # A client that connects but never says HELLO is dropped (HixlTimeout) after this.
            hello = self.framed.recv_frame(time.monotonic() + self.server.handshake_timeout)
        finally:
            self.framed.sock.settimeout(self.framed.interval)
        if not isinstance(hello, proto.Hello):
            raise ProtocolError(f"expected HELLO, got {type(hello).__name__}")
        self.framed.send(proto.encode(proto.Welcome(self.server.welcome_info(), hello.req_id)))

    def _serve(self, message: proto.Message) -> bool:
        if isinstance(message, proto.ReadRequest):
            self._serve_read(message)
        elif isinstance(message, proto.WriteRequest):
            self._serve_write(message)
        elif isinstance(message, proto.Notify):
            self._serve_notify(message)
        elif isinstance(message, proto.QueryRegions):
            table = self.server.registry.table
            regions = np.array(table.regions, dtype=np.uint64).reshape(-1, 2)
            self.framed.send(proto.encode(proto.Regions(regions, message.req_id)))
        elif isinstance(message, proto.QueryMeta):
            value = self.server.metadata.get(message.key)
            if value is None:
                reply: proto.Message = proto.Error(message.req_id, Status.PARAM_INVALID, f"no metadata {message.key!r}")
            else:
                reply = proto.Meta(message.req_id, value)
            self.framed.send(proto.encode(reply))
        elif isinstance(message, proto.Ping):
            self.framed.send(proto.encode(proto.Pong(message.req_id)))
        elif isinstance(message, proto.Bye):
            return False
        elif not isinstance(message, proto.Pong):
            raise ProtocolError(f"unexpected {type(message).__name__} from an initiator")
        return True

    def _refusal(self, descs: np.ndarray) -> str | None:
        bad = self.server.registry.table.outside(descs[:, 0], descs[:, 1])
        if len(bad) == 0:
            return None
        i = int(bad[0])
        return f"range [{int(descs[i, 0]):#x}, +{int(descs[i, 1])}) is not registered here"

    def _serve_read(self, message: proto.ReadRequest) -> None:
        refusal = self._refusal(message.descs)
        if refusal:
            self.framed.send(proto.encode(proto.Error(message.req_id, Status.PARAM_INVALID, refusal)))
            return
        data = IovCursor(iovecs(message.descs[:, 0], message.descs[:, 1]))
        self.framed.send(proto.encode(proto.Data(message.req_id, data.total)), data=data)

    def _serve_write(self, message: proto.WriteRequest) -> None:
        refusal = self._refusal(message.descs)
        if refusal:
            self.framed.drain(message.data_len)  # keep the stream in step
            self.framed.send(proto.encode(proto.Error(message.req_id, Status.PARAM_INVALID, refusal)))
            return
        self.framed.move(IovCursor(iovecs(message.descs[:, 0], message.descs[:, 1])), write=False)
        self.framed.send(proto.encode(proto.Ack(message.req_id)))

    def _serve_notify(self, message: proto.Notify) -> None:
        try:
            self.server.on_notify(NotifyDesc(message.name, message.msg))
        except ResourceExhausted as exc:
            self.framed.send(proto.encode(proto.Error(message.req_id, exc.status, str(exc))))
            return
        self.framed.send(proto.encode(proto.Ack(message.req_id)))
