"""The initiator's end of a connection: one authenticated socket per peer.

Theory of operation. ``connect`` runs the handshake (see
:mod:`hixl._protocol.connection`); from then on the link owns the socket's
:class:`~hixl._session.wire.Wire`. Replies reach the :class:`Pending` entry registered
under their ``req_id``; a READ reply's data flows from the socket straight into
local memory.

Who reads the socket? Whoever needs to, one at a time (``wire.read_lock``):

- A synchronous caller with nothing else being read takes the read role itself:
  it sends its request and reads the reply on its own thread — no hand-off to
  another thread, which is what makes a small ``transfer_sync`` cost about one
  network round trip. It never moves another request's data, though: a DATA
  frame for another request (whose bytes may be many and whose deadline is not
  its own) hands the read role, with that frame, to the reader thread, and the
  caller waits for its own reply like anyone else.
- Otherwise the link's *reader thread* reads. It sleeps in ``epoll`` with the
  socket armed one-shot; a caller holding the read role disarms it first, so
  the reader is not even woken by replies the caller reads, and re-arms it
  when done (after releasing the role, so nothing that arrived meanwhile is
  missed: re-arming a readable socket fires at once).

The peer's registrations (table, generation, the lease same-host copies hold)
are one :class:`~hixl._session.peer_regions.PeerRegions`, ``link.regions``;
whoever reads applies each REGIONS and REVOKE to it in stream order.

When the peer dies its socket closes and whoever reads notices at once; a peer
that hangs is caught by heartbeats. Either way the link turns BROKEN, every
pending request fails with :class:`PeerDisconnected`, and later calls fail
immediately instead of hanging.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _accel
from .. import _protocol as proto
from .._exceptions import (
    EncryptionMismatch,
    HixlError,
    HixlTimeout,
    IntegrityError,
    PeerDisconnected,
    ProtocolError,
    TransferTimeout,
    error_for_status,
)
from .._protocol.connection import DEADLINE_GUARD, ConnectionClosed, ConnState, PeerFatal, RegionsPushed
from .._types import IdentityEnum, Status
from .peer_regions import PeerRegions
from .wire import LANDING_RATE, LANDING_SPIN_MAX, SCRATCH, Wire

if TYPE_CHECKING:
    from .._iov import IovCursor

__all__ = ["LinkState", "Pending", "PeerLink", "handshake"]

log = logging.getLogger("hixl")

_ARMED = select.EPOLLIN | select.EPOLLONESHOT
INPUT_CHECK = 0.001
"""Seconds between two looks at the socket by a copying thread (see :meth:`PeerLink.poll_input`)."""
REARM_QUIET = 0.002
"""Seconds the latency path must have left the socket alone before the reader thread re-arms it
(see :meth:`PeerLink.exchange`); also how often the reader looks while it waits to."""


class LinkState(IdentityEnum):
    """State of a :class:`PeerLink`: CONNECTED until it is CLOSED by us or BROKEN."""

    CONNECTED = "CONNECTED"
    CLOSED = "CLOSED"
    BROKEN = "BROKEN"


class Pending:
    """Something waiting for the reply with a given ``req_id``; subclasses override."""

    done = False
    waker: threading.Event | None = None
    """Set by the link once the entry is done, if the link gave one (see :meth:`PeerLink.exchange`)."""
    abandoned = False
    """Its caller gave up on it (its deadline passed): the reply, should it come, is read and
    dropped. It stays registered until then, so that the link still counts as waiting on the peer
    (heartbeats at the busy pace: a frozen peer is found out)."""

    def on_reply(self, message: proto.Message) -> None:
        """Called by the reading thread with the reply frame."""

    def on_data(self, link: PeerLink, nbytes: int) -> None:
        """Called by the reading thread when ``nbytes`` of data for this request follow."""
        raise ProtocolError("unexpected DATA frame")

    def on_failure(self, error: HixlError) -> None:
        """Called when the link ends before a reply came; possibly twice, with the same error
        (by the thread that ended the link, and by a caller reading for this entry)."""

    def on_landed(self, nbytes: int) -> None:
        """Called by the latency path's reader (see :meth:`PeerLink.exchange`) with the reply the
        connection accepted: an ACK (``nbytes`` 0), or a DATA of which ``nbytes`` landed where
        the request said — all of it, unless its deadline passed first."""
        raise ProtocolError("unexpected reply on the latency path")


class _Call(Pending):
    """A synchronous request/reply (QUERY_REGIONS, QUERY_META, NOTIFY)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reply: proto.Message | None = None
        self.error: HixlError | None = None

    def on_reply(self, message: proto.Message) -> None:
        self.reply = message
        self.done = True
        self.event.set()

    def on_failure(self, error: HixlError) -> None:
        self.error = error
        self.done = True
        self.event.set()


class PeerLink:
    """A live, authenticated connection to one remote engine (see the module docstring)."""

    def __init__(self, remote_engine: str, wire: Wire, connect_deadline: float | None = None) -> None:
        self.remote_engine = remote_engine
        self.wire = wire
        self.connect_deadline = connect_deadline
        """When the ``connect`` that made this link gives up: transports' probes end by then."""
        self.welcome = wire.conn.peer_info
        self.state = LinkState.CONNECTED
        self.regions = PeerRegions(self.welcome.get("regions", []), wire.conn.regions_generation)
        """The peer's registrations and the lease same-host copies hold (see the module docstring)."""
        self.on_event: Callable[[Any], None] | None = None
        """Fault injection (:class:`hixl.testing.faults.FaultyTransport` sets it): called on the reading
        thread with each event read, before the link handles it; one that sleeps delays it, as a slow
        network would."""
        self.on_send_failed: Callable[[int], None] | None = None
        """Fault injection (as ``on_event``): called on the sending thread with the id of a request whose
        send failed, before the link forgets it; one that waits lets another thread act on the failure first."""
        self._ids = itertools.count(1)
        self._pending: dict[int, Pending] = {}
        self._pending_lock = threading.Lock()
        self._closing = False
        self._end_error: PeerDisconnected | None = None
        """Why the link ended (what every request pending on it fails with); None while CONNECTED."""
        self._next_input_check = 0.0
        self._last_exchange = 0.0
        """When the latency path last gave the read role back (see :meth:`exchange`)."""
        self._disarmed = False
        """Whether the socket is left disarmed for the latency path, for the reader thread to re-arm (see :meth:`exchange`)."""
        self._arm_lock = threading.Lock()
        """Held to change ``_disarmed`` together with the socket's ``epoll`` registration it
        describes: written apart, a re-arm by one thread can fall between another's flag and
        its ``epoll_ctl`` and leave the socket disarmed with the flag saying armed, a reply
        then unread until a heartbeat finds the link dead (see :meth:`_rearm`)."""
        self._handed_over: Any = None
        """A DATA frame a caller met for another request, with the read role, for the reader thread."""
        self._epoll = select.epoll()
        self._wake_r, self._wake_w = os.pipe()
        self._epoll.register(wire.fd, _ARMED)
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._reader = threading.Thread(target=self._read_loop, name=f"hixl-link-{remote_engine}", daemon=True)
        self._reader.start()

    def next_id(self) -> int:
        """A fresh request id for this link."""
        return next(self._ids)

    # -- what transports see besides (see hixl.transports.base.LinkSession) -------------------------
    @property
    def socket(self) -> socket.socket:
        """The authenticated connection's socket: for proving who holds its far end, not for I/O."""
        return self.wire.sock

    def binding(self, label: str) -> bytes:
        """16 bytes only the two ends of this connection can compute, for ``label``."""
        with self.wire.conn_lock:
            return self.wire.conn.binding(label)

    def peer_deadline(self, deadline: float | None) -> int:
        """Our monotonic ``deadline`` in the peer's clock, microseconds (0: none). Lock-free: it
        reads one offset, and the latency path calls it."""
        return self.wire.conn.peer_deadline(deadline)

    def take_data(self, nbytes: int) -> bytes:
        """Up to ``nbytes`` of the current reply's data that arrived with its frame."""
        with self.wire.conn_lock:
            return self.wire.conn.take_data(nbytes)

    def receive_into(self, cursor: IovCursor, owner: object | None = None, abandon_at: float | None = None) -> bool:
        """Land the current reply's data into ``cursor`` (see :meth:`Wire.receive_into`)."""
        return self.wire.receive_into(cursor, owner, abandon_at=abandon_at)

    def ensure_alive(self) -> None:
        """Raise :class:`PeerDisconnected` unless the link is CONNECTED."""
        if self.state is not LinkState.CONNECTED:
            raise PeerDisconnected(f"link to {self.remote_engine} is {self.state.name}: {self.wire.dead_reason or 'closed'}")

    def expect(self, req_id: int, pending: Pending) -> None:
        """Route the reply for ``req_id`` to ``pending``."""
        with self._pending_lock:
            self.ensure_alive()
            if not self._pending:
                self.wire.busy_since = time.monotonic()  # the peer owes us progress from now
            self._pending[req_id] = pending

    def forget(self, req_id: int) -> None:
        """Stop waiting for ``req_id`` (a late reply is then ignored, its data drained)."""
        with self._pending_lock:
            self._pending.pop(req_id, None)
            self._idle_if_done()

    def _idle_if_done(self) -> None:
        """Caller holds ``_pending_lock``: with nothing waiting on the peer, the link is idle."""
        if not self._pending:
            self.wire.busy_since = None

    # -- requests ---------------------------------------------------------------------------------
    def submit(
        self,
        message: proto.Message,
        pending: Pending,
        data: Any = None,
        deadline: float | None = None,
        read_reply: bool = False,
    ) -> None:
        """Send a request (and its bulk ``data``) whose reply goes to ``pending``.

        With ``read_reply``, if this thread can take the read role (nothing else is
        being read), it reads until ``pending`` is done or ``deadline`` passes;
        otherwise the reply is left to whoever reads.
        """
        req_id = message.req_id
        self.expect(req_id, pending)
        if not read_reply or not self._take_read_role():
            self._send(req_id, lambda: self.wire.send(message, data, deadline))
            if self._disarmed:
                self._rearm()  # (left disarmed by the latency path: the reply is not to wait for a look)
            return
        reading = True
        try:
            self._send(req_id, lambda: self.wire.send(message, data, deadline))
            reading = self._read_until(req_id, pending, deadline)
        finally:
            if reading:
                self._give_back_read_role()

    def exchange(
        self, write: bool, descs: list[tuple[int, int, int]], nbytes: int, pending: Pending, deadline: float
    ) -> bool:
        """The latency path: if nobody else is reading, send one READ or WRITE frame for ``descs``
        ((local, remote, len) tuples, ``nbytes`` in all) — a WRITE's data from local memory in
        the same ``sendmsg`` — and read the reply on this thread (or, if another request's data
        comes first, wait for the reader thread to read it). False, having sent nothing, if
        someone else reads. On a sealed link the frame and data go out as one record, and the
        reply is opened and parsed as any other (never read straight off the socket).

        The reply expected — the ACK, or the DATA whose bytes land in the local ranges — is read
        straight off the socket (:meth:`Wire.read_reply`: three calls of :mod:`hixl._accel` and
        the connection's own accounting) and handed to ``pending.on_landed``; anything else goes
        the general way, through ``on_reply`` / ``on_data``. Not with fault injection on
        (``on_event``): it sees every event. Written flat, without closures: each layer is a few
        hundred ns of a ~15 us round trip.

        Nor does it disarm the socket and re-arm it for the reader thread on every call (two
        ``epoll_ctl``, ~1 us a call): the first call of a burst disarms it and tells the reader
        thread, which re-arms it once no call has used it for :data:`REARM_QUIET` (see
        :meth:`_read_loop`). What arrives between two calls meanwhile is read by the next call
        (:meth:`_read_until` dispatches what is not its reply), or at that re-arming. While
        other requests wait on replies, a call disarms and re-arms the socket as every other
        reader does (:meth:`_take_read_role`), and a request sent for the reader thread to
        answer re-arms it (:meth:`submit`): their replies are not to wait for a look.
        """
        wire = self.wire
        if self.state is not LinkState.CONNECTED or not wire.read_lock.acquire(blocking=False):
            return False
        shared = bool(self._pending)  # other requests wait on replies: the socket is the reader thread's between calls
        if shared:
            self._disarm()
        elif not self._disarmed:
            self._disarm_for_burst()
        reading = True
        try:
            req_id = next(self._ids)
            self.expect(req_id, pending)
            conn = wire.conn
            sent = nbytes if write else 0  # (the data that goes out with the frame, and lands before the ACK)
            pairs = [(remote, length) for _, remote, length in descs]
            with wire.conn_lock:
                frame = wire.frame_of(conn.transfer_frame, write, req_id, conn.peer_deadline(deadline), pairs, sent)
            local = [(addr, length) for addr, _, length in descs]
            try:
                wire.send_parts(frame, local if write else [], deadline, sent)
            except HixlError:
                self._send_failed(req_id)
                raise
            into = None if wire.seal is not None else [] if write else local
            reading = self._read_until(req_id, pending, deadline, into, sent)
            if reading and not pending.done:
                # Timed out, marked while we still read: a DATA that comes later is drained, not
                # landed in memory its caller is told the READ never filled.
                pending.abandoned = True
        finally:
            if reading:
                self._last_exchange = time.monotonic()
                self._give_back_read_role(rearm=shared or bool(self._pending))
        if not reading and pending.waker is not None:
            if not pending.waker.wait(max(0.0, deadline - time.monotonic())):
                self._abandon(req_id, pending)
        return True

    def compiled_exchange(self) -> Any:
        """The latency path in C for this link (:class:`hixl._accel.TcpSmall`, driven by the
        link's state: see its ``run``), or None where the extension is not in use, or the link is
        sealed (its frames are records: the compiled path speaks plaintext)."""
        if _accel.TcpSmall is None or self.wire.seal is not None:
            return None
        return _accel.TcpSmall(self, self.wire, SCRATCH, LinkState.CONNECTED, ConnState.OPEN, DEADLINE_GUARD, LANDING_RATE, LANDING_SPIN_MAX)

    def resume(
        self, stopped: tuple[Any, ...], write: bool, descs: list[tuple[int, int, int]], nbytes: int, pending: Pending, deadline: float
    ) -> None:
        """Go on from where the compiled latency path stopped short (``stopped``, see
        :meth:`hixl._accel.TcpSmall.run`), holding the read role — and, stopped while sending,
        the send lock — it left held: the request it sent becomes one the link and the connection
        know of, as :meth:`exchange` would have made it before sending, and the rest goes as
        there. What it read is the connection's: frames behind an answered reply, a reply that
        was not the one expected (an ERROR, say) or frames before it, for the general path to
        parse. A socket error it met fails the request and breaks the link as one met here would;
        an exception a signal handler raised is raised, with the request known to the link."""
        stage, req_id, frame, sent, landed, extra, eof, error = stopped
        wire, conn = self.wire, self.wire.conn
        reading = True
        try:
            if stage == "tail":  # answered: only the frames behind the reply are left
                with wire.conn_lock:
                    conn.receive_data(extra)
                with self._pending_lock:
                    self._idle_if_done()  # (the compiled path marked the link busy for its request)
                pending.on_landed(landed)
                return
            try:
                self.expect(req_id, pending)
                with wire.conn_lock:
                    wire.frame_of(conn.sent_small, write, req_id, 0 if write else nbytes)
            except BaseException:
                if stage == "send":
                    wire.send_lock.release()
                raise
            if stage == "send":
                local = [(addr, length) for addr, _, length in descs]
                try:
                    if error is not None:
                        wire.send_lock.release()
                        if isinstance(error, OSError):
                            raise wire._fail(f"socket error: {error}", error) from error
                        raise error
                    wire.finish_parts(frame, local if write else [], deadline, len(frame) + (nbytes if write else 0), sent)
                except HixlError:
                    self._send_failed(req_id)
                    raise
                reading = self._read_until(req_id, pending, deadline, [] if write else local, nbytes if write else 0)
            else:
                if stage == "land":  # (a READ's DATA, short: the rest is the next reader's to drop)
                    with wire.conn_lock:
                        conn.took_frame(proto.FrameType.DATA, req_id, nbytes)
                        conn.data_moved(landed)
                with wire.conn_lock:
                    if extra:
                        conn.receive_data(extra)
                    if eof:
                        conn.receive_data(b"")
                if isinstance(error, OSError):
                    self._end(LinkState.BROKEN, str(wire._fail(f"socket error: {error}", error)))
                elif error is not None:
                    raise error
                if stage == "land":
                    self._landed(req_id, pending, landed)
                else:
                    reading = self._read_until(req_id, pending, deadline)
            if reading and not pending.done:
                pending.abandoned = True  # (as in exchange: a DATA that comes later is drained)
        finally:
            if reading:
                self._last_exchange = time.monotonic()
                self._give_back_read_role(rearm=bool(self._pending))

    def _abandon(self, req_id: int, pending: Pending) -> None:
        """Request ``req_id``, handed to the reader thread, timed out: mark it abandoned, so that its
        reply lands nothing — unless the reader thread took the reply already, and is landing it:
        then wait for that (it lands what came, at once; the rest it drops, past the deadline)."""
        with self._pending_lock:
            waiting = self._pending.get(req_id) is pending
            if waiting:
                pending.abandoned = True  # (the reader takes entries under this lock: it will see it)
        if not waiting and pending.waker is not None:
            pending.waker.wait(self.wire.interval)

    def _take_read_role(self) -> bool:
        """Become the reader if nobody is; the parked reader thread is not woken by our replies."""
        if not self.wire.read_lock.acquire(blocking=False):
            return False
        self._disarm()
        return True

    def _disarm(self) -> None:
        """Disarm the socket for a reader that will re-arm it when it gives the read role back."""
        with self._arm_lock:
            self._set_armed(False)

    def _disarm_for_burst(self) -> None:
        """The latency path's first call of a burst (it holds the read role): disarm the socket,
        and wake the reader thread to look every :data:`REARM_QUIET` for when to re-arm it."""
        with self._arm_lock:
            self._disarmed = True
            self._set_armed(False)
        try:
            os.write(self._wake_w, b"d")
        except OSError:
            pass  # closed: the link is ending

    def _give_back_read_role(self, rearm: bool = True) -> None:
        # Released before re-arming: whatever arrived meanwhile fires the re-armed socket at once.
        self.wire.read_lock.release()
        if rearm:
            self._rearm()
        if self.wire.conn.buffered and self.state is LinkState.CONNECTED:
            # But frames that came in the same recv as our reply are in the buffer, not the socket,
            # and no socket event will announce them (a REVOKE among them would wait for the next
            # heartbeat, past the peer's patience): handle them now, if nobody else reads.
            self._pump_buffered()

    def poll_input(self) -> None:
        """Handle what already arrived for this link, on this thread, if nobody else reads (at most
        once a millisecond; non-blocking).

        For a thread that copies back to back without touching the socket (shm): it keeps
        dropping and retaking the GIL around short calls, and each such drop wakes the reader
        thread only to lose the race again — for seconds, while a REVOKE waits unread (CPython's
        convoy effect). Looking itself costs one ``recv`` a millisecond.
        """
        now = time.monotonic()
        if now < self._next_input_check:
            return
        self._next_input_check = now + INPUT_CHECK
        self._pump_buffered()

    def _pump_buffered(self) -> None:
        if not self.wire.read_lock.acquire(blocking=False):
            return  # whoever reads now parses them
        try:
            self._pump()
        except HixlError as exc:
            self._ended_by(exc)
        finally:
            # As when giving back the read role: released, then re-armed — the reader thread, woken
            # by data while we held the role, left the socket for us to re-arm.
            self.wire.read_lock.release()
            self._rearm()

    def _read_until(
        self,
        req_id: int,
        pending: Pending,
        deadline: float | None,
        into: list[tuple[int, int]] | None = None,
        landing: int = 0,
    ) -> bool:
        """Read (as the reader) until ``pending`` (request ``req_id``) is answered, the link ends,
        or ``deadline``. False if it handed the read role to the reader thread instead, with
        another request's DATA frame: its bytes are that request's I/O, on its deadline, not
        ours (``pending.waker`` is then set once ours is answered). With ``into`` (the latency
        path, see :meth:`exchange`) the expected reply is first looked for straight off the socket,
        after the target landed ``landing`` bytes we sent (:meth:`Wire.reply_spin`)."""
        wire = self.wire
        try:
            if into is not None and deadline is not None and self.on_event is None and not (wire.conn.buffered or wire.conn.data_left):
                landed = wire.read_reply(req_id, into, deadline, landing)
                if landed is not None:
                    self._landed(req_id, pending, landed)
            while not pending.done and self.state is LinkState.CONNECTED:
                event = self.wire.next_event(deadline)
                if isinstance(event, proto.Data) and event.req_id != req_id:
                    pending.waker = threading.Event()
                    self._hand_over(event)
                    return False
                self._dispatch(event)
        except TransferTimeout:
            pass  # the request's own deadline reports it; the reader thread takes over the socket
        except HixlError as exc:
            self._ended_by(exc)
        if not pending.done and self._end_error is not None:
            # Another thread ended the link and is still failing its requests, ours among
            # them: fail it now, with the same error, rather than return it unanswered (a
            # caller would take that for a timeout).
            _fail(pending, self._end_error)
        return True

    def _landed(self, req_id: int, pending: Pending, landed: int) -> None:
        """The latency path read request ``req_id``'s reply itself, ``landed`` bytes of its data:
        ``pending`` is answered (unless the link ended meanwhile, and failed it)."""
        with self._pending_lock:
            mine = self._pending.pop(req_id, None) is pending
            self._idle_if_done()
        if mine:
            pending.on_landed(landed)
            _woken(pending)

    def _hand_over(self, data: proto.Data) -> None:
        """Give the read role (held) and ``data``, whose bytes are next on the socket, to the reader thread."""
        self._handed_over = data
        try:
            os.write(self._wake_w, b"h")
        except OSError:
            pass  # closed: the link is ending, and every pending entry fails with it

    def _send(self, req_id: int, send: Callable[[], None]) -> None:
        """Run ``send`` for request ``req_id``; if it fails, forget the request (and end a dead link)."""
        try:
            send()
        except HixlError:
            self._send_failed(req_id)
            raise

    def _send_failed(self, req_id: int) -> None:
        """The send of request ``req_id`` failed: forget the request (and end a dead link)."""
        if self.on_send_failed is not None:
            self.on_send_failed(req_id)
        self.forget(req_id)
        with self.wire.conn_lock:
            self.wire.conn.forget_request(req_id)
        if self.wire.dead_reason:  # e.g. a send that ran out of time mid-frame
            self._end(LinkState.BROKEN, self.wire.dead_reason)

    def call(self, message: proto.Message, timeout: float) -> proto.Message:
        """Send a request and wait for its reply; an ERROR reply is raised as its error."""
        pending = _Call()
        deadline = time.monotonic() + timeout
        try:
            self.submit(message, pending, deadline=deadline, read_reply=True)
            if not pending.event.wait(max(0.0, deadline - time.monotonic())):
                raise TransferTimeout(f"{type(message).__name__} to {self.remote_engine}: no reply in {timeout} s")
        finally:
            self.forget(message.req_id)
        if pending.error is not None:
            raise pending.error
        reply = pending.reply
        if isinstance(reply, proto.Error):
            raise error_for_status(reply.status, reply.message)
        assert reply is not None
        return reply

    def refresh_regions(self, timeout: float) -> None:
        """Ask the peer for its current registrations. The answer is installed by whoever reads
        it, in stream order like every other update, so it can never undo a later REVOKE."""
        reply = self.call(proto.QueryRegions(self.next_id()), timeout)
        if not isinstance(reply, proto.Regions):
            raise ProtocolError(f"expected REGIONS, got {type(reply).__name__}")

    def check_remote(self, addrs: np.ndarray, lens: np.ndarray, timeout: float, write: bool = False) -> None:
        """Refuse descriptors outside the peer's regions (or, for ``write``, its writable ones).

        A miss refreshes a stale view once first, so a registration the peer made a
        moment ago is usable even if its REGIONS update is still on the wire.
        """
        if self.regions.misses(addrs, lens, write):
            self.refresh_regions(timeout)
            self.regions.check(addrs, lens, write)

    # -- reading ----------------------------------------------------------------------------------
    def _read_loop(self) -> None:
        # While the latency path keeps the socket disarmed (``_disarmed``, see exchange), look every
        # REARM_QUIET for it to have gone quiet, and re-arm the socket then; heartbeat duty still
        # an interval apart.
        idle_at = time.monotonic() + self.wire.interval
        try:
            while not self._closing:
                events = self._epoll.poll(REARM_QUIET if self._disarmed else self.wire.interval)
                fired = False  # the socket's event (one-shot: it is disarmed until someone re-arms it)
                for fd, _ in events:
                    if fd == self._wake_r:
                        os.read(self._wake_r, 64)
                        if self._closing:
                            return
                        self._take_over()
                    else:
                        fired = True
                if not fired and events:
                    continue  # woken only
                now = time.monotonic()
                if self._disarmed and not fired and now < idle_at:
                    if now - self._last_exchange >= REARM_QUIET and not self.wire.read_lock.locked():
                        self._rearm()
                    continue
                if not self.wire.read_lock.acquire(blocking=False):
                    if fired:
                        # A caller reads. The socket fired, so it is disarmed now; the latency path
                        # will not re-arm it when done: this thread will (the others do as well).
                        self._left_disarmed()
                    continue
                try:
                    if fired:
                        self._pump()
                    else:
                        self.wire.on_idle()
                finally:
                    self.wire.read_lock.release()
                    if fired or self._disarmed:
                        self._rearm()
                    idle_at = now + self.wire.interval
        except HixlError as exc:
            self._ended_by(exc)
        except Exception as exc:  # a bug must still not strand waiters
            log.exception("hixl link reader crashed")
            self._end(LinkState.BROKEN, f"internal error: {exc!r}")
        finally:
            handed, self._handed_over = self._handed_over, None
            if handed is not None:  # a caller's read role, handed over as the link closed: given back
                self.wire.read_lock.release()

    def _take_over(self) -> None:
        """Read on from the DATA frame a caller handed over, with the read role it holds for us."""
        data, self._handed_over = self._handed_over, None
        if data is None:
            return
        try:
            self._dispatch(data)
            self._pump()
        finally:
            self.wire.read_lock.release()
            self._rearm()

    def _pump(self) -> None:
        """Handle every frame that is already readable (reader holds the read role)."""
        while self.state is LinkState.CONNECTED:
            event = self.wire.next_event(block=False)
            if event is proto.NEED_DATA:
                return
            self._dispatch(event)

    def _rearm(self) -> None:
        """Arm the socket for the reader thread (from any thread, holding the read role or not).

        The flag and the registration change under ``_arm_lock``, so that ``_disarmed`` False
        always means armed — or fired, the event the reader thread's to handle. A latency call
        starting a burst sets the flag and disarms; a request queued for the reader thread
        re-arms (:meth:`submit`): apart, the re-arm could land between the other's two steps."""
        with self._arm_lock:
            self._disarmed = False
            self._set_armed(True)

    def _left_disarmed(self) -> None:
        """The reader thread's event fired (one-shot: the socket is disarmed now) while a caller
        reads: flag it, for this thread to re-arm once the caller is done (see :meth:`_read_loop`)."""
        with self._arm_lock:
            self._disarmed = True

    def _set_armed(self, armed: bool) -> None:
        """Caller holds ``_arm_lock``."""
        try:
            self._epoll.modify(self.wire.fd, _ARMED if armed else 0)
        except (OSError, ValueError):
            pass  # closed meanwhile: reading reports it

    def _dispatch(self, message: Any) -> None:
        if self.on_event is not None:
            self.on_event(message)
        if isinstance(message, ConnectionClosed):
            raise PeerDisconnected(f"{self.remote_engine} closed the connection")
        if isinstance(message, RegionsPushed):
            self.regions.apply(message.update)
            return
        if isinstance(message, proto.Revoke):
            # Within the peer's patience for our answer (its deregister_timeout, which it does
            # not tell us; liveness is the longest it may be): else the link is no use anyway.
            deadline = time.monotonic() + self.wire.interval * self.wire.misses
            self.regions.revoke(message, deadline)
            self.wire.send(proto.Revoked(message.generation), deadline=deadline)
            return
        if isinstance(message, proto.Ping):
            self.wire.try_send(proto.Pong(message.req_id))
            return
        if isinstance(message, proto.Pong):
            return
        if isinstance(message, proto.Bye):
            # An orderly goodbye: the link is unusable, but nothing went wrong.
            log.info("hixl: %s closed the link (%s)", self.remote_engine, message.reason or "no reason given")
            self._end(LinkState.BROKEN, f"peer closed the link ({message.reason or 'no reason given'})", quiet=True)
            return
        if isinstance(message, PeerFatal):
            if message.status == Status.AUTH_FAILED and self.wire.seal is not None:
                # (what the target says when a record of ours failed its check: a WRITE's data altered on the way)
                raise IntegrityError(f"{self.remote_engine} refused what arrived from us: {message.message}")
            raise PeerDisconnected(f"{self.remote_engine} reported a fatal error: {message.message}")
        if isinstance(message, proto.Regions):
            self.regions.apply(message)  # an answer to QUERY_REGIONS: installed here, in stream order
        with self._pending_lock:
            pending = self._pending.pop(message.req_id, None)
            self._idle_if_done()
        if pending is not None and pending.abandoned:
            pending = None  # (its caller gave up: the reply is dropped)
        if isinstance(message, proto.Data):
            if pending is None:
                self.wire.drain()
                return
            try:
                pending.on_data(self, message.data_len)
            except HixlError as exc:
                # Popped already, so _end() would not reach it: fail it here,
                # or a link dying mid-data strands its request WAITING.
                _fail(pending, exc)
                raise
            _woken(pending)
        elif pending is not None:
            pending.on_reply(message)
            _woken(pending)

    # -- ending -----------------------------------------------------------------------------------
    def close(self, timeout: float = 1.0) -> None:
        """Say BYE, close the socket and join the reader; idempotent."""
        self._closing = True  # the peer's reaction to BYE is not a failure
        if self.state is LinkState.CONNECTED:
            self.wire.try_send(proto.Bye(0, "disconnect"))
        self._end(LinkState.CLOSED, "disconnected")
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout)
        self.wire.close()
        self._epoll.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _ended_by(self, exc: HixlError) -> None:
        """End the link because of ``exc``, met reading or sending (see :meth:`_end`)."""
        kind = IntegrityError if isinstance(exc, IntegrityError) else PeerDisconnected
        self._end(LinkState.CLOSED if self._closing else LinkState.BROKEN, str(exc), kind=kind)

    def _end(
        self, state: LinkState, reason: str, quiet: bool = False, kind: type[PeerDisconnected] = PeerDisconnected
    ) -> None:
        """End the link and fail every pending request with :class:`PeerDisconnected` (saying why:
        the peer died, closed, or broke the protocol — its stream can't be trusted any more), or
        ``kind`` of it (:class:`~hixl.IntegrityError`: an encrypted link's bytes were altered)."""
        error = kind(f"link to {self.remote_engine} {state.name.lower()}: {reason}")
        with self._pending_lock:
            if self.state is not LinkState.CONNECTED:
                return
            self._end_error = error  # set with the state: whoever sees one sees the other
            self.state = state
            pending, self._pending = self._pending, {}
        self.wire.mark_dead(reason)
        if state is LinkState.BROKEN and not quiet:
            log.warning("hixl: link to %s broken: %s", self.remote_engine, reason)
        for entry in pending.values():
            _fail(entry, error)

    def __repr__(self) -> str:
        return f"<PeerLink {self.remote_engine} {self.state.name} regions={len(self.regions)} pending={len(self._pending)}>"


def _woken(pending: Pending) -> None:
    if pending.waker is not None:
        pending.waker.set()


def _fail(pending: Pending, error: HixlError) -> None:
    pending.on_failure(error)
    _woken(pending)


def handshake(wire: Wire, info: dict[str, Any], deadline: float) -> None:
    """Initiator side of the handshake on a fresh ``wire``; raises on refusal or timeout.

    :class:`AuthenticationFailed` if either proof fails, :class:`EncryptionMismatch` if one side
    encrypts and the other not, :class:`HixlTimeout` past ``deadline``, :class:`ProtocolError` for a
    peer that is not a compatible hixl engine. Encrypting, everything after the CHALLENGE is sealed.
    """
    try:
        wire.send_raw(wire.conn.initiate(), deadline)
        try:
            _expect(wire, proto.Challenge, deadline)
        except EncryptionMismatch as exc:
            raise EncryptionMismatch(f"{wire.peer}: {exc}") from None
        if wire.conn.seal is not None:
            wire.start_sealing()
        with wire.conn_lock:
            frame = wire.conn.authenticate(info)
        wire.send_raw(frame, deadline)
        _expect(wire, proto.Welcome, deadline)
    except TransferTimeout as exc:
        raise HixlTimeout(f"{wire.peer} did not complete the handshake in time") from exc


def _expect(wire: Wire, kind: type, deadline: float) -> None:
    event = wire.next_event(deadline)
    if isinstance(event, proto.Error):
        raise error_for_status(event.status, f"{wire.peer} refused the connection: {event.message}")
    if isinstance(event, ConnectionClosed):
        raise PeerDisconnected(f"{wire.peer} closed the connection during the handshake")
    if not isinstance(event, kind):  # pragma: no cover - the connection's state table refuses it first
        raise ProtocolError(f"{wire.peer} answered with {type(event).__name__}")

