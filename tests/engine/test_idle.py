"""Idle TCP links ping slowly (``idle_ping_interval``) and are still found dead a budget after that;
a busy one keeps the heartbeat's pace; the target allows an idle peer its announced silence."""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

import hixl
from hixl import Engine, Op, PeerDisconnected, TransferTimeout
from hixl.bench.procstat import cpu_ns
from hixl.testing import TargetProcess

MakeTarget = Callable[..., TargetProcess]

pytestmark = pytest.mark.timeout(60)

INTERVAL, MISSES, IDLE = 0.1, 3, 1.0
BUDGET = INTERVAL * MISSES
OPTIONS = {"transport": "tcp", "heartbeat_interval": INTERVAL, "heartbeat_misses": MISSES, "idle_ping_interval": IDLE}


def _link_up(eng: Engine, target: str) -> bool:
    """Whether the link is up, asked without touching the network (no request makes it busy)."""
    try:
        eng.peer_incarnation(target)
    except PeerDisconnected:
        return False
    return True


def test_an_idle_tcp_link_to_a_frozen_target_breaks_a_budget_after_its_idle_ping(make_target: MakeTarget) -> None:
    target = make_target([1 << 20], {"heartbeat_interval": INTERVAL, "heartbeat_misses": MISSES})
    with Engine("127.0.0.1", OPTIONS) as eng:
        buf = hixl.empty(4096)
        eng.register_mem(buf)
        eng.connect(target.engine)
        eng.transfer_sync(target.engine, Op.READ, [(int(buf.ctypes.data), target.addrs[0], 8)])
        target.stop(signal.SIGSTOP)
        start = time.monotonic()
        try:
            time.sleep(IDLE * 0.8)  # idle, silent, within its idle allowance: nothing happens
            descs = np.array([[buf.ctypes.data, target.addrs[0], 8]], dtype=np.uint64)
            with pytest.raises((PeerDisconnected, TransferTimeout)):
                # A request makes the link busy: the frozen peer now has one budget to show life.
                eng.transfer_sync(target.engine, Op.READ, descs, timeout=10)
            took = time.monotonic() - start
            assert took < IDLE * 0.8 + BUDGET + 1.0, f"a busy link to a frozen peer broke only after {took:.1f} s"
            with pytest.raises(PeerDisconnected):
                eng.transfer_sync(target.engine, Op.READ, descs, timeout=1)
        finally:
            target.stop(signal.SIGCONT)


def test_an_idle_tcp_link_is_pinged_slowly_and_survives_on_both_sides(make_target: MakeTarget) -> None:
    """Idle for five idle intervals with a 0.3 s budget: the initiator pinged, the target answered
    and kept the connection (it allows the silence the peer announced), and the link still works."""
    target = make_target([1 << 20], {"heartbeat_interval": INTERVAL, "heartbeat_misses": MISSES})
    with Engine("127.0.0.1", OPTIONS) as eng:
        buf = hixl.empty(4096)
        eng.register_mem(buf)
        eng.connect(target.engine)
        served = target.call("served_connections")
        time.sleep(5 * IDLE)
        assert target.call("served_connections") == served  # the same connection, not dropped
        eng.transfer_sync(target.engine, Op.READ, [(int(buf.ctypes.data), target.addrs[0], 8)], timeout=2)


def test_an_idle_frozen_target_is_found_dead_within_its_idle_ping_and_a_budget(make_target: MakeTarget) -> None:
    target = make_target([1 << 20], {"heartbeat_interval": INTERVAL, "heartbeat_misses": MISSES})
    with Engine("127.0.0.1", OPTIONS) as eng:
        eng.connect(target.engine)
        target.stop(signal.SIGSTOP)
        start = time.monotonic()
        try:
            while _link_up(eng, target.engine) and time.monotonic() - start < 10:
                time.sleep(0.02)
            took = time.monotonic() - start
        finally:
            target.stop(signal.SIGCONT)
        assert IDLE * 0.9 <= took < IDLE + BUDGET + 1.0, f"the idle link broke after {took:.1f} s"


@pytest.mark.parametrize("busy_poll", [0.0, 0.01])
def test_a_target_busy_polls_only_right_after_a_request(busy_poll: float) -> None:
    """The target's I/O thread polls for ``busy_poll`` seconds after a request (0.01, the most
    allowed), then sleeps: idle afterwards, the target burns well under 2 % of a core; and with
    busy polling off, requests are served just the same."""
    with TargetProcess([1 << 20], {"busy_poll": busy_poll}) as target, Engine("127.0.0.1", {"transport": "tcp", "busy_poll": busy_poll}) as eng:
        buf = hixl.empty(4096)
        eng.register_mem(buf)
        eng.connect(target.engine)
        for _ in range(20):
            eng.transfer_sync(target.engine, Op.READ, [(int(buf.ctypes.data), target.addrs[0], 8)])
        time.sleep(0.05)
        before = cpu_ns(target.pid)
        time.sleep(1.0)
        burnt = (cpu_ns(target.pid) - before) / 1e9
        assert burnt < 0.02, f"the idle target burnt {burnt * 100:.1f} % of a core"


def test_a_wake_up_asked_for_during_the_loops_drain_is_not_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """The target's I/O loop is woken through a pipe and a flag (set: a byte is on its way). A
    worker asking for a wake-up while the loop drains that pipe (injected: a call_soon from inside
    the drain's read) must not leave the flag set with the pipe empty — every later wake-up would
    then be skipped, and a worker's hand-back wait for the loop's next sweep."""
    with Engine("127.0.0.1:0") as eng:
        loop = eng._server.loop  # type: ignore[union-attr]
        real_read = os.read
        injected = threading.Event()

        def read_with_a_worker_asking_meanwhile(fd: int, n: int) -> bytes:
            data = real_read(fd, n)
            if fd == loop._wake_r and not injected.is_set():
                injected.set()
                loop.call_soon(lambda: None)  # (as a worker would, at that very moment)
            return data

        monkeypatch.setattr(os, "read", read_with_a_worker_asking_meanwhile)
        ran = threading.Event()
        loop.call_soon(ran.set)
        assert ran.wait(5) and injected.wait(5)
        done = threading.Event()
        loop.call_soon(done.set)  # (either wakes the loop or finds the flag rightly set)
        assert done.wait(5)
        monkeypatch.setattr(os, "read", real_read)
        # The flag is set only while a byte waits in the pipe.
        if loop._woken:
            assert select.select([loop._wake_r], [], [], 0.5)[0], "flag set, pipe empty: wake-ups are lost"
