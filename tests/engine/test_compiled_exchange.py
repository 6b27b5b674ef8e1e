"""TCP's latency path in C (hixl._accel.TcpSmall): a small ``transfer_sync`` sent, answered and
landed in one call, and — wherever that call stops short — the link going on from there exactly as
its Python path would: a refusal raised, frames before or behind the reply handled, a DATA that
stalls past the deadline landing nothing afterwards, a send the socket cannot take at once
finished, a peer that hangs up or resets reported. Scripted targets send what a real one sends
only by bad luck; each test first checks that the call it is about did stop where it says.

Only with the C extension (the pure twin's latency path is PeerLink.exchange, tested elsewhere)."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import hixl
from hixl import Engine, MemoryRangeError, Op, PeerDisconnected, TransferTimeout, _accel
from hixl import _protocol as proto
from hixl._exceptions import Status
from hixl._session import initiator
from hixl.testing import ScriptedPeer, ScriptedTarget

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(_accel.TcpSmall is None, reason="the compiled latency path is the C extension's"),
]

BASE = 0x7000_0000_0000
QUIET = 1.0
"""REARM_QUIET for these tests: the call a test is about must find the socket as the warm-up left
it (disarmed), however long a loaded machine takes between the two."""
WARM = 3
"""READs answered plainly first: the burst's first call goes the Python way (it disarms the socket)."""


@pytest.fixture(autouse=True)
def _patient_rearming(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(initiator, "REARM_QUIET", QUIET)


class _Answers:
    """What the link's compiled path answered each call (True, None, or the stage it stopped at):
    the test's eyes on it; every call goes through to the real one."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seen: list[object] = []

    def run(self, write: bool, descs: list[tuple[int, int, int]], deadline: float) -> Any:
        answer = self.inner.run(write, descs, deadline)
        self.seen.append(answer if answer is True or answer is None else answer[0])
        return answer


def _watch(eng: Engine, peer: str) -> _Answers:
    channel = eng._peers[peer].channel  # (white box: the compiled path is the channel's)
    answers = _Answers(channel._compiled)
    channel._compiled = answers
    return answers


def _answer_reads(peer: ScriptedPeer, count: int = WARM) -> None:
    for _ in range(count):
        request = peer.recv()
        peer.send(proto.Data(request.req_id, int(request.descs[:, 1].sum())), bytes(int(request.descs[:, 1].sum())))


@contextlib.contextmanager
def _warmed(
    script: Callable[[ScriptedPeer], None],
    regions: tuple[int, int, int] = (BASE, 4096, 1),
    also: np.ndarray | None = None,
    **options: Any,
) -> Iterator[tuple[Engine, str, np.ndarray, _Answers]]:
    """An engine linked to a scripted target that answers WARM READs and then runs ``script``;
    the engine's 1 MiB registered buffer (zeroed; ``also`` registered too), and its compiled
    path's answers from then on (the next call within QUIET of the last: after that the socket
    is re-armed, and the next call is the Python path's again)."""

    def scripted(peer: ScriptedPeer) -> None:
        peer.accept_handshake([regions])
        _answer_reads(peer)
        script(peer)

    with ScriptedTarget(scripted) as fake, Engine("127.0.0.1", {"transport": "tcp", **options}) as eng:
        buf = hixl.empty(1 << 20)
        eng.register_mem(buf)
        if also is not None:
            eng.register_mem(also)
        eng.connect(fake.engine)
        answers = _watch(eng, fake.engine)
        for _ in range(WARM):
            eng.transfer_sync(fake.engine, Op.READ, [(int(buf.ctypes.data), BASE, 8)], timeout=5)
        assert answers.seen == [None] + [True] * (WARM - 1), answers.seen
        buf[:] = 0
        yield eng, fake.engine, buf, answers
        eng.disconnect(fake.engine)


def test_a_burst_of_small_transfers_runs_compiled_and_moves_every_byte() -> None:
    with Engine("127.0.0.1:0", {"transport": "tcp"}) as target, Engine("127.0.0.1", {"transport": "tcp"}) as eng:
        remote = hixl.empty(1 << 16)
        remote[:] = np.arange(1 << 16, dtype=np.uint64).astype(np.uint8)
        target.register_mem(remote)
        local = hixl.empty(1 << 16)
        local[:] = 0
        eng.register_mem(local)
        eng.connect(target.local_engine)
        answers = _watch(eng, target.local_engine)
        r, loc = int(remote.ctypes.data), int(local.ctypes.data)
        for i in range(50):  # READs of 1 to 3 ranges, then WRITEs back of their bytes + 1
            n = 1 + i % 3
            descs = [(loc + 4096 * k + i, r + 4096 * k + 7 * i, 100 + i) for k in range(n)]
            eng.transfer_sync(target.local_engine, Op.READ, descs)
            for a, b, length in descs:
                assert bytes(local[a - loc : a - loc + length]) == bytes(remote[b - r : b - r + length])
        local[:] = (np.arange(1 << 16) * 3 % 251).astype(np.uint8)
        for i in range(50):
            eng.transfer_sync(target.local_engine, Op.WRITE, [(loc + 1000 * i, r + 999 * i, 8 + i)])
            assert bytes(remote[999 * i : 999 * i + 8 + i]) == bytes(local[1000 * i : 1000 * i + 8 + i])
        link = eng._peers[target.local_engine].link
        assert answers.seen[0] is None and answers.seen[1:] == [True] * 99, answers.seen
        assert not link._pending and link.wire.conn.outstanding == 0 and link.wire.busy_since is None


def test_a_refusal_is_raised_and_the_link_serves_on() -> None:
    def script(peer: ScriptedPeer) -> None:
        refused = peer.recv()
        peer.send(proto.Error(refused.req_id, int(Status.PARAM_INVALID), "not registered here"))
        again = peer.recv()
        peer.send(proto.Data(again.req_id, 8), b"\x5a" * 8)
        peer.recv()  # BYE

    with _warmed(script) as (eng, target, buf, answers):
        with pytest.raises(MemoryRangeError, match="not registered here"):
            eng.transfer_sync(target, Op.READ, [(int(buf.ctypes.data), BASE, 8)], timeout=5)
        eng.transfer_sync(target, Op.READ, [(int(buf.ctypes.data) + 8, BASE, 8)], timeout=5)
        assert bytes(buf[8:16]) == b"\x5a" * 8
        assert answers.seen[WARM] == "reply", answers.seen


@pytest.mark.parametrize("where", ["before", "behind"])
def test_a_ping_next_to_the_reply_is_answered_at_once(where: str) -> None:
    """A PING in the same segment as the DATA, before it (the reply is not the first frame) or
    behind it (frames the connection must still parse): both the READ and the PING answered."""
    ponged: list[float] = []

    def script(peer: ScriptedPeer) -> None:
        request = peer.recv()
        data = peer.conn.send(proto.Data(request.req_id, 8)) + b"\x11" * 8
        ping = peer.conn.send(proto.Ping(77))
        sent = time.monotonic()
        peer.send_raw(ping + data if where == "before" else data + ping)  # (one segment)
        peer.answer_pings = False
        reply = peer.recv()
        assert isinstance(reply, proto.Pong) and reply.req_id == 77, reply
        ponged.append(time.monotonic() - sent)
        peer.recv()  # BYE

    with _warmed(script, heartbeat_interval=5.0) as (eng, target, buf, answers):
        eng.transfer_sync(target, Op.READ, [(int(buf.ctypes.data), BASE, 8)], timeout=5)
        assert bytes(buf[:8]) == b"\x11" * 8
        assert eng._peers[target].link.wire.busy_since is None  # nothing waits on the peer: idle pings
        deadline = time.monotonic() + 3
        while not ponged and time.monotonic() < deadline:
            time.sleep(0.01)
        assert answers.seen[WARM] == ("reply" if where == "before" else "tail"), answers.seen
        assert ponged and ponged[0] < 0.5, f"the PING was answered after {ponged} s"


def test_a_data_that_stalls_past_the_deadline_lands_nothing_afterwards() -> None:
    """Half of a READ's data in time, the rest after its deadline: TransferTimeout, the late half
    drained (not landed), the next READ answered in step."""
    gave_up = threading.Event()

    def script(peer: ScriptedPeer) -> None:
        request = peer.recv()
        peer.send(proto.Data(request.req_id, 16), b"\x22" * 8)
        gave_up.wait(10)
        peer.send_raw(b"\x33" * 8)
        again = peer.recv()
        peer.send(proto.Data(again.req_id, 8), b"\x44" * 8)
        peer.recv()  # BYE

    with _warmed(script) as (eng, target, buf, answers):
        with pytest.raises(TransferTimeout):
            eng.transfer_sync(target, Op.READ, [(int(buf.ctypes.data), BASE, 16)], timeout=0.3)
        gave_up.set()
        time.sleep(0.3)
        assert bytes(buf[:16]) == b"\x22" * 8 + bytes(8), f"landed after TransferTimeout: {bytes(buf[:16])!r}"
        eng.transfer_sync(target, Op.READ, [(int(buf.ctypes.data) + 16, BASE, 8)], timeout=5)
        assert bytes(buf[16:24]) == b"\x44" * 8
        assert answers.seen[WARM] == "land", answers.seen


def test_a_write_the_socket_cannot_take_at_once_is_finished() -> None:
    """A 32 MiB WRITE to a peer that reads nothing for longer than a heartbeat interval: the
    compiled path hands the send over after an interval, and the link finishes it."""
    size = 32 << 20
    got: list[bytes] = []

    def script(peer: ScriptedPeer) -> None:
        time.sleep(0.8)  # longer than an interval, shorter than the budget (3 intervals)
        request = peer.recv()
        got.append(peer.recv_data())
        peer.send(proto.Ack(request.req_id))
        peer.recv()  # BYE

    big = hixl.empty(size)
    big[:] = (np.arange(size) % 253).astype(np.uint8)
    with _warmed(script, (BASE, size, 3), big, heartbeat_interval=0.5) as (eng, target, _, answers):
        eng.transfer_sync(target, Op.WRITE, [(int(big.ctypes.data), BASE, size)], timeout=20)
        assert answers.seen[WARM] == "send", answers.seen
        assert got and got[0] == big.tobytes()


@pytest.mark.parametrize("how", ["close", "reset"])
def test_a_peer_that_hangs_up_instead_of_answering_is_reported(how: str) -> None:
    def script(peer: ScriptedPeer) -> None:
        peer.recv()
        if how == "reset":  # (an RST: recv fails with ECONNRESET, an OSError)
            peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        peer.sock.close()

    with _warmed(script) as (eng, target, buf, answers):
        with pytest.raises(PeerDisconnected):
            eng.transfer_sync(target, Op.READ, [(int(buf.ctypes.data), BASE, 8)], timeout=5)
        with pytest.raises(PeerDisconnected):  # the link is over, and says so at once
            eng.transfer_sync(target, Op.READ, [(int(buf.ctypes.data), BASE, 8)], timeout=5)
        assert answers.seen[WARM] == "reply", answers.seen
