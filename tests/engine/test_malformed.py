"""Raw sockets against a target engine: malformed traffic drops only that connection, a bad
request gets an ERROR and the connection stays usable, and proper clients are served throughout."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator

import numpy as np
import pytest

import hixl
from hixl import Engine, Op, Status
from hixl import _protocol as proto
from hixl._protocol.frames import MAGIC, MAX_BODY
from hixl.testing import TargetProcess

pytestmark = pytest.mark.timeout(60)

_HEADER = struct.Struct("<4sBBHQIQ")
HANDSHAKE_TIMEOUT = 0.5


@pytest.fixture(scope="module")
def target() -> Iterator[TargetProcess]:
    """A target with a short handshake timeout, shared by this module."""
    with TargetProcess([1 << 20], {"connect_timeout": HANDSHAKE_TIMEOUT}) as tp:
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


class Raw:
    """A raw client socket that speaks frames by hand."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=5)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def hello(self) -> proto.Welcome:
        self.send(proto.encode(proto.Hello({"engine": "127.0.0.1", "engine_id": "raw-test"})))
        welcome = self.recv()
        assert isinstance(welcome, proto.Welcome)
        return welcome

    def recv_exact(self, nbytes: int) -> bytes:
        data = b""
        while len(data) < nbytes:
            chunk = self.sock.recv(nbytes - len(data))
            if not chunk:
                raise EOFError(f"connection closed after {len(data)} of {nbytes} bytes")
            data += chunk
        return data

    def recv(self) -> proto.Message:
        """The next frame that is not a heartbeat."""
        while True:
            header = proto.parse_header(self.recv_exact(proto.HEADER_SIZE))
            message = proto.parse_body(header, self.recv_exact(header.body_len))
            if not isinstance(message, (proto.Ping, proto.Pong)) or message.req_id:
                return message

    def expect_dropped(self, timeout: float = 5.0) -> list[proto.Message]:
        """Read until the target closes the connection; return what it sent first."""
        self.sock.settimeout(timeout)
        frames = []
        try:
            while True:
                frames.append(self.recv())
        except (EOFError, ConnectionResetError):
            return frames

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def raw(target: TargetProcess) -> Iterator[Raw]:
    conn = Raw(target.engine)
    yield conn
    conn.close()


def header(kind: int = proto.FrameType.PING, req_id: int = 0, body_len: int = 0, data_len: int = 0,
           magic: bytes = MAGIC, flags: int = 0, reserved: int = 0) -> bytes:
    return _HEADER.pack(magic, kind, flags, reserved, req_id, body_len, data_len)


def _protocol_error(frames: list[proto.Message]) -> None:
    """The target explains a drop with one ERROR frame (status FAILED)."""
    assert len(frames) == 1 and isinstance(frames[0], proto.Error), frames
    assert frames[0].status == Status.FAILED
    assert "protocol error" in frames[0].message


GARBAGE = {
    "http": b"GET / HTTP/1.1\r\nHost: example.com\r\n\r\n",
    "bad-magic": header(magic=b"HXL2"),
    "unknown-type": header(kind=99),
    "reserved-bits": header(flags=1),
    "reserved-field": header(reserved=7),
    "body-too-large": header(kind=proto.FrameType.HELLO, body_len=MAX_BODY + 1),
    "data-on-control-frame": header(kind=proto.FrameType.HELLO, body_len=2, data_len=5) + b"{}",
    "hello-not-json": header(kind=proto.FrameType.HELLO, body_len=3) + b"{{{",
    "hello-not-object": header(kind=proto.FrameType.HELLO, body_len=2) + b"[]",
}


@pytest.mark.parametrize("data", list(GARBAGE.values()), ids=list(GARBAGE))
def test_garbage_instead_of_hello(raw: Raw, data: bytes) -> None:
    raw.send(data)
    _protocol_error(raw.expect_dropped())


def test_request_before_hello(raw: Raw, target: TargetProcess) -> None:
    descs = np.array([[target.addrs[0], 16]], dtype=np.uint64)
    raw.send(proto.encode(proto.ReadRequest(1, descs)))
    frames = raw.expect_dropped()
    _protocol_error(frames)
    assert "HELLO" in frames[0].message  # type: ignore[union-attr]


AFTER_HELLO = {
    "garbage": b"\x00" * proto.HEADER_SIZE,
    "bad-magic": header(magic=b"XXXX"),
    "welcome-from-initiator": proto.encode(proto.Welcome({})),
    "data-from-initiator": proto.encode(proto.Data(1, 0)),
    "ack-from-initiator": proto.encode(proto.Ack(3)),
    "read-without-descs": header(kind=proto.FrameType.READ, req_id=1),
    "read-odd-body": header(kind=proto.FrameType.READ, req_id=1, body_len=8) + bytes(8),
    "read-zero-length": header(kind=proto.FrameType.READ, req_id=1, body_len=16) + struct.pack("<QQ", 4096, 0),
    "write-len-mismatch": header(kind=proto.FrameType.WRITE, req_id=1, body_len=16, data_len=9)
    + struct.pack("<QQ", 4096, 8),
    "notify-bad-utf8": header(kind=proto.FrameType.NOTIFY, req_id=1, body_len=4) + struct.pack("<H", 1) + b"\xff\xfe",
    # (addr + len) wrapping past 2**64 would pass a region check done modulo 2**64
    "read-wrapping": header(kind=proto.FrameType.READ, req_id=1, body_len=16) + struct.pack("<QQ", 1 << 40, (1 << 64) - 1),
    "write-lengths-wrapping": header(kind=proto.FrameType.WRITE, req_id=1, body_len=32)
    + struct.pack("<QQQQ", 4096, 1 << 63, 4096, 1 << 63),
}


@pytest.mark.parametrize("data", list(AFTER_HELLO.values()), ids=list(AFTER_HELLO))
def test_malformed_frame_after_hello(raw: Raw, data: bytes) -> None:
    raw.hello()
    raw.send(data)
    _protocol_error(raw.expect_dropped())


def test_truncated_frame_then_close(target: TargetProcess) -> None:
    conn = Raw(target.engine)
    conn.hello()
    conn.send(header(kind=proto.FrameType.WRITE, req_id=1, body_len=16, data_len=1 << 20)[:10])
    conn.close()  # the target must just forget this connection (checked by still_serves)


def test_write_body_then_close_mid_data(raw: Raw, target: TargetProcess) -> None:
    raw.hello()
    target.write(0, 8192, bytes(4096))
    descs = np.array([[target.addrs[0] + 8192, 4096]], dtype=np.uint64)
    raw.send(proto.encode(proto.WriteRequest(1, descs, 4096)) + b"\x01" * 100)
    raw.close()
    # The bytes that arrived went straight into registered memory (zero copy),
    # so restore the pattern once they have landed.
    deadline = time.monotonic() + 5
    while target.read(0, 8192 + 99, 1) != b"\x01" and time.monotonic() < deadline:
        time.sleep(0.01)
    target.fill(0, 11)


def test_silent_client_is_dropped_after_the_handshake_timeout(raw: Raw) -> None:
    start = time.monotonic()
    raw.expect_dropped(timeout=10)
    assert time.monotonic() - start < HANDSHAKE_TIMEOUT + 2


def test_bad_requests_get_an_error_and_the_connection_stays_usable(raw: Raw, target: TargetProcess) -> None:
    welcome = raw.hello()
    assert [target.addrs[0], 1 << 20] in welcome.info["regions"]
    outside = np.array([[target.addrs[0] + (1 << 20) - 8, 16]], dtype=np.uint64)
    # WRITE outside the regions, with its data: refused, data skipped, nothing written.
    before = target.read(0, (1 << 20) - 8, 8)
    raw.send(proto.encode(proto.WriteRequest(5, outside, 16)) + b"\xab" * 16)
    reply = raw.recv()
    assert isinstance(reply, proto.Error) and reply.req_id == 5 and reply.status == Status.PARAM_INVALID
    assert target.read(0, (1 << 20) - 8, 8) == before
    # READ outside: refused.
    raw.send(proto.encode(proto.ReadRequest(6, outside)))
    reply = raw.recv()
    assert isinstance(reply, proto.Error) and reply.req_id == 6 and reply.status == Status.PARAM_INVALID
    # The stream is still in step: PING, QUERY_REGIONS, a good READ and WRITE.
    raw.send(proto.encode(proto.Ping(7)))
    assert raw.recv() == proto.Pong(7)
    raw.send(proto.encode(proto.QueryRegions(8)))
    reply = raw.recv()
    assert isinstance(reply, proto.Regions) and reply.req_id == 8
    assert [target.addrs[0], 1 << 20] in reply.regions.tolist()
    inside = np.array([[target.addrs[0] + 100, 50], [target.addrs[0] + 4000, 30]], dtype=np.uint64)
    raw.send(proto.encode(proto.ReadRequest(9, inside)))
    reply = raw.recv()
    assert reply == proto.Data(9, 80)
    expected = TargetProcess.expected(1 << 20, 11)
    assert raw.recv_exact(80) == expected[100:150].tobytes() + expected[4000:4030].tobytes()
    scratch = np.array([[target.addrs[0] + 8192, 3]], dtype=np.uint64)
    raw.send(proto.encode(proto.WriteRequest(10, scratch, 3)) + b"xyz")
    assert raw.recv() == proto.Ack(10)
    assert target.read(0, 8192, 3) == b"xyz"
    target.fill(0, 11)  # restore for the other tests
    raw.send(proto.encode(proto.Bye(0, "done")))
    assert raw.expect_dropped() == []
