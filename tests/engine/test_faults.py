"""A scripted fake target (fault injection): a real socket on 127.0.0.1 whose replies a test
writes frame by frame, to reach failures a real target only shows by chance — dying in the
middle of a reply, stalling mid-data, answering with the wrong frame."""

from __future__ import annotations

import socket
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

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
REGION = (0x7000_0000_0000, 64 * MiB)  # what the fake claims to have registered


class Conn:
    """The fake's end of one connection."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.settimeout(20)

    def recv_exact(self, nbytes: int) -> bytes:
        data = b""
        while len(data) < nbytes:
            chunk = self.sock.recv(nbytes - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return data

    def recv(self) -> proto.Message:
        """Next frame that is not a heartbeat (PINGs are answered)."""
        while True:
            header = proto.parse_header(self.recv_exact(proto.HEADER_SIZE))
            message = proto.parse_body(header, self.recv_exact(header.body_len))
            if isinstance(message, proto.Ping):
                self.send(proto.encode(proto.Pong(message.req_id)))
            elif not isinstance(message, proto.Pong):
                return message

    def recv_request(self) -> proto.Message:
        """Next request, with a WRITE's data read (and dropped)."""
        request = self.recv()
        if isinstance(request, proto.WriteRequest):
            self.recv_exact(request.data_len)
        return request

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def welcome(self) -> None:
        hello = self.recv()
        assert isinstance(hello, proto.Hello)
        info = {"engine": "fake", "engine_id": "fake", "version": 1, "regions": [list(REGION)], "transports": {}}
        self.send(proto.encode(proto.Welcome(info, hello.req_id)))


class ScriptedTarget:
    """Listens on 127.0.0.1; runs ``script(conn)`` for the first connection on a thread."""

    def __init__(self, script: Callable[[Conn], None]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.engine = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(script,), daemon=True)
        self.thread.start()

    def _run(self, script: Callable[[Conn], None]) -> None:
        sock, _ = self.listener.accept()
        try:
            script(Conn(sock))
        except (EOFError, ConnectionError, OSError):
            pass  # the initiator went away: fine for a fake
        except BaseException as exc:  # noqa: BLE001  (reported by close())
            self.error = exc
        finally:
            sock.close()

    def close(self) -> None:
        self.listener.close()
        self.thread.join(10)
        assert not self.thread.is_alive(), "the fake's script did not finish"
        if self.error is not None:
            raise self.error


@pytest.fixture
def scripted() -> Iterator[Callable[[Callable[[Conn], None]], ScriptedTarget]]:
    fakes: list[ScriptedTarget] = []

    def start(script: Callable[[Conn], None]) -> ScriptedTarget:
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
    def script(conn: Conn) -> None:
        conn.welcome()
        read = conn.recv()
        assert isinstance(read, proto.ReadRequest)
        conn.send(proto.encode(proto.Data(read.req_id, 4 * MiB)) + b"\x01" * MiB)

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
    def script(conn: Conn) -> None:
        conn.welcome()
        read = conn.recv()
        conn.send(proto.encode(proto.Data(read.req_id, 17)) + bytes(17))  # type: ignore[union-attr]
        conn.recv()  # until the initiator drops us

    fake = scripted(script)
    eng, buf = initiator
    eng.connect(fake.engine)
    with pytest.raises(ProtocolError, match="17"):
        eng.transfer_sync(fake.engine, Op.READ, _read(buf, 16), timeout=10)
    with pytest.raises(PeerDisconnected):  # the stream can't be trusted any more
        eng.transfer_sync(fake.engine, Op.READ, _read(buf, 16), timeout=5)


def test_error_replies_become_errors(scripted, initiator) -> None:  # type: ignore[no-untyped-def]
    def script(conn: Conn) -> None:
        conn.welcome()
        for status in (Status.PARAM_INVALID, Status.RESOURCE_EXHAUSTED, Status.NOT_CONNECTED):
            request = conn.recv_request()
            conn.send(proto.encode(proto.Error(request.req_id, status, f"refused with {status.name}")))  # type: ignore[union-attr]
        request = conn.recv_request()
        conn.send(proto.encode(proto.Ack(request.req_id)))  # type: ignore[union-attr]
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
    def script(conn: Conn) -> None:
        conn.welcome()
        conn.recv()
        conn.send(reply)
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
    def script(conn: Conn) -> None:
        conn.recv()
        conn.send(answer)
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

    def script(conn: Conn) -> None:
        conn.welcome()
        read = conn.recv()
        conn.send(proto.encode(proto.Data(read.req_id, 16 * MiB)) + b"\x01" * MiB)  # type: ignore[union-attr]
        go_on.wait(1.5)  # stall for a while, mid-chunk
        conn.send(b"\x02" * 15 * MiB)
        final = conn.recv()
        conn.send(proto.encode(proto.Data(final.req_id, 16)) + b"\x03" * 16)  # type: ignore[union-attr]
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
