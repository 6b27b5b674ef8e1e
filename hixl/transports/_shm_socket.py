"""The Unix socket over which a target hands its pool memfds to initiators (``SCM_RIGHTS``).

Both ends of the exchange described in :mod:`hixl._protocol.shm`:

- :class:`GrantServer` (target): one thread with one ``selectors`` loop serves
  every client, so a client that stalls delays only itself. Whatever arrives is
  input from someone unknown: a client gets ``timeout`` seconds from ``accept``
  to send its one request and take the answer, requests are read into a buffer
  one byte longer than a valid one (so anything longer is seen, never buffered),
  descriptors sent *to* the server are discarded by the kernel (no room is given
  for them), and at most ``max_clients`` are served at once (a newcomer evicts the
  oldest). Each client's credentials (``SO_PEERCRED``: pid, uid, gid, as the
  kernel saw them at connect) go to the ``answer`` callback with its request.
- :func:`fetch` (initiator): one connect, one request, replies until the last,
  all within one deadline; every descriptor received is closed if anything fails.

The socket is a path, not an abstract name: abstract sockets belong to a network
namespace, so two containers of one node in different network namespaces could
not reach each other, while a directory both mount can be shared.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import struct
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from .._exceptions import ProtocolError
from .._protocol import shm as shm_proto

__all__ = ["Credentials", "Fetched", "GrantServer", "Received", "fetch"]

log = logging.getLogger("hixl")

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_WAKE = "wake"


class Credentials(NamedTuple):
    """Who connected, as the kernel saw it at connect (pid 0: not in our pid namespace)."""

    pid: int
    uid: int
    gid: int


Message = tuple[bytes, list[int]]
"""A message to send and the descriptors riding on it (owned by the server from then on)."""
Answer = Callable[[bytes, Credentials], list[Message]]


class _Client:
    __slots__ = ("cred", "deadline", "outbox", "sock")

    def __init__(self, sock: socket.socket, cred: Credentials, deadline: float) -> None:
        self.sock, self.cred, self.deadline = sock, cred, deadline
        self.outbox: deque[Message] | None = None  # None until the request came


class GrantServer:
    """Serves ``answer`` on a Unix socket at ``path`` (see the module docstring)."""

    def __init__(self, path: str, answer: Answer, timeout: float, max_clients: int = 64) -> None:
        self.path = path
        self._answer = answer
        self._timeout = timeout
        self._max_clients = max_clients
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self._listener.bind(path)
            # Peers may run as other users (the point of this transport); the binding, not the
            # file mode, decides who gets anything.
            os.chmod(path, 0o666)
            self._listener.listen(64)
            self._listener.setblocking(False)
        except BaseException:
            self._listener.close()
            raise
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._clients: dict[socket.socket, _Client] = {}  # insertion order: oldest first
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"hixl-shm-{os.path.basename(path)}", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """Stop serving, close every client and unlink the socket; idempotent."""
        if self._closed:
            return
        self._closed = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout)
        for client in list(self._clients.values()):
            self._drop(client)
        self._selector.close()
        self._listener.close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def _run(self) -> None:
        try:
            while not self._closed:
                now = time.monotonic()
                for client in [c for c in self._clients.values() if c.deadline <= now]:
                    log.warning(
                        "hixl: shm socket %s: dropped pid %d (uid %d): no complete exchange within %.1f s",
                        self.path, client.cred.pid, client.cred.uid, self._timeout,
                    )
                    self._drop(client)
                wait = min((c.deadline for c in self._clients.values()), default=now + 3600) - now
                for key, events in self._selector.select(max(0.0, wait)):
                    if key.data == _WAKE:
                        return
                    client = key.data
                    if client is None:
                        self._accept()
                    elif self._clients.get(client.sock) is client:  # (not dropped earlier in this batch)
                        self._serve(client)
        except Exception:  # a bug must not leave initiators waiting on a dead server unnoticed
            log.exception("hixl: shm socket %s crashed", self.path)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say: the clients waiting are served later
                log.warning("hixl: shm socket %s cannot accept: %s", self.path, exc)
                return
            sock.setblocking(False)
            pid, uid, gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
            if len(self._clients) >= self._max_clients:
                oldest = next(iter(self._clients.values()))
                log.warning("hixl: shm socket %s: %d clients at once; dropped the oldest", self.path, len(self._clients))
                self._drop(oldest)
            client = _Client(sock, Credentials(pid, uid, gid), time.monotonic() + self._timeout)
            self._clients[sock] = client
            self._selector.register(sock, selectors.EVENT_READ, client)

    def _serve(self, client: _Client) -> None:
        try:
            if client.outbox is None:
                # Room for one byte more than a request: a longer message is cut and seen as malformed.
                data = client.sock.recv(shm_proto.REQUEST_SIZE + 1)
                if not data:
                    self._drop(client)  # hung up (or sent an empty message) before asking
                    return
                client.outbox = deque(self._answer(data, client.cred))
                self._selector.modify(client.sock, selectors.EVENT_WRITE, client)
            self._flush(client)
        except (BlockingIOError, InterruptedError):
            pass  # not ready after all: the selector says when
        except OSError as exc:
            log.info("hixl: shm socket %s: pid %d went away: %s", self.path, client.cred.pid, exc)
            self._drop(client)
        except Exception:  # a bug in answering one client must not stop the server
            log.exception("hixl: shm socket %s: answering pid %d failed", self.path, client.cred.pid)
            self._drop(client)

    def _flush(self, client: _Client) -> None:
        assert client.outbox is not None
        while client.outbox:
            payload, fds = client.outbox[0]
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array("i", fds))] if fds else []
            client.sock.sendmsg([payload], rights)  # whole or not at all (SOCK_SEQPACKET)
            client.outbox.popleft()
            _close_all(fds)
        self._drop(client)  # everything went out; what is queued is still delivered

    def _drop(self, client: _Client) -> None:
        if self._clients.pop(client.sock, None) is None:
            return
        try:
            self._selector.unregister(client.sock)
        except (KeyError, ValueError):
            pass
        client.sock.close()
        for _, fds in client.outbox or ():
            _close_all(fds)

    def __repr__(self) -> str:
        return f"<GrantServer {self.path} clients={len(self._clients)}>"


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class Received(NamedTuple):
    """One grant and the descriptor that came with it (the caller owns and closes it)."""

    grant: shm_proto.Grant
    fd: int


class Fetched(NamedTuple):
    """What :func:`fetch` got: the grants, and the target's liveness pipe (both the caller's to close)."""

    received: list[Received]
    liveness: int


def _connect(sock: socket.socket, path: str, deadline: float) -> None:
    """Connect by ``deadline``. A Unix socket whose backlog is full refuses a non-blocking connect
    with EAGAIN at once (it does not wait as TCP would): try again, briefly, until the target
    has accepted what filled it."""
    pause = 0.001
    while True:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() + pause >= deadline:
                raise TimeoutError(f"{path} accepted no connection in time (its backlog is full)") from None
            time.sleep(pause)
            pause = min(0.05, pause * 2)


def fetch(path: str, binding: bytes, proof: bytes, timeout: float) -> Fetched:
    """Ask the target at ``path`` for its grants, proving ``binding``; all within ``timeout`` s.

    Raises :class:`~hixl._protocol.shm.Refused` if the target says no,
    :class:`~hixl.ProtocolError` for a malformed answer (or one without this
    connection's ``proof``), ``OSError`` (``TimeoutError`` among them) if it cannot
    be reached in time. Every descriptor received is closed if it raises.
    """
    deadline = time.monotonic() + timeout
    received: list[Received] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
            _connect(sock, path, deadline)
            sock.send(shm_proto.encode_request(binding))
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no complete answer from {path} within {timeout} s")
                sock.settimeout(left)
                data, fds, flags, _ = socket.recv_fds(
                    sock, shm_proto.MAX_MESSAGE + 1, shm_proto.MAX_PER_MESSAGE + 1, socket.MSG_CMSG_CLOEXEC
                )
                pending = list(fds)  # ours from here on, whatever follows
                try:
                    if not data:
                        raise ConnectionError(f"{path} hung up before its last answer")
                    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                        raise ProtocolError("an answer too long, or with too many descriptors")
                    reply = shm_proto.decode_reply(data, len(pending), proof)
                    if len(received) + len(reply.grants) > shm_proto.MAX_GRANTS:
                        raise ProtocolError(f"more than {shm_proto.MAX_GRANTS} grants")
                except BaseException:
                    _close_all(pending)
                    raise
                received += [Received(g, fd) for g, fd in zip(reply.grants, pending)]
                if reply.last:
                    return Fetched(received, pending[-1])
    except BaseException:
        _close_all([r.fd for r in received])
        raise
