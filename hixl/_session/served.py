"""One initiator's connection on the target: its handshake, then its requests, served in order.

The handshake (see :mod:`hixl._protocol.connection`) must deliver its HELLO within
``hello_timeout`` and finish within ``handshake_timeout``, both counted from
``accept``; a peer that fails the shared-secret proof is refused and logged,
and learns nothing about this engine. One that passes asks the server for an
authenticated slot (:meth:`~hixl._session.target.TargetServer.promote`) just before
its WELCOME, and is refused if it gets none. Then each
:class:`_ServedConnection` serves frames in arrival order: the data frames
(READ, WRITE) go to the transport that declares it serves them (see
:mod:`hixl._session.contract`), on a worker — or on the loop itself, for one that
declares it does not block (TCP); NOTIFY, QUERY_REGIONS, QUERY_META and PING are
answered on the loop. Because a connection is served strictly in order, a
notification sent after a transfer is seen after that transfer's data. A bad
request gets an ERROR reply and the connection stays usable; a malformed frame,
or a frame that does not complete within ``frame_timeout``, ends only that
connection.

Nothing here blocks the loop. Answers queue in the connection's
:class:`~hixl._session.outbox.Outbox` and go as the socket takes them (a peer
whose answers pile up is not read until it takes them); a WRITE's data lands
as it arrives, in whole 8-byte words, at most a chunk a round (see
:meth:`_ServedConnection._land`); each connection serves a fair share of
frames a round, then the loop turns to the others.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import fcntl
import itertools
import logging
import selectors
import socket
import termios
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _accel
from .. import _protocol as proto
from .._exceptions import (
    AuthenticationFailed,
    HixlError,
    IntegrityError,
    PeerDisconnected,
    ProtocolError,
    TransferTimeout,
)
from .._iov import IovCursor
from .._memory import RemoteRegions, memory_view
from .._protocol.connection import (
    NEED_DATA,
    Connection,
    ConnectionClosed,
    ConnState,
    Role,
)
from .._types import IdentityEnum, NotifyDesc, Status
from .outbox import Outbox
from .wire import CHUNK, READ_SIZE, SENDMSG_RANGES, Wire

if TYPE_CHECKING:
    from .target import TargetServer

log = logging.getLogger("hixl")

_serials = itertools.count(1)
_NO_ROWS = np.empty((0, 3), dtype=np.uint64)
_OUTBOX_READ_LIMIT = 4 << 20
"""A connection with this many bytes of answers unsent is not read until it takes them."""
_FRAMES_PER_ROUND = 32
"""Most frames of one connection served before the loop turns to the others."""
_MAX_IDLE_PING = 60.0
"""The longest idle silence a peer may announce (idle_ping): a peer that says more gets this."""
_LOWAT = 256 << 10
"""Most bytes a landing WRITE waits to have arrived before its next ``readv`` (see _landing_window)."""
_WORD = 8
"""A landing WRITE never leaves a word of this many bytes half-written while it waits (see _land)."""
_DROPPED = bytearray(64 << 10)
_DROPPED_VIEW = memoryview(_DROPPED)
"""Where the loop reads data it drops (refused or late WRITEs): one buffer, one thread."""
_BUFFERED = 1 << 8
"""An ``on_ready`` mask bit besides the selector's: frames are buffered, the socket was not polled."""
_HEARTBEATS = frozenset({proto.FrameType.PING, proto.FrameType.PONG})
"""Frames that are no request: they do not make a connection recently used (see ``last_request``)."""


def _whole_words(done: int, n: int, left: int) -> int:
    """Of ``n`` bytes that could land now, after ``done`` landed and with ``left`` still due: all
    of them if they are the last, else as many as end on a word boundary of the data."""
    return left if n >= left else max(0, n - (done + n) % _WORD)


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
