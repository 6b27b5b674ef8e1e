"""TCP's latency path on the initiator (a small ``transfer_sync``, its reply read by the caller).

It leaves the socket disarmed between its calls (no ``epoll_ctl`` a request): whatever the peer
sends once a burst of calls is over is still read at once — by the link's reader thread, which
re-arms the socket a few milliseconds after the last call — not a heartbeat interval later. And a
READ it reported timed out lands nothing when its DATA comes after all (for a caller that had
handed the socket to the reader thread, see test_region_updates.py). Scripted targets, which send
what a real one would only by bad luck (a DATA in flight past the deadline) or not at all."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import hixl
from hixl import Engine, Op, PeerDisconnected, TransferTimeout
from hixl import _protocol as proto
from hixl._session.initiator import REARM_QUIET
from hixl.testing import ScriptedPeer, ScriptedTarget

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
