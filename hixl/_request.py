"""Completion objects for transfers.

A :class:`TransferReq` starts WAITING and moves exactly once to COMPLETED, FAILED
or TIMEOUT. Whoever moves the bytes (an I/O thread or the caller) holds
``io_lock`` while it writes into a chunk of the destination and checks
``cancelled`` first; expiring a request takes the same lock, so once a request
reports TIMEOUT no further byte of it lands in local memory.
"""

from __future__ import annotations

import threading
import time

from ._exceptions import HixlError, TransferTimeout
from ._types import Op, TransferStatus

__all__ = ["TransferReq"]


class TransferReq:
    """One transfer in flight; returned by :meth:`Engine.transfer_async`."""

    __slots__ = (
        "_done",
        "_lock",
        "_status",
        "cancelled",
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
        self.io_lock = threading.Lock()
        self._lock = threading.Lock()
        # Created only if someone has to block: a transfer_sync that completed
        # inline never pays for an Event (a measurable share of an 8-byte copy).
        self._done: threading.Event | None = None
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
            limit = timeout
            if self.deadline is not None:
                left = self.deadline - time.monotonic()
                limit = left if limit is None else min(limit, left)
            self._done.wait(None if limit is None else max(0.0, limit))
        status = self.status
        if self.error is not None:
            raise self.error
        return status

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
            done = self._done
        if error is not None:
            self.cancelled = True
        if done is not None:
            done.set()

    def __repr__(self) -> str:
        elapsed = (time.monotonic() - self.started) * 1e3
        return (
            f"<TransferReq {self.op.name} {self.remote_engine} {self.num_descs} desc(s) "
            f"{self.nbytes} B {self._status.name} after {elapsed:.1f} ms>"
        )
