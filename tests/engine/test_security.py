"""Who may connect, and what they may touch: the shared secret, exposure, allow-lists,
read-only regions, and replayed handshakes (aiming a same-host copy elsewhere: test_trust_cma.py)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import numpy as np
import pytest

import hixl
from hixl import AccessDenied, AuthenticationFailed, Engine, MemType, Op, ParamInvalid, Status
from hixl import _protocol as proto
from hixl.testing import ScriptedPeer, ScriptedTarget, TargetProcess

pytestmark = pytest.mark.timeout(60)

SECRET = "correct horse battery staple"
MakeTarget = Callable[..., TargetProcess]


def _initiator(options: dict | None = None) -> tuple[Engine, np.ndarray]:
    eng = Engine("127.0.0.1", options)
    buf = hixl.empty(1 << 20)
    eng.register_mem(buf)
    return eng, buf


def _read_ok(eng: Engine, buf: np.ndarray, target: TargetProcess) -> None:
    eng.transfer_sync(target.engine, Op.READ, [(int(buf.ctypes.data), target.addrs[0], 4096)])
    assert buf[:4096].tobytes() == target.read(0, 0, 4096)


# -- the shared secret ------------------------------------------------------------------------------
def test_engines_sharing_the_secret_connect(transport: str, make_target: MakeTarget) -> None:
    target = make_target([1 << 20], {"auth_secret": SECRET})
    target.fill(0, 3)
    eng, buf = _initiator({"auth_secret": SECRET, "transport": transport})
    with eng:
        eng.connect(target.engine)
        assert eng.transport_of(target.engine) == transport
        _read_ok(eng, buf, target)


@pytest.mark.parametrize(
    ("target_secret", "initiator_secret"),
    [(SECRET, "wrong"), (SECRET, None), (None, SECRET)],
    ids=["wrong-secret", "initiator-without", "target-without"],
)
def test_a_peer_without_the_secret_is_refused(
    make_target: MakeTarget, target_secret: str | None, initiator_secret: str | None
) -> None:
    target = make_target([1 << 20], {"auth_secret": target_secret} if target_secret else {})
    target.fill(0, 3)
    with Engine("127.0.0.1", {"auth_secret": initiator_secret} if initiator_secret else {}) as eng:
        with pytest.raises(AuthenticationFailed) as info:
            eng.connect(target.engine)
        assert info.value.status is Status.AUTH_FAILED
        assert SECRET not in str(info.value) and SECRET not in repr(info.value)
        assert eng.connected_engines() == []
    # The target keeps serving everyone else.
    eng, buf = _initiator({"auth_secret": target_secret} if target_secret else {})
    with eng:
        eng.connect(target.engine)
        _read_ok(eng, buf, target)


def test_the_target_logs_why_it_refused_and_never_the_secret(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="hixl")
    with Engine("127.0.0.1:0", {"auth_secret": SECRET}) as target, Engine("127.0.0.1", {"auth_secret": "nope"}) as eng:
        with pytest.raises(AuthenticationFailed):
            eng.connect(target.local_engine)
        assert SECRET not in repr(target.options) and SECRET not in str(target.options)
        assert "***" in repr(target.options["auth_secret"])
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert refusals and "shared secret" in refusals[0].getMessage()
    assert all(SECRET not in r.getMessage() for r in caplog.records)


def test_the_secret_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HIXL_AUTH_SECRET", SECRET)
    with Engine("127.0.0.1:0") as target, Engine("127.0.0.1") as eng:
        eng.connect(target.local_engine)  # both read it from the environment
    with Engine("127.0.0.1:0") as target, Engine("127.0.0.1", {"auth_secret": "other"}) as eng:
        with pytest.raises(AuthenticationFailed):
            eng.connect(target.local_engine)  # an explicit option wins


def test_nothing_about_the_target_before_the_proof(make_target: MakeTarget) -> None:
    """A stranger gets a CHALLENGE (version, nonce, proof, clock) and, for a made-up proof, a
    refusal: no pid, no regions, no cma probe, no metadata — whatever it sends."""
    target = make_target([1 << 20], {"auth_secret": SECRET})
    target.call("set_metadata", "layout", b"secret layout")
    with ScriptedPeer.connect(target.engine) as stranger:
        stranger.send_raw(stranger.conn.initiate())
        challenge = stranger.recv_raw()
        assert isinstance(challenge, proto.Challenge)
        assert set(challenge.info) == {"version", "nonce", "proof", "clock"}
        asks = (proto.QueryRegions(1), proto.QueryMeta(2, "layout"), proto.Auth({"proof": "00" * 32, "info": {}}))
        stranger.send_raw(b"".join(proto.encode(ask) for ask in asks))  # one send: it is dropped at the first
        frames = []
        with contextlib.suppress(EOFError, ConnectionResetError):
            while True:
                frames.append(stranger.recv_raw())
    assert len(frames) == 1 and isinstance(frames[0], proto.Error), frames
    assert frames[0].status == Status.AUTH_FAILED or "protocol error" in frames[0].message
    assert str(target.pid) not in frames[0].message and str(target.addrs[0]) not in frames[0].message


# -- exposure ----------------------------------------------------------------------------------------
def test_listening_beyond_loopback_needs_a_secret_or_an_explicit_opt_in() -> None:
    with pytest.raises(ParamInvalid, match="allow_unauthenticated") as info:
        Engine("0.0.0.0:0")
    assert "auth_secret" in str(info.value)
    with Engine("0.0.0.0:0", {"auth_secret": SECRET}):
        pass
    with Engine("0.0.0.0:0", {"allow_unauthenticated": True}):
        pass
    with Engine("127.0.0.1:0"), Engine("0.0.0.0"):  # loopback, and client-only engines, need neither
        pass


def test_allowed_networks(make_target: MakeTarget) -> None:
    outside = make_target([1 << 20], {"allowed_networks": ["10.0.0.0/8", "fd00::/8"]})
    inside = make_target([1 << 20], {"allowed_networks": ["127.0.0.0/8"]})
    with Engine("127.0.0.1") as eng:
        with pytest.raises(AuthenticationFailed, match="allowed_networks"):
            eng.connect(outside.engine)
        eng.connect(inside.engine)


@pytest.mark.parametrize(
    "options",
    [
        {"allowed_networks": ["not a network"]},
        {"allowed_networks": "127.0.0.0/8"},
        {"allowed_networks": []},
        {"auth_secret": 42},
        {"allow_unauthenticated": "yes"},
        {"max_connections": 0},
        {"max_connections_per_peer": -1},
        {"max_handshakes": 0},
        {"max_handshakes_per_source": 2.5},
        {"hello_timeout": 0},
        {"hello_timeout": 6.0},  # more than handshake_timeout
        {"max_inflight": 1.5},
        {"max_notify_bytes": 10},
        {"max_notifies_per_connection": 0},
        {"max_notify_bytes_per_connection": 4095},
        {"handshake_timeout": 0},
        {"frame_timeout": -1.0},
        {"heartbeat_interval": True},
        {"connect_fail_fast": 1},
        {"busy_poll": -1e-6},
        {"busy_poll": 0.5},  # more than 10 ms: a CPU burnt per request, not a wake-up saved
        {"busy_poll": "50us"},
    ],
    ids=lambda o: next(iter(o)),
)
def test_option_values_are_range_checked(options: dict) -> None:
    with pytest.raises(ParamInvalid, match=next(iter(options))):
        Engine("127.0.0.1:0", options)


def test_a_shorter_handshake_timeout_shortens_the_hello_timeout_left_out() -> None:
    with Engine("127.0.0.1:0", {"handshake_timeout": 0.5}) as eng:
        assert eng.options["hello_timeout"] == 0.5
    with Engine("127.0.0.1:0", {"handshake_timeout": 0.5, "hello_timeout": 0.2}) as eng:
        assert eng.options["hello_timeout"] == 0.2


# -- access rights ------------------------------------------------------------------------------------
def test_register_access_modes() -> None:
    frozen = np.zeros(4096, dtype=np.uint8)
    frozen.flags.writeable = False
    with Engine("127.0.0.1:0") as eng:
        with pytest.raises(ParamInvalid, match="access='r'"):
            eng.register_mem(frozen)
        handle = eng.register_mem(frozen, MemType.HOST, access="r")
        assert handle.access == "r"
        with pytest.raises(ParamInvalid, match="access"):
            eng.register_mem(hixl.empty(4096), MemType.HOST, access="w")
        shared = hixl.empty(4096)
        eng.register_mem(shared, MemType.HOST, access="r")
        with pytest.raises(ParamInvalid, match="registered already"):
            eng.register_mem(shared, MemType.HOST, access="rw")


def test_a_local_read_lands_in_read_only_registrations_only_where_the_buffer_is_writable(
    transport: str, make_target: MakeTarget
) -> None:
    """``access="r"`` keeps peers from writing; this engine may still READ into its own writable memory
    (a push-mode KV cache is read-only to peers and still pulled into), never into a read-only buffer."""
    target = make_target([1 << 20])
    target.write(0, 0, b"\x07" * 4096)
    with Engine("127.0.0.1", {"transport": transport}) as eng:
        mine = hixl.empty(4096)
        eng.register_mem(mine, MemType.HOST, access="r")
        frozen = np.zeros(4096, dtype=np.uint8)
        frozen.flags.writeable = False
        eng.register_mem(frozen, MemType.HOST, access="r")
        eng.connect(target.engine)
        remote = target.addrs[0]
        eng.transfer_sync(target.engine, Op.READ, [(int(mine.ctypes.data), remote, 4096)])
        assert (mine == 7).all()
        with pytest.raises(AccessDenied, match="local"):
            eng.transfer_sync(target.engine, Op.READ, [(int(frozen.ctypes.data), remote, 16)])
        with pytest.raises(AccessDenied, match="local"):
            eng.transfer_sync(target.engine, Op.READ, np.array([[int(frozen.ctypes.data), remote, 4096]], np.uint64))
        assert not frozen.any()
        eng.transfer_sync(target.engine, Op.WRITE, [(int(frozen.ctypes.data), remote, 16)])


def test_peers_may_read_but_not_write_read_only_regions(transport: str, make_target: MakeTarget) -> None:
    target = make_target([1 << 20])
    addr = target.add_buffer(1 << 16, access="r")
    target.write(1, 0, b"\x05" * (1 << 16))
    eng, buf = _initiator({"transport": transport})
    with eng:
        eng.connect(target.engine)
        eng.transfer_sync(target.engine, Op.READ, [(int(buf.ctypes.data), addr, 1 << 16)])
        assert (buf[: 1 << 16] == 5).all()
        buf[:] = 9
        for descs in ([(int(buf.ctypes.data), addr, 16)], np.array([[int(buf.ctypes.data), addr + 8, 64]])):
            with pytest.raises(AccessDenied, match="read-only"):
                eng.transfer_sync(target.engine, Op.WRITE, descs)
            with pytest.raises(AccessDenied):
                eng.transfer_async(target.engine, Op.WRITE, descs)
        assert target.read(1, 0, 1 << 16) == b"\x05" * (1 << 16)


def test_the_target_itself_refuses_a_write_into_a_read_only_region(make_target: MakeTarget) -> None:
    """An initiator that skips its own check (a raw peer) is refused by the TCP target."""
    target = make_target([1 << 20])
    addr = target.add_buffer(4096, access="r")
    target.write(1, 0, b"\x05" * 4096)
    with ScriptedPeer.connect(target.engine) as peer:
        welcome = peer.handshake()
        assert [addr, 4096, 0] in welcome["regions"]
        peer.send(proto.WriteRequest(1, np.array([[addr, 16]], dtype=np.uint64), 16), b"\xff" * 16)
        reply = peer.recv()
        assert isinstance(reply, proto.Error) and reply.status == Status.ACCESS_DENIED
        peer.send(proto.ReadRequest(2, np.array([[addr, 16]], dtype=np.uint64)))
        assert peer.recv() == proto.Data(2, 16) and peer.recv_data() == b"\x05" * 16
    assert target.read(1, 0, 4096) == b"\x05" * 4096


# -- replayed handshakes --------------------------------------------------------------------------------
def test_a_replayed_welcome_is_refused(shared_target: TargetProcess) -> None:
    with ScriptedPeer.connect(shared_target.engine) as spy:
        spy.send_raw(spy.conn.initiate())
        spy.recv()
        spy.send_raw(spy.conn.authenticate({"engine": "spy"}))
        recorded = proto.encode(spy.recv())  # a real engine's WELCOME, MAC and all

    def replay(peer: ScriptedPeer) -> None:
        peer.recv()
        peer.send_raw(peer.conn.challenge())
        peer.recv()
        peer.send_raw(recorded)
        peer.expect_closed()

    with ScriptedTarget(replay) as fake, Engine("127.0.0.1") as eng:
        with pytest.raises(AuthenticationFailed, match="replayed or forged"):
            eng.connect(fake.engine)
