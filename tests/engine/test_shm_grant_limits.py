"""An shm target cannot make an initiator map, allocate or wait beyond bounds.

The target here completes an honest, authenticated handshake and serves its own Unix socket (in
this process, so its memfds are named as this process's pool names its own: the initiator's
check of whose memfd it is passes, and what is tested is what comes after). It grants: a sparse
memfd of 1.5 GiB (mapping it populated would allocate all of it here); 4000 grants of one memfd
(4000 mappings, past the default ``max_grants``); more bytes than ``max_grant_bytes``; memory it
never registered; or nothing at all, stalling. Each is refused within ``connect``'s timeout, and
leaves no descriptor and no mapping behind.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import hixl
from hixl import Engine, Unsupported, _shm_pool
from hixl._protocol import shm as shm_proto
from hixl._session.address import boot_id
from hixl.testing import ScriptedPeer, ScriptedTarget
from hixl.testing.leaks import open_fds
from hixl.transports import CmaTransport, ShmTransport, TcpTransport
from hixl.transports._shm_socket import Credentials, GrantServer, Message

pytestmark = pytest.mark.timeout(60)

ADDR = 0x7F0000000000
PAGE = mmap.PAGESIZE
HUGE = 3 << 29  # 1.5 GiB
_SEALED = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def _pool_name() -> str:
    """The name this process's pool gives its memfds (read off one of them)."""
    buf = hixl.empty(PAGE, shared=True)
    (entry,) = _shm_pool.overlapping(int(buf.ctypes.data), 1)
    return os.readlink(f"/proc/self/fd/{entry.fd}").removeprefix("/memfd:").removesuffix(" (deleted)")


@contextmanager
def _memfd(size: int, allocate: bool = True) -> Iterator[int]:
    """A memfd named as this process's pool names its own, sealed against resizing."""
    fd = os.memfd_create(_pool_name(), os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        if allocate:
            os.posix_fallocate(fd, 0, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALED)
        yield fd
    finally:
        os.close(fd)


def _pool_maps() -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if "/memfd:hixl-pool" in line]


@contextmanager
def _nothing_left() -> Iterator[None]:
    """Fails unless the block leaves no more descriptors and no more pool mappings than it found."""
    fds, maps = open_fds(), len(_pool_maps())
    yield
    assert len(_pool_maps()) <= maps
    assert open_fds() <= fds


Grants = Callable[[bytes], list[Message]]
"""Given the connection's proof, what the target's socket answers (less the liveness pipe)."""


@contextmanager
def _target(tmp_path: Path, regions: list[tuple[int, int, int]], grants: Grants | None) -> Iterator[str]:
    """A scripted target registering ``regions`` whose shm socket answers ``grants(proof)`` and a
    liveness pipe (None: a socket that listens and never accepts); its address."""
    conns: list[ScriptedPeer] = []
    path = str(tmp_path / "target.sock")
    alive_r, alive_w = os.pipe()  # the write end held: the target lives as long as this block
    server: GrantServer | socket.socket
    if grants is None:
        server = stalling = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        stalling.bind(path)
        stalling.listen(8)  # connects queue up; nothing is ever read or answered
    else:

        def answer(request: bytes, cred: Credentials) -> list[Message]:
            messages = grants(conns[0].conn.binding("shm-target"))
            messages[-1][1].append(os.dup(alive_r))
            return messages

        server = GrantServer(path, answer, 10.0)

    def script(peer: ScriptedPeer) -> None:
        conns.append(peer)
        peer.accept_handshake(regions, boot_id=boot_id(), transports={"shm": {"boot_id": boot_id(), "socket": path}, "tcp": {}})
        peer.expect_closed(20)

    try:
        with ScriptedTarget(script) as fake:
            yield fake.engine
    finally:
        server.close()
        os.close(alive_r)
        os.close(alive_w)


def _answer(proof: bytes, grants: list[shm_proto.Grant], fd: int) -> list[Message]:
    """Every grant, each with a descriptor of ``fd``."""
    per = shm_proto.MAX_PER_MESSAGE
    messages = shm_proto.encode_grants(proof, grants)
    return [(m, [os.dup(fd) for _ in grants[i * per : (i + 1) * per]]) for i, m in enumerate(messages)]


def _refused(
    tmp_path: Path, regions: list[tuple[int, int, int]], grants: list[shm_proto.Grant], fd: int, why: str,
    timeout: float = 5.0, shm: ShmTransport | None = None,
) -> float:
    """Connect (shm forced) to a target registering ``regions`` and granting ``grants``, each with
    a descriptor of ``fd``: refused for ``why``, with nothing left behind; the seconds it took."""
    transports = None if shm is None else [CmaTransport(), shm, TcpTransport()]
    with _nothing_left():
        target = _target(tmp_path, regions, lambda proof: _answer(proof, grants, fd))
        with target as address, Engine("127.0.0.1", {"transport": "shm"}, transports=transports) as eng:
            started = time.monotonic()
            with pytest.raises(Unsupported, match=why):
                eng.connect(address, timeout=timeout)
            return time.monotonic() - started


def test_a_sparse_huge_grant_is_refused_at_once_and_allocates_nothing(tmp_path: Path) -> None:
    """1.5 GiB of memfd with no page allocated: mapped populated, it would allocate 1.5 GiB here
    (and take longer than connect's second)."""
    with _memfd(HUGE, allocate=False) as fd:
        assert _refused(tmp_path, [(ADDR, HUGE, 1)], [shm_proto.Grant(ADDR, HUGE, True)], fd, "not allocated", 1.0) < 1.0
        assert os.fstat(fd).st_blocks == 0  # not a page of it was allocated


def test_more_grants_than_max_grants_are_all_refused_and_nothing_stays(tmp_path: Path) -> None:
    """4000 grants of one page of one memfd, in a region the target did register: past the default
    max_grants (1024), so every one is refused, and every descriptor closed as it came."""
    with _memfd(PAGE) as fd:
        grants = [shm_proto.Grant(ADDR + i * PAGE, PAGE, True) for i in range(4000)]
        _refused(tmp_path, [(ADDR, 4000 * PAGE, 1)], grants, fd, "max_grants")


def test_more_bytes_than_max_grant_bytes_are_all_refused(tmp_path: Path) -> None:
    with _memfd(4 * PAGE) as fd:
        grants = [shm_proto.Grant(ADDR, 4 * PAGE, True)]
        _refused(tmp_path, [(ADDR, 4 * PAGE, 1)], grants, fd, "max_grant_bytes", shm=ShmTransport(max_grant_bytes=2 * PAGE))


def test_a_grant_of_memory_the_target_never_registered_is_refused_before_it_is_mapped(tmp_path: Path) -> None:
    with _memfd(PAGE) as fd:
        _refused(tmp_path, [(ADDR, PAGE, 1)], [shm_proto.Grant(ADDR + (1 << 20), PAGE, True)], fd, "not a region the peer registered")


@pytest.mark.parametrize("transport", ["shm", "auto"])
def test_a_target_whose_socket_stalls_cannot_hold_connect_past_its_timeout(tmp_path: Path, transport: str) -> None:
    """Its socket takes the request and never answers (the transport's own timeout is 2 s): connect
    ends by its own timeout of 1 s — forced shm refused, auto on TCP."""
    engine = Engine("127.0.0.1", {"transport": transport})
    with _nothing_left(), _target(tmp_path, [(ADDR, PAGE, 1)], None) as target, engine as eng:
        started = time.monotonic()
        if transport == "shm":
            with pytest.raises(Unsupported, match="timed out|in time|no time left|within"):
                eng.connect(target, timeout=1.0)
        else:
            eng.connect(target, timeout=1.0)
            assert eng.transport_of(target) == "tcp"
        assert time.monotonic() - started < 1.3
