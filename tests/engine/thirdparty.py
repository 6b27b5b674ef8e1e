"""A transport defined outside hixl, for the conformance suite: its own socket, its own framing.

:class:`SidecarTransport` ("sidecar") moves bytes over a connection of its own, not over the
engine's, and reaches the engine only through the Transport contract (``transports=[...]``).

*Target half.* ``advertise`` (called as each authenticated connection's WELCOME is made) listens
on an abstract Unix socket, made on first need, and names it; it files the connection under its
``binding("sidecar")``, which only the two ends of that connection can compute. A client of the
socket must send such a binding of a connection that is still open, and is answered with
``binding("sidecar-target")``, proof that this is that connection's target (anyone may listen
on an abstract name). It is then served on a thread of its own, one request at a time: each
request holds its ranges (``session.hold``) and is checked against the registrations and their
access rights (``session.regions().check``) before a byte moves, and stops between chunks once
its deadline passed or the engine ended the connection (``session.is_open()``): a client that
proves nothing, or breaks the framing, is hung up on. *Initiator half.* ``probe`` connects and
checks the proof; the channel sends one request at a time and reads its reply on the calling
thread, landing a READ's data straight in registered memory, chunk by chunk under ``io_lock``.

Frames, little-endian. Request: ``op u8, count u32, deadline u64`` (the target's clock, µs; 0:
none), ``count`` x ``(addr u64, len u64)``, then a WRITE's data. Reply: ``code u8, text_len u32``,
the text (why it was refused), then an accepted READ's data.
"""

from __future__ import annotations

import ctypes
import hmac
import os
import select
import socket
import struct
import threading
import time
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from hixl import AccessDenied, HixlError, MemoryRangeError, MemType, Op, PeerDisconnected, ProtocolError, TransferTimeout
from hixl.transports.base import Capabilities, Channel, Transport

if TYPE_CHECKING:
    from hixl import TransferReq
    from hixl.transports.base import LinkSession, ServedSession

_REQUEST = struct.Struct("<BIQ")
_REPLY = struct.Struct("<BI")
_READ, _WRITE = 1, 2
_OK, _OUT_OF_RANGE, _DENIED, _LATE = 0, 1, 2, 3
_ERRORS: dict[int, type[HixlError]] = {_OUT_OF_RANGE: MemoryRangeError, _DENIED: AccessDenied, _LATE: TransferTimeout}
MAX_DESCS = 1 << 16
"""Most descriptors in one request; a larger transfer is several."""
CHUNK = 1 << 20
"""Most bytes moved between two looks at the deadline, the connection and (initiator) ``cancelled``."""
_HELLO_TIMEOUT = 2.0
_IDLE_CHECK = 0.5  # seconds between two looks at an idle client's engine connection


def _view(addr: int, nbytes: int) -> memoryview:
    """``nbytes`` of this process's memory at ``addr`` (registered memory, checked before)."""
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


def _chunks(pairs: np.ndarray) -> Iterator[memoryview]:
    """The memory of ``pairs`` ((N, 2): addr, len) in pieces of at most :data:`CHUNK`, in order."""
    for addr, length in pairs.tolist():
        for offset in range(0, length, CHUNK):
            yield _view(addr + offset, min(CHUNK, length - offset))


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` (within its timeout)."""
    done = 0
    while done < len(view):
        got = sock.recv_into(view[done:])
        if not got:
            raise ConnectionError("the other end hung up")
        done += got


def _recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    data = bytearray(nbytes)
    _recv_into(sock, memoryview(data))
    return bytes(data)


def _readable(sock: socket.socket, timeout: float) -> bool:
    return bool(select.select([sock], [], [], timeout)[0])


def _reply(code: int, text: str = "") -> bytes:
    encoded = text.encode()
    return _REPLY.pack(code, len(encoded)) + encoded


class SidecarTransport(Transport):
    """Requests and their data over a Unix socket of the transport's own (see the module docstring)."""

    capabilities = Capabilities(name="sidecar", same_host_only=True, mem_types=frozenset({MemType.HOST}))

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._name = f"hixl-sidecar-{os.getpid()}-{os.urandom(6).hex()}"
        # Weak: a connection that ended is forgotten with it.
        self._sessions: weakref.WeakValueDictionary[bytes, Any] = weakref.WeakValueDictionary()
        self._clients: dict[bytes, socket.socket] = {}  # binding -> its client: one per connection
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._dialed: weakref.WeakKeyDictionary[LinkSession, socket.socket] = weakref.WeakKeyDictionary()

    # -- target half ----------------------------------------------------------------------------
    def advertise(self, session: ServedSession) -> dict[str, Any]:
        """The socket's name; the connection may use it from now on."""
        with self._lock:
            if self._closed:
                return {}
            if self._listener is None:
                self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
                self._listener.bind("\0" + self._name)
                self._listener.listen(16)
                self._spawn(self._accept_loop, self._listener)
            self._sessions[session.binding("sidecar")] = session
        return {"socket": self._name}

    def _spawn(self, run: Any, sock: socket.socket) -> None:
        """Run ``run(sock)`` on a thread of its own (caller holds the lock)."""
        self._threads = [t for t in self._threads if t.is_alive()]
        thread = threading.Thread(target=run, args=(sock,), name=f"sidecar-{self._name}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._spawn(self._serve_client, sock)

    def _serve_client(self, sock: socket.socket) -> None:
        binding = b""
        try:
            sock.settimeout(_HELLO_TIMEOUT)
            binding = _recv_exact(sock, 16)
            with self._lock:
                session = self._sessions.get(binding)
                if self._closed or session is None or not session.is_open():
                    return  # hung up on: it proved nothing
                replaced, self._clients[binding] = self._clients.get(binding), sock
            if replaced is not None:
                replaced.shutdown(socket.SHUT_RDWR)  # its initiator gave it up for this one
            sock.sendall(session.binding("sidecar-target"))
            while self._serve_request(sock, session):
                pass
        except (OSError, HixlError):
            pass  # gone, too slow, or the engine connection ended mid-request: hung up on
        finally:
            with self._lock:
                if self._clients.get(binding) is sock:
                    del self._clients[binding]
            sock.close()

    def _serve_request(self, sock: socket.socket, session: ServedSession) -> bool:
        """Serve the next request; False to hang up."""
        while not _readable(sock, _IDLE_CHECK):
            if not session.is_open():
                return False
        sock.settimeout(_HELLO_TIMEOUT)  # the rest of the request follows at once
        op, count, deadline_us = _REQUEST.unpack(_recv_exact(sock, _REQUEST.size))
        if op not in (_READ, _WRITE) or not 0 < count <= MAX_DESCS:
            return False
        pairs = np.frombuffer(_recv_exact(sock, 16 * count), dtype="<u8").reshape(count, 2).astype(np.uint64)
        write = op == _WRITE
        with session.hold(pairs):  # from before the check to the last byte: deregistration waits
            code, text = _OK, ""
            try:
                session.regions().check(pairs[:, 0], pairs[:, 1], write, "requested")
            except AccessDenied as exc:
                code, text = _DENIED, str(exc)
            except HixlError as exc:
                code, text = _OUT_OF_RANGE, str(exc)
            if code == _OK and session.expired(deadline_us):
                code, text = _LATE, "the request arrived after its deadline"
            if code != _OK:
                left = sum(pairs[:, 1].tolist()) if write else 0
                while left:  # a WRITE's data follows it: read past it, to keep the stream in step
                    left -= len(_recv_exact(sock, min(left, CHUNK)))
                sock.sendall(_reply(code, text))
                return True
            deadline = session.local_deadline(deadline_us)
            if not write:
                sock.sendall(_reply(_OK))
            for piece in _chunks(pairs):
                if not session.is_open() or time.monotonic() >= deadline:
                    return False  # past its deadline, or cut off: nothing more moves
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                if write:
                    _recv_into(sock, piece)
                else:
                    sock.sendall(piece)
            if write:
                sock.sendall(_reply(_OK))
        return True

    def close(self) -> None:
        """Stop listening, hang up on every client and join the threads; idempotent."""
        with self._lock:
            self._closed = True
            listener, self._listener = self._listener, None
            clients, threads = list(self._clients.values()), list(self._threads)
        for sock in [listener, *clients]:
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked on it
                except OSError:
                    pass
        for thread in threads:
            thread.join(5.0)
        if listener is not None:
            listener.close()

    # -- initiator half -------------------------------------------------------------------------
    def probe(self, link: LinkSession) -> str | None:
        """Connect to the peer's socket and check that it is this connection's target."""
        info = link.welcome.get("transports", {}).get("sidecar")
        if not isinstance(info, dict) or not isinstance(info.get("socket"), str):
            return "the peer does not offer sidecar"
        try:
            self._dialed[link] = _dial(link, info["socket"], _HELLO_TIMEOUT)
        except (OSError, HixlError) as exc:
            return f"cannot use the peer's sidecar socket: {exc}"
        return None

    def open(self, link: LinkSession) -> Channel:
        """A channel over the socket :meth:`probe` connected."""
        return SidecarChannel(link, self._dialed.pop(link), link.welcome["transports"]["sidecar"]["socket"])


def _dial(link: LinkSession, name: str, timeout: float) -> socket.socket:
    """A socket to the peer's sidecar, bound to ``link``'s connection, within ``timeout`` seconds."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(timeout)
        sock.connect("\0" + name)
        sock.sendall(link.binding("sidecar"))
        if not hmac.compare_digest(_recv_exact(sock, 16), link.binding("sidecar-target")):
            raise ProtocolError("the sidecar socket did not prove it belongs to this connection's target")
    except BaseException:
        sock.close()
        raise
    return sock


class SidecarChannel(Channel):
    """Sends requests over the peer's sidecar socket, one at a time, on the calling thread."""

    def __init__(self, link: LinkSession, sock: socket.socket, name: str) -> None:
        self.link = link
        self._sock: socket.socket | None = sock
        self._name = name
        # One request at a time on the socket; the engine's async worker starts requests in order.
        self._lock = threading.Lock()

    def start(self, req: TransferReq, op: Op, descs: np.ndarray) -> None:
        """Move the whole request before returning (see the module docstring)."""
        req.lands_remotely = op is Op.WRITE  # the target lands a WRITE: cancel waits for its answer
        if not self._lock.acquire(timeout=req.remaining()):
            req.fail(TransferTimeout(f"{req!r} waited past its deadline for the requests before it"))
            return
        try:
            if self._sock is None:  # the last one was hung up on: a fresh one, bound the same way
                self.link.ensure_alive()
                self._sock = _dial(self.link, self._name, req.remaining())
            for i in range(0, len(descs), MAX_DESCS):
                refusal = self._exchange(self._sock, req, op, descs[i : i + MAX_DESCS])
                if refusal is not None:
                    req.fail(refusal)
                    return
        except (OSError, HixlError) as exc:
            self._hang_up()
            late = req.deadline is not None and time.monotonic() >= req.deadline
            error = TransferTimeout(f"{req!r} passed its deadline") if late else PeerDisconnected(f"sidecar: {exc}")
            req.fail(error)
            return
        finally:
            self._lock.release()
        req.complete()

    def _exchange(self, sock: socket.socket, req: TransferReq, op: Op, descs: np.ndarray) -> HixlError | None:
        """One request and its reply; the error it was refused with, if it was."""
        write = op is Op.WRITE
        deadline_us = self.link.peer_deadline(req.deadline)
        pairs = np.ascontiguousarray(descs[:, 1:3], dtype="<u8")
        sock.settimeout(req.remaining())
        sock.sendall(_REQUEST.pack(_WRITE if write else _READ, len(descs), deadline_us) + pairs.tobytes())
        local = descs[:, [0, 2]]
        if write:
            for piece in _chunks(local):
                sock.settimeout(req.remaining())
                sock.sendall(piece)
        sock.settimeout(req.remaining())
        code, length = _REPLY.unpack(_recv_exact(sock, _REPLY.size))
        if code != _OK:
            if code not in _ERRORS or length > 4096:
                raise ProtocolError(f"a sidecar reply with code {code} and {length} bytes of text")
            text = _recv_exact(sock, length).decode("utf-8", "replace")
            return _ERRORS[code](f"{self.link.remote_engine} refused the transfer: {text}")
        if not write:
            for piece in _chunks(local):
                self._land(sock, req, piece)
        return None

    @staticmethod
    def _land(sock: socket.socket, req: TransferReq, piece: memoryview) -> None:
        """Receive ``piece`` of a READ's destination; waits outside ``io_lock``, lands under it."""
        done = 0
        while done < len(piece):
            if not _readable(sock, req.remaining()) or (req.deadline is not None and time.monotonic() >= req.deadline):
                req.done()  # a look past its deadline makes it TIMEOUT
                raise TransferTimeout(f"{req!r} passed its deadline")
            with req.io_lock:
                if req.cancelled:  # expired or cancelled: its status says which, and this is no-op'd
                    raise TransferTimeout(f"{req!r} ended before its data")
                got = sock.recv_into(piece[done:])
            if not got:
                raise ConnectionError("the target hung up mid-reply")
            done += got

    def _hang_up(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def close(self) -> None:
        """Close the sidecar socket."""
        self._hang_up()
