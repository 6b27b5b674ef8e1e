"""Every error the Engine reports: the right class, the right status, raised before anything moves."""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

import hixl
from hixl import (
    AccessDenied,
    AuthenticationFailed,
    AlreadyConnected,
    Engine,
    HixlError,
    HixlTimeout,
    MemDesc,
    MemoryRangeError,
    MemType,
    NotConnected,
    NotifyDesc,
    Op,
    ParamInvalid,
    PeerDisconnected,
    ProtocolError,
    ResourceExhausted,
    Status,
    TransferError,
    TransferOpDesc,
    TransferTimeout,
    Unsupported,
)
from hixl._exceptions import error_for_status
from hixl.testing import TargetProcess
from hixl.transports import CmaTransport, TcpTransport
from hixl.transports.base import Capabilities, Transport

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def engine(transport: str, shared_target: TargetProcess) -> Iterator[Engine]:
    """An initiator on ``transport`` connected to the shared target, with ``engine.buf`` registered."""
    with Engine("127.0.0.1", {"transport": transport}) as eng:
        eng.buf = hixl.empty(1 << 16)  # type: ignore[attr-defined]
        eng.register_mem(eng.buf)  # type: ignore[attr-defined]
        eng.connect(shared_target.engine)
        yield eng


def _addr(buf: np.ndarray) -> int:
    return int(buf.ctypes.data)


# -- the error tree ------------------------------------------------------------------
STATUS_OF = {
    HixlError: Status.FAILED,
    ParamInvalid: Status.PARAM_INVALID,
    MemoryRangeError: Status.PARAM_INVALID,
    HixlTimeout: Status.TIMEOUT,
    TransferTimeout: Status.TIMEOUT,
    NotConnected: Status.NOT_CONNECTED,
    AlreadyConnected: Status.ALREADY_CONNECTED,
    Unsupported: Status.UNSUPPORTED,
    ResourceExhausted: Status.RESOURCE_EXHAUSTED,
    TransferError: Status.FAILED,
    PeerDisconnected: Status.FAILED,
    ProtocolError: Status.FAILED,
}


@pytest.mark.parametrize("cls", list(STATUS_OF), ids=lambda c: c.__name__)
def test_status_of_each_error(cls: type[HixlError]) -> None:
    assert cls.status is STATUS_OF[cls]
    err = cls("boom")
    assert err.status is STATUS_OF[cls]
    assert isinstance(err, HixlError)
    assert str(err).startswith("boom")  # (a PeerDisconnected adds what to do about it)
    assert repr(err) == f"{cls.__name__}({str(err)!r}, status={STATUS_OF[cls].name})"


def test_builtin_mixins() -> None:
    assert issubclass(ParamInvalid, ValueError)
    assert issubclass(MemoryRangeError, ParamInvalid)
    assert issubclass(HixlTimeout, TimeoutError)
    assert issubclass(TransferTimeout, TimeoutError)
    assert issubclass(TransferTimeout, HixlTimeout) and issubclass(TransferTimeout, TransferError)
    assert issubclass(NotConnected, ConnectionError)
    assert issubclass(PeerDisconnected, ConnectionError) and issubclass(PeerDisconnected, TransferError)
    with pytest.raises(TimeoutError):
        raise TransferTimeout("late")


def test_explicit_status_overrides_the_class_default() -> None:
    assert TransferError("x", Status.RESOURCE_EXHAUSTED).status is Status.RESOURCE_EXHAUSTED


@pytest.mark.parametrize("status", [s for s in Status if s is not Status.SUCCESS], ids=lambda s: s.name)
def test_error_for_status(status: Status) -> None:
    err = error_for_status(int(status), "from the peer")
    assert isinstance(err, STATUS_CLASS[status])
    assert err.status is status
    assert "from the peer" in str(err)


STATUS_CLASS = {
    Status.PARAM_INVALID: ParamInvalid,
    Status.TIMEOUT: HixlTimeout,
    Status.NOT_CONNECTED: NotConnected,
    Status.ALREADY_CONNECTED: AlreadyConnected,
    Status.UNSUPPORTED: Unsupported,
    Status.RESOURCE_EXHAUSTED: ResourceExhausted,
    Status.FAILED: TransferError,
    Status.AUTH_FAILED: AuthenticationFailed,
    Status.ACCESS_DENIED: AccessDenied,
}


@pytest.mark.parametrize("status", [999, -1, int(Status.SUCCESS)])
def test_error_for_a_status_no_error_has_is_a_protocol_error(status: int) -> None:
    # An ERROR frame claiming SUCCESS is as malformed as one with an unknown code;
    # an exception whose status says SUCCESS would contradict itself.
    err = error_for_status(status, "what")
    assert isinstance(err, ProtocolError)
    assert err.status is Status.FAILED


# -- options and addresses -----------------------------------------------------------
def test_unknown_option() -> None:
    with pytest.raises(ParamInvalid, match="bogus"):
        Engine("127.0.0.1", {"bogus": 1})


def test_forcing_an_unknown_transport() -> None:
    with pytest.raises(ParamInvalid, match="rdma"):
        Engine("127.0.0.1", {"transport": "rdma"})
    # Also when the transport exists but is not among those given to the engine.
    with pytest.raises(ParamInvalid, match="cma"):
        Engine("127.0.0.1", {"transport": "cma"}, transports=[TcpTransport()])


BAD_ADDRESSES = [
    "",
    "localhost:0",
    "example.com",
    "127.0.0.1:70000",
    "127.0.0.1:-1",
    "127.0.0.1:abc",
    "127.0.0.1:",
    "1.2.3.4.5",
    "::1:0",
    "[::1",
    "[::1]x",
    "[not-v6]:0",
    5,
    None,
]


@pytest.mark.parametrize("address", BAD_ADDRESSES, ids=repr)
def test_malformed_local_address(address: object) -> None:
    with pytest.raises(ParamInvalid):
        Engine(address)  # type: ignore[arg-type]


@pytest.mark.parametrize("address", [*BAD_ADDRESSES, "127.0.0.1", "[::1]"], ids=repr)
def test_malformed_remote_address(address: object) -> None:
    with Engine("127.0.0.1") as eng:
        with pytest.raises(ParamInvalid):
            eng.connect(address)  # type: ignore[arg-type]
        assert eng.connected_engines() == []


def test_cannot_listen_on_a_foreign_address() -> None:
    with pytest.raises(ParamInvalid, match="cannot listen"):
        Engine("192.0.2.1:0", {"allow_unauthenticated": True})  # TEST-NET-1: never a local address


def test_connect_to_itself_by_its_name() -> None:
    with Engine("127.0.0.1:0") as eng:
        with pytest.raises(ParamInvalid, match="itself"):
            eng.connect(eng.local_engine)
        assert eng.connected_engines() == []


def test_connect_to_itself_by_another_name(shared_target: TargetProcess) -> None:
    """Listening on every address, the engine is reached as 127.0.0.1: the handshake spots it."""
    with Engine("0.0.0.0:0", {"allow_unauthenticated": True}) as eng:
        port = eng.local_engine.rsplit(":", 1)[1]
        with pytest.raises(ParamInvalid, match="itself"):
            eng.connect(f"127.0.0.1:{port}")
        # The failed attempt left nothing behind: the engine connects elsewhere normally.
        assert eng.connected_engines() == []
        eng.connect(shared_target.engine)
        assert eng.connected_engines() == [shared_target.engine]


def test_connect_twice(shared_target: TargetProcess) -> None:
    with Engine("127.0.0.1") as eng:
        eng.connect(shared_target.engine)
        with pytest.raises(AlreadyConnected) as info:
            eng.connect(shared_target.engine)
        assert info.value.status is Status.ALREADY_CONNECTED
        assert eng.connected_engines() == [shared_target.engine]


def test_connect_to_a_port_nobody_listens_on() -> None:
    # A bound socket that never listens: connections to it are refused, and
    # nobody else can take the port while we hold it.
    with socket.socket() as hole, Engine("127.0.0.1") as eng:
        hole.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{hole.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(NotConnected) as info:
            eng.connect(address, timeout=3)
        assert time.monotonic() - start < 3
        assert info.value.status is Status.NOT_CONNECTED
        assert eng.connected_engines() == []
        with pytest.raises(NotConnected):  # and it is not remembered as connected
            eng.transfer_sync(address, Op.READ, [(1, 1, 1)])


def test_calls_on_a_peer_that_is_not_connected(shared_target: TargetProcess) -> None:
    with Engine("127.0.0.1") as eng:
        buf = hixl.empty(4096)
        eng.register_mem(buf)
        name = shared_target.engine
        descs = [TransferOpDesc(_addr(buf), shared_target.addrs[0], 16)]
        with pytest.raises(NotConnected):
            eng.transfer_sync(name, Op.READ, descs)
        with pytest.raises(NotConnected):
            eng.transfer_async(name, Op.WRITE, descs)
        with pytest.raises(NotConnected):
            eng.send_notify(name, NotifyDesc("a", "b"))
        with pytest.raises(NotConnected):
            eng.remote_mems(name)
        with pytest.raises(NotConnected):
            eng.transport_of(name)
        with pytest.raises(NotConnected):
            eng.disconnect(name)
        # After a disconnect, the same again.
        eng.connect(name)
        eng.transfer_sync(name, Op.READ, descs)
        eng.disconnect(name)
        with pytest.raises(NotConnected):
            eng.transfer_sync(name, Op.READ, descs)


# -- transfer arguments ------------------------------------------------------------------
def test_bad_op(engine: Engine, shared_target: TargetProcess) -> None:
    descs = [TransferOpDesc(_addr(engine.buf), shared_target.addrs[0], 16)]  # type: ignore[attr-defined]
    for op in (2, -1, "READ", None, 1.5):
        with pytest.raises(ParamInvalid, match="op"):
            engine.transfer_sync(shared_target.engine, op, descs)  # type: ignore[arg-type]
        with pytest.raises(ParamInvalid, match="op"):
            engine.transfer_async(shared_target.engine, op, descs)  # type: ignore[arg-type]
    # Plain ints naming a valid op are accepted.
    engine.transfer_sync(shared_target.engine, 0, descs)  # type: ignore[arg-type]


BAD_DESCS = {
    "empty-list": [],
    "empty-array": np.zeros((0, 3), dtype=np.uint64),
    "shape-N2": np.ones((4, 2), dtype=np.uint64),
    "shape-1d": np.ones(3, dtype=np.uint64),
    "shape-3d": np.ones((1, 1, 3), dtype=np.uint64),
    "float-array": np.ones((1, 3), dtype=np.float64),
    "negative": np.array([[1, 1, -1]], dtype=np.int64),
    "single-desc": TransferOpDesc(1, 1, 1),
    "pairs": [(1, 2)],
    "strings": [("a", "b", "c")],
    "overflow": [(1 << 64, 1, 1)],
    "not-iterable": 42,
}


@pytest.mark.parametrize("descs", list(BAD_DESCS.values()), ids=list(BAD_DESCS))
def test_malformed_descriptors(engine: Engine, shared_target: TargetProcess, descs: object) -> None:
    for call in (engine.transfer_sync, engine.transfer_async):
        with pytest.raises(ParamInvalid) as info:
            call(shared_target.engine, Op.READ, descs)
        assert not isinstance(info.value, MemoryRangeError)


@pytest.mark.parametrize("form", ["list", "array"])
def test_zero_length_descriptor(engine: Engine, shared_target: TargetProcess, form: str) -> None:
    local, remote = _addr(engine.buf), shared_target.addrs[0]  # type: ignore[attr-defined]
    rows = [(local, remote, 8), (local + 8, remote + 8, 0)]
    descs = [TransferOpDesc(*r) for r in rows] if form == "list" else np.array(rows, dtype=np.uint64)
    with pytest.raises(ParamInvalid, match="descriptor 1 has length 0"):
        engine.transfer_sync(shared_target.engine, Op.READ, descs)
    with pytest.raises(ParamInvalid, match="length 0"):
        engine.transfer_sync(shared_target.engine, Op.READ, [TransferOpDesc(local, remote, 0)])


def test_non_positive_timeout(engine: Engine, shared_target: TargetProcess) -> None:
    descs = [TransferOpDesc(_addr(engine.buf), shared_target.addrs[0], 16)]  # type: ignore[attr-defined]
    for timeout in (0, -1):
        with pytest.raises(ParamInvalid, match="timeout"):
            engine.transfer_sync(shared_target.engine, Op.READ, descs, timeout=timeout)
        with pytest.raises(ParamInvalid, match="timeout"):
            engine.transfer_async(shared_target.engine, Op.READ, descs, timeout=timeout)


def test_get_transfer_status_of_something_else(engine: Engine) -> None:
    with pytest.raises(ParamInvalid):
        engine.get_transfer_status("not a request")  # type: ignore[arg-type]


# -- notifications -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "notify",
    [
        NotifyDesc("n" * 1025, ""),
        NotifyDesc("", "m" * 1025),
        NotifyDesc("\u00e9" * 513, ""),  # 513 characters, 1026 bytes of UTF-8
        NotifyDesc("", "\u4e2d" * 342),  # 342 characters, 1026 bytes
    ],
    ids=["name", "msg", "name-utf8", "msg-utf8"],
)
def test_notify_too_large(engine: Engine, shared_target: TargetProcess, notify: NotifyDesc) -> None:
    shared_target.notifies()
    with pytest.raises(ParamInvalid, match="1024"):
        engine.send_notify(shared_target.engine, notify)
    assert shared_target.notifies() == []


@pytest.mark.parametrize("notify", [("a", "b"), NotifyDesc(1, "b"), NotifyDesc("a", b"b"), None], ids=repr)
def test_notify_of_the_wrong_type(engine: Engine, shared_target: TargetProcess, notify: object) -> None:
    with pytest.raises(ParamInvalid, match="NotifyDesc"):
        engine.send_notify(shared_target.engine, notify)  # type: ignore[arg-type]


def test_notify_queue_full(transport: str, make_target) -> None:  # type: ignore[no-untyped-def]
    target = make_target(options={"max_notifies": 3})
    with Engine("127.0.0.1", {"transport": transport}) as eng:
        eng.connect(target.engine)
        for i in range(3):
            eng.send_notify(target.engine, NotifyDesc("n", str(i)))
        with pytest.raises(ResourceExhausted) as info:
            eng.send_notify(target.engine, NotifyDesc("n", "overflow"))
        assert info.value.status is Status.RESOURCE_EXHAUSTED
        # The refused one was dropped, the others kept; draining makes room again.
        assert target.notifies() == [("n", "0"), ("n", "1"), ("n", "2")]
        eng.send_notify(target.engine, NotifyDesc("n", "3"))
        assert target.notifies() == [("n", "3")]


def test_a_notification_handler_takes_or_refuses_as_they_arrive() -> None:
    """A handler sees its notifications on the serving thread as they come; what it raises is what the
    sender's send_notify raises; handled notifications bypass the queue and its limits."""
    seen: list[tuple[str, str, str]] = []

    def handler(notify: NotifyDesc) -> None:
        seen.append((notify.msg, notify.sender, threading.current_thread().name))
        if notify.msg == "no":
            raise AccessDenied("not from you")
        if notify.msg == "bug":
            raise KeyError("a bug in the handler")

    with Engine("127.0.0.1:0", {"max_notifies": 1}) as target, Engine("127.0.0.1") as sender:
        target.handle_notifies("job", handler)
        sender.connect(target.local_engine)
        sender.send_notify(target.local_engine, NotifyDesc("other", "queued"))  # the queue is full now
        sender.send_notify(target.local_engine, NotifyDesc("job", "yes"))
        with pytest.raises(AccessDenied, match="not from you"):
            sender.send_notify(target.local_engine, NotifyDesc("job", "no"))
        with pytest.raises(HixlError, match="failed to handle"):
            sender.send_notify(target.local_engine, NotifyDesc("job", "bug"))
        assert [msg for msg, _, _ in seen] == ["yes", "no", "bug"]
        assert seen[0][1] in target.served_connections() and seen[0][2].startswith("hixl-serve")
        assert target.get_notifies() == [NotifyDesc("other", "queued")]
        with pytest.raises(ParamInvalid, match="callable"):
            target.handle_notifies("job", None)  # type: ignore[arg-type]
    with Engine("127.0.0.1") as client, pytest.raises(Unsupported, match="client-only"):
        client.handle_notifies("job", handler)


# -- registration --------------------------------------------------------------------------
def test_registration_errors() -> None:
    with Engine("127.0.0.1", {"max_registrations": 2}) as eng:
        buf = hixl.empty(3 * 4096)
        with pytest.raises(ParamInvalid):
            eng.register_mem(buf, MemType.DEVICE)
        with pytest.raises(ParamInvalid):
            eng.register_mem(buf, 0)  # type: ignore[arg-type]
        first = eng.register_mem(buf[:4096])
        eng.register_mem(buf[4096:8192])
        with pytest.raises(ResourceExhausted) as info:
            eng.register_mem(buf[8192:])
        assert info.value.status is Status.RESOURCE_EXHAUSTED
        assert eng.register_mem(buf[:4096]) == first  # re-registering the same range is no new one
        eng.deregister_mem(first)
        with pytest.raises(ParamInvalid):
            eng.deregister_mem(first)  # twice
        with pytest.raises(ParamInvalid):
            eng.deregister_mem(MemDesc(_addr(buf), 4096))  # type: ignore[arg-type]
        eng.register_mem(buf[8192:])  # the freed slot is usable


def test_unsupported_when_no_transport_reaches_the_peer(shared_target: TargetProcess) -> None:
    class Unreachable(Transport):
        """A transport whose probe always fails (fault injection)."""

        capabilities = Capabilities("never", False, frozenset({MemType.HOST}))

        def probe(self, link):  # type: ignore[no-untyped-def]
            return "this transport never reaches anyone"

        def open(self, link):  # type: ignore[no-untyped-def]
            raise AssertionError("open() after a failed probe")

    with Engine("127.0.0.1", transports=[Unreachable()]) as eng:
        with pytest.raises(Unsupported, match="never reaches") as info:
            eng.connect(shared_target.engine)
        assert info.value.status is Status.UNSUPPORTED
        assert eng.connected_engines() == []
    # With a working transport after it, the engine falls back to that one.
    with Engine("127.0.0.1", transports=[Unreachable(), TcpTransport()]) as eng:
        eng.connect(shared_target.engine)
        assert eng.transport_of(shared_target.engine) == "tcp"
    forced = Engine("127.0.0.1", {"transport": "never"}, transports=[Unreachable(), CmaTransport()])
    with forced, pytest.raises(Unsupported):
        forced.connect(shared_target.engine)


def test_calls_after_finalize(shared_target: TargetProcess) -> None:
    eng = Engine("127.0.0.1:0")
    eng.finalize()
    buf = hixl.empty(4096)
    for call in (
        lambda: eng.register_mem(buf),
        lambda: eng.connect(shared_target.engine),
        lambda: eng.transfer_sync(shared_target.engine, Op.READ, [(1, 1, 1)]),
        lambda: eng.send_notify(shared_target.engine, NotifyDesc("a", "b")),
        lambda: eng.disconnect(shared_target.engine),
    ):
        with pytest.raises(HixlError, match="finalized"):
            call()


def test_a_host_name_is_refused_with_what_to_write_instead() -> None:
    with pytest.raises(ParamInvalid, match=r"write '127\.0\.0\.1:5001'"):
        Engine("localhost:5001")
    with hixl.Engine("127.0.0.1") as eng, pytest.raises(ParamInvalid, match=r"resolve 'prefill-0' first .* 'ip:port'"):
        eng.connect("prefill-0:5000")


@pytest.mark.parametrize("name", ["1.2.3:99", "10.0.0.256:5000", "1.2.3.4.5"])
def test_a_malformed_ipv4_address_is_called_that_not_a_host_name(name: str) -> None:
    with pytest.raises(ParamInvalid, match=r"IPv4 address is four numbers from 0 to 255") as info:
        Engine(name)
    assert "host name" not in str(info.value) and "resolve" not in str(info.value)


def test_a_remote_range_outside_the_peer_s_memory_says_what_the_peer_registered(
    engine: Engine, shared_target: TargetProcess
) -> None:
    peer = shared_target.engine
    regions = engine.remote_mems(peer)
    last = max(regions, key=lambda m: m.addr)
    outside = hixl.TransferOpDesc(_addr(engine.buf), last.addr + last.len + (1 << 30), 64)  # type: ignore[attr-defined]
    with pytest.raises(MemoryRangeError) as info:
        engine.transfer_sync(peer, hixl.Op.READ, [outside])
    message = str(info.value)
    assert "range(s) registered there, the nearest [" in message and "remote_mems(peer)" in message, message
    # The peer's last region (its neighbours merged with it, when they touch) is the one named.
    start, length = (int(x, 0) for x in re.search(r"the nearest \[(0x[0-9a-f]+), \+(\d+)\)", message).groups())  # type: ignore[union-attr]
    assert start <= last.addr and start + length == last.addr + last.len, message
