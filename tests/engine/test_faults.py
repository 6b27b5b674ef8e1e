"""A scripted fake target (fault injection, :class:`hixl.testing.ScriptedTarget`): a real socket
on 127.0.0.1 speaking the real protocol, whose replies a test writes frame by frame, to reach
failures a real target only shows by chance — dying in the middle of a reply, stalling mid-data,
answering with the wrong frame."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import hixl
from hixl import (
    Engine,
    MemoryRangeError,
    NotConnected,
    Op,
    PeerDisconnected,
    ProtocolError,
    ResourceExhausted,
    Status,
    TransferStatus,
    TransferTimeout,
)
from hixl import _protocol as proto
from hixl.testing import ScriptedPeer, ScriptedTarget

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
REGION = (0x7000_0000_0000, 64 * MiB)  # what the fake claims to have registered
REGIONS = [(*REGION, proto.REGION_WRITABLE)]


def _request(conn: ScriptedPeer) -> proto.Message:
    """Next request, with a WRITE's data read (and dropped)."""
    request = conn.recv()
    if isinstance(request, proto.WriteRequest):
        conn.recv_data()
    return request


@pytest.fixture
def scripted() -> Iterator[Callable[[Callable[[ScriptedPeer], None]], ScriptedTarget]]:
    fakes: list[ScriptedTarget] = []

    def start(script: Callable[[ScriptedPeer], None]) -> ScriptedTarget:
        fakes.append(ScriptedTarget(script))
        return fakes[-1]

    yield start
    for fake in fakes:
        fake.close()


@pytest.fixture
def initiator() -> Iterator[tuple[Engine, np.ndarray]]:
    with Engine("127.0.0.1", {"transport": "tcp"}) as eng:
        buf = hixl.empty(64 * MiB)
        eng.register_mem(buf)
        yield eng, buf


def _read(buf: np.ndarray, size: int, offset: int = 0) -> list[tuple[int, int, int]]:
    return [(int(buf.ctypes.data), REGION[0] + offset, size)]


def test_link_dying_mid_data_fails_the_request(scripted, initiator) -> None:  # type: ignore[no-untyped-def]
    def script(conn: ScriptedPeer) -> None:
        conn.accept_handshake(REGIONS)
        read = conn.recv()
        assert isinstance(read, proto.ReadRequest)
        conn.send(proto.Data(read.req_id, 4 * MiB), b"\x01" * MiB)

    fake = scripted(script)
    eng, buf = initiator
    eng.connect(fake.engine)
    start = time.monotonic()
    with pytest.raises(PeerDisconnected):
        eng.transfer_sync(fake.engine, Op.READ, _read(buf, 4 * MiB), timeout=20)
    assert time.monotonic() - start < 5, "the request waited for its deadline instead of failing"
    with pytest.raises(PeerDisconnected):
        eng.transfer_sync(fake.engine, Op.READ, _read(buf, 16), timeout=5)


def test_data_of_the_wrong_length(scripted, initiator) -> None:  # type: ignore[no-untyped-def]
    def script(conn: ScriptedPeer) -> None:
        conn.accept_handshake(REGIONS)
        read = conn.recv()
        conn.send_raw(proto.encode(proto.Data(read.req_id, 17)) + bytes(17))  # type: ignore[union-attr]
        conn.recv()  # until the initiator drops us

    fake = scripted(script)
    eng, buf = initiator
    eng.connect(fake.engine)
    with pytest.raises(PeerDisconnected, match="DATA carries 17 bytes, the READ asked for 16"):
        eng.transfer_sync(fake.engine, Op.READ, _read(buf, 16), timeout=10)
    with pytest.raises(PeerDisconnected):  # the stream can't be trusted any more
        eng.transfer_sync(fake.engine, Op.READ, _read(buf, 16), timeout=5)


def test_error_replies_become_errors(scripted, initiator) -> None:  # type: ignore[no-untyped-def]
    def script(conn: ScriptedPeer) -> None:
        conn.accept_handshake(REGIONS)
        for status in (Status.PARAM_INVALID, Status.RESOURCE_EXHAUSTED, Status.NOT_CONNECTED):
            request = _request(conn)
            conn.send(proto.Error(request.req_id, status, f"refused with {status.name}"))  # type: ignore[union-attr]
        request = _request(conn)
        conn.send(proto.Ack(request.req_id))  # type: ignore[union-attr]
        conn.recv()

    fake = scripted(script)
    eng, buf = initiator
    eng.connect(fake.engine)
    # The target refuses a transfer with PARAM_INVALID only for a range it has
    # not registered (its view is newer than ours): that is a MemoryRangeError.
    with pytest.raises(MemoryRangeError, match="PARAM_INVALID"):
        eng.transfer_sync(fake.engine, Op.READ, _read(buf, 16), timeout=10)
    with pytest.raises(ResourceExhausted):
        eng.transfer_sync(fake.engine, Op.WRITE, _read(buf, 16), timeout=10)
    with pytest.raises(NotConnected):
        eng.transfer_sync(fake.engine, Op.READ, _read(buf, 16), timeout=10)
    eng.transfer_sync(fake.engine, Op.WRITE, _read(buf, 16), timeout=10)  # the link is still fine


@pytest.mark.parametrize(
    "reply",
    [proto.encode(proto.Hello({})), proto.encode(proto.Bye(0, "going away")), b"\xff" * proto.HEADER_SIZE],
    ids=["hello", "bye", "garbage"],
)
def test_wrong_frame_instead_of_a_reply(scripted, initiator, reply: bytes) -> None:  # type: ignore[no-untyped-def]
    def script(conn: ScriptedPeer) -> None:
        conn.accept_handshake(REGIONS)
        conn.recv()
        conn.send_raw(reply)
        conn.recv()  # until the initiator drops the connection

    fake = scripted(script)
    eng, buf = initiator
    eng.connect(fake.engine)
    start = time.monotonic()
    req = eng.transfer_async(fake.engine, Op.READ, _read(buf, 16), timeout=20)
    with pytest.raises(PeerDisconnected):
        req.wait()
    assert time.monotonic() - start < 5
    assert req.status is TransferStatus.FAILED


@pytest.mark.parametrize(
    "answer", [proto.encode(proto.Ack(1)), b"\x00" * proto.HEADER_SIZE], ids=["ack", "garbage"]
)
def test_bad_answer_to_hello(scripted, answer: bytes) -> None:  # type: ignore[no-untyped-def]
    def script(conn: ScriptedPeer) -> None:
        conn.recv()
        conn.send_raw(answer)
        conn.recv()  # until the initiator drops the connection

    fake = scripted(script)
    with Engine("127.0.0.1") as eng:
        with pytest.raises((ProtocolError, NotConnected)):
            eng.connect(fake.engine, timeout=5)
        assert eng.connected_engines() == []


@pytest.mark.timeout(30)
def test_no_byte_lands_after_a_read_reported_timeout(scripted, initiator) -> None:  # type: ignore[no-untyped-def]
    """The reply stalls in the middle of a chunk; the READ times out meanwhile.

    Whoever sees TIMEOUT first — here a second thread polling the status, while
    another waits — must see the destination as it stays: no byte may land later.
    """
    go_on = threading.Event()

    def script(conn: ScriptedPeer) -> None:
        conn.accept_handshake(REGIONS)
        read = conn.recv()
        conn.send(proto.Data(read.req_id, 16 * MiB), b"\x01" * MiB)  # type: ignore[union-attr]
        go_on.wait(1.5)  # stall for a while, mid-chunk
        conn.send_raw(b"\x02" * 15 * MiB)
        final = conn.recv()
        conn.send(proto.Data(final.req_id, 16), b"\x03" * 16)  # type: ignore[union-attr]
        conn.recv()

    fake = scripted(script)
    eng, buf = initiator
    eng.connect(fake.engine)
    buf.fill(0xEE)
    req = eng.transfer_async(fake.engine, Op.READ, _read(buf, 16 * MiB), timeout=0.5)
    waiter = threading.Thread(target=lambda: pytest.raises(TransferTimeout, req.wait))
    waiter.start()
    time.sleep(0.8)  # past the deadline, while the fake stalls
    assert req.status is TransferStatus.TIMEOUT
    seen = buf[: 16 * MiB].copy()
    go_on.set()
    waiter.join(10)
    # Once the next request's reply is back, the stale data has been dealt with.
    marker = hixl.empty(4096)
    eng.register_mem(marker)
    eng.transfer_sync(fake.engine, Op.READ, [(int(marker.ctypes.data), REGION[0], 16)], timeout=10)
    assert marker[:16].tobytes() == b"\x03" * 16
    assert np.array_equal(buf[: 16 * MiB], seen), "bytes landed after the READ reported TIMEOUT"
    assert (buf[16 * MiB :] == 0xEE).all()  # and nothing past the READ's range
