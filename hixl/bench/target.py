"""The benchmark's far side: a child process with a target engine *and* a raw socket server.

:class:`hixl.testing.TargetProcess` cannot free buffers, and the TCP
baseline needs a plain socket server reading and writing the very buffers
the engine serves; so the bench runs its own child. Buffers are allocated
with :func:`hixl.empty`, filled (so every page is resident before anything is
timed), registered with the engine, and freed again between phases to keep
the run's footprint to one phase's worth.

The child is a ``python -m hixl.bench._target_main`` process started through
:class:`hixl._child.ChildProcess`, like hixl's other test peers.

The raw server speaks the smallest protocol that can do the job: a 17-byte
request ``op ('R'|'W'), addr, nbytes``; for ``R`` it ``sendall``\\s the bytes,
for ``W`` it ``recv_into``\\s them (:func:`recv_exact`) and answers one byte.
Both ends of a raw stream set the same options (:func:`tune_stream`), and both poll for
the next bytes a moment before they block (:func:`await_bytes`), as hixl does.
"""

from __future__ import annotations

import mmap
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import numpy as np

from .._tools.child import ChildProcess, CommandChild, serve_commands

if TYPE_CHECKING:
    from ..testing.hosts import Host

__all__ = [
    "ECHO",
    "ECHO_SIZE",
    "RAW_HEADER",
    "STREAM",
    "STREAM_LOWAT",
    "STREAM_LOWAT_FROM",
    "BenchTarget",
    "RemoteBuffer",
    "await_bytes",
    "map_memfd",
    "readable",
    "recv_exact",
    "sample_bytes",
    "tune_stream",
]

RAW_HEADER = struct.Struct("<cQQ")
STREAM, ECHO = b"S", b"E"
"""First byte of a raw connection: a READ/WRITE stream, or 8-byte echo (the round-trip baseline)."""
ECHO_SIZE = 8
BUSY_POLL = 50e-6
"""Seconds both ends of a raw stream poll for the next bytes before a blocking read (the default
of hixl's option ``busy_poll``): a blocked thread's wake-up costs ~30 us on a VM whose idle CPU
halts, and the baseline is to be the fastest plain loop — as fast as the echo of two threads
that happen to share a CPU, wherever the scheduler puts them."""
STREAM_LOWAT = 256 << 10
"""The low-water mark (``SO_RCVLOWAT``) a raw stream's receiver reads a large message at: see
:func:`recv_exact`. hixl's own receiver asks for the same."""
STREAM_LOWAT_FROM = 4 << 20
"""The smallest message read at :data:`STREAM_LOWAT`: a 1 MiB READ ran at 0.6-0.9x of the plain
read with the mark raised (it waits for a window the sender has not filled yet), 4 MiB alike,
16-512 MiB mostly faster (docs/measurements.md, "The engine scenario's baselines")."""
#: Bytes at the start of every target buffer that hold a seeded random pattern (for self-checks).
SAMPLE = 64 << 10


def sample_bytes(seed: int, nbytes: int) -> np.ndarray:
    """The pattern a target buffer allocated with ``seed`` starts with (its first ``nbytes``)."""
    return np.random.default_rng(seed).integers(0, 256, min(nbytes, SAMPLE), dtype=np.uint8)


@dataclass(frozen=True)
class RemoteBuffer:
    """A buffer registered in the target process."""

    id: int
    addr: int
    size: int


# -- the child -------------------------------------------------------------------------------
class _RawServer:
    """Plain-socket READ/WRITE of the child's buffers: the TCP baseline (see module docstring)."""

    def __init__(self, buffers: dict[int, np.ndarray], host: str) -> None:
        self.buffers = buffers
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind((host, 0))
        self.listener.listen(8)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, name="bench-raw-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            tune_stream(sock)
            threading.Thread(target=self._serve, args=(sock,), name="bench-raw-serve", daemon=True).start()

    def _view(self, addr: int, nbytes: int) -> memoryview:
        for buf in list(self.buffers.values()):
            start = int(buf.ctypes.data)
            if start <= addr and addr + nbytes <= start + buf.nbytes:
                return buf[addr - start : addr - start + nbytes].data
        raise ValueError(f"[{addr:#x}, +{nbytes}) is in no buffer")

    def _serve(self, sock: socket.socket) -> None:
        mode = bytearray(1)
        with sock:
            try:
                if sock.recv_into(mode, 1) != 1:
                    return
                if mode == ECHO:
                    _echo(sock)
                else:
                    self._stream(sock)
            except (OSError, ValueError):
                pass  # the initiator went away, or asked for nonsense: drop the connection

    def _stream(self, sock: socket.socket) -> None:
        header = bytearray(RAW_HEADER.size)
        poller = readable(sock)
        while await_bytes(poller) and recv_exact(sock, memoryview(header)):
            op, addr, nbytes = RAW_HEADER.unpack(header)
            view = self._view(addr, nbytes)
            if op == b"R":
                sock.sendall(view)
            else:
                if not recv_exact(sock, view):
                    return
                sock.sendall(b"\x01")


def _echo(sock: socket.socket) -> None:
    """The round-trip baseline's far end: 8-byte messages back as they come, the plainest loop."""
    message = bytearray(ECHO_SIZE)
    poller = readable(sock)
    while await_bytes(poller) and sock.recv_into(message, ECHO_SIZE, socket.MSG_WAITALL) == ECHO_SIZE:
        sock.send(message)


def readable(sock: socket.socket) -> select.poll:
    """A poll object watching ``sock`` for input, for :func:`await_bytes`."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return poller


def await_bytes(poller: select.poll, spin: float = BUSY_POLL) -> bool:
    """Look (yielding the CPU between looks) for up to ``spin`` seconds whether the socket of
    ``poller`` (:func:`readable`) has input, so that the blocking read that follows finds it
    there rather than sleeps; True (for use in a loop condition)."""
    end = time.monotonic() + spin
    while not poller.poll(0) and time.monotonic() < end:
        os.sched_yield()
    return True


def tune_stream(sock: socket.socket) -> None:
    """The options both ends of a raw connection set: ``TCP_NODELAY`` (an 8-byte echo or a
    request header goes out at once, as hixl's frames do)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from the blocking ``sock``; False on a clean EOF before the first byte.

    A blocking ``recv_into(..., MSG_WAITALL)`` is woken for every few segments that arrive;
    with the socket's low-water mark raised to :data:`STREAM_LOWAT` it is woken once that
    much has come, and a large message (from :data:`STREAM_LOWAT_FROM`) lands in far fewer
    wake-ups (hixl's receiver does the same; over a veth the plain read reached 1.56 GiB/s
    where this reaches 2-2.7). The mark is raised for all but the message's last
    :data:`STREAM_LOWAT` bytes: a mark above what is still to come would never be reached,
    and the read would wait for ever. It is 1 again before this returns, for whatever is
    read next (a header, a WRITE's 1-byte ack).
    """
    nbytes = len(view)
    if nbytes < STREAM_LOWAT_FROM:
        return _fill(sock, view, started=False)
    head = nbytes - STREAM_LOWAT
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, STREAM_LOWAT)
    try:
        if not _fill(sock, view[:head], started=False):
            return False
    finally:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
    return _fill(sock, view[head:], started=True)


def _fill(sock: socket.socket, view: memoryview, started: bool) -> bool:
    """``recv_exact`` without the low-water mark: one ``MSG_WAITALL`` call in the normal case."""
    got = sock.recv_into(view, len(view), socket.MSG_WAITALL)
    while got < len(view):
        if got == 0 and not started:
            return False
        n = sock.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        if n == 0:
            raise ConnectionError("peer closed mid-message")
        got += n
    return True


def _serve(conn: Connection) -> None:
    """The child's main loop: host and options in, then ``(command, args)`` requests until ``exit``."""
    from .. import Engine, empty  # imported in the child only

    host, options = conn.recv()
    engine = Engine(f"{host}:0", options)
    buffers: dict[int, np.ndarray] = {}
    handles: dict[int, Any] = {}
    raw = _RawServer(buffers, host)
    conn.send((engine.local_engine, raw.port, os.getpid()))
    state = {"next_id": 1}

    def alloc(size: int, seed: int, fill: int, shared: bool) -> tuple[int, int]:
        buf = empty(size, shared=shared)
        buf.fill(fill)  # touch every page now, not inside a timed transfer
        buf[:SAMPLE] = sample_bytes(seed, size)
        buf_id = state["next_id"]
        state["next_id"] += 1
        buffers[buf_id], handles[buf_id] = buf, engine.register_mem(buf)
        return buf_id, int(buf.ctypes.data)

    def free(buf_id: int) -> None:
        engine.deregister_mem(handles.pop(buf_id))
        del buffers[buf_id]  # the last reference: the mapping goes back to the kernel

    def read(buf_id: int, offset: int, nbytes: int) -> bytes:
        return buffers[buf_id][offset : offset + nbytes].tobytes()

    def memfd(buf_id: int) -> int:
        from .._shm_pool import overlapping

        (entry,) = overlapping(int(buffers[buf_id].ctypes.data), 1)
        return entry.fd

    commands: dict[str, Callable[..., Any]] = {"alloc": alloc, "free": free, "read": read, "memfd": memfd}
    try:
        serve_commands(conn, lambda command, args: commands[command](*args))
    finally:
        raw.listener.close()
        engine.finalize()


def map_memfd(path: str, nbytes: int) -> np.ndarray:
    """The first ``nbytes`` of the memfd at ``path`` (a ``/proc/<pid>/fd/<n>`` of a process of ours),
    mapped shared, every page populated up front."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)
    return np.frombuffer(mapping, dtype=np.uint8, count=nbytes)


# -- the parent's handle ---------------------------------------------------------------------
class BenchTarget(CommandChild):
    """Start the bench's target process; a context manager. See the module docstring.

    Attributes: ``engine`` (its ``"ip:port"``), ``raw_address`` (the raw
    server's ``(host, port)``) and ``pid``. With ``host`` (a :class:`~hixl.testing.hosts.Host`
    without a PID namespace of its own, so that ``pid`` means the same process here), the
    child runs on it and both servers listen on its address; else on 127.0.0.1.
    """

    who = "bench target"

    def __init__(self, options: dict[str, Any] | None = None, timeout: float = 60.0, host: Host | None = None) -> None:
        if host is not None and host.pid_namespace:
            raise ValueError("the bench target reads its own pid from /proc here: give a host without a PID namespace")
        ip = "127.0.0.1" if host is None else host.ip
        self._child = ChildProcess("hixl.bench._target_main", timeout, prefix=[] if host is None else host.prefix)
        try:
            self._child.send((ip, options or {}))
            self.engine, port, self.pid = self._child.receive()
        except BaseException:
            self._child.kill()
            raise
        self.raw_address = (ip, port)

    def alloc(self, size: int, seed: int = 0, fill: int = 0x5A, shared: bool = False) -> RemoteBuffer:
        """A new registered buffer of ``size`` bytes: ``fill`` everywhere, then :func:`sample_bytes` in front;
        from the shared-memory pool if ``shared`` (what the shm transport moves)."""
        buf_id, addr = self._do("alloc", size, seed, fill, shared)
        return RemoteBuffer(buf_id, addr, size)

    def free(self, buf: RemoteBuffer) -> None:
        """Deregister and release ``buf``."""
        self._do("free", buf.id)

    def memfd_path(self, buf: RemoteBuffer) -> str:
        """Where this process (or another of ours) opens the memfd behind the target's pool buffer ``buf``."""
        return f"/proc/{self.pid}/fd/{self._do('memfd', buf.id)}"

    def mapped(self, buf: RemoteBuffer) -> np.ndarray:
        """The target's pool buffer ``buf`` mapped into this process, through its memfd (opened in
        ``/proc``: the child is ours): the very memory an shm transfer copies, for its baselines."""
        return map_memfd(self.memfd_path(buf), buf.size)

    def read(self, buf: RemoteBuffer, offset: int, nbytes: int) -> bytes:
        """Bytes of ``buf`` as the target sees them."""
        return self._do("read", buf.id, offset, nbytes)  # type: ignore[no-any-return]
