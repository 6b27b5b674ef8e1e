"""TCP's latency path on the initiator (a small ``transfer_sync``, its reply read by the caller).

It leaves the socket disarmed between its calls (no ``epoll_ctl`` a request): whatever the peer
sends once a burst of calls is over is still read at once — by the link's reader thread, which
re-arms the socket a few milliseconds after the last call — not a heartbeat interval later. And a
READ it reported timed out lands nothing when its DATA comes after all (for a caller that had
handed the socket to the reader thread, see test_region_updates.py). Scripted targets, which send
what a real one would only by bad luck (a DATA in flight past the deadline) or not at all."""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import hixl
from hixl import Engine, Op, PeerDisconnected, TransferTimeout
from hixl import _protocol as proto
from hixl._session.initiator import REARM_QUIET
from hixl.testing import ScriptedPeer, ScriptedTarget, TargetProcess

pytestmark = pytest.mark.timeout(60)

BASE = 0x7000_0000_0000
NO_ROWS = np.zeros((0, 3), np.uint64)
BURST = 200
INTERVAL = 5.0
"""The heartbeat interval: the reader thread's longest sleep, which an unread frame would wait out."""


def _burst_then(after: proto.Message) -> tuple[ScriptedTarget, list[float], threading.Event]:
    """A target that answers BURST 8-byte READs, waits for the caller to have stopped, sends
    ``after``, and times how long until the initiator's answer to it comes back."""
    answered: list[float] = []
    burst_done = threading.Event()

    def script(peer: ScriptedPeer) -> None:
        peer.accept_handshake([(BASE, 4096, 1)])
        for _ in range(BURST):
            request = peer.recv()
            peer.send(proto.Data(request.req_id, 8), bytes(8))
        burst_done.wait(10)
        time.sleep(10 * REARM_QUIET)  # the burst is over: nobody holds the read role
        sent = time.monotonic()
        peer.send(after)
        reply = peer.recv()
        answered.append(time.monotonic() - sent)
        assert isinstance(reply, (proto.Pong, proto.Revoked)), reply
        peer.recv()  # BYE

    return ScriptedTarget(script), answered, burst_done


@pytest.mark.parametrize(
    "after",
    [proto.Ping(7), proto.Revoke(2, 1, NO_ROWS, np.array([[BASE, 4096, 1]], dtype=np.uint64))],
    ids=["ping", "revoke"],
)
def test_a_frame_after_a_burst_of_latency_calls_is_answered_at_once(after: proto.Message) -> None:
    fake, answered, burst_done = _burst_then(after)
    with fake, Engine("127.0.0.1", {"transport": "tcp", "heartbeat_interval": INTERVAL}) as eng:
        buf = hixl.empty(4096)
        eng.register_mem(buf)
        eng.connect(fake.engine)
        for _ in range(BURST):
            eng.transfer_sync(fake.engine, Op.READ, [(int(buf.ctypes.data), BASE, 8)], timeout=5)
        burst_done.set()
        deadline = time.monotonic() + 3 * INTERVAL
        while not answered and time.monotonic() < deadline:
            time.sleep(0.01)
        eng.disconnect(fake.engine)
    assert answered, "the initiator never answered"
    assert answered[0] < INTERVAL / 10, f"answered {answered[0] * 1e3:.0f} ms after it came: the socket was left disarmed"


def test_a_data_that_comes_after_its_read_timed_out_lands_nothing() -> None:
    """The caller reads the socket itself when its deadline passes; the DATA comes 0.3 s later."""
    answered = threading.Event()

    def script(peer: ScriptedPeer) -> None:
        peer.accept_handshake([(BASE, 4096, 1)])
        late = peer.recv()
        answered.wait(10)  # (the caller has given up)
        peer.send(proto.Data(late.req_id, 8), b"\xab" * 8)
        again = peer.recv()
        peer.send(proto.Data(again.req_id, 8), b"\xcd" * 8)
        peer.recv()  # BYE

    with ScriptedTarget(script) as fake, Engine("127.0.0.1", {"transport": "tcp"}) as eng:
        buf = hixl.empty(4096)
        buf[:] = 0
        eng.register_mem(buf)
        eng.connect(fake.engine)
        with pytest.raises(TransferTimeout):
            eng.transfer_sync(fake.engine, Op.READ, [(int(buf.ctypes.data), BASE, 8)], timeout=0.3)
        answered.set()
        time.sleep(0.3)  # the late DATA has come, and been read (by the reader thread)
        assert not buf.any(), f"a READ reported timed out landed {bytes(buf[:8])!r} afterwards"
        eng.transfer_sync(fake.engine, Op.READ, [(int(buf.ctypes.data) + 8, BASE, 8)], timeout=5)
        assert bytes(buf[:16]) == bytes(8) + b"\xcd" * 8  # the stream is in step: the next READ is answered
        eng.disconnect(fake.engine)


def test_a_read_made_while_another_thread_says_bye_meets_a_disconnected_peer() -> None:
    """The instant between a disconnect's BYE going out and the link ending: a READ made then
    fails with PeerDisconnected (the link is going away), not with the ProtocolError the
    connection raises for a READ sent after BYE. (The target here waits after the BYE, so the
    instant lasts.)"""
    said_bye = threading.Event()

    def script(peer: ScriptedPeer) -> None:
        peer.accept_handshake([(BASE, 4096, 1)])
        for _ in range(3):  # a burst: under the C extension the READs after the first are compiled
            request = peer.recv()
            peer.send(proto.Data(request.req_id, 8), bytes(8))
        assert isinstance(peer.recv(), proto.Bye)
        said_bye.wait(10)

    with ScriptedTarget(script) as fake, Engine("127.0.0.1", {"transport": "tcp"}) as eng:
        buf = hixl.empty(4096)
        eng.register_mem(buf)
        eng.connect(fake.engine)
        for _ in range(3):
            eng.transfer_sync(fake.engine, Op.READ, [(int(buf.ctypes.data), BASE, 8)], timeout=5)
        link = eng._peers[fake.engine].link  # (white box: the first half of what disconnect does)
        assert link.wire.try_send(proto.Bye(0, "disconnect"))
        try:
            with pytest.raises(PeerDisconnected, match="closing"):
                eng.transfer_sync(fake.engine, Op.READ, [(int(buf.ctypes.data), BASE, 8)], timeout=5)
        finally:
            said_bye.set()


# -- the socket's arming, between the latency path and requests left to the reader thread ----------
class _HeldEpoll:
    """The link's ``epoll`` with a moment held on purpose (fault injection): the first disarming
    (``modify(fd, 0)``) waits, up to ``HOLD`` s, for another thread to re-arm; ``poll`` waits
    while ``polls`` is clear. Everything else is the real object's."""

    HOLD = 0.5

    def __init__(self, real: Any) -> None:
        self.real = real
        self.disarming = threading.Event()
        self.rearmed = threading.Event()
        self.polls = threading.Event()
        self.polls.set()
        self._held = False

    def modify(self, fd: int, mask: int) -> None:
        if mask == 0 and not self._held:
            self._held = True
            self.disarming.set()
            self.rearmed.wait(self.HOLD)
        elif mask:
            self.rearmed.set()
        self.real.modify(fd, mask)

    def poll(self, timeout: float = -1) -> list[tuple[int, int]]:
        self.polls.wait(10)
        return self.real.poll(timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@contextlib.contextmanager
def _held_link() -> Iterator[tuple[Engine, str, list[tuple[int, int, int]], _HeldEpoll]]:
    """An engine linked over TCP to a real target, its link's ``epoll`` a :class:`_HeldEpoll`; the
    8-byte WRITE descriptor to use; nothing sent yet (the socket armed, no burst begun)."""
    with Engine("127.0.0.1:0", {"transport": "tcp"}) as target, Engine("127.0.0.1", {"transport": "tcp", "heartbeat_interval": INTERVAL}) as eng:
        remote, local = hixl.empty(4096), hixl.empty(4096)
        target.register_mem(remote)
        eng.register_mem(local)
        eng.connect(target.local_engine)
        link = eng._peers[target.local_engine].link  # (white box: the fault goes where the race is)
        held = _HeldEpoll(link._epoll)
        link._epoll = held
        assert not link._disarmed
        yield eng, target.local_engine, [(int(local.ctypes.data), int(remote.ctypes.data), 8)], held
        link._epoll = held.real


def _park_reader(link: Any, held: _HeldEpoll) -> None:
    """Keep the link's reader thread out of ``poll`` until ``held.polls`` is set."""
    held.polls.clear()
    os.write(link._wake_w, b"w")  # it leaves the real poll, into the held one
    time.sleep(0.05)


def test_a_request_queued_while_a_burst_disarms_the_socket_is_still_answered() -> None:
    """A burst's first latency call flags the socket disarmed, then disarms it; a request queued for
    the reader thread in between re-arms it. Were the two steps apart, the re-arm would land between
    them: the socket left disarmed, flagged armed — and the next request queued, finding it so, would
    wait for its reply until a heartbeat found the link dead (seen in CI: a DataDist push whose last
    layer did not land in 10 s)."""
    with _held_link() as (eng, target, write, held):
        _park_reader(eng._peers[target].link, held)  # (else it may catch the queued ACK, and re-arm)
        caller = threading.Thread(target=eng.transfer_sync, args=(target, Op.WRITE, write, 5))
        caller.start()
        assert held.disarming.wait(5)
        queued = eng.transfer_async(target, Op.WRITE, write, timeout=5)  # its worker re-arms the socket
        caller.join(10)
        assert queued.wait(5) is hixl.TransferStatus.COMPLETED  # (its ACK read by the caller)
        late = eng.transfer_async(target, Op.WRITE, write, timeout=5)
        held.polls.set()
        status = late.wait(3)
        assert status is hixl.TransferStatus.COMPLETED, f"a request queued after the burst: {status.name}"


def test_a_reply_that_fires_with_the_reader_threads_wake_up_is_read() -> None:
    """The reader thread woken by a burst's start (its wake-up pipe) and by a queued request's reply
    (the socket) in one ``poll``: it reads the reply, rather than take the wake-up alone and leave
    the socket — one-shot, disarmed by firing — for nobody to re-arm."""
    with _held_link() as (eng, target, write, held):
        _park_reader(eng._peers[target].link, held)
        eng.transfer_sync(target, Op.WRITE, write, timeout=5)  # a burst begins: the pipe says so
        queued = eng.transfer_async(target, Op.WRITE, write, timeout=5)  # re-arms; its ACK fires the socket
        time.sleep(0.1)
        held.polls.set()
        status = queued.wait(3)
        assert status is hixl.TransferStatus.COMPLETED, f"the queued request's reply: {status.name}"


def test_mixed_traffic_on_one_link_never_leaves_a_reply_unread() -> None:
    """Two threads making small ``transfer_sync`` calls (the latency path, which leaves the socket
    disarmed between calls), two queuing small async READs for the reader thread, one queuing
    large ones, for a few seconds on one link to a real target: every request is answered within
    its deadline with the right bytes. Before the arming fix above this stalled within seconds."""
    size, seconds = 1 << 20, 4.0
    errors: list[str] = []
    done: dict[str, int] = {}
    with TargetProcess([size]) as target, Engine("127.0.0.1", {"transport": "tcp"}) as eng:
        target.fill(0, 3)
        want, remote = TargetProcess.expected(size, 3), target.addrs[0]
        eng.connect(target.engine)
        stop = time.monotonic() + seconds

        def traffic(kind: str, seed: int) -> None:
            rng = random.Random(seed)
            local = hixl.empty(size)
            eng.register_mem(local)
            base, count = int(local.ctypes.data), 0
            try:
                while time.monotonic() < stop:
                    length = rng.choice([1 << 18, 1 << 19] if kind == "large" else [8, 64, 4096, 1 << 16])
                    at = rng.randrange(0, size - length + 1) & ~7
                    local[at : at + length] = 0
                    desc = [(base + at, remote + at, length)]
                    if kind == "sync":
                        eng.transfer_sync(target.engine, Op.READ, desc, timeout=5)
                    else:
                        status = eng.transfer_async(target.engine, Op.READ, desc, timeout=5).wait(8)
                        assert status is hixl.TransferStatus.COMPLETED, f"{kind} READ of {length} B: {status.name}"
                    assert np.array_equal(local[at : at + length], want[at : at + length]), f"{kind}: wrong bytes"
                    count += 1
            except Exception as exc:  # (reported by the test's thread)
                errors.append(f"{kind}: {exc!r}")
            done[f"{kind}{seed}"] = count

        workers = [threading.Thread(target=traffic, args=(kind, i)) for i, kind in enumerate(["sync", "sync", "async", "async", "large"])]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(seconds + 20)
    assert not errors, errors
    assert len(done) == len(workers) and all(done.values()), done
