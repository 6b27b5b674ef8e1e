"""The shm transport between real processes that cma cannot reach: another pid namespace, other
users. Which transport is chosen and why, bytes both ways, pool memory moved by shm and the rest
by TCP (in order), deregistration unmapping before it returns, and read-only memory handed out
read-only and sealed. (Hostile clients and impostor targets: test_shm_hostile.py.)

The namespace and user tests need root (``unshare``, ``setpriv``) and are skipped elsewhere.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import hixl
from hixl import AccessDenied, Engine, MemoryRangeError, Op, TransferStatus, Unsupported
from hixl.testing import ScriptedPeer, TargetProcess
from hixl.transports import ShmTransport, TcpTransport
from hixl.transports._shm_socket import fetch

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
ODD = 5 * 4096 + 123  # a buffer size no other mapping in these tests has: its mapping is found by size
MakeTarget = Callable[..., TargetProcess]


def _addr(buf: np.ndarray) -> int:
    return int(buf.ctypes.data)


def _root_only() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (other pid namespaces, other users)")


def _pid_namespace() -> list[str]:
    """A prefix that runs a target in a pid namespace of its own (its pid there: 1)."""
    _root_only()
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--pid", "--fork", "true"], timeout=10, check=False).returncode:
        pytest.skip("cannot make a pid namespace here")
    return ["unshare", "--pid", "--fork"]


def _as_user(uid: int) -> list[str]:
    """A prefix that runs a child as ``uid``, without CAP_SYS_PTRACE (so cma is refused for real).

    CAP_DAC_READ_SEARCH stays, only so that it may read the interpreter and packages where root
    installed them (a home directory others cannot enter, on this machine); it grants no ptrace."""
    _root_only()
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv")
    caps = "+dac_read_search"
    prefix = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", f"--inh-caps={caps}", f"--ambient-caps={caps}"]
    if subprocess.run([*prefix, sys.executable, "-c", "import numpy"], timeout=30, check=False).returncode:
        pytest.skip(f"cannot run this interpreter as uid {uid} here")
    return prefix


def _pool_mappings(size: int) -> list[str]:
    """This process's mappings of pool memory (another's memfds) of ``size`` bytes, rounded to pages."""
    pages = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
    found = []
    with open("/proc/self/maps") as f:
        for line in f:
            if "/memfd:hixl-pool" in line:
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                if end - start == pages:
                    found.append(line.strip())
    return found


COUNTED = ["hixl.transports.cma:CmaTransport", "tests.engine.shm_transports:CountingShm", "hixl.transports.tcp:TcpTransport"]
"""A target's transports, shm counting what its target half serves over TCP."""


@pytest.fixture
def initiator() -> Iterator[tuple[Engine, np.ndarray]]:
    """A client-only engine with the default transports and a registered 2 MiB buffer."""
    with Engine("127.0.0.1") as eng:
        buf = hixl.empty(2 * MiB)
        eng.register_mem(buf)
        yield eng, buf


def _round_trips(eng: Engine, buf: np.ndarray, target: TargetProcess, index: int, size: int, seed: int) -> None:
    """READ what the target holds, then WRITE other bytes and read them back there; byte for byte."""
    target.fill(index, seed)
    descs = [(_addr(buf) + 3, target.addrs[index] + 1, size - 1)]
    eng.transfer_sync(target.engine, Op.READ, descs)
    assert buf[3 : 2 + size].tobytes() == target.read(index, 1, size - 1)
    buf[: size + 3] = np.random.default_rng(seed + 1).integers(0, 256, size + 3, dtype=np.uint8)
    eng.transfer_sync(target.engine, Op.WRITE, np.array(descs, dtype=np.uint64))
    assert target.read(index, 1, size - 1) == buf[3 : 2 + size].tobytes()


# -- selection ---------------------------------------------------------------------------------------
def test_a_target_in_another_pid_namespace_is_reached_over_shm(
    initiator: tuple[Engine, np.ndarray], caplog: pytest.LogCaptureFixture
) -> None:
    """cma is refused (the pid the target names, 1 in its namespace, holds no socket of ours), so the
    engine picks shm by itself; pool memory moves without TCP, other memory of the target over it."""
    eng, buf = initiator
    with TargetProcess([MiB, MiB], shared=True, prefix=_pid_namespace(), transports=COUNTED) as target:
        assert target.pid == 1
        with caplog.at_level(logging.INFO, logger="hixl"):
            eng.connect(target.engine)
        assert eng.transport_of(target.engine) == "shm"
        assert "cma unusable" in caplog.text and "uses shm" in caplog.text
        for index in (0, 1):
            _round_trips(eng, buf, target, index, MiB, seed=index)
        assert target.transport_call("shm", "served") == 0
        plain = target.add_buffer(64 << 10, shared=False)  # not pool memory: TCP moves it
        _round_trips(eng, buf, target, 2, 64 << 10, seed=5)
        assert plain in [m.addr for m in eng.remote_mems(target.engine)]
        assert target.transport_call("shm", "served") == 2  # the READ and the WRITE


def test_engines_of_two_other_users_pick_shm() -> None:
    """Target and initiator run as two unprivileged users: cma is refused (no ptrace permission),
    shm is picked automatically, and both directions are byte-exact."""
    with (
        TargetProcess([MiB], shared=True, prefix=_as_user(65534)) as target,
        TargetProcess([MiB], prefix=_as_user(65533)) as other,
    ):
        other.call("connect", target.engine)
        assert other.call("transport_of", target.engine) == "shm"
        target.fill(0, 11)
        other.call("transfer_sync", target.engine, Op.READ, [(other.addrs[0], target.addrs[0], MiB)])
        assert other.read(0, 0, MiB) == target.read(0, 0, MiB)
        other.fill(0, 12)
        other.call("transfer_sync", target.engine, Op.WRITE, [(other.addrs[0] + 1, target.addrs[0] + 2, MiB - 2)])
        assert target.read(0, 2, MiB - 2) == other.read(0, 1, MiB - 2)


def test_a_target_without_pool_memory_is_reached_over_tcp(
    make_target: MakeTarget, caplog: pytest.LogCaptureFixture
) -> None:
    target = make_target([MiB])
    with caplog.at_level(logging.INFO, logger="hixl"), Engine("127.0.0.1", transports=[ShmTransport(), TcpTransport()]) as eng:
        eng.connect(target.engine)
        assert eng.transport_of(target.engine) == "tcp"
    assert "no pool memory registered" in caplog.text
    with Engine("127.0.0.1", {"transport": "shm"}) as eng, pytest.raises(Unsupported, match="no pool memory"):
        eng.connect(target.engine)


def test_an_unreachable_socket_means_tcp(caplog: pytest.LogCaptureFixture) -> None:
    """The target's socket is gone (as from a container that does not mount its directory)."""
    with TargetProcess([MiB], shared=True) as target:
        with Engine("127.0.0.1", {"transport": "shm"}) as first:
            first.connect(target.engine)  # the target listens from its first WELCOME with pool memory
        (path,) = [e.path for e in os.scandir(ShmTransport().socket_dir) if e.name.startswith(f"hixl-shm-{target.pid}-")]
        os.unlink(path)
        with caplog.at_level(logging.INFO, logger="hixl"), Engine("127.0.0.1", transports=[ShmTransport(), TcpTransport()]) as eng:
            eng.connect(target.engine)
            assert eng.transport_of(target.engine) == "tcp"
        assert f"cannot get the peer's shared memory from {path}" in caplog.text


def test_a_uid_outside_allowed_uids_gets_tcp() -> None:
    transports = ["tests.engine.shm_transports:OnlyUid4242", "hixl.transports.tcp:TcpTransport"]
    with TargetProcess([MiB], shared=True, transports=transports) as target:
        with Engine("127.0.0.1", transports=[ShmTransport(), TcpTransport()]) as eng:
            eng.connect(target.engine)
            assert eng.transport_of(target.engine) == "tcp"
        refused = pytest.raises(Unsupported, match=f"uid {os.geteuid()} is not among the allowed_uids")
        with Engine("127.0.0.1", {"transport": "shm"}) as eng, refused:
            eng.connect(target.engine)


# -- order ---------------------------------------------------------------------------------------------
def test_requests_over_tcp_and_over_shm_take_effect_in_order(make_target: MakeTarget) -> None:
    """A WRITE that spans pool memory and other memory goes over TCP whole; a READ of its pool part
    started after it goes over shm, and must still see it."""
    target = make_target([4 * MiB], {})
    pool = target.add_buffer(4 * MiB, shared=True)
    plain = target.add_buffer(4 * MiB, shared=False)
    with Engine("127.0.0.1", {"transport": "shm"}) as eng:
        src, dst = hixl.empty(8 * MiB), hixl.empty(4 * MiB)
        eng.register_mem(src)
        eng.register_mem(dst)
        eng.connect(target.engine)
        for round_ in range(8):
            src[:] = round_ + 1
            # The pool part last: its bytes are still in the socket buffers when the WRITE's send returns.
            write = eng.transfer_async(
                target.engine, Op.WRITE, [(_addr(src) + 4 * MiB, plain, 4 * MiB), (_addr(src), pool, 4 * MiB)]
            )
            read = eng.transfer_async(target.engine, Op.READ, [(_addr(dst), pool, 4 * MiB)])
            assert write.wait(30) is TransferStatus.COMPLETED and read.wait(30) is TransferStatus.COMPLETED
            assert (dst == round_ + 1).all(), f"round {round_}: the READ overtook the WRITE"


# -- deregistration ------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [ODD, 16 * MiB + ODD], ids=["small", "streamed"])
def test_deregistration_unmaps_before_it_returns_and_nothing_lands_after(make_target: MakeTarget, size: int) -> None:
    """A thread keeps WRITEing into a pool buffer while the target deregisters it and writes its
    own pattern there (reuse): from then on the buffer is not mapped here, transfers to it are
    refused, and not one byte of ours lands in it. Also with WRITEs large enough to be copied with
    streaming stores (hixl._accel.STREAM_FROM), which must be visible before the copy lets go, and
    split over two lanes inside one call of the latency path (each lane's bytes under its hold)."""
    target = make_target([MiB], {"deregister_timeout": 2.0})
    target.add_buffer(size, shared=True)
    with Engine("127.0.0.1", {"transport": "shm", "copy_lanes": 2}) as eng:
        src = hixl.empty(size)
        src.fill(0xAA)
        eng.register_mem(src)
        eng.connect(target.engine)
        remote = target.addrs[1]
        eng.transfer_sync(target.engine, Op.WRITE, [(_addr(src), remote, size)])
        assert target.read(1, 0, size) == b"\xaa" * size and len(_pool_mappings(size)) == 1
        stop, refused, errors = threading.Event(), [0], []

        def keep_writing() -> None:
            deadline = time.monotonic() + 20
            while not stop.is_set() and time.monotonic() < deadline:
                try:
                    eng.transfer_sync(target.engine, Op.WRITE, [(_addr(src), remote, size)])
                except MemoryRangeError:
                    refused[0] += 1
                except Exception as exc:  # noqa: BLE001  (reported below)
                    errors.append(exc)
                    return

        writer = threading.Thread(target=keep_writing)
        writer.start()
        try:
            time.sleep(0.05)
            target.deregister(1)
            assert _pool_mappings(size) == []  # unmapped before deregister_mem returned
            target.write(1, 0, b"\x55" * size)  # the target reuses its memory
            deadline = time.monotonic() + 10
            while refused[0] < 50 and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            stop.set()
            writer.join(30)
        assert not errors and refused[0] >= 50
        assert target.read(1, 0, size) == b"\x55" * size
        with pytest.raises(MemoryRangeError):
            eng.transfer_sync(target.engine, Op.READ, np.array([[_addr(src), remote, 16]], dtype=np.uint64))


# -- read-only memory ----------------------------------------------------------------------------------
def test_read_only_pool_memory_is_mapped_and_handed_out_read_only(make_target: MakeTarget) -> None:
    target = make_target([MiB])
    addr = target.add_buffer(ODD, access="r", shared=True)
    target.write(1, 0, b"\x05" * ODD)
    with Engine("127.0.0.1", {"transport": "shm"}) as eng:
        buf = hixl.empty(ODD)
        eng.register_mem(buf)
        eng.connect(target.engine)
        eng.transfer_sync(target.engine, Op.READ, [(_addr(buf), addr, ODD)])
        assert buf.tobytes() == b"\x05" * ODD
        buf[:] = 9
        with pytest.raises(AccessDenied, match="read-only"):
            eng.transfer_sync(target.engine, Op.WRITE, [(_addr(buf), addr, 16)])
        (line,) = _pool_mappings(ODD)
        assert line.split()[1] == "r--s"  # mapped read-only here
    assert target.read(1, 0, ODD) == b"\x05" * ODD
    # What any peer that proves a binding gets for it: a read-only descriptor of a memfd sealed against writes.
    with ScriptedPeer.connect(target.engine) as peer:
        welcome = peer.handshake()
        path = welcome["transports"]["shm"]["socket"]
        fetched = fetch(path, peer.conn.binding("shm"), peer.conn.binding("shm-target"), 5)
    try:
        (got,) = [r for r in fetched.received if r.grant.addr == addr]
        assert not got.grant.writable
        assert fcntl.fcntl(got.fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        with pytest.raises(PermissionError):
            mmap.mmap(got.fd, got.grant.length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        # Reopening it read-write through /proc works for anyone who holds it; the seal still refuses writes.
        reopened = os.open(f"/proc/self/fd/{got.fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                os.pwrite(reopened, b"\xff", 0)
            with pytest.raises(PermissionError):
                mmap.mmap(reopened, got.grant.length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(reopened)
    finally:
        for received in fetched.received:
            os.close(received.fd)
        os.close(fetched.liveness)
    assert target.read(1, 0, ODD) == b"\x05" * ODD


def test_the_target_serves_in_tcp_request_only_for_transports_that_serve_as_tcp_does() -> None:
    """A small READ or WRITE may be served inside hixl._accel.tcp_request (docs/internals.md) only when
    the transport serving it would do just that: not one that serves its own way, as CountingShm
    (which the test above relies on counting every READ and WRITE) or a TCP that watches them."""
    from tests.engine.shm_transports import CountingShm

    class Watching(TcpTransport):
        def serve_small(self, *args: Any) -> None:
            super().serve_small(*args)

    assert TcpTransport().serves_plainly() and ShmTransport().serves_plainly()
    assert not CountingShm().serves_plainly() and not Watching().serves_plainly()
