"""shm against hostile peers: clients of a target's Unix socket that send garbage, wrong bindings,
oversized messages, descriptors, or nothing at all (the target refuses them in time and keeps
serving honest engines meanwhile); and impostor targets whose socket hands out what must not be
mapped (the initiator refuses, maps nothing and falls back or fails cleanly)."""

from __future__ import annotations

import fcntl
import glob
import os
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest

import hixl
from hixl import Engine, Op, Unsupported, _shm_pool
from hixl._protocol import shm as shm_proto
from hixl._session.address import boot_id
from hixl._shm_pool import F_SEAL_FUTURE_WRITE
from hixl.testing import ScriptedPeer, ScriptedTarget, TargetProcess
from hixl.testing.leaks import open_fds
from hixl.transports import ShmTransport
from hixl.transports._shm_maps import map_grant, unmap
from hixl.transports._shm_peer import RECHECK, Liveness
from hixl.transports._shm_socket import Credentials, GrantServer, fetch

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
TIMEOUT = ShmTransport().timeout  # what the target gives one client


@pytest.fixture(scope="module")
def target() -> Iterator[TargetProcess]:
    """A target with pool memory, listening on its socket (an engine connected once)."""
    with TargetProcess([MiB], shared=True) as tp:
        tp.fill(0, 3)
        with Engine("127.0.0.1", {"transport": "shm"}) as eng:
            eng.connect(tp.engine)
        yield tp


@pytest.fixture(scope="module")
def path(target: TargetProcess) -> str:
    (found,) = glob.glob(os.path.join(ShmTransport().socket_dir, f"hixl-shm-{target.pid}-*.sock"))
    return found


def _client(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    deadline = time.monotonic() + 10
    while True:  # a full backlog refuses at once (EAGAIN): the target drains it soon
        sock.settimeout(TIMEOUT + 3)
        try:
            sock.connect(path)
            return sock
        except BlockingIOError:
            assert time.monotonic() < deadline, "the target accepts no more connections"
            time.sleep(0.01)


def _refusal(sock: socket.socket) -> str:
    data = sock.recv(shm_proto.MAX_MESSAGE)
    with pytest.raises(shm_proto.Refused) as refused:
        shm_proto.decode_reply(data, 0, bytes(16))
    return str(refused.value)


def _honest_read(target: TargetProcess) -> float:
    """Connect a fresh engine over shm, READ 1 MiB byte-exact; the seconds it took."""
    start = time.monotonic()
    with Engine("127.0.0.1", {"transport": "shm"}) as eng:
        buf = hixl.empty(MiB)
        eng.register_mem(buf)
        eng.connect(target.engine)
        eng.transfer_sync(target.engine, Op.READ, [(int(buf.ctypes.data), target.addrs[0], MiB)])
        assert buf.tobytes() == target.read(0, 0, MiB)
    return time.monotonic() - start


# -- hostile clients ---------------------------------------------------------------------------------
def test_a_binding_of_no_open_connection_is_refused(target: TargetProcess, path: str) -> None:
    with pytest.raises(shm_proto.Refused, match="no open authenticated connection"):
        fetch(path, os.urandom(16), os.urandom(16), TIMEOUT)
    # A binding that was good, once its connection is closed, is no good either.
    with ScriptedPeer.connect(target.engine) as peer:
        peer.handshake()
        binding, proof = peer.conn.binding("shm"), peer.conn.binding("shm-target")
        fetched = fetch(path, binding, proof, TIMEOUT)
        for fd in [r.fd for r in fetched.received] + [fetched.liveness]:
            os.close(fd)
    deadline = time.monotonic() + 10
    while True:  # the target notices the connection closed a moment later
        try:
            fetch(path, binding, proof, TIMEOUT)
        except shm_proto.Refused:
            break
        assert time.monotonic() < deadline, "a closed connection's binding still fetches grants"
        time.sleep(0.05)


@pytest.mark.parametrize(
    "message",
    [b"garbage", b"HXSM" + bytes(20), shm_proto.encode_request(bytes(16)) + b"x", b"\xff" * 4096],
    ids=["garbage", "bad-version", "one-byte-long", "oversized"],
)
def test_malformed_requests_are_refused(target: TargetProcess, path: str, message: bytes) -> None:
    with _client(path) as sock:
        sock.send(message)
        reason = _refusal(sock)
        assert "malformed request" in reason or "no open authenticated connection" in reason
        assert sock.recv(16) == b""  # and then the target hangs up
    assert _honest_read(target) < TIMEOUT


def test_descriptors_sent_to_the_target_are_dropped(target: TargetProcess, path: str) -> None:
    r, w = os.pipe()
    ours = f"pipe:[{os.fstat(r).st_ino}]"
    try:
        for _ in range(5):
            with _client(path) as sock:
                socket.send_fds(sock, [shm_proto.encode_request(os.urandom(16))], [r, w])
                assert "no open authenticated connection" in _refusal(sock)
        assert ours not in _open_files(target.pid)
    finally:
        os.close(r)
        os.close(w)
    assert _honest_read(target) < TIMEOUT


def _open_files(pid: int) -> set[str]:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            found.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass  # closed meanwhile
    return found


def test_stalled_clients_are_dropped_in_time_and_delay_nobody(target: TargetProcess, path: str) -> None:
    """70 clients (more than the 64 served at once) connect and send nothing: honest engines get
    their memory mapped meanwhile, and the stalled ones are dropped after the target's timeout."""
    stalled = [_client(path) for _ in range(70)]
    try:
        assert _honest_read(target) < TIMEOUT  # while they stall
        start = time.monotonic()
        for sock in stalled:
            sock.settimeout(max(0.1, start + TIMEOUT + 3 - time.monotonic()))
            assert sock.recv(16) == b""  # hung up on (evicted, or past the timeout)
        assert time.monotonic() - start < TIMEOUT + 3
    finally:
        for sock in stalled:
            sock.close()
    assert _honest_read(target) < TIMEOUT


# -- impostor targets ------------------------------------------------------------------------------
def _memfd(size: int, seals: int) -> int:
    """A memfd as this process's pool makes them (named so, its pages allocated), with ``seals``."""
    fd = os.memfd_create(_shm_pool.memfd_name(), os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    os.posix_fallocate(fd, 0, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


_SEALED = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
ADDR = 0x7F0000000000


def _lie(kind: str, proof: bytes) -> list[tuple[bytes, list[int]]]:
    """What an impostor's socket answers, for each kind of lie (descriptors made fresh each time)."""
    alive_r, alive_w = os.pipe()
    os.close(alive_w)
    grant = [shm_proto.Grant(ADDR, 4096, True)]
    if kind == "wrong-proof":
        return [(shm_proto.encode_grants(bytes(16), grant)[0], [_memfd(4096, _SEALED), alive_r])]
    if kind == "unsealed":
        return [(shm_proto.encode_grants(proof, grant)[0], [_memfd(4096, 0), alive_r])]
    if kind == "too-small":
        big = [shm_proto.Grant(ADDR, 3 * 4096, True)]
        return [(shm_proto.encode_grants(proof, big)[0], [_memfd(4096, _SEALED), alive_r])]
    if kind == "a-pipe":
        r, w = os.pipe()
        os.close(w)
        return [(shm_proto.encode_grants(proof, grant)[0], [r, alive_r])]
    if kind == "no-liveness":
        os.close(alive_r)
        return [(shm_proto.encode_grants(proof, grant)[0], [_memfd(4096, _SEALED)])]
    raise AssertionError(kind)


_REASONS = {
    "wrong-proof": "does not prove",
    "unsealed": "may be shrunk",
    "too-small": "not a file of at least",
    "a-pipe": "not a pool memfd",
    "no-liveness": "descriptors",
}


@pytest.mark.parametrize("kind", sorted(_REASONS))
def test_an_impostor_socket_gets_nothing_mapped(kind: str, tmp_path: object) -> None:
    """A target that completes an honest handshake but whose socket lies: forced shm fails with
    the reason, nothing stays mapped or open here."""
    conns: list[object] = []

    def answer(request: bytes, cred: Credentials) -> list[tuple[bytes, list[int]]]:
        return _lie(kind, conns[0].binding("shm-target"))  # type: ignore[attr-defined]

    server = GrantServer(f"{tmp_path}/impostor.sock", answer, 5.0)

    def script(peer: ScriptedPeer) -> None:
        conns.append(peer.conn)
        shm = {"boot_id": boot_id(), "socket": server.path}
        peer.accept_handshake([(ADDR, 3 * 4096, 1)], boot_id=boot_id(), transports={"shm": shm, "tcp": {}})
        peer.expect_closed(20)

    fds, maps = open_fds(), _pool_maps()
    try:
        refused = pytest.raises(Unsupported, match=_REASONS[kind])
        with ScriptedTarget(script) as fake, Engine("127.0.0.1", {"transport": "shm"}) as eng, refused:
            eng.connect(fake.engine)
    finally:
        server.close()
    assert _pool_maps() <= maps
    assert open_fds() <= fds


def _pool_maps() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line for line in f if "/memfd:hixl-pool" in line}


# -- the initiator's checks, one by one ------------------------------------------------------------------
def test_map_grant_maps_writable_only_what_may_be_written() -> None:
    grant = shm_proto.Grant(ADDR, 4096, True)
    fd = _memfd(4096, _SEALED)
    try:
        mapped = map_grant(grant, fd)
        try:
            assert mapped.writable and mapped.size == 4096
            os.pwrite(fd, b"\x42", 0)
            assert np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * 1).from_address(mapped.here))[0] == 0x42
        finally:
            unmap(mapped)
        # Opened read-only, or sealed against writes: mapped read-only, whatever the grant says.
        read_only = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
        try:
            mapped = map_grant(grant, read_only)
            assert not mapped.writable
            unmap(mapped)
        finally:
            os.close(read_only)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)
        mapped = map_grant(grant, fd)
        assert not mapped.writable
        unmap(mapped)
    finally:
        os.close(fd)


def test_liveness_hangs_up_when_the_target_is_gone() -> None:
    r, w = os.pipe()
    liveness = Liveness(r)
    assert liveness.alive()
    os.close(w)
    time.sleep(RECHECK)  # a look stays good that long
    assert not liveness.alive()
    liveness.close()
    assert not liveness.alive()
    r, w = os.pipe()
    os.close(r)
    for fd, says in ((_memfd(4096, 0), "not a pipe"), (w, "read end")):
        with pytest.raises(hixl.ProtocolError, match=says):
            Liveness(fd)
        with pytest.raises(OSError):
            os.fstat(fd)  # closed by the refusal

