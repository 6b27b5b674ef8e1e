"""TransferReq, the completion object: states, wait, deadlines, and the io_lock contract."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import pytest

from hixl import (
    Op,
    PeerDisconnected,
    TransferError,
    TransferReq,
    TransferStatus,
    TransferTimeout,
)

pytestmark = pytest.mark.timeout(30)


def _req(timeout: float | None = 10.0) -> TransferReq:
    return TransferReq("127.0.0.1:1234", Op.WRITE, 3, 300, timeout)


def test_initial_state_and_repr() -> None:
    req = _req()
    assert req.status is TransferStatus.WAITING and not req.done()
    assert not TransferStatus.WAITING.is_final
    assert req.error is None and req.finished_at is None
    text = repr(req)
    assert text.startswith("<TransferReq WRITE 127.0.0.1:1234 3 desc(s) 300 B WAITING after ")
    assert text.endswith(" ms>")


def test_complete_is_final() -> None:
    req = _req()
    req.complete()
    assert req.status is TransferStatus.COMPLETED and req.done() and TransferStatus.COMPLETED.is_final
    assert req.wait() is TransferStatus.COMPLETED
    assert req.finished_at is not None
    req.fail(PeerDisconnected("late"))  # no effect once final
    assert req.status is TransferStatus.COMPLETED and req.error is None
    assert "COMPLETED" in repr(req)


def test_fail_is_final_and_raised_by_wait() -> None:
    req = _req()
    error = PeerDisconnected("gone")
    req.fail(error)
    assert req.status is TransferStatus.FAILED and req.done()
    assert req.error is error and req.cancelled
    with pytest.raises(PeerDisconnected):
        req.wait()
    req.complete()
    assert req.status is TransferStatus.FAILED


def test_fail_with_a_timeout_is_timeout() -> None:
    req = _req()
    req.fail(TransferTimeout("slow"))
    assert req.status is TransferStatus.TIMEOUT
    with pytest.raises(TransferTimeout):
        req.wait()


def test_deadline_expires_by_polling() -> None:
    req = _req(timeout=0.1)
    assert req.status is TransferStatus.WAITING
    time.sleep(0.15)
    assert req.status is TransferStatus.TIMEOUT
    assert req.cancelled and isinstance(req.error, TransferTimeout)
    req.complete()
    assert req.status is TransferStatus.TIMEOUT


def test_wait_with_a_shorter_timeout_returns_waiting() -> None:
    req = _req(timeout=10)
    start = time.monotonic()
    assert req.wait(0.1) is TransferStatus.WAITING
    assert 0.1 <= time.monotonic() - start < 1
    no_deadline = _req(timeout=None)
    assert no_deadline.wait(0.05) is TransferStatus.WAITING


def test_wait_stops_at_the_deadline() -> None:
    req = _req(timeout=0.2)
    start = time.monotonic()
    with pytest.raises(TransferTimeout):
        req.wait(10)
    assert 0.2 <= time.monotonic() - start < 1


@pytest.mark.parametrize("outcome", ["complete", "fail"])
def test_wait_wakes_when_another_thread_finishes(outcome: str) -> None:
    req = _req(timeout=10)

    def finish() -> None:
        time.sleep(0.1)
        req.complete() if outcome == "complete" else req.fail(TransferError("no"))

    threading.Thread(target=finish).start()
    start = time.monotonic()
    if outcome == "complete":
        assert req.wait() is TransferStatus.COMPLETED
    else:
        with pytest.raises(TransferError):
            req.wait()
    assert time.monotonic() - start < 2  # woken, not timed out


def test_timeout_is_reported_only_after_the_chunk_being_written() -> None:
    """While a chunk is being written (its writer holds io_lock), nobody may see TIMEOUT yet:
    once anyone has seen it, no further byte of the request may land."""
    req = _req(timeout=0.1)
    outcomes: list[str] = []

    def waiter() -> None:
        try:
            req.wait()
        except TransferTimeout:
            outcomes.append("timeout")

    with req.io_lock:  # a writer in the middle of a chunk
        waiters = [threading.Thread(target=waiter) for _ in range(2)]
        for thread in waiters:
            thread.start()
        time.sleep(0.4)  # well past the deadline
        assert outcomes == [], "TIMEOUT was reported while a chunk was still being written"
        assert req.cancelled  # but the writer is told to stop after this chunk
    for thread in waiters:
        thread.join(5)
    assert outcomes == ["timeout", "timeout"]
    assert req.status is TransferStatus.TIMEOUT


# -- done callbacks (what ``await req`` is built on) -----------------------------------
def test_done_callbacks_run_once_in_the_finishing_thread() -> None:
    req = _req()
    calls: list[tuple[str, TransferStatus, str]] = []

    def record(name: str) -> Callable[[TransferReq], None]:
        return lambda r: calls.append((name, r.status, threading.current_thread().name))

    first, removed = record("first"), record("removed")
    req.add_done_callback(first)
    req.add_done_callback(removed)
    req.remove_done_callback(removed)
    req.remove_done_callback(removed)  # not there any more: no-op
    finisher = threading.Thread(target=req.complete, name="finisher")
    finisher.start()
    finisher.join(5)
    req.fail(TransferError("late"))  # already final: no second call
    assert calls == [("first", TransferStatus.COMPLETED, "finisher")]
    req.add_done_callback(record("late"))  # already final: called at once, here
    assert calls[-1] == ("late", TransferStatus.COMPLETED, threading.current_thread().name)


def test_a_raising_done_callback_is_logged_and_the_others_still_run(caplog: pytest.LogCaptureFixture) -> None:
    req = _req()
    seen: list[TransferStatus] = []

    def broken(r: TransferReq) -> None:
        raise RuntimeError("subscriber bug")

    req.add_done_callback(broken)
    req.add_done_callback(lambda r: seen.append(r.status))
    with caplog.at_level(logging.ERROR, logger="hixl"):
        req.fail(TransferTimeout("slow"))
    assert seen == [TransferStatus.TIMEOUT]
    assert "subscriber bug" in caplog.text


def test_done_callbacks_see_a_deadline_noticed_by_a_waiter() -> None:
    req = _req(timeout=0.1)
    seen: list[TransferStatus] = []
    req.add_done_callback(lambda r: seen.append(r.status))
    with pytest.raises(TransferTimeout):
        req.wait(5)
    assert seen == [TransferStatus.TIMEOUT]


def test_await_without_a_loop_timer_is_woken_by_another_thread() -> None:
    req = _req(timeout=None)  # no deadline: only the finishing thread can wake the loop

    async def main() -> TransferStatus:
        threading.Timer(0.1, req.complete).start()
        return await asyncio.wait_for(req.wait_async(), 5)

    assert asyncio.run(main()) is TransferStatus.COMPLETED
