"""Waiting without polling: Engine.wait_notifies, and asyncio awaits of requests and notifications.

Peers are real child processes (:class:`hixl.testing.TargetProcess`). To keep
requests waiting for as long as a test needs, the target is frozen (SIGSTOP)
behind a TCP link: its engine thread then serves nothing until SIGCONT.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import hixl
from hixl import Engine, NotifyDesc, Op, TransferReq, TransferStatus, TransferTimeout
from hixl.testing import TargetProcess

pytestmark = pytest.mark.timeout(60)

MakeTarget = Callable[..., TargetProcess]
# No heartbeat verdict while a test keeps the target frozen on purpose.
PATIENT = {"transport": "tcp", "heartbeat_interval": 30.0, "transfer_timeout": 60.0}


@pytest.fixture
def listener() -> Iterator[Engine]:
    """An engine that listens, so a target process can connect back and notify it."""
    with Engine("127.0.0.1:0", {"heartbeat_interval": 30.0}) as eng:
        yield eng


def _notify_from(target: TargetProcess, engine: Engine, *messages: str) -> None:
    """Have the child connect to ``engine`` (once) and send it ``messages`` in order."""
    if engine.local_engine not in target.call("connected_engines"):
        target.call("connect", engine.local_engine)
    for msg in messages:
        target.call("send_notify", engine.local_engine, NotifyDesc("n", msg))


# -- Engine.wait_notifies ---------------------------------------------------------------
def test_wait_notifies_blocks_until_a_notification_arrives(listener: Engine, shared_target: TargetProcess) -> None:
    shared_target.call("connect", listener.local_engine)
    try:
        sender = threading.Timer(0.3, lambda: _notify_from(shared_target, listener, "one", "two"))
        start = time.monotonic()
        sender.start()
        got = listener.wait_notifies(10)
        elapsed = time.monotonic() - start
        sender.join()
        assert elapsed >= 0.25  # it blocked until the sender ran
        got += listener.wait_notifies(5) if len(got) < 2 else []
        assert got == [NotifyDesc("n", "one"), NotifyDesc("n", "two")]
        assert listener.get_notifies() == []  # drained
    finally:
        shared_target.call("disconnect", listener.local_engine)


def test_wait_notifies_returns_what_is_already_there_at_once(listener: Engine, shared_target: TargetProcess) -> None:
    _notify_from(shared_target, listener, "early")
    try:
        start = time.monotonic()
        assert listener.wait_notifies(10) == [NotifyDesc("n", "early")]
        assert time.monotonic() - start < 1
    finally:
        shared_target.call("disconnect", listener.local_engine)


def test_wait_notifies_times_out_empty(listener: Engine) -> None:
    start = time.monotonic()
    assert listener.wait_notifies(0.3) == []
    assert 0.3 <= time.monotonic() - start < 2


def test_finalize_wakes_a_blocked_waiter() -> None:
    eng = Engine("127.0.0.1:0")
    result: list[list[NotifyDesc]] = []
    waiter = threading.Thread(target=lambda: result.append(eng.wait_notifies(30)))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive()
    eng.finalize()
    waiter.join(5)
    assert not waiter.is_alive() and result == [[]]
    with pytest.raises(hixl.HixlError, match="finalized"):
        eng.wait_notifies(0)


# -- asyncio ----------------------------------------------------------------------------
def test_await_a_request(shared_target: TargetProcess) -> None:
    with Engine("127.0.0.1") as eng:
        buf = hixl.empty(1 << 20)
        eng.register_mem(buf)
        eng.connect(shared_target.engine)

        async def main() -> TransferStatus:
            req = eng.transfer_async(shared_target.engine, Op.READ, [(int(buf.ctypes.data), shared_target.addrs[0], 1 << 20)])
            return await req

        assert asyncio.run(main()) is TransferStatus.COMPLETED
        np.testing.assert_array_equal(buf, TargetProcess.expected(1 << 20, 7))


def test_awaited_request_times_out_by_its_deadline(make_target: MakeTarget) -> None:
    target = make_target()
    with Engine("127.0.0.1", PATIENT) as eng:
        buf = hixl.empty(4096)
        eng.register_mem(buf)
        eng.connect(target.engine)
        target.stop()
        req = eng.transfer_async(target.engine, Op.READ, [(int(buf.ctypes.data), target.addrs[0], 4096)], timeout=0.3)

        async def main() -> None:
            assert await req.wait_async(0.05) is TransferStatus.WAITING  # a shorter wait returns
            start = time.monotonic()
            with pytest.raises(TransferTimeout):
                await req  # nobody polls: the loop's timer applies the deadline
            assert 0.15 <= time.monotonic() - start < 2

        asyncio.run(main())
        assert req.status is TransferStatus.TIMEOUT


def test_cancelling_an_await_leaves_the_request_running(make_target: MakeTarget) -> None:
    target = make_target()
    target.fill(0, 11)
    with Engine("127.0.0.1", PATIENT) as eng:
        buf = hixl.empty(1 << 20)
        eng.register_mem(buf)
        eng.connect(target.engine)
        target.stop()
        req = eng.transfer_async(target.engine, Op.READ, [(int(buf.ctypes.data), target.addrs[0], 1 << 20)])

        async def main() -> None:
            waiter = asyncio.ensure_future(req.wait_async())
            await asyncio.sleep(0.1)
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            assert req.status is TransferStatus.WAITING
            target.stop(signal.SIGCONT)
            assert await asyncio.wait_for(req.wait_async(), 10) is TransferStatus.COMPLETED  # awaited again

        asyncio.run(main())
        np.testing.assert_array_equal(buf, TargetProcess.expected(1 << 20, 11))


def test_wait_notifies_async(listener: Engine, shared_target: TargetProcess) -> None:
    shared_target.call("connect", listener.local_engine)
    try:

        async def main() -> None:
            assert await listener.wait_notifies_async(0.2) == []  # times out empty
            waiter = asyncio.ensure_future(listener.wait_notifies_async(10))
            await asyncio.sleep(0.1)
            assert not waiter.done()
            await asyncio.get_running_loop().run_in_executor(None, _notify_from, shared_target, listener, "hi")
            assert await asyncio.wait_for(waiter, 10) == [NotifyDesc("n", "hi")]

        asyncio.run(main())
    finally:
        shared_target.call("disconnect", listener.local_engine)


def test_a_thousand_awaits_cost_no_idle_cpu(make_target: MakeTarget, listener: Engine) -> None:
    """800 requests to a frozen peer and 200 notification waits, on one loop: the process idles."""
    target = make_target()
    target.fill(0, 5)
    n_reqs, n_notifies, size = 800, 200, 512
    with Engine("127.0.0.1", PATIENT) as eng:
        buf = hixl.empty(n_reqs * size)
        eng.register_mem(buf)
        eng.connect(target.engine)
        target.call("connect", listener.local_engine)
        target.stop()
        base = int(buf.ctypes.data)
        reqs: list[TransferReq] = [
            eng.transfer_async(target.engine, Op.READ, [(base + i * size, target.addrs[0] + i * size, size)])
            for i in range(n_reqs)
        ]

        async def main() -> tuple[float, list[TransferStatus], list[list[NotifyDesc]]]:
            req_waits = [asyncio.ensure_future(req.wait_async()) for req in reqs]
            notify_waits = [asyncio.ensure_future(listener.wait_notifies_async(30)) for _ in range(n_notifies)]
            waits: list[asyncio.Future[Any]] = [*req_waits, *notify_waits]
            await asyncio.sleep(0.3)  # everyone is parked
            assert not any(w.done() for w in waits)
            cpu, wall = time.process_time(), time.monotonic()
            await asyncio.sleep(2.0)
            idle = (time.process_time() - cpu) / (time.monotonic() - wall)
            assert not any(w.done() for w in waits)
            target.stop(signal.SIGCONT)
            statuses = await asyncio.wait_for(asyncio.gather(*req_waits), 30)
            # One notification at a time: the waiters it wakes run before the next is sent.
            loop = asyncio.get_running_loop()
            for i in range(n_notifies):
                await loop.run_in_executor(None, _notify_from, target, listener, str(i))
            return idle, statuses, await asyncio.wait_for(asyncio.gather(*notify_waits), 30)

        idle, statuses, notes = asyncio.run(main())
    assert idle < 0.01, f"{idle:.2%} of a core while 1000 awaits waited"
    assert statuses == [TransferStatus.COMPLETED] * n_reqs
    np.testing.assert_array_equal(buf, TargetProcess.expected(1 << 20, 5)[: n_reqs * size])
    # Each notification went to exactly one waiter.
    received = [[n.msg for n in got] for got in notes]
    assert sorted(received) == sorted([str(i)] for i in range(n_notifies))
