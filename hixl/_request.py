"""Completion objects for transfers.

A :class:`TransferReq` starts WAITING and moves exactly once to COMPLETED, FAILED
or TIMEOUT. Whoever moves the bytes (an I/O thread or the caller) holds
``io_lock`` while it writes into a chunk of the destination and checks
``cancelled`` first; expiring a request takes the same lock, so once a request
reports TIMEOUT no further byte of it lands in local memory.

Waiting: :meth:`TransferReq.wait` blocks a thread on an Event; ``await req``
(or :meth:`TransferReq.wait_async`) parks a coroutine on a done-callback that
wakes its event loop (:mod:`hixl._aio`). Either way, nothing spins.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator
from typing import Any

from ._aio import wait_until
from ._exceptions import HixlError, TransferCancelled, TransferTimeout
from ._types import Op, TransferStatus

__all__ = ["TransferReq"]

log = logging.getLogger("hixl")

DoneCallback = Callable[["TransferReq"], Any]


class TransferReq:
    """One transfer in flight; returned by :meth:`Engine.transfer_async`."""

    __slots__ = (
        "_callbacks",
        "_done",
        "_lock",
        "_status",
        "cancelled",
        "lands_remotely",
        "deadline",
        "error",
        "finished_at",
        "io_lock",
        "nbytes",
        "num_descs",
        "op",
        "remote_engine",
        "started",
    )

    def __init__(self, remote_engine: str, op: Op, num_descs: int, nbytes: int, timeout: float | None) -> None:
        self.remote_engine = remote_engine
        self.op = op
        self.num_descs = num_descs
        self.nbytes = nbytes
        self.started = time.monotonic()
        self.deadline = None if timeout is None else self.started + timeout
        self.error: HixlError | None = None
        self.finished_at: float | None = None
        """``time.monotonic()`` when the request reached its final status."""
        self.cancelled = False
        self.lands_remotely = False
        """Set by a transport whose target lands this request's data itself (a TCP WRITE)."""
        self.io_lock = threading.Lock()
        self._lock = threading.Lock()
        # Created only if someone has to block: a transfer_sync that completed
        # inline never pays for an Event (a measurable share of an 8-byte copy).
        self._done: threading.Event | None = None
        self._callbacks: list[DoneCallback] | None = None  # likewise, only once someone subscribes
        self._status = TransferStatus.WAITING

    @property
    def status(self) -> TransferStatus:
        """Current status; a WAITING request past its deadline becomes TIMEOUT here."""
        if self._status is TransferStatus.WAITING and self.deadline is not None and time.monotonic() >= self.deadline:
            self._expire()
        return self._status

    def done(self) -> bool:
        """True once the status is final."""
        return self.status.is_final

    def wait(self, timeout: float | None = None) -> TransferStatus:
        """Block (without spinning) until the request is final or ``timeout`` seconds pass.

        Returns the status — still WAITING if ``timeout`` ran out first. Raises the
        transfer's error (:class:`TransferError`, :class:`TransferTimeout`, ...) if
        it failed or passed its own deadline.
        """
        if self._status is TransferStatus.WAITING:
            with self._lock:
                if self._done is None:
                    self._done = threading.Event()
                if self._status is not TransferStatus.WAITING:
                    self._done.set()
            self._done.wait(self._limit(timeout))
        return self._outcome()

    async def wait_async(self, timeout: float | None = None) -> TransferStatus:
        """:meth:`wait` for asyncio: ``await req.wait_async(timeout)``; ``await req`` waits with no limit.

        The event loop is woken by the thread that finishes the request (no
        thread per await, no polling). Cancelling the await leaves the request
        running: it still completes, and can be waited for again.
        """
        await wait_until(self.done, self.add_done_callback, self.remove_done_callback, self._limit(timeout))
        return self._outcome()

    def __await__(self) -> Generator[Any, None, TransferStatus]:
        """``await req``: :meth:`wait_async` without a limit of its own (the request's deadline applies)."""
        return self.wait_async().__await__()

    def cancel(self) -> TransferStatus:
        """Stop the request; when this returns, no further byte of it lands, and the final
        status is returned (FAILED with :class:`TransferCancelled`, unless it ended first).

        A READ, or a same-host copy, stops at once: the chunk being written when it is
        called finishes first (it was already landing), none after it starts. A WRITE
        whose data went to a target that lands it itself (TCP) cannot be called back:
        ``cancel`` then waits until the target answered or the request's deadline passed
        (after which the target lands nothing of it), and reports what happened.
        """
        if self.lands_remotely and self._status is TransferStatus.WAITING:
            self.wait_quietly()
        self.cancelled = True  # later chunks see it (under io_lock) and are not written
        with self.io_lock:
            self._finish(TransferStatus.FAILED, TransferCancelled(f"{self!r} was cancelled"))
        return self.status

    def wait_quietly(self) -> None:
        """Wait until the request is final or its deadline passed, raising nothing."""
        try:
            self.wait()
        except HixlError:
            pass

    def remaining(self, default: float = 30.0) -> float:
        """Seconds left before the deadline (at least a millisecond); ``default`` without one."""
        if self.deadline is None:
            return default
        return max(0.001, self.deadline - time.monotonic())

    def _limit(self, timeout: float | None) -> float | None:
        """Seconds to wait: ``timeout``, cut short by the request's own deadline."""
        if self.deadline is None:
            return timeout
        left = max(0.0, self.deadline - time.monotonic())
        return left if timeout is None else max(0.0, min(timeout, left))

    def _outcome(self) -> TransferStatus:
        status = self.status
        if self.error is not None:
            raise self.error
        return status

    def add_done_callback(self, callback: DoneCallback) -> None:
        """Call ``callback(req)`` once the request is final; at once (here) if it already is.

        It runs in whichever thread finishes the request — often an engine I/O
        thread — so it must be quick and must not block: wake something up and
        return. Exceptions it raises are logged. A deadline passing is noticed
        when someone looks (:attr:`status`, a wait), not by a timer.
        """
        with self._lock:
            if self._status is TransferStatus.WAITING:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(callback)
                return
        _call(callback, self)

    def remove_done_callback(self, callback: DoneCallback) -> None:
        """Forget a callback added with :meth:`add_done_callback` (no-op if it is not there)."""
        with self._lock:
            if self._callbacks is not None and callback in self._callbacks:
                self._callbacks.remove(callback)

    def complete(self) -> None:
        """Mark success (no-op if the request already ended)."""
        self._finish(TransferStatus.COMPLETED, None)

    def fail(self, error: HixlError) -> None:
        """Mark failure with ``error`` (no-op if the request already ended)."""
        self._finish(TransferStatus.TIMEOUT if isinstance(error, TransferTimeout) else TransferStatus.FAILED, error)

    def _expire(self) -> None:
        self.cancelled = True  # later chunks see it (under io_lock) and are not written
        # Wait out a chunk being written right now *before* reporting TIMEOUT: reported
        # first, another thread could see TIMEOUT while that chunk was still landing.
        with self.io_lock:
            self._finish(TransferStatus.TIMEOUT, TransferTimeout(f"{self!r} passed its deadline"))

    def _finish(self, status: TransferStatus, error: HixlError | None) -> None:
        with self._lock:
            if self._status is not TransferStatus.WAITING:
                return
            self.error = error
            self._status = status
            self.finished_at = time.monotonic()
            done, callbacks, self._callbacks = self._done, self._callbacks, None
        if error is not None:
            self.cancelled = True
        if done is not None:
            done.set()
        for callback in callbacks or ():
            _call(callback, self)

    def __repr__(self) -> str:
        elapsed = (time.monotonic() - self.started) * 1e3
        return (
            f"<TransferReq {self.op.name} {self.remote_engine} {self.num_descs} desc(s) "
            f"{self.nbytes} B {self._status.name} after {elapsed:.1f} ms>"
        )


def _call(callback: DoneCallback, req: TransferReq) -> None:
    try:
        callback(req)
    except Exception:  # a subscriber's bug must not break the thread that finished the request
        log.exception("hixl: done callback %r of %r raised", callback, req)
