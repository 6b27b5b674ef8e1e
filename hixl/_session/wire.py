"""The I/O driver: runs a sans-IO :class:`~hixl._protocol.connection.Connection` over one socket.

It owns the byte-level concerns both ends share: frames out (one non-blocking
``send`` nearly always takes a whole frame), events in, bulk data moved with
``readv``/``writev`` straight between the socket and registered memory, and
liveness. The socket is always non-blocking; every wait is a ``poll`` bounded
by the heartbeat interval and the caller's deadline, so nothing waits inside a
syscall that could land bytes later (a stopped process resumes in ``poll``,
sees the time, and moves nothing).

Liveness counts only real progress: bytes received from the peer, or our bulk
data taken by its kernel while it reads. A peer that shows none for
``interval * misses`` seconds is declared dead (:class:`PeerDisconnected`); one
silent for half of that is PINGed, so that a healthy one always has something
to answer in time. ``TCP_USER_TIMEOUT`` tells the kernel the same budget for data it
could not deliver (a cut cable, a downed link).

Bytes that arrive in the same ``recv`` as a frame header (at most
:data:`READ_SIZE`) are copied once from the read buffer; everything after is
moved by the kernel straight into registered memory.

An encrypted connection (``encrypt=True``) switches, once its handshake has the session key
(:meth:`Wire.start_sealing`), to sealed records both ways (:mod:`hixl._session.sealed`): every
receive goes through the connection's opener — bulk data lands from a verified record, never
straight from the socket — and every send is sealed in the order it goes out. The compiled
latency paths (:func:`hixl._accel.tcp_reply` and its kin) speak plaintext frames only, so an
encrypted link never takes them (its small requests take the Python one, records and all);
on a plaintext link, each path is as it was, but for one test of :attr:`Wire.seal`.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar


from .. import _accel
from .. import _protocol as proto
from .._exceptions import PeerDisconnected, ProtocolError, TransferTimeout
from .._iov import IovCursor, bytes_cursor, readv, writev
from .._memory import memory_view
from .._protocol.connection import (
    NEED_DATA,
    Connection,
    ConnectionClosed,
    ConnState,
    Event,
)
from .._protocol.frames import HEADER_SIZE
from .._protocol.seal import Seal
from . import sealed

__all__ = ["CHUNK", "READ_SIZE", "Wire"]

T = TypeVar("T")

READ_SIZE = (64 << 10) + 4096
"""Bytes asked of the socket per frame read: a request or reply with up to 64 KiB of data comes
whole in one ``recv`` and is copied once from there — far cheaper than landing it straight from
the socket in pieces (a 16 KiB WRITE's ACK came after 163 us that way, 34 us this way). Larger
data lands straight from the socket after what came with its frame."""
CHUNK = 4 << 20
"""Most bytes one ``readv`` may land; deadlines and cancellation are checked between chunks."""
SENDMSG_RANGES = 8
"""Most data ranges sent with their frame in one ``sendmsg`` (a small reply: one segment, one ``recv``)."""
LANDING_RATE = 1 << 30
"""Bytes a second an initiator counts on the target landing a WRITE's data at, at the least, once
it is all sent (it lands 2.5-4 GiB/s here, Python's steps per piece included): it polls that much
longer for the ACK (see :meth:`Wire.reply_spin`)."""
LANDING_SPIN_MAX = 1e-3
"""The most seconds that adds to ``busy_poll``: a stalled target costs a spin this long, no more,
and a WRITE that takes longer pays a sleeping side's wake-up (~30 us) as a few percent at most."""
_LOWAT = 256 * 1024
"""Most bytes a data wait asks the kernel to gather first (small enough to show a slow peer's progress)."""
_POLLIN = select.POLLIN
_POLLOUT = select.POLLOUT


class _Scratch(threading.local):
    """A thread's receive buffer (see :attr:`Wire.scratch`)."""

    def __init__(self) -> None:
        self.data = bytearray(READ_SIZE)
        self.view = memoryview(self.data)


SCRATCH = _Scratch()
"""Each thread's receive buffer (its ``data``)."""


class Wire:
    """One connected socket and its :class:`Connection` (see the module docstring).

    One thread at a time reads (``read_lock``), one at a time sends (``send_lock``).
    """

    def __init__(self, sock: socket.socket, conn: Connection, peer: str, interval: float, misses: int) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, int(interval * misses * 1000)))
        sock.setblocking(False)
        self.sock = sock
        self.fd = sock.fileno()
        self.conn = conn
        self.peer = peer
        self.interval = interval
        self.misses = misses
        self.idle_ping: float | None = None
        """Set (seconds) for a link whose traffic all goes through this socket (TCP): while nothing
        waits on the peer, it is pinged only after this long silent, and its budget counts from
        then — a thousand idle links cost their target a few frames a second. None (cma, shm,
        whose copies bypass the socket): every link is busy, pinged at half its budget."""
        self.busy_since: float | None = None
        """When requests began waiting on the peer (its owner keeps it; None: none waits)."""
        self.busy_poll = 0.0
        """Seconds :meth:`read_reply` tries again for its reply before it sleeps (option ``busy_poll``)."""
        self.send_lock = threading.Lock()
        self.read_lock = threading.Lock()
        self.conn_lock = threading.Lock()
        self.last_alive = time.monotonic()
        self._last_ping = 0.0
        self._asked_at = 0.0  # the first PING since the peer was last heard (0: none yet)
        self.dead_reason = ""
        self._frame_started: float | None = None
        self.seal: Seal | None = None
        """The connection's seal once everything on this socket is sealed records (see :meth:`start_sealing`)."""

    @property
    def scratch(self) -> bytearray:
        """Where a ``recv`` of frames lands: the calling thread's (what it holds is handed to the
        connection before the call that read it returns), so a thousand connections cost a
        reading thread's buffer, not one each."""
        return SCRATCH.data

    @property
    def _scratch_view(self) -> memoryview:
        return SCRATCH.view

    def start_sealing(self) -> None:
        """Every byte from now on, both ways, is a sealed record: the connection just switched (see
        :attr:`Connection.seal <hixl._protocol.connection.Connection.seal>`), between two frames of
        the handshake, with nothing read past the one that switched it."""
        if self.conn.seal is None:
            raise RuntimeError("the connection has no seal: its handshake did not switch to sealed records")
        self.seal = self.conn.seal

    # -- life -----------------------------------------------------------------------------------
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

    def _fail(self, reason: str, cause: BaseException | None = None) -> PeerDisconnected:
        self.mark_dead(reason)
        error = PeerDisconnected(f"connection to {self.peer} failed: {reason}")
        error.__cause__ = cause
        return error

    def close(self) -> None:
        """Shut the socket down, and release it once nobody reads or sends on it.

        A reader or a sender inside a call holds the socket's descriptor number (``fd``, and C
        code holds it as an int), not the socket: released under it, the number goes to the next
        socket this process opens — a new connection, often to the same peer — and that thread's
        next syscall reads or writes the other connection's stream (its bytes stolen, or ours
        spliced into it). Shut down, the socket fails such syscalls at once, so holders let go
        soon. If either lock is held now (by the caller itself, perhaps, closing from a callback),
        a thread of its own releases the socket once both are free, waiting no longer than the
        peer's liveness budget (a holder stuck that long is not coming back)."""
        self.mark_dead("closed")
        if self.read_lock.acquire(blocking=False):
            if self.send_lock.acquire(blocking=False):
                self.sock.close()
                self.send_lock.release()
                self.read_lock.release()
                return
            self.read_lock.release()
        threading.Thread(target=self._close_when_free, name=f"hixl-close-{self.peer}", daemon=True).start()

    def _close_when_free(self) -> None:
        # Read role first, then the send lock: the order every holder of both takes them in.
        budget = self.interval * self.misses
        reading = self.read_lock.acquire(timeout=budget)
        sending = self.send_lock.acquire(timeout=budget)
        self.sock.close()
        if sending:
            self.send_lock.release()
        if reading:
            self.read_lock.release()

    # -- waiting ----------------------------------------------------------------------------------
    def wait(self, events: int, deadline: float | None, what: str) -> None:
        """Block until the socket is ready for ``events``, the peer is dead, or ``deadline``.

        Wakes at least every heartbeat interval to check liveness and PING an idle peer.
        Raises :class:`TransferTimeout` (naming ``what``) once ``deadline`` passed.
        """
        poller = select.poll()
        poller.register(self.fd, events)
        started = time.monotonic()
        while True:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TransferTimeout(f"{what} with {self.peer} timed out")
            self.check_alive()
            limit = self.interval if deadline is None else min(self.interval, deadline - now)
            if poller.poll(max(0.0, limit) * 1000):
                return
            self.on_idle(waiting_since=started)

    def on_idle(self, waiting_since: float | None = None) -> None:
        """Heartbeat duty: declare a silent peer dead, PING one that has been quiet a while.
        ``waiting_since``: when the caller began waiting on the peer (it is busy then, see
        :attr:`idle_ping`)."""
        self.check_alive()
        now = time.monotonic()
        reference = self._liveness_reference(waiting_since)
        if self.past_budget(now, reference, self.interval * self.misses):
            raise self._fail(f"no sign of life for {now - reference:.1f} s")
        if self.ping_due(now, waiting_since):
            self.pinged(now)
            self.try_send(proto.Ping())

    def past_budget(self, now: float, reference: float, budget: float) -> bool:
        """Whether the peer, silent since ``reference``, is to be declared dead: silent for longer
        than ``budget``, *and* a PING of ours went out since it was last heard and has gone
        unanswered for half the budget, *and* nothing it sent waits unread in our socket.

        The last two guard against our own stalls: this process may be held up for seconds (an
        application thread keeping the GIL, a paused VM) between the poll that found nothing and
        this check, with the peer's answers sitting in the socket all along — or before it ever
        asked. Then the caller's PING is due (see :meth:`ping_due`), and the peer gets its half
        budget to answer; a peer that is really gone is declared dead that much later at most."""
        if now - reference <= budget:
            return False
        if self._asked_at < self.last_alive or now - self._asked_at < budget / 2:
            return False
        return not self._heard_unread()

    def _heard_unread(self) -> bool:
        """Whether bytes from the peer wait unread in our socket: a sign of life, counted as of now."""
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        if not poller.poll(0):
            return False
        self.last_alive = time.monotonic()
        return True

    def _liveness_reference(self, waiting_since: float | None) -> float:
        """Since when the peer's silence counts against its budget. A busy link (something waits on
        the peer; or one whose traffic bypasses this socket, :attr:`idle_ping` None): since its last
        sign of life, or since the waiting began, whichever is later. An idle link: its budget only
        starts after :attr:`idle_ping` of silence (when it is pinged)."""
        if self.idle_ping is None:
            return self.last_alive
        since = max(self.busy_since or 0.0, waiting_since or 0.0)
        if since:
            return max(self.last_alive, since)
        return self.last_alive + self.idle_ping

    def ping_due(self, now: float, waiting_since: float | None = None) -> bool:
        """Whether to PING the peer now. A busy link: once silent for half its budget (``interval *
        misses``, at least an interval) — an answer then still comes well within it — and not
        pinged for as long. An idle link (see :attr:`idle_ping`): once silent that long."""
        if self.idle_ping is None or self.busy_since or waiting_since:
            after = max(self.interval, self.interval * self.misses / 2)
            return now - self._liveness_reference(waiting_since) >= after and now - self._last_ping >= after
        return now - self.last_alive >= self.idle_ping and now - self._last_ping >= self.idle_ping

    def pinged(self, now: float) -> None:
        """Record a PING sent (by :meth:`on_idle`, or the target's I/O loop)."""
        self._last_ping = now
        if self._asked_at < self.last_alive:
            self._asked_at = now

    # -- receiving --------------------------------------------------------------------------------
    def next_event(
        self, deadline: float | None = None, block: bool = True, frame_timeout: float | None = None
    ) -> Event:
        """The next event from the peer (reader holds ``read_lock``).

        ``block=False`` returns :data:`NEED_DATA` instead of waiting. With ``deadline``
        (handshakes), raise :class:`TransferTimeout` once it passes; with
        ``frame_timeout``, once a frame has been arriving for that long without
        completing (a peer trickling bytes is alive, but may not hold us forever).
        Protocol and authentication errors are raised as they are (the connection is
        CLOSED; the socket stays open so that the owner can say why before closing it).
        """
        if self.conn.data_left:
            self.drain()  # a reader before us gave up in the middle of some data
        while True:
            event = self._parsed()
            if event is not NEED_DATA:
                return event
            limit = deadline
            if frame_timeout is not None and self._frame_started is not None:
                ends = self._frame_started + frame_timeout
                limit = ends if limit is None else min(limit, ends)
            if not self._fill(limit, block):
                return NEED_DATA

    def _parsed(self) -> Event:
        """The next event the buffer holds, or :data:`NEED_DATA`; times a frame that has started
        arriving and not completed (see :meth:`frame_overdue`)."""
        with self.conn_lock:
            event = self.conn.next_event()  # a protocol error is the owner's to report, then close
        if event is not NEED_DATA:
            self._frame_started = None
            if isinstance(event, ConnectionClosed):
                self.mark_dead(self.conn.closed_reason or "peer closed the connection")
        elif not (self.conn.buffered or self.seal is not None and self.seal.opener.held):
            self._frame_started = None
        elif self._frame_started is None:
            self._frame_started = time.monotonic()
        return event

    def buffered_event(self, read: bool) -> Event:
        """For an event loop: the next event the buffer holds, after one non-blocking ``recv`` if
        it holds none and ``read``; :data:`NEED_DATA` if there is none yet. One ``recv`` per
        readiness, not one more to learn that the socket is empty: a level-triggered selector says
        so again if it is not. (A frame started and not completed is timed, see :meth:`frame_overdue`.)"""
        while True:
            event = self._parsed()
            if event is not NEED_DATA or not read or not self._fill(None, False):
                return event
            read = False

    def frame_overdue(self, now: float, frame_timeout: float) -> bool:
        """Whether a frame has been arriving for ``frame_timeout`` seconds without completing (as
        :meth:`next_event` with ``frame_timeout`` judges it; for a caller that reads with ``block=False``)."""
        return self._frame_started is not None and now >= self._frame_started + frame_timeout

    def _fill(self, deadline: float | None, block: bool) -> bool:
        """One ``recv`` into the connection (end of stream included); False if none was possible
        without blocking and ``block`` is false."""
        if self.seal is not None:
            return self._fill_sealed(deadline, block)
        while True:
            try:
                n = self.sock.recv_into(self._scratch_view, READ_SIZE)
            except (BlockingIOError, InterruptedError):
                if not block:
                    return False
                self.wait(_POLLIN, deadline, "receiving")
                continue
            except OSError as exc:
                raise self._fail(f"socket error: {exc}", exc) from exc
            with self.conn_lock:
                self.conn.receive_data(self._scratch_view[:n] if n else b"")
            if n:
                self.last_alive = time.monotonic()
            return True

    def _fill_sealed(self, deadline: float | None, block: bool) -> bool:
        """:meth:`_fill` on a sealed link: one ``recv`` of ciphertext, every whole record opened into
        the connection. Blocking, it tries again for ``busy_poll`` seconds before it sleeps, as the
        plaintext latency path does for its reply (a sleeping thread's wake-up costs more)."""
        spin_until = time.monotonic() + self.busy_poll if block and self.busy_poll else 0.0
        while True:
            got, _ = self.receive_sealed()
            if got >= 0:
                return True
            if not block:
                return False
            if spin_until and time.monotonic() < spin_until:
                os.sched_yield()
                continue
            self.wait(_POLLIN, deadline, "receiving")

    def receive_sealed(self, cursor: IovCursor | None = None, limit: int = 0, words: bool = False) -> tuple[int, int]:
        """A sealed link's one non-blocking ``recv``, then every whole record opened: of the bulk
        data due, up to ``limit`` bytes land in ``cursor`` (``words``: see
        :func:`~hixl._session.sealed.open_records`), the rest goes to the connection. (bytes the
        socket gave: -1 if none waited, 0 at the end of the stream, which the connection is told;
        bytes landed). :class:`~hixl.IntegrityError` if a record fails its check."""
        assert self.seal is not None
        opener = self.seal.opener
        try:
            got = sealed.receive(self.sock, opener)
        except OSError as exc:
            raise self._fail(f"socket error: {exc}", exc) from exc
        if got <= 0:
            if got == 0:
                with self.conn_lock:
                    opener.end_of_stream()  # (a record cut short is a protocol error, as a frame would be)
                    self.conn.receive_data(b"")
            return got, 0
        self.last_alive = time.monotonic()
        return got, sealed.open_records(self.conn, opener, self.conn_lock, cursor, limit, words)

    def sealed_lowat(self, limit: int) -> int:
        """A sealed link waiting for its data: how many bytes to have the socket gather first (at
        most ``limit``) — the rest of the record in front at least (it opens whole only), and as much
        of the data still due as is sure to come (its records are longer than the bytes they carry):
        one wake-up per few records, not per record."""
        assert self.seal is not None
        opener = self.seal.opener
        return min(limit, max(opener.needed, self.conn.data_left - self.conn.buffered - opener.held))

    def reply_spin(self, landing: int) -> float:
        """How long :meth:`read_reply` tries again before it sleeps, for a reply the target sends
        only once it landed ``landing`` bytes sent to it (a WRITE's data): ``busy_poll``, plus
        the time that takes at :data:`LANDING_RATE` (at most :data:`LANDING_SPIN_MAX`). Asleep
        through it, the initiator would cost the target's ACK its wake-up, and miss the window
        in which the target looks for the next request before it sleeps itself (a 1 MiB WRITE
        took 350 us instead of 265). None of it with ``busy_poll`` 0."""
        if not self.busy_poll:
            return 0.0
        return self.busy_poll + min(landing / LANDING_RATE, LANDING_SPIN_MAX)

    def read_reply(self, req_id: int, into: list[tuple[int, int]], deadline: float, landing: int = 0) -> int | None:
        """TCP's latency path: read the reply to request ``req_id`` straight off the socket, for a
        reader holding ``read_lock`` with nothing buffered. If it is the DATA or ACK that request
        waits for, the connection accounts for it (:meth:`Connection.took_frame`: its checks,
        its verdict) and only then does the DATA's data land in ``into`` ((addr, len) ranges of
        local memory; ``[]`` for an ACK): the bytes landed, fewer than asked only if
        ``deadline`` passed first (the rest is the next reader's to drop). None if the reply is
        anything else, or nothing came for a heartbeat interval: what arrived is then the
        connection's, and the general path (:meth:`next_event`) goes on from it. ``landing``:
        the bytes the target lands before it answers (see :meth:`reply_spin`)."""
        scratch = self.scratch
        try:
            kind, have, data_len = _accel.tcp_reply(
                self.sock, scratch, 0, req_id, min(deadline, time.monotonic() + self.interval), self.reply_spin(landing)
            )
            if have:
                self.last_alive = time.monotonic()
            if kind <= 0:
                with self.conn_lock:
                    if have:
                        self.conn.receive_data(self._scratch_view[:have])
                    if kind == _accel.TCP_EOF:
                        self.conn.receive_data(b"")
                return None
            with self.conn_lock:
                self.conn.took_frame(proto.FRAME_TYPES[kind], req_id, data_len)
            if data_len:
                landed, end = _accel.tcp_land(self.sock, scratch, HEADER_SIZE, have, into, deadline, self.busy_poll)
            else:
                landed, end = 0, HEADER_SIZE
        except OSError as exc:
            raise self._fail(f"socket error: {exc}", exc) from exc
        if landed:
            self.conn.data_moved(landed)
        if end < have:  # frames that came behind the reply in the same recv
            with self.conn_lock:
                self.conn.receive_data(self._scratch_view[end:have])
        return landed

    def receive_into(
        self,
        cursor: IovCursor,
        owner: object | None = None,
        deadline: float | None = None,
        abandon_at: float | None = None,
    ) -> bool:
        """Move the current bulk data into ``cursor``'s memory; True if all of it landed.

        With ``owner`` (a :class:`~hixl.TransferReq`), each chunk lands under its
        ``io_lock`` and only while it is not ``cancelled``. Waiting for more data stops
        at ``abandon_at`` (by default the owner's deadline), leaving the rest to whoever
        reads next (it is dropped then): a caller never waits past its own timeout.
        Nothing lands once ``deadline`` passed (the target's rule for a WRITE); the rest
        is read and dropped here, so the stream stays in step. Waiting happens outside
        the lock, so expiring a request never waits behind a stalled peer.
        """
        lock = getattr(owner, "io_lock", None)
        if abandon_at is None and owner is not None:
            abandon_at = getattr(owner, "deadline", None)
        wait_until = abandon_at if abandon_at is not None else deadline
        while not cursor.finished and self.conn.data_left:
            if lock is not None:
                with lock:
                    if owner.cancelled:  # type: ignore[union-attr]
                        break
                    moved = self._land_chunk(cursor, None)
            else:
                moved = self._land_chunk(cursor, deadline)
            if moved < 0:
                break
            if moved == 0:
                try:
                    self._wait_for_data(min(self.conn.data_left, _LOWAT), wait_until)
                except TransferTimeout:
                    if abandon_at is not None:
                        return False  # the next reader drops the rest (see next_event)
                    break
        complete = cursor.finished
        self.drain()
        return complete

    def _wait_for_data(self, nbytes: int, deadline: float | None) -> None:
        """Wait until ``nbytes`` of data are queued (``SO_RCVLOWAT``), not just one: a big
        transfer then lands in a few large ``readv``s instead of one per segment, with as
        few wake-ups as a blocking ``recv(MSG_WAITALL)`` would have."""
        if self.seal is not None:
            nbytes = self.sealed_lowat(_LOWAT)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, max(1, nbytes))
        try:
            self.wait(_POLLIN, deadline, "receiving data")
        finally:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)

    def _land_chunk(self, cursor: IovCursor, deadline: float | None) -> int:
        """Land what is available now (at most :data:`CHUNK`); -1 if ``deadline`` passed, 0 if nothing."""
        if deadline is not None and time.monotonic() >= deadline:
            return -1
        if self.conn.buffered:
            with self.conn_lock:
                view = self.conn.take_data(min(CHUNK, cursor.total - cursor.done))
            cursor.copy_in(view)
            self.last_alive = time.monotonic()
            return len(view)
        limit = min(CHUNK, self.conn.data_left)
        if self.seal is not None:
            got, moved = self.receive_sealed(cursor, limit)
            if got == 0:
                raise self._fail("peer closed the connection mid-data")
            if not moved and self.conn.buffered:
                return self._land_chunk(cursor, deadline)  # (it all went to the buffer: the cursor is full)
            return moved
        try:
            moved = readv(self.fd, cursor, limit, deadline)
        except ConnectionError as exc:
            raise self._fail("peer closed the connection mid-data", exc) from exc
        except OSError as exc:
            raise self._fail(f"socket error: {exc}", exc) from exc
        if moved > 0:
            self.conn.data_moved(moved)
            self.last_alive = time.monotonic()
        return moved

    def drain(self) -> None:
        """Read and drop what is left of the current bulk data."""
        scratch: bytearray | None = None
        while self.conn.data_left:
            if self.conn.buffered:
                with self.conn_lock:
                    self.conn.take_data(self.conn.data_left)
                continue
            if self.seal is not None:
                got, _ = self.receive_sealed()  # (into the buffer, dropped above)
                if got < 0:
                    self.wait(_POLLIN, None, "draining data")
                elif got == 0:
                    raise self._fail("peer closed the connection mid-data")
                continue
            if scratch is None:
                scratch = bytearray(min(self.conn.data_left, CHUNK))
            n = min(self.conn.data_left, len(scratch))
            try:
                got = self.sock.recv_into(memoryview(scratch)[:n], n)
            except (BlockingIOError, InterruptedError):
                self.wait(_POLLIN, None, "draining data")
                continue
            except OSError as exc:
                raise self._fail(f"socket error: {exc}", exc) from exc
            if not got:
                raise self._fail("peer closed the connection mid-data")
            self.conn.data_moved(got)
            self.last_alive = time.monotonic()

    # -- sending --------------------------------------------------------------------------------
    def send(self, message: proto.Message, data: IovCursor | None = None, deadline: float | None = None) -> None:
        """Send ``message`` and (for WRITE/DATA) its data as one unit on the wire.

        A few data ranges go out with the frame in one ``sendmsg`` (a small reply is
        one segment, read by the peer in one ``recv``); more are ``writev``-ed after it.
        On a sealed link, frame and data go out as records instead.
        Waiting for another sender counts against ``deadline`` too.
        """
        self.check_alive()
        self._acquire_send(deadline)
        try:
            with self.conn_lock:
                frame = self.frame_of(self.conn.send, message)
            if self.seal is not None:
                self._send_sealed(sealed.RecordSource(self.seal.sealer, [frame], data), deadline, data is not None)
                return
            if data is not None and data.count <= SENDMSG_RANGES:
                ranges = data.pending_ranges()
                self._send_parts(frame, ranges, deadline, len(frame) + sum(n for _, n in ranges))
                return
            self._send_frame(frame, deadline)
            if data is not None:
                self._send_data(data, deadline)
        finally:
            self.send_lock.release()

    def frame_of(self, make: Callable[..., T], *args: Any) -> T:
        """``make(*args)``: a frame from the connection (caller holds ``conn_lock``). If the connection
        has closed meanwhile (the peer's end of stream was just parsed, by another thread), that
        is :class:`PeerDisconnected`, as it is for every other way a send finds the peer gone —
        not the :class:`ProtocolError` the connection raises for sending on a closed connection.
        So is one that is closing (another thread said BYE, and is ending the link): a request
        made in that instant meets a link going away, not a broken protocol."""
        try:
            return make(*args)
        except ProtocolError as exc:
            if self.conn.state is ConnState.CLOSED:
                raise self._fail(self.conn.closed_reason or "the connection closed", exc) from exc
            if self.conn.state is ConnState.CLOSING:
                raise PeerDisconnected(f"the connection to {self.peer} is closing (BYE sent)") from exc
            raise

    def _acquire_send(self, deadline: float | None) -> None:
        """Take ``send_lock``, waiting for it no later than ``deadline`` (a plain call, not a
        context manager: this is on every request's path)."""
        if not self.send_lock.acquire(timeout=-1 if deadline is None else max(0.0, deadline - time.monotonic())):
            raise TransferTimeout(f"sending to {self.peer} waited past its deadline for another send")

    def try_send(self, message: proto.Message) -> bool:
        """Send a small frame only if nobody else is sending right now; within the peer's liveness
        budget (a peer that takes none of it for that long is dead anyway)."""
        if self.dead_reason or not self.send_lock.acquire(blocking=False):
            return False
        try:
            with self.conn_lock:
                frame = self.conn.send(message)
            self._send_frame(frame, time.monotonic() + self.interval * self.misses)
        except (PeerDisconnected, ProtocolError, TransferTimeout):
            return False
        finally:
            self.send_lock.release()
        return True

    def send_parts(self, frame: bytes, data: list[tuple[int, int]], deadline: float | None, nbytes: int) -> None:
        """Send a frame the connection made and the bulk data at ``data`` ((addr, len) ranges,
        ``nbytes`` in all) with one ``sendmsg`` when the socket takes it all (the latency path);
        on a sealed link, as records (one, for a small request)."""
        self.check_alive()
        if not self.send_lock.acquire(blocking=False):  # (nearly always free: a lock call, not a clock read too)
            self._acquire_send(deadline)
        try:
            if self.seal is not None:
                parts = [frame, *(memory_view(addr, n) for addr, n in data)]
                self._send_sealed(sealed.RecordSource(self.seal.sealer, parts), deadline, bool(data))
            else:
                self._send_parts(frame, data, deadline, len(frame) + nbytes)
        finally:
            self.send_lock.release()

    def finish_parts(self, frame: bytes, data: list[tuple[int, int]], deadline: float | None, total: int, sent: int) -> None:
        """Send the rest of what :meth:`send_parts` sends, ``sent`` bytes of which its caller sent,
        holding ``send_lock`` (released here)."""
        try:
            self._send_parts(frame, data, deadline, total, sent)
        finally:
            self.send_lock.release()

    def _send_parts(self, frame: bytes, data: list[tuple[int, int]], deadline: float | None, total: int, sent: int = 0) -> None:
        # One hixl._accel.tcp_send call nearly always: it retries a short send itself, and waits for
        # room at most an interval at a time, so heartbeat duty and the deadline are checked here.
        started = now = time.monotonic()
        while True:
            until = now + self.interval if deadline is None else min(deadline, now + self.interval)
            before = sent
            try:
                sent = _accel.tcp_send(self.sock, frame, data, sent, until, self.busy_poll)
            except OSError as exc:
                raise self._fail(f"socket error: {exc}", exc) from exc
            if sent == total:
                return
            now = time.monotonic()
            if sent > max(before, len(frame)):
                self.last_alive = now  # our data taken by a peer that reads it (a frame alone is not)
            if deadline is not None and now >= deadline:
                # Part of a frame may be on the wire: the stream can't be resumed.
                self.mark_dead("a send passed its deadline mid-frame")
                raise TransferTimeout(f"sending with {self.peer} timed out")
            self.check_alive()
            self.on_idle(waiting_since=started)

    def send_raw(self, frame: bytes, deadline: float | None = None) -> None:
        """Send bytes the connection already produced (handshake steps); caller sequences them."""
        with self.send_lock:
            self._send_frame(frame, deadline)

    def _send_frame(self, frame: bytes, deadline: float | None) -> None:
        """Frames are small and the socket buffer is usually free: one send nearly always takes it."""
        if self.seal is not None:
            self._send_sealed(sealed.RecordSource(self.seal.sealer, [frame]), deadline, sign_of_life=False)
            return
        try:
            sent = self.sock.send(frame)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            raise self._fail(f"socket error: {exc}", exc) from exc
        if sent < len(frame):
            self._send_data(bytes_cursor(frame[sent:]), deadline, sign_of_life=False)

    def _send_data(self, cursor: IovCursor, deadline: float | None, sign_of_life: bool = True) -> None:
        """writev until done. Our data taken by a peer that reads it is a sign of its life;
        a frame header alone is not (a frozen peer's kernel still buffers it)."""
        while not cursor.finished:
            try:
                moved = writev(self.fd, cursor, cursor.total - cursor.done)
            except OSError as exc:
                raise self._fail(f"socket error: {exc}", exc) from exc
            if moved:
                if sign_of_life:
                    self.last_alive = time.monotonic()
                continue
            try:
                self.wait(_POLLOUT, deadline, "sending")
            except TransferTimeout:
                # Part of a frame is on the wire: the stream can't be resumed.
                self.mark_dead("a send passed its deadline mid-frame")
                raise

    def _send_sealed(self, source: sealed.RecordSource, deadline: float | None, sign_of_life: bool) -> None:
        """Send ``source``'s records, each sealed as it is next to go (caller holds ``send_lock``)."""
        while (record := source.next_record()) is not None:
            sent = 0
            while sent < len(record):
                try:
                    sent += self.sock.send(record[sent:])
                except (BlockingIOError, InterruptedError):
                    try:
                        self.wait(_POLLOUT, deadline, "sending")
                    except TransferTimeout:
                        self.mark_dead("a send passed its deadline mid-record")  # (the stream can't be resumed)
                        raise
                    continue
                except OSError as exc:
                    raise self._fail(f"socket error: {exc}", exc) from exc
                if sign_of_life:
                    self.last_alive = time.monotonic()

    def __repr__(self) -> str:
        return f"<Wire {self.peer} {self.conn.state.name} {'dead: ' + self.dead_reason if self.dead_reason else 'live'}>"
