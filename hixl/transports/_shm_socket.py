"""The Unix socket beside an authenticated TCP connection: how a same-host target proves which
process it is, and how an shm target hands its pool memfds to initiators (``SCM_RIGHTS``).

Whoever connects to such a socket learns from the kernel, not from anything said on it, which
process listens there (:func:`hixl.transports._peerproc.listener`); whoever answers must prove it
serves the authenticated connection the client names. So the process that runs the peer engine is
known for certain, whatever descriptors the peer passed around (see :mod:`._peerproc`).

- :class:`SessionSocket` (target): the socket of one transport, made on first need at a fresh
  path in a directory others cannot swap it in, that hands a client proving the binding of a
  connection this engine serves right now to the transport's ``serve`` callback (and refuses
  anyone else, or uids outside an allow-list).
- :class:`GrantServer` (target): one thread with one ``selectors`` loop serves
  every client, so a client that stalls delays only itself. Whatever arrives is
  input from someone unknown: a client gets ``timeout`` seconds from ``accept``
  to send its one request and take the answer, requests are read into a buffer
  one byte longer than a valid one (so anything longer is seen, never buffered),
  descriptors sent *to* the server are discarded by the kernel (no room is given
  for them), and at most ``max_clients`` are served at once (a newcomer evicts the
  oldest). Each client's credentials (``SO_PEERCRED``: pid, uid, gid, as the
  kernel saw them at connect) go to the ``answer`` callback with its request.
- :func:`prove` (cma's initiator): one connect, one request, one proof back; the process that
  listens there, pinned.
- :func:`fetch` (shm's initiator): one connect, one request, replies until the last,
  all within one deadline and at most so many grants. A descriptor that is not a pool memfd made
  by the process listening there (one passed on from another process, a socket, a pipe) is closed
  as soon as it arrives; every descriptor received is closed if anything fails.

The socket is a path, not an abstract name: abstract sockets belong to a network
namespace, so two containers of one node in different network namespaces could
not reach each other, while a directory both mount can be shared.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import secrets
import selectors
import socket
import stat
import struct
import threading
import time
import weakref
from array import array
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from .. import _shm_pool
from .._exceptions import ProtocolError
from .._protocol import shm as shm_proto
from ._peerproc import PeerProcess, listener

if TYPE_CHECKING:
    from .base import LinkSession, ServedSession

__all__ = [
    "Credentials",
    "Fetched",
    "GrantServer",
    "Received",
    "SessionSocket",
    "default_socket_dir",
    "fetch",
    "probe_timeout",
    "prove",
    "usable_path",
]

log = logging.getLogger("hixl")

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_WAKE = "wake"
DIR_ENV = "HIXL_SHM_DIR"
"""Environment variable naming the default socket directory."""
DEFAULT_DIR = "/tmp"
_SUN_PATH = 108  # sizeof(sockaddr_un.sun_path), the terminating NUL included
_STALE_AFTER = 60.0
"""Seconds after which a socket nobody listens on is taken for one left by a dead engine."""


class Credentials(NamedTuple):
    """Who connected, as the kernel saw it at connect (pid 0: not in our pid namespace)."""

    pid: int
    uid: int
    gid: int

    def __str__(self) -> str:
        return f"pid {self.pid} (uid {self.uid}, gid {self.gid})"


Message = tuple[bytes, list[int]]
"""A message to send and the descriptors riding on it (owned by the server from then on)."""
Answer = Callable[[bytes, Credentials], list[Message]]
Serve = Callable[["ServedSession", Credentials], list[Message]]
"""What a :class:`SessionSocket` answers a client that proved a connection's binding."""


def default_socket_dir(socket_dir: str | os.PathLike[str] | None) -> str:
    """``socket_dir``, or by default ``$HIXL_SHM_DIR``, else ``/tmp``."""
    return os.fspath(socket_dir or os.environ.get(DIR_ENV) or DEFAULT_DIR)


def _directory_problem(path: str) -> str | None:
    """Why sockets in ``path`` could be swapped by someone else (None: they cannot)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"cannot use {path}: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid not in (0, os.geteuid()):
        return f"{path} belongs to uid {st.st_uid}, who could replace the sockets in it"
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return f"{path} is writable by others and not sticky: they could replace the sockets in it"
    return None


def _sweep(directory: str, prefix: str) -> None:
    """Remove this user's sockets named ``prefix...`` in ``directory`` that nobody listens on any
    more: their engine ended without ``finalize`` (killed, say). A socket made less than a minute
    ago is left alone, as its engine may not be listening yet. (By the refused connect, not by the
    pid in the name: that pid may be of another PID namespace.)"""
    old = time.time() - _STALE_AFTER
    try:
        entries = [e for e in os.scandir(directory) if e.name.startswith(prefix) and e.name.endswith(".sock")]
    except OSError:
        return
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid() or st.st_mtime > old:
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as probe:
                probe.setblocking(False)
                probe.connect(entry.path)
        except ConnectionRefusedError:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
        except OSError:
            continue  # someone listens (its backlog may be full), or it is gone already


def usable_path(path: object) -> bool:
    """Whether ``path`` (a peer's word) is an absolute path that fits a Unix socket address."""
    return isinstance(path, str) and path.startswith("/") and "\0" not in path and len(os.fsencode(path)) < _SUN_PATH


def probe_timeout(link: LinkSession, most: float) -> float:
    """Seconds a probe of ``link`` may take: ``most``, or what is left before the deadline of the
    ``connect`` that made it, if that comes first (0: nothing left)."""
    if link.connect_deadline is None:
        return most
    return max(0.0, min(most, link.connect_deadline - time.monotonic()))


class _Session:
    """A served connection that may use the socket; lives (in its keepalive) as long as the connection."""

    __slots__ = ("__weakref__", "session")

    def __init__(self, session: ServedSession) -> None:
        self.session = weakref.ref(session)


class SessionSocket:
    """The target half of a same-host transport's side channel (see the module docstring).

    ``name`` (the transport's) goes into the socket's file name and the log; ``label`` is the
    binding a client must prove (``ServedSession.binding(label)``); ``serve(session, cred)``
    answers one that did.
    """

    def __init__(
        self,
        name: str,
        socket_dir: str,
        label: str,
        serve: Serve,
        timeout: float,
        allowed_uids: frozenset[int] | None = None,
    ) -> None:
        self.name = name
        self.socket_dir = socket_dir
        self.label = label
        self.timeout = timeout
        self.allowed_uids = allowed_uids
        self._serve = serve
        self._lock = threading.Lock()
        self._server: GrantServer | None = None
        self._unavailable: str | None = None
        self._sessions: weakref.WeakValueDictionary[bytes, _Session] = weakref.WeakValueDictionary()

    def offer(self, session: ServedSession) -> str | None:
        """The socket's path, at which ``session``'s initiator may now prove its binding; None if
        this engine cannot listen (logged once)."""
        path = self._listening()
        if path is not None:
            token = _Session(session)
            session.keepalive.append(token)  # the binding is good as long as the connection
            with self._lock:
                self._sessions[session.binding(self.label)] = token
        return path

    def _listening(self) -> str | None:
        """The socket's path, listening from the first call on; None if it cannot be."""
        with self._lock:
            if self._server is None and self._unavailable is None:
                try:
                    self._server = GrantServer(self._new_path(), self._answer, self.timeout)
                except (OSError, ValueError) as exc:
                    self._unavailable = str(exc)
                    log.warning("hixl: %s: no socket for peers on this host (they use another transport): %s", self.name, exc)
            return self._server.path if self._server is not None else None

    def _new_path(self) -> str:
        if not os.path.isdir(self.socket_dir):
            os.makedirs(self.socket_dir, exist_ok=True)
            os.chmod(self.socket_dir, 0o1777)  # peers of other users put their sockets here too
        problem = _directory_problem(self.socket_dir)
        if problem is not None:
            raise ValueError(problem)
        _sweep(self.socket_dir, f"hixl-{self.name}-")
        path = os.path.join(self.socket_dir, f"hixl-{self.name}-{os.getpid()}-{secrets.token_hex(6)}.sock")
        if not usable_path(path):
            raise ValueError(f"socket path {path!r} is longer than a Unix socket address allows")
        return path

    def _answer(self, request: bytes, cred: Credentials) -> list[Message]:
        """One client's request, on the socket's thread: ``serve``'s answer, or why not."""
        try:
            binding = shm_proto.decode_request(request)
        except ProtocolError as exc:
            return self._refuse(cred, f"malformed request: {exc}")
        if self.allowed_uids is not None and cred.uid not in self.allowed_uids:
            return self._refuse(cred, f"uid {cred.uid} is not among the allowed_uids")
        with self._lock:
            token = self._sessions.get(binding)
        session = token.session() if token is not None else None
        if session is None or not session.is_open():
            return self._refuse(cred, "no open authenticated connection has this binding")
        return self._serve(session, cred)

    def _refuse(self, cred: Credentials, reason: str) -> list[Message]:
        log.warning("hixl: %s: refused %s: %s", self.name, cred, reason)
        return [(shm_proto.encode_refusal(reason), [])]

    def close(self) -> None:
        """Stop listening and remove the socket; idempotent (no socket again after it)."""
        with self._lock:
            server, self._server = self._server, None
            self._unavailable = "closed"
        if server is not None:
            server.close()


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
        self._thread = threading.Thread(target=self._run, name=f"hixl-socket-{os.path.basename(path)}", daemon=True)
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
    refused: list[str]
    """Why each grant dropped on arrival was (its descriptor closed already)."""


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


def prove(path: str, binding: bytes, proof: bytes, timeout: float, root: str = "") -> PeerProcess:
    """The process listening at ``path``, pinned, once it proved that it serves the connection whose
    bindings are ``binding`` (sent) and ``proof`` (expected back); all within ``timeout`` s.

    ``root``: the directory ``path`` is found from (``/proc/<pid>/root``: from that process's mount
    namespace). Its pid is the kernel's (0 if it is outside our PID namespace). Raises
    :class:`~hixl._protocol.shm.Refused` if it says no, :class:`~hixl.ProtocolError` for anything
    but the proof, ``OSError`` (``TimeoutError`` among them) if it cannot be reached in time.
    """
    deadline = time.monotonic() + timeout
    directory, name = os.path.split(path)
    # Through the directory, opened apart: ``root`` and the path together may be longer than a
    # socket address allows, the directory's descriptor and the name are not.
    where = os.open(f"{root}{directory}", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
        try:
            _connect(sock, f"/proc/self/fd/{where}/{name}", deadline)
        finally:
            os.close(where)
        process = PeerProcess(*listener(sock))
        try:
            sock.send(shm_proto.encode_request(binding))
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            data = sock.recv(shm_proto.MAX_MESSAGE + 1)  # (no room for descriptors: the kernel drops any)
            if not hmac.compare_digest(data, proof):
                shm_proto.decode_reply(data, 0, proof)  # raises Refused, or says what is wrong with it
                raise ProtocolError(f"{path} answered with grants, not a proof")
        except BaseException:
            process.close()
            raise
    return process


def fetch(path: str, binding: bytes, proof: bytes, timeout: float, max_grants: int = shm_proto.MAX_GRANTS) -> Fetched:
    """Ask the target at ``path`` for its grants, proving ``binding``; all within ``timeout`` s
    and at most ``max_grants`` of them.

    A grant whose descriptor is not a pool memfd made by the process listening at ``path`` (as the
    kernel names it: see :func:`hixl._shm_pool.identity`) is dropped, its descriptor closed at once,
    and said why in :attr:`Fetched.refused`. Raises :class:`~hixl._protocol.shm.Refused` if the
    target says no, :class:`~hixl.ProtocolError` for a malformed answer (or one without this
    connection's ``proof``, or with too many grants), ``OSError`` (``TimeoutError`` among them) if
    it cannot be reached in time. Every descriptor received is closed if it raises.
    """
    deadline = time.monotonic() + timeout
    received: list[Received] = []
    refused: list[str] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
            _connect(sock, path, deadline)
            owner = _identity_of_listener(sock)
            sock.send(shm_proto.encode_request(binding))
            granted = 0
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
                    granted += len(reply.grants)
                    if granted > max_grants:
                        raise ProtocolError(f"more than {max_grants} grants (max_grants)")
                except BaseException:
                    _close_all(pending)
                    raise
                for grant, fd in zip(reply.grants, pending):
                    problem = _not_owned(fd, owner, path)
                    if problem is None:
                        received.append(Received(grant, fd))
                    else:
                        os.close(fd)  # not what was asked for: not kept a moment longer
                        refused.append(f"the descriptor for {grant.addr:#x} {problem}")
                if reply.last:
                    return Fetched(received, pending[-1], refused)
    except BaseException:
        _close_all([r.fd for r in received])
        raise


def _not_owned(fd: int, owner: str | None, path: str) -> str | None:
    """Why ``fd`` is not a pool memfd made by the process ``owner`` (None: it is one)."""
    if owner is None:
        return (
            f"cannot be told apart from another process's: the process listening at {path} cannot be named "
            "from here (it is gone, or outside our PID namespace on a kernel without pidfs)"
        )
    made_by = _shm_pool.creator(fd)
    if made_by is None:
        return "is not a pool memfd"
    if made_by != owner:
        return f"is a memfd of another process than the one listening at {path} (passed on to it)"
    return None


def _identity_of_listener(sock: socket.socket) -> str | None:
    """How the process listening at the other end of ``sock`` names its pool memfds (None: it
    cannot be told from here, and none is taken)."""
    pid, pidfd = listener(sock)
    process = PeerProcess(pid, pidfd)
    try:
        named = _shm_pool.identity(process.fd, pid)
        return named if process.alive() else None  # (alive: a pid read was still its own)
    finally:
        process.close()
