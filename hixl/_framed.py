"""A socket that speaks hixl frames, shared by both ends of a connection.

It owns the byte-level concerns — whole frames in, whole frames out, data moved
with readv/writev straight to and from registered memory — and liveness: the
socket timeout is the heartbeat interval; on each idle timeout it sends PING,
and once the peer showed no sign of life (nothing received from it, none of our
bulk data taken) for ``interval * misses`` seconds it is declared dead with
:class:`PeerDisconnected`.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np

from . import _protocol as proto
from ._exceptions import HixlTimeout, PeerDisconnected, TransferTimeout
from ._iov import IovCursor, bytes_cursor, socket_vector_io

#: Bytes moved between two checks of a request's ``cancelled`` flag.
CHUNK = 8 << 20


class FramedSocket:
    """Frame I/O with heartbeats over one connected socket (see module docstring)."""

    def __init__(self, sock: socket.socket, peer: str, interval: float, misses: int) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(interval)
        self.sock = sock
        self.peer = peer
        self.interval = interval
        self.misses = misses
        self.send_lock = threading.Lock()
        self.last_activity = time.monotonic()
        self.dead_reason = ""

    def mark_dead(self, reason: str) -> None:
        """Remember why the connection ended and wake anyone blocked on it."""
        if not self.dead_reason:
            self.dead_reason = reason
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def check_alive(self) -> None:
        """Raise :class:`PeerDisconnected` if the connection has ended."""
        if self.dead_reason:
            raise PeerDisconnected(f"connection to {self.peer} is down: {self.dead_reason}")

    # -- receiving -------------------------------------------------------------------
    def recv_frame(self, deadline: float | None = None) -> proto.Message:
        """Block for the next frame (header and body; data is left on the socket).

        With ``deadline`` (handshakes), raise :class:`HixlTimeout` once it passes:
        heartbeats alone would wait for a peer that connects but never speaks.
        """
        header = proto.parse_header(self._recv_exact(proto.HEADER_SIZE, deadline))
        body = self._recv_exact(header.body_len, deadline) if header.body_len else b""
        return proto.parse_body(header, body)

    def _recv_exact(self, nbytes: int, deadline: float | None = None) -> bytes:
        buf = bytearray(nbytes)
        view = memoryview(buf)
        got = 0
        while got < nbytes:
            try:
                n = self.sock.recv_into(view[got:])
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise HixlTimeout(f"{self.peer} sent no complete frame in time") from None
                self._on_idle()
                continue
            except OSError as exc:
                self.mark_dead(f"socket error: {exc}")
                raise PeerDisconnected(f"connection to {self.peer} failed: {exc}") from exc
            if n == 0:
                self.mark_dead("peer closed the connection")
                self.check_alive()
            got += n
            self.last_activity = time.monotonic()
        return bytes(buf)

    def receive_into(self, cursor: IovCursor, owner: object) -> None:
        """Receive data into ``cursor``'s memory in chunks, stopping once ``owner`` is cancelled.

        ``owner`` has ``io_lock`` and ``cancelled`` (a :class:`~hixl.TransferReq`);
        data arriving after it was cancelled is drained, never written.
        """
        while not cursor.finished:
            with owner.io_lock:  # type: ignore[attr-defined]
                if owner.cancelled:  # type: ignore[attr-defined]
                    break
                self.move(cursor, write=False, limit=CHUNK)
        self.drain(cursor.total - cursor.done)

    def drain(self, nbytes: int) -> None:
        """Read and drop ``nbytes`` of data nobody wants."""
        scratch = np.empty(min(nbytes, CHUNK), dtype=np.uint8)
        while nbytes > 0:
            n = min(nbytes, len(scratch))
            self.move(IovCursor(np.array([[scratch.ctypes.data, n]], dtype=np.uint64)), write=False)
            nbytes -= n

    # -- sending ---------------------------------------------------------------------
    def send(self, frame: bytes, data: IovCursor | None = None, deadline: float | None = None) -> None:
        """Send a frame and (for WRITE/DATA) its data as one unit on the wire."""
        self.check_alive()
        with self.send_lock:
            self._send_frame(frame, deadline)
            if data is not None:
                self.move(data, write=True, deadline=deadline)

    def try_send(self, frame: bytes) -> bool:
        """Send a small frame only if nobody else is sending right now."""
        if self.dead_reason or not self.send_lock.acquire(blocking=False):
            return False
        try:
            self._send_frame(frame, None)
        except PeerDisconnected:
            return False
        finally:
            self.send_lock.release()
        return True

    def _send_frame(self, frame: bytes, deadline: float | None) -> None:
        """Send a header and body (caller holds ``send_lock``).

        Frames are small and the socket buffer is usually free, so one
        non-blocking ``send`` nearly always takes the whole frame; the iovec
        machinery of :meth:`move` is kept for the rest. That halves a control
        round trip's Python cost.
        """
        try:
            sent = self.sock.send(frame, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self.mark_dead(f"socket error: {exc}")
            raise PeerDisconnected(f"connection to {self.peer} failed: {exc}") from exc
        if sent < len(frame):
            self.move(bytes_cursor(frame[sent:]), write=True, deadline=deadline, sign_of_life=False)

    def move(
        self,
        cursor: IovCursor,
        write: bool,
        deadline: float | None = None,
        limit: int | None = None,
        sign_of_life: bool = True,
    ) -> None:
        """Vector I/O that tolerates a slow peer but not a dead one, nor a passed deadline.

        Progress counts as a sign of the peer's life unless ``sign_of_life`` is
        false. Sending a frame is no such sign — a frozen peer's kernel still
        buffers it, and counting our own PINGs kept such links alive forever —
        but bulk data flowing on is: the peer reads it, so it's alive while it
        sends us nothing back.
        """
        stop = cursor.total if limit is None else min(cursor.total, cursor.done + limit)
        while cursor.done < stop:
            try:
                socket_vector_io(self.sock.fileno(), cursor, write, self.interval, stop - cursor.done)
            except TimeoutError:
                self._on_idle()
                if deadline is not None and time.monotonic() >= deadline:
                    # Part of a frame is on the wire: the stream can't be resumed.
                    self.mark_dead("a send passed its deadline mid-frame")
                    raise TransferTimeout(f"sending to {self.peer} timed out") from None
            except OSError as exc:
                self.mark_dead(f"socket error: {exc}")
                raise PeerDisconnected(f"connection to {self.peer} failed: {exc}") from exc
            if sign_of_life:
                self.last_activity = time.monotonic()

    def _on_idle(self) -> None:
        self.check_alive()
        silent = time.monotonic() - self.last_activity
        if silent > self.interval * self.misses:
            self.mark_dead(f"no sign of life for {silent:.1f} s")
            self.check_alive()
        if silent >= self.interval:
            self.try_send(proto.encode(proto.Ping()))

    def close(self) -> None:
        """Shut the socket down and release it."""
        self.mark_dead("closed")
        self.sock.close()
