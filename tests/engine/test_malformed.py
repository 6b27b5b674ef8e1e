"""Raw sockets against a target engine: malformed traffic drops only that connection, a bad
request gets an ERROR and the connection stays usable, and proper clients are served throughout."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import hixl
from hixl import Engine, Op, Status
from hixl import _protocol as proto
from hixl._protocol.frames import BODY_LIMITS, MAGIC
from hixl._session.wire import READ_SIZE
from hixl.testing import ScriptedPeer, TargetProcess

pytestmark = pytest.mark.timeout(60)

_HEADER = struct.Struct("<4sBBHQIQ")
NO_DEADLINE = struct.pack("<q", 0)
HANDSHAKE_TIMEOUT = 0.5


@pytest.fixture(scope="module")
def target() -> Iterator[TargetProcess]:
    """A target with a short handshake timeout, shared by this module."""
    with TargetProcess([1 << 20], {"handshake_timeout": HANDSHAKE_TIMEOUT}) as tp:
        tp.fill(0, 11)
        yield tp


@pytest.fixture(autouse=True)
def still_serves(target: TargetProcess) -> Iterator[None]:
    """After every test, a proper Engine client is served correctly by the same target."""
    yield
    with Engine("127.0.0.1", {"transport": "tcp"}) as eng:
        buf = hixl.empty(1 << 20)
        eng.register_mem(buf)
        eng.connect(target.engine)
        eng.transfer_sync(target.engine, Op.READ, [(int(buf.ctypes.data), target.addrs[0], 1 << 20)])
        assert np.array_equal(buf, TargetProcess.expected(1 << 20, 11))


@pytest.fixture
def raw(target: TargetProcess) -> Iterator[ScriptedPeer]:
    conn = ScriptedPeer.connect(target.engine, timeout=5)
    yield conn
    conn.close()


def header(kind: int = proto.FrameType.PING, req_id: int = 0, body_len: int = 0, data_len: int = 0,
           magic: bytes = MAGIC, flags: int = 0, reserved: int = 0) -> bytes:
    return _HEADER.pack(magic, kind, flags, reserved, req_id, body_len, data_len)


def _protocol_error(frames: list[proto.Message]) -> None:
    """The target explains a drop with one ERROR frame (status FAILED): a refusal during the
    handshake, a fatal error (request id 0, the PeerFatal event) once open."""
    assert len(frames) == 1 and isinstance(frames[0], (proto.Error, proto.PeerFatal)), frames
    assert frames[0].status == Status.FAILED
    assert "protocol error" in frames[0].message


GARBAGE = {
    "http": b"GET / HTTP/1.1\r\nHost: example.com\r\n\r\n",
    "bad-magic": header(magic=b"HXL2"),
    "unknown-type": header(kind=99),
    "reserved-bits": header(flags=1),
    "reserved-field": header(reserved=7),
    "body-too-large": header(kind=proto.FrameType.HELLO, body_len=BODY_LIMITS[proto.FrameType.HELLO] + 1),
    "auth-before-hello": proto.encode(proto.Auth({"proof": "x", "info": {}})),
    "data-on-control-frame": header(kind=proto.FrameType.HELLO, body_len=2, data_len=5) + b"{}",
    "hello-not-json": header(kind=proto.FrameType.HELLO, body_len=3) + b"{{{",
    "hello-not-object": header(kind=proto.FrameType.HELLO, body_len=2) + b"[]",
}


@pytest.mark.parametrize("data", list(GARBAGE.values()), ids=list(GARBAGE))
def test_garbage_instead_of_hello(raw: ScriptedPeer, data: bytes) -> None:
    raw.send_raw(data)
    _protocol_error(raw.expect_closed())


@pytest.mark.parametrize(
    "versions", [None, [1, 1], [proto.frames.VERSION + 1, proto.frames.VERSION + 9]], ids=["none", "too-old", "too-new"]
)
def test_no_common_protocol_version(raw: ScriptedPeer, versions: list[int] | None) -> None:
    hello = {"nonce": "00" * 32, "clock": 0} | ({"versions": versions} if versions else {})
    raw.send_raw(proto.encode(proto.Hello(hello)))
    frames = raw.expect_closed()
    assert len(frames) == 1 and isinstance(frames[0], proto.Error), frames
    assert frames[0].status == Status.UNSUPPORTED and "version" in frames[0].message


def test_request_before_hello(raw: ScriptedPeer, target: TargetProcess) -> None:
    descs = np.array([[target.addrs[0], 16]], dtype=np.uint64)
    raw.send_raw(proto.encode(proto.ReadRequest(1, descs)))
    frames = raw.expect_closed()
    _protocol_error(frames)
    assert "HELLO" in frames[0].message  # type: ignore[union-attr]
    assert "regions" not in frames[0].message and str(target.addrs[0]) not in frames[0].message


AFTER_HELLO = {
    "garbage": b"\x00" * proto.HEADER_SIZE,
    "bad-magic": header(magic=b"XXXX"),
    "welcome-from-initiator": proto.encode(proto.Welcome({})),
    "data-from-initiator": proto.encode(proto.Data(1, 0)),
    "ack-from-initiator": proto.encode(proto.Ack(3)),
    "read-without-descs": header(kind=proto.FrameType.READ, req_id=1),
    "read-odd-body": header(kind=proto.FrameType.READ, req_id=1, body_len=16) + NO_DEADLINE + bytes(8),
    "read-zero-length": header(kind=proto.FrameType.READ, req_id=1, body_len=24)
    + NO_DEADLINE
    + struct.pack("<QQ", 4096, 0),
    "read-request-id-0": header(kind=proto.FrameType.READ, req_id=0, body_len=24)
    + NO_DEADLINE
    + struct.pack("<QQ", 4096, 8),
    "read-negative-deadline": header(kind=proto.FrameType.READ, req_id=1, body_len=24)
    + struct.pack("<q", -5)
    + struct.pack("<QQ", 4096, 8),
    "write-len-mismatch": header(kind=proto.FrameType.WRITE, req_id=1, body_len=24, data_len=9)
    + NO_DEADLINE
    + struct.pack("<QQ", 4096, 8),
    "read-over-its-size-limit": header(kind=proto.FrameType.READ, req_id=1, body_len=BODY_LIMITS[proto.FrameType.READ] + 16),
    "notify-over-its-size-limit": header(kind=proto.FrameType.NOTIFY, req_id=1, body_len=3000),
    "notify-name-too-long": header(kind=proto.FrameType.NOTIFY, req_id=1, body_len=2 + 1025)
    + struct.pack("<H", 1025)
    + b"n" * 1025,
    "hello-again": proto.encode(proto.Hello({"versions": [2, 2], "nonce": "00" * 32, "clock": 0})),
    "notify-bad-utf8": header(kind=proto.FrameType.NOTIFY, req_id=1, body_len=4) + struct.pack("<H", 1) + b"\xff\xfe",
    # (addr + len) wrapping past 2**64 would pass a region check done modulo 2**64
    "read-wrapping": header(kind=proto.FrameType.READ, req_id=1, body_len=24)
    + NO_DEADLINE
    + struct.pack("<QQ", 1 << 40, (1 << 64) - 1),
    "write-lengths-wrapping": header(kind=proto.FrameType.WRITE, req_id=1, body_len=40)
    + NO_DEADLINE
    + struct.pack("<QQQQ", 4096, 1 << 63, 4096, 1 << 63),
}


@pytest.mark.parametrize("data", list(AFTER_HELLO.values()), ids=list(AFTER_HELLO))
def test_malformed_frame_after_hello(raw: ScriptedPeer, data: bytes) -> None:
    raw.handshake()
    raw.send_raw(data)
    _protocol_error(raw.expect_closed())


def test_truncated_frame_then_close(target: TargetProcess) -> None:
    conn = ScriptedPeer.connect(target.engine)
    conn.handshake()
    conn.send_raw(header(kind=proto.FrameType.WRITE, req_id=1, body_len=24, data_len=1 << 20)[:10])
    ours = "{}:{}".format(*conn.sock.getsockname())
    _wait_until(lambda: ours in target.call("served_connections").values())  # (named once its WELCOME is out)
    conn.close()  # the target must just forget this connection (and still serve others: still_serves)
    _wait_until(lambda: ours not in target.call("served_connections").values())


def _wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert condition()


def test_write_body_then_close_mid_data(raw: ScriptedPeer, target: TargetProcess) -> None:
    raw.handshake()
    target.write(0, 8192, bytes(4096))
    descs = np.array([[target.addrs[0] + 8192, 4096]], dtype=np.uint64)
    raw.send(proto.WriteRequest(1, descs, 4096), b"\x01" * 100)
    raw.close()
    # A WRITE this small lands once all its data is in, in one copy: cut off, none of it lands.
    time.sleep(0.3)
    assert target.read(0, 8192, 4096) == bytes(4096)
    target.fill(0, 11)


@pytest.mark.parametrize("cut", [200 << 10, (200 << 10) + 3], ids=["on-a-word", "mid-word"])
def test_a_large_write_cut_off_mid_data_ends_its_connection(target: TargetProcess, cut: int) -> None:
    """A 1 MiB WRITE's frame and ``cut`` bytes of its data, then the peer closes: the target lands
    them straight from the socket, finds the stream's end (which the socket reports as readable,
    holding nothing — not a pause in the data) and forgets the connection rather than look again
    and again."""
    conn = ScriptedPeer.connect(target.engine)
    conn.handshake()
    ours = "{}:{}".format(*conn.sock.getsockname())
    descs = np.array([[target.addrs[0], 1 << 20]], dtype=np.uint64)
    conn.send(proto.WriteRequest(1, descs, 1 << 20), b"\x03" * cut)
    _wait_until(lambda: target.read(0, cut // 8 * 8 - 1, 1) == b"\x03")
    conn.close()
    _wait_until(lambda: ours not in target.call("served_connections").values())
    target.fill(0, 11)


@pytest.mark.parametrize("first", [12, (72 << 10) + 12], ids=["from-the-buffer", "from-the-buffer-and-the-socket"])
def test_a_write_never_leaves_a_word_half_written_while_it_waits(raw: ScriptedPeer, target: TargetProcess, first: int) -> None:
    """A 512 KiB WRITE's data arrives ``first`` bytes with its frame, then a pause, then the
    rest: during the pause every whole word that came has landed and the word that came in part
    is still all old — a concurrent reader never sees it torn. 12 bytes all wait in the
    connection's buffer; 72 KiB + 12 go partly there (the frame's recv of READ_SIZE: a part-word
    at its end) and partly straight from the socket (a part-word at its end too)."""
    assert first < 16 or first > READ_SIZE  # (the second case reaches past what the frame's recv takes)
    raw.handshake()
    size, whole = 512 << 10, first // 8 * 8
    target.write(0, 8192, bytes(size))
    descs = np.array([[target.addrs[0] + 8192, size]], dtype=np.uint64)
    raw.send(proto.WriteRequest(1, descs, size), b"\x01" * first)
    _wait_until(lambda: target.read(0, 8192 + whole - 1, 1) == b"\x01")
    time.sleep(0.3)
    assert target.read(0, 8192, whole + 8) == b"\x01" * whole + bytes(8), "a word landed in two parts"
    raw.send_raw(b"\x01" * (size - first))
    assert isinstance(raw.recv(), proto.Ack)
    assert target.read(0, 8192, size) == b"\x01" * size
    target.fill(0, 11)


@pytest.mark.parametrize("last", [264, 8], ids=["264-bytes", "a-word"])
def test_a_write_whose_last_bytes_come_late_lands_them_when_they_come(raw: ScriptedPeer, target: TargetProcess, last: int) -> None:
    """A 256 KiB WRITE's data all but its ``last`` bytes, trickling in 8 KiB at a time (each piece
    ends on a word: nothing waits in the connection's buffer), a pause, then those: they land and
    the ACK comes. While it waited, the target had asked the socket to turn readable only once
    a piece of the rest had come (SO_RCVLOWAT): that mark must follow what is still due, or the
    socket never turns readable for so few bytes (the WRITE stalls)."""
    raw.handshake()
    size, piece = 256 << 10, 8 << 10
    target.write(0, 8192, bytes(size))
    descs = np.array([[target.addrs[0] + 8192, size]], dtype=np.uint64)
    raw.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    raw.send(proto.WriteRequest(1, descs, size), b"\x02" * piece)
    for start in range(piece, size - last, piece):
        time.sleep(0.002)
        raw.send_raw(b"\x02" * min(piece, size - last - start))
    time.sleep(0.3)
    raw.send_raw(b"\x02" * last)
    assert isinstance(raw.recv(), proto.Ack)
    assert target.read(0, 8192, size) == b"\x02" * size
    target.fill(0, 11)


def test_silent_client_is_dropped_after_the_handshake_timeout(raw: ScriptedPeer) -> None:
    start = time.monotonic()
    raw.expect_closed(timeout=10)
    assert time.monotonic() - start < HANDSHAKE_TIMEOUT + 2


def test_bad_requests_get_an_error_and_the_connection_stays_usable(raw: ScriptedPeer, target: TargetProcess) -> None:
    welcome = raw.handshake()
    assert [target.addrs[0], 1 << 20, proto.REGION_WRITABLE] in welcome["regions"]
    outside = np.array([[target.addrs[0] + (1 << 20) - 8, 16]], dtype=np.uint64)
    # WRITE outside the regions, with its data: refused, data skipped, nothing written.
    before = target.read(0, (1 << 20) - 8, 8)
    raw.send(proto.WriteRequest(5, outside, 16), b"\xab" * 16)
    reply = raw.recv()
    assert isinstance(reply, proto.Error) and reply.req_id == 5 and reply.status == Status.PARAM_INVALID
    assert target.read(0, (1 << 20) - 8, 8) == before
    # READ outside: refused.
    raw.send(proto.ReadRequest(6, outside))
    reply = raw.recv()
    assert isinstance(reply, proto.Error) and reply.req_id == 6 and reply.status == Status.PARAM_INVALID
    # The stream is still in step: PING, QUERY_REGIONS, a good READ and WRITE.
    raw.send(proto.Ping(7))
    reply = raw.recv()
    assert isinstance(reply, proto.Pong) and reply.req_id == 7
    raw.send(proto.QueryRegions(8))
    reply = raw.recv()
    assert isinstance(reply, proto.Regions) and reply.req_id == 8
    assert reply.base == proto.WHOLE and [target.addrs[0], 1 << 20, proto.REGION_WRITABLE] in reply.added.tolist()
    inside = np.array([[target.addrs[0] + 100, 50], [target.addrs[0] + 4000, 30]], dtype=np.uint64)
    raw.send(proto.ReadRequest(9, inside))
    reply = raw.recv()
    assert reply == proto.Data(9, 80)
    expected = TargetProcess.expected(1 << 20, 11)
    assert raw.recv_data() == expected[100:150].tobytes() + expected[4000:4030].tobytes()
    scratch = np.array([[target.addrs[0] + 8192, 3]], dtype=np.uint64)
    raw.send(proto.WriteRequest(10, scratch, 3), b"xyz")
    assert raw.recv() == proto.Ack(10)
    assert target.read(0, 8192, 3) == b"xyz"
    target.fill(0, 11)  # restore for the other tests
    raw.send(proto.Bye(0, "done"))
    assert raw.expect_closed() == []



@pytest.mark.parametrize("refused_first", [False, True], ids=["landed-first", "refused-first"])
def test_small_writes_arriving_in_one_segment_with_what_follows_land_in_order(
    raw: ScriptedPeer, target: TargetProcess, refused_first: bool
) -> None:
    """WRITEs into overlapping memory, a refused WRITE and a PING, sent as one burst: the target
    lands a small WRITE's data from the very receive that brought it (not via the connection's
    buffer), so what came after it in that receive must still be served, in order — as when the
    first frame is refused and its data dropped."""
    raw.handshake()
    base = target.addrs[0]
    send = raw.conn.send
    refused = send(proto.WriteRequest(1, np.array([[base + (1 << 20) - 8, 16]], dtype=np.uint64), 16)) + b"\xab" * 16
    first = send(proto.WriteRequest(2, np.array([[base + 8192, 5], [base + 9000, 3]], dtype=np.uint64), 8)) + b"abcdeXYZ"
    payload = np.random.default_rng(5).integers(0, 256, 100000, dtype=np.uint8).tobytes()
    rest = (
        send(proto.WriteRequest(3, np.array([[base + 8194, 4]], dtype=np.uint64), 4)) + b"1234"
        + send(proto.WriteRequest(4, np.array([[base + 16384, 100000]], dtype=np.uint64), 100000)) + payload
        + send(proto.Ping(5))
    )
    raw.send_raw(refused + first + rest if refused_first else first + refused + rest)
    replies = {reply.req_id: reply for reply in (raw.recv() for _ in range(5))}
    assert isinstance(replies[1], proto.Error) and replies[1].status == Status.PARAM_INVALID
    assert [replies[2], replies[3], replies[4]] == [proto.Ack(2), proto.Ack(3), proto.Ack(4)]
    assert isinstance(replies[5], proto.Pong)
    assert target.read(0, 8192, 6) == b"ab1234" and target.read(0, 9000, 3) == b"XYZ"
    assert target.read(0, 16384, 100000) == payload
    target.fill(0, 11)  # restore for the other tests
