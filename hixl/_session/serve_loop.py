"""The target's one I/O thread: however many peers, one loop accepts, reads, answers and times them.

Threads. However many peers: one I/O loop (:class:`_Loop`: a selector over the
listener and every socket, timers as one sweep, every send through a
connection's non-blocking :class:`~hixl._session.outbox.Outbox`), and at most
``serve_threads`` workers (:class:`~hixl._session.pool.WorkerPool`) for requests that
move data, which may wait on a slow peer up to their deadlines. A connection whose
request went to a worker is not watched until the worker hands it back.

A round: the sockets that are ready (the listener's new connections are admitted
by the server, see :mod:`hixl._session.target`), then the connections with whole
frames still buffered (the selector cannot see those), then what other threads
asked for, then a batch of connections with pushed updates to send, then the sweep
of timers when it is due (handshake deadlines, partial frames, liveness and PINGs).
With ``busy_poll`` it polls on for that long before it sleeps: a peer that waits on
its answer often sends its next request within microseconds.

Nothing another thread wants sent waits on a socket: it asks the loop
(:meth:`_Loop.call_soon`, a byte down a pipe to wake it). A registration change is
one word to the loop, which sends the newest table to every peer (encoded once:
:meth:`_Loop.shared_frame`); a deregistration has the loop queue every peer's
REVOKE at once and waits for the confirmations, so it takes one round trip plus
the slowest peer, bounded by ``deregister_timeout``.
"""

from __future__ import annotations

import collections
import logging
import os
import selectors
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import _protocol as proto
from .served import _BUFFERED, _Phase, _ServedConnection

if TYPE_CHECKING:
    from .target import TargetServer

log = logging.getLogger("hixl")

_FLUSHES_PER_ROUND = 128
"""Most connections the loop sends pushed updates to before it looks at its sockets again."""


class _Loop:
    """The target's one I/O thread: accept, handshakes, control frames, heartbeats, outboxes.

    Every socket is non-blocking and watched by one selector; timers are a sweep
    (handshake deadlines, partial frames, liveness and PINGs) at least every
    :attr:`tick` seconds. Other threads talk to it only through :meth:`call_soon`.
    A connection whose request went to a worker is not watched until it comes back.
    """

    def __init__(self, server: TargetServer) -> None:
        self.server = server
        limits = server.limits
        # Handshakes are timed to a quarter of their timeouts; open connections' liveness, partial
        # frames and outboxes to half an interval (a peer is dead only after several).
        self.tick = max(0.01, min(0.25, limits.hello_timeout / 4, limits.handshake_timeout / 4))
        self.open_tick = max(self.tick, min(limits.heartbeat_interval / 2, limits.frame_timeout / 4))
        self._next_open_sweep = 0.0
        self.busy_poll = limits.busy_poll
        self._polling_until = 0.0  # (see _events)
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._selector.register(server.listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._calls: collections.deque[Callable[[], None]] = collections.deque()
        self._calls_lock = threading.Lock()
        self._stopped = False
        """The thread has ended: calls are refused (guarded by ``_calls_lock``)."""
        self._woken = False
        self._ready: collections.deque[_ServedConnection] = collections.deque()
        """Connections with complete frames buffered (the selector cannot see those)."""
        self._handshaking: set[_ServedConnection] = set()
        """Connections watched while in their handshake (swept more often than open ones)."""
        self._to_flush: collections.deque[_ServedConnection] = collections.deque()
        """Connections with something to send made elsewhere (a REGIONS push), a batch per round."""
        self._conns: set[_ServedConnection] = set()
        self._accept_paused_until = 0.0
        self._stopping = False
        self._next_sweep = 0.0
        self._shared: dict[tuple[proto.FrameType, int], tuple[proto.Message, bytes]] = {}
        self._shared_generation = -1  # the registrations generation _shared's frames are of
        self.thread = threading.Thread(target=self._run, name=f"hixl-loop-{server.address}", daemon=True)

    def start(self) -> None:
        """Start the loop's thread."""
        self.thread.start()

    # -- from any thread ------------------------------------------------------------------------------
    def call_soon(self, fn: Callable[[], None]) -> bool:
        """Run ``fn`` on the loop's thread soon; False if the loop has stopped (it will not run)."""
        with self._calls_lock:
            if self._stopped:
                return False
            self._calls.append(fn)
        if not self._woken:
            self._woken = True
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass  # closed: the loop has stopped
        return True

    def stop(self, timeout: float) -> None:
        """End every connection (BYE first), stop and join the thread."""
        if self.thread.is_alive() and self.call_soon(self._begin_stop):
            self.thread.join(timeout)
        self._selector.close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    # -- on the loop's thread -------------------------------------------------------------------------
    def connections(self) -> list[_ServedConnection]:
        """The connections the loop serves now (busy ones included)."""
        return list(self._conns)

    def watch(self, conn: _ServedConnection) -> None:
        """Serve ``conn``: a new one, or one back from a worker."""
        if conn.ended:
            return  # (evicted by a newer one accepted in the same batch)
        self._conns.add(conn)
        if not conn.is_open():
            self._handshaking.add(conn)
        self.update(conn)
        if conn.wire.conn.buffered:
            self._ready.append(conn)

    def update(self, conn: _ServedConnection) -> None:
        """Watch ``conn``'s socket for what it waits for now (nothing while a worker has it)."""
        events = conn.interest()
        if events == conn.watched and events:
            return  # (the common case, on every frame: nothing to change)
        conn.watched = events
        key = self._selector.get_map().get(conn.wire.fd)
        if key is not None and key.data is not conn:
            self._selector.unregister(conn.wire.fd)  # (a descriptor number reused since: not ours)
            key = None
        if events and key is None:
            self._selector.register(conn.wire.fd, events, conn)
        elif events and key is not None and key.events != events:
            self._selector.modify(conn.wire.fd, events, conn)
        elif not events and key is not None:
            self._selector.unregister(conn.wire.fd)

    def ended(self, conn: _ServedConnection) -> None:
        """``conn`` is over: stop watching it (before its socket closes)."""
        self._conns.discard(conn)
        key = self._selector.get_map().get(conn.wire.fd)
        if key is not None and key.data is conn:
            self._selector.unregister(conn.wire.fd)

    def pause_accepting(self, seconds: float) -> None:
        """Out of descriptors: stop accepting for a while (the sweep resumes it)."""
        self._accept_paused_until = time.monotonic() + seconds
        self._selector.unregister(self.server.listener)

    def push_regions(self) -> None:
        """Tell every open connection what changed in the registrations (one REGIONS frame for all
        that knew the same generation), in the next rounds: whatever else waits for the loop (a
        deregistration's decision) first."""
        for conn in self._conns:
            conn.regions_dirty = True
        self._to_flush.extend(self._conns)

    def shared_frame(self, kind: proto.FrameType, base: int) -> tuple[proto.Message, bytes]:
        """A REGIONS (pushed) or REVOKE taking a peer that knows generation ``base`` to the newest
        registrations — what changed, or all of them if that is shorter — and its frame: encoded
        once for every connection at ``base``, again only when the registrations change."""
        registry = self.server.registry
        if self._shared_generation != registry.generation:
            self._shared.clear()
        cached = self._shared.get((kind, base))
        if cached is None:
            update = registry.update_since(base)
            self._shared_generation = update.generation
            change = (update.generation, proto.WHOLE if update.base is None else update.base, update.added, update.removed)
            message = proto.Revoke(*change) if kind is proto.FrameType.REVOKE else proto.Regions(*change)
            cached = self._shared[(kind, base)] = (message, proto.encode(message))
        return cached

    def _run(self) -> None:
        try:
            while not (self._stopping and not self._conns):
                self._once()
        except Exception:
            log.exception("hixl: the I/O loop of %s crashed", self.server.address)
        finally:
            with self._calls_lock:
                self._stopped = True
                calls = list(self._calls)
            for fn in calls:  # (workers handing connections back, revokes asking: they are owed an answer)
                fn()
            for conn in list(self._conns):
                conn.end("target finalized")

    def _once(self) -> None:
        timeout = 0.0 if self._ready or self._calls or self._to_flush else max(0.0, self._next_sweep - time.monotonic())
        for key, mask in self._events(timeout):
            conn = key.data
            if conn is not None:
                conn.on_ready(mask)
            elif key.fileobj is self.server.listener:
                for new in self.server.accept():
                    self.watch(new)
            else:
                self._drain_wakes()
        for _ in range(len(self._ready)):
            self._ready.popleft().on_ready(_BUFFERED)
        while self._calls:
            self._calls.popleft()()
        for _ in range(min(len(self._to_flush), _FLUSHES_PER_ROUND)):
            conn = self._to_flush.popleft()
            conn.flush()
            if not conn.ended:
                self.update(conn)
        now = time.monotonic()
        if now >= self._next_sweep:
            self._next_sweep = now + self.tick
            self._sweep(now)

    def _events(self, timeout: float) -> list[tuple[selectors.SelectorKey, int]]:
        """The selector's events, waiting ``timeout`` at most. For ``busy_poll`` seconds after the
        last events it polls again and again (yielding the CPU between looks) before it sleeps: the
        next request of a peer that waits on its answer is often due within microseconds, and a
        sleeping thread's wake-up would cost more than that."""
        if timeout > 0.0 and self._polling_until:
            while not (events := self._selector.select(0)) and time.monotonic() < self._polling_until:
                os.sched_yield()
            if not events:
                self._polling_until = 0.0
                events = self._selector.select(timeout)
        else:
            events = self._selector.select(timeout)
        if events and self.busy_poll:
            self._polling_until = time.monotonic() + self.busy_poll
        return events

    def again(self, conn: _ServedConnection) -> None:
        """``conn`` stopped with complete frames still buffered (its share of this round): later."""
        self._ready.append(conn)

    def _drain_wakes(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        # Cleared after the pipe is empty, not before: a call_soon between the two would have
        # written a byte this drain swallowed and left the flag set with the pipe empty, and every
        # later call_soon (a worker handing its connection back) waited for the next sweep.
        # One that sees the flag still set queued its call before, and this round runs it.
        self._woken = False

    def _sweep(self, now: float) -> None:
        if self._accept_paused_until and now >= self._accept_paused_until and not self._stopping:
            self._accept_paused_until = 0.0
            self._selector.register(self.server.listener, selectors.EVENT_READ, None)
        full = now >= self._next_open_sweep
        if full:
            self._next_open_sweep = now + self.open_tick
        self._handshaking = {c for c in self._handshaking if c.phase in (_Phase.HELLO, _Phase.AUTH)}
        for conn in list(self._conns if full else self._handshaking):
            conn.on_timer(now, full)

    def _begin_stop(self) -> None:
        self._stopping = True
        if not self._accept_paused_until:
            self._selector.unregister(self.server.listener)
        for conn in list(self._conns):
            if not conn.busy:
                conn.say_bye("target finalized")
                conn.end("target finalized")
