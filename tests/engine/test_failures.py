"""Peers that die or hang: transfers fail clearly within their timeout, never hang, and the
survivor keeps working. Targets are real child processes, killed (SIGKILL) or frozen (SIGSTOP)."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

import hixl
from hixl import (
    Engine,
    HixlError,
    HixlTimeout,
    NotConnected,
    NotifyDesc,
    Op,
    PeerDisconnected,
    TransferStatus,
    TransferTimeout,
)
from hixl.testing import TargetProcess
from hixl.testing.faults import FaultyTransport
from hixl.transports import TcpTransport
from hixl.transports._shm_peer import RECHECK

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
# Heartbeats fast enough that a frozen peer is noticed in well under a second.
FAST_HEARTBEAT = {"heartbeat_interval": 0.1, "heartbeat_misses": 3}
MakeTarget = Callable[..., TargetProcess]


def _addr(buf: np.ndarray) -> int:
    return int(buf.ctypes.data)


def _initiator(transport: str, **options: object) -> tuple[Engine, np.ndarray]:
    eng = Engine("127.0.0.1", {"transport": transport, **options})
    buf = hixl.empty(64 * MiB)
    eng.register_mem(buf)
    return eng, buf


# -- a peer that dies ------------------------------------------------------------------
def test_killed_peer(transport: str, make_target: MakeTarget) -> None:
    dying, other = make_target([MiB]), make_target([MiB])
    other.fill(0, 3)
    eng, buf = _initiator(transport)
    with eng:
        eng.connect(dying.engine)
        eng.connect(other.engine)
        descs = [(_addr(buf), dying.addrs[0], 4096)]
        eng.transfer_sync(dying.engine, Op.READ, descs)
        dying.kill()
        if transport == "shm":
            # shm looks at the target's liveness pipe at most once per RECHECK (docs/engine.md): a
            # transfer in that window still copies, as if made just before the death.
            time.sleep(2 * RECHECK)
        for op in (Op.READ, Op.WRITE):
            start = time.monotonic()
            with pytest.raises(PeerDisconnected, match=r"\(connect\(\) to it again replaces the broken link\)$"):
                eng.transfer_sync(dying.engine, op, descs, timeout=5)
            assert time.monotonic() - start < 5
        # An async request fails at once if the link is known to be down by
        # now, else through its status; either way it never hangs.
        try:
            req = eng.transfer_async(dying.engine, Op.WRITE, descs, timeout=5)
        except PeerDisconnected:
            pass
        else:
            with pytest.raises(PeerDisconnected):
                req.wait(10)
            assert req.status is TransferStatus.FAILED and isinstance(req.error, PeerDisconnected)
        with pytest.raises(PeerDisconnected):
            eng.send_notify(dying.engine, NotifyDesc("a", "b"), timeout=5)
        # The survivor still serves the other peer, on the same engine and transport.
        eng.transfer_sync(other.engine, Op.READ, [(_addr(buf), other.addrs[0], MiB)])
        assert np.array_equal(buf[:MiB], TargetProcess.expected(MiB, 3))
        # The dead peer can be dropped, and a new process connected in its place.
        eng.disconnect(dying.engine)
        assert eng.connected_engines() == [other.engine]
        replacement = make_target([MiB])
        eng.connect(replacement.engine)
        eng.transfer_sync(replacement.engine, Op.WRITE, [(_addr(buf), replacement.addrs[0], MiB)])
        assert replacement.read(0, 0, MiB) == buf[:MiB].tobytes()


def test_peer_killed_while_a_tcp_transfer_waits(make_target: MakeTarget) -> None:
    """Frozen first, so the READ is certainly in flight when the peer dies."""
    target = make_target([64 * MiB])
    eng, buf = _initiator("tcp")
    with eng:
        eng.connect(target.engine)
        target.stop()
        req = eng.transfer_async(target.engine, Op.READ, [(_addr(buf), target.addrs[0], 64 * MiB)], timeout=20)
        assert req.wait(0.3) is TransferStatus.WAITING
        start = time.monotonic()
        target.kill()
        with pytest.raises(PeerDisconnected):
            req.wait(10)
        assert time.monotonic() - start < 5
        assert req.status is TransferStatus.FAILED


def test_killed_initiator_does_not_disturb_the_target(transport: str, make_target: MakeTarget) -> None:
    """Our engine is the target here; initiators in child processes come and go."""
    with Engine("127.0.0.1:0") as eng:
        region = hixl.empty(MiB, shared=transport == "shm")
        eng.register_mem(region)
        dying = make_target([MiB], {"transport": transport})
        dying.call("connect", eng.local_engine)
        dying.write(0, 0, b"\x01" * 4096)
        dying.call("transfer_sync", eng.local_engine, Op.WRITE, [(dying.addrs[0], _addr(region), 4096)])
        assert region[:4096].tobytes() == b"\x01" * 4096
        dying.kill()
        survivor = make_target([MiB], {"transport": transport})
        survivor.call("connect", eng.local_engine)
        survivor.fill(0, 9)
        survivor.call("transfer_sync", eng.local_engine, Op.WRITE, [(survivor.addrs[0], _addr(region), MiB)])
        assert np.array_equal(region, TargetProcess.expected(MiB, 9))
        survivor.call("send_notify", eng.local_engine, NotifyDesc("still", "here"))
        assert eng.get_notifies() == [NotifyDesc("still", "here")]


# -- a peer that hangs -----------------------------------------------------------------
def test_frozen_tcp_peer_times_out(make_target: MakeTarget) -> None:
    target = make_target([MiB])
    eng, buf = _initiator("tcp")
    with eng:
        eng.connect(target.engine)
        target.stop()
        descs = [(_addr(buf), target.addrs[0], 4096)]
        for op in (Op.READ, Op.WRITE):
            start = time.monotonic()
            with pytest.raises(TransferTimeout) as info:
                eng.transfer_sync(target.engine, op, descs, timeout=1)
            assert 1 <= time.monotonic() - start < 2
            assert isinstance(info.value, TimeoutError)
        req = eng.transfer_async(target.engine, Op.READ, descs, timeout=0.6)
        assert req.wait(0.2) is TransferStatus.WAITING  # a short wait returns, it does not raise
        assert not req.done() and "WAITING" in repr(req)
        assert eng.get_transfer_status(req) is TransferStatus.WAITING
        with pytest.raises(TransferTimeout):
            req.wait(5)
        assert req.status is TransferStatus.TIMEOUT and req.done() and "TIMEOUT" in repr(req)
        with pytest.raises(TransferTimeout):
            eng.send_notify(target.engine, NotifyDesc("a", "b"), timeout=0.5)
        # Status is also updated by polling, without anyone waiting.
        req = eng.transfer_async(target.engine, Op.READ, descs, timeout=0.3)
        time.sleep(0.4)
        assert req.status is TransferStatus.TIMEOUT
        assert isinstance(req.error, TransferTimeout)


@pytest.mark.parametrize("transport", ["cma", "shm", "tcp"])
def test_heartbeats_break_the_link_to_a_frozen_peer(transport: str, make_target: MakeTarget) -> None:
    target = make_target([MiB])
    eng, buf = _initiator(transport, **FAST_HEARTBEAT)
    with eng:
        eng.connect(target.engine)
        target.stop()
        descs = [(_addr(buf), target.addrs[0], 4096)]
        start = time.monotonic()
        while True:
            # cma and shm still copy from a frozen process, tcp times out; once the
            # heartbeats give up, both refuse at once.
            try:
                eng.transfer_sync(target.engine, Op.READ, descs, timeout=0.2)
            except TransferTimeout:
                pass
            except PeerDisconnected:
                break
            assert time.monotonic() - start < 5, "the link to a frozen peer never broke"
            time.sleep(0.05)
        start = time.monotonic()
        with pytest.raises(PeerDisconnected):
            eng.transfer_sync(target.engine, Op.READ, descs, timeout=5)
        assert time.monotonic() - start < 0.5


def _hold_the_gil(seconds: float) -> None:
    """Hold this whole process up as an application thread keeping the GIL would (a C call through
    ``ctypes.PyDLL`` never releases it): no other Python thread here runs meanwhile."""
    ctypes.PyDLL(None).usleep(int(seconds * 1e6))


def test_a_live_peer_is_not_declared_dead_because_this_process_was_held_up(transport: str, make_target: MakeTarget) -> None:
    # Our budget is 0.3 s; the target's is 5 s, so it waits for us. Held up for 1.5 s with the
    # target's answers (or nothing yet asked of it) in our socket, the link must live on: silence
    # counts against a peer only once a PING of ours went unanswered (the vLLM case: a worker's
    # main thread kept the GIL for 10 s and its links declared the live prefill dead).
    target = make_target([MiB])
    target.fill(0, 5)
    eng, buf = _initiator(transport, **FAST_HEARTBEAT)
    with eng:
        eng.connect(target.engine)
        descs = [(_addr(buf), target.addrs[0], 4096)]
        for _ in range(2):
            time.sleep(0.35)  # (the reader's poll, or its PING, in flight when the hold begins)
            _hold_the_gil(1.5)
            time.sleep(0.5)  # the checks that follow the hold, and the PING they send, answered
            eng.transfer_sync(target.engine, Op.READ, descs, timeout=5)
            assert np.array_equal(buf[:4096], TargetProcess.expected(MiB, 5)[:4096])
            buf[:4096] = 0
        assert eng.connected_engines() == [target.engine]


def test_connect_to_a_frozen_peer_times_out(make_target: MakeTarget) -> None:
    target = make_target([MiB])
    target.stop()
    with Engine("127.0.0.1") as eng:
        start = time.monotonic()
        with pytest.raises(HixlTimeout):
            eng.connect(target.engine, timeout=1)
        assert time.monotonic() - start < 2
        assert eng.connected_engines() == []
        target.stop(signal.SIGCONT)
        eng.connect(target.engine)  # the failed attempt left nothing behind


def test_timed_out_tcp_read_never_lands_and_the_link_recovers(make_target: MakeTarget) -> None:
    """A READ that reported TIMEOUT writes nothing, even when its data arrives later."""
    size = 16 * MiB
    target = make_target([size])
    target.fill(0, 5)
    eng, buf = _initiator("tcp")  # default heartbeats: a 1 s freeze does not break the link
    with eng:
        eng.connect(target.engine)
        buf.fill(0xEE)
        target.stop()
        req = eng.transfer_async(target.engine, Op.READ, [(_addr(buf), target.addrs[0], size)], timeout=0.5)
        with pytest.raises(TransferTimeout):
            req.wait(5)
        target.stop(signal.SIGCONT)
        # The target now serves the stale READ, then this one; once this one is
        # back, the stale data has been through the link too (served in order).
        marker = hixl.empty(4096)
        eng.register_mem(marker)
        eng.transfer_sync(target.engine, Op.READ, [(_addr(marker), target.addrs[0], 4096)], timeout=10)
        assert np.array_equal(marker, TargetProcess.expected(size, 5)[:4096])
        assert (buf[:size] == 0xEE).all(), "a timed-out READ wrote into its destination"
        assert req.status is TransferStatus.TIMEOUT
        # And the link carries full transfers again.
        eng.transfer_sync(target.engine, Op.READ, [(_addr(buf), target.addrs[0], size)])
        assert np.array_equal(buf[:size], TargetProcess.expected(size, 5))


def test_tcp_write_timing_out_mid_frame(make_target: MakeTarget) -> None:
    """A WRITE too big for the socket buffers stalls mid-frame: it times out, and as the
    stream can't be resumed the link is dropped; a new connection works.

    (What the timed-out WRITE had put in the kernel's buffers still lands in buffer 0
    once the target resumes, even after the new connection's transfers: the check
    after reconnecting uses buffer 1.)"""
    target = make_target([64 * MiB, MiB])
    eng, buf = _initiator("tcp")
    with eng:
        eng.connect(target.engine)
        target.stop()
        start = time.monotonic()
        with pytest.raises(TransferTimeout):
            eng.transfer_sync(target.engine, Op.WRITE, [(_addr(buf), target.addrs[0], 64 * MiB)], timeout=1)
        assert time.monotonic() - start < 3
        target.stop(signal.SIGCONT)
        with pytest.raises(PeerDisconnected):
            eng.transfer_sync(target.engine, Op.READ, [(_addr(buf), target.addrs[0], 16)], timeout=5)
        eng.disconnect(target.engine)
        eng.connect(target.engine)
        buf[:MiB] = 7
        eng.transfer_sync(target.engine, Op.WRITE, [(_addr(buf), target.addrs[1], MiB)], timeout=10)
        assert target.read(1, 0, MiB) == bytes([7]) * MiB


def _link_alive(eng: Engine, remote: str) -> bool:
    try:
        eng.transport_of(remote)  # raises once the link has ended; sends nothing
    except PeerDisconnected:
        return False
    return True


def test_write_timing_out_mid_frame_is_a_timeout_whoever_reports_it(make_target: MakeTarget) -> None:
    """The send that runs out of time mid-frame kills the link, and the link's reader fails
    what was pending on it. Fault injection (``FaultyTransport.failed_sends_wait``) lets the
    reader go first, deterministically: the request is still reported as timed out, not as a
    disconnect. Then the caller's own thread: transfer_sync reads its reply itself, so it is
    the one whose send runs out of time, and it reports the timeout."""
    target = make_target([64 * MiB, 64 * MiB])
    faulty = FaultyTransport(TcpTransport())
    faulty.failed_sends_wait = 2.0
    with Engine("127.0.0.1", transports=[faulty]) as eng:
        buf = hixl.empty(64 * MiB)
        eng.register_mem(buf)
        eng.connect(target.engine)
        target.stop()
        # transfer_async: the engine's worker sends, the link's reader thread reads.
        req = eng.transfer_async(target.engine, Op.WRITE, [(_addr(buf), target.addrs[0], 64 * MiB)], timeout=1)
        # Not a look at the request before the link is dead: a look past its deadline would
        # make it TIMEOUT by itself, whatever the reader then reported.
        deadline = time.monotonic() + 10
        while _link_alive(eng, target.engine):
            assert time.monotonic() < deadline, "the link did not die of the stalled send"
            time.sleep(0.01)
        with pytest.raises(TransferTimeout):
            req.wait(10)
        target.stop(signal.SIGCONT)
        eng.disconnect(target.engine)
        eng.connect(target.engine)
        target.stop()
        faulty.failed_sends_wait = 0.0  # nobody else reads: nobody else could go first
        with pytest.raises(TransferTimeout):
            eng.transfer_sync(target.engine, Op.WRITE, [(_addr(buf), target.addrs[1], 64 * MiB)], timeout=1)


def test_errors_stay_hixl_errors(transport: str, make_target: MakeTarget) -> None:
    """Whatever happens to the peer, callers can catch HixlError and nothing else."""
    target = make_target([MiB])
    eng, buf = _initiator(transport, **FAST_HEARTBEAT)
    with eng:
        eng.connect(target.engine)
        target.kill()
        for call in (
            lambda: eng.transfer_sync(target.engine, Op.READ, [(_addr(buf), target.addrs[0], 16)], timeout=2),
            lambda: eng.transfer_async(target.engine, Op.READ, [(_addr(buf), target.addrs[0], 16)], timeout=2).wait(),
            lambda: eng.send_notify(target.engine, NotifyDesc("a", "b"), timeout=2),
            lambda: eng.remote_mems(target.engine),
        ):
            with pytest.raises(HixlError):
                call()


# -- a dead peer is PeerDisconnected, whichever thread ends the link -----------------------------
def _sync_read_while_the_link_ends(target: TargetProcess, end: Callable[[Engine], None], busy: int) -> BaseException | None:
    """A sync READ waits on a frozen ``target`` behind ``busy`` async requests; another thread
    ends the link (``end``) and fails them all — the sync READ last. What it raised."""
    with Engine("127.0.0.1", {"transport": "tcp", "max_inflight": 2 * busy}) as eng:
        buf = hixl.empty(MiB)
        eng.register_mem(buf)
        eng.connect(target.engine)
        target.stop(signal.SIGSTOP)
        descs = np.array([[_addr(buf), target.addrs[0], 8]] * busy, dtype=np.uint64)
        eng.transfer_async_split(target.engine, Op.READ, descs, [1] * busy, timeout=20)
        time.sleep(0.3)  # they are sent (or queued in a full socket): the link is busy
        # Half a second for the sync READ below to be waiting before the link ends: with 0.1 s, a
        # loaded machine (the async worker holding the GIL) once ended it first, and the READ,
        # not yet begun, was rightly told NotConnected — a run that tested nothing.
        ender = threading.Timer(0.5, end, (eng,))
        ender.start()
        try:
            eng.transfer_sync(target.engine, Op.READ, [(_addr(buf), target.addrs[0], 8)], timeout=20)
        except HixlError as exc:
            return exc
        finally:
            ender.join()
        return None


def test_a_disconnect_by_another_thread_fails_a_waiting_sync_read_as_disconnected(make_target: MakeTarget) -> None:
    """The thread that ends the link fails its many requests one by one; the caller reading
    for the last of them must not return first and take its silence for a timeout."""
    target = make_target([MiB])
    tested = 0
    for _ in range(10):
        error = _sync_read_while_the_link_ends(target, lambda eng: eng.disconnect(target.engine), busy=20_000)
        target.stop(signal.SIGCONT)
        if isinstance(error, NotConnected):
            continue  # the link ended before the READ began (the async worker held the GIL past the timer): nothing tested
        assert isinstance(error, PeerDisconnected), repr(error)
        tested += 1
        if tested == 5:
            break
    assert tested >= 3, f"only {tested} of 10 runs had the READ waiting when the link ended"


@pytest.mark.slow
def test_a_killed_peer_fails_a_waiting_sync_read_as_disconnected(make_target: MakeTarget) -> None:
    """Killed while frozen (no last words): whichever thread sees it first — the reader, or the
    async worker whose send fails — every pending request is PeerDisconnected (many trials)."""
    errors = []
    for _ in range(12):
        target = make_target([MiB])
        errors.append(_sync_read_while_the_link_ends(target, lambda eng, pid=target.pid: os.kill(pid, signal.SIGKILL), busy=40_000))
    assert all(isinstance(error, PeerDisconnected) for error in errors), [repr(e) for e in errors]
