"""A peer that knows the secret still cannot aim a same-host copy anywhere but at itself.

The attacker here is a scripted target M that completes an honest, authenticated
handshake with the initiator, then lies in its WELCOME: it names another hixl
process V (or the initiator itself) as the process to copy into. It does all an
attacker can do to pass the probe: plants this connection's binding bytes in V's
memory with an ordinary TCP WRITE, lifts V's generation fd and generation from V's
own WELCOME, and lists V's read-only and unregistered memory as its regions.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import hixl
from hixl import Engine, Op, Unsupported
from hixl import _protocol as proto
from hixl._session.address import boot_id
from hixl.testing import ScriptedPeer, ScriptedTarget, TargetProcess
from hixl.transports._peerproc import PeerProcess

pytestmark = pytest.mark.timeout(60)

SECRET = "correct horse battery staple"
SIZE = 1 << 16
PLANT_AT = 4096  # where M writes the binding bytes into V's read-write buffer


@pytest.fixture
def victim() -> Iterator[TargetProcess]:
    """V: an honest engine with a read-write buffer (0), a read-only one (1) and a deregistered one (2)."""
    with TargetProcess([SIZE], {"auth_secret": SECRET}) as target:
        target.add_buffer(SIZE, "r")
        target.add_buffer(SIZE)
        target.deregister(2)
        for index in range(3):
            target.fill(index, 10 + index)
        yield target


def _own_generation() -> tuple[int, int]:
    """This process's newest cma generation memfd and the generation in it (what M needs to name us)."""
    fds = [int(fd) for fd in os.listdir("/proc/self/fd") if "hixl-cma-generation" in _link(fd)]
    fd = max(fds)
    return fd, int(np.frombuffer(os.pread(fd, 8, 0), np.uint64)[0])


def _link(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def _impostor(victim: TargetProcess) -> Callable[[ScriptedPeer], None]:
    """M's script: authenticate, plant the binding bytes in V and name V."""
    with ScriptedPeer.connect(victim.engine, SECRET) as spy:
        advertised = spy.handshake()  # V's own WELCOME: its generation fd and generation
    regions = [[victim.addrs[1], SIZE, 1], [victim.addrs[2], SIZE, 1]]  # read-only and unregistered, offered writable

    def script(peer: ScriptedPeer) -> None:
        assert isinstance(peer.recv(), proto.Hello)
        peer.send_raw(peer.conn.challenge())
        assert isinstance(peer.recv(), proto.Auth)
        binding = peer.conn.binding("cma")
        with Engine("127.0.0.1", {"auth_secret": SECRET, "transport": "tcp"}) as planter:
            plant = hixl.empty(16)
            plant[:] = np.frombuffer(binding, np.uint8)
            planter.register_mem(plant)
            planter.connect(victim.engine)
            planter.transfer_sync(victim.engine, Op.WRITE, [(int(plant.ctypes.data), victim.addrs[0] + PLANT_AT, 16)])
        cma = {
            "pid": victim.pid,
            "boot_id": boot_id(),
            "probe_addr": victim.addrs[0] + PLANT_AT,
            "generation_fd": advertised["transports"]["cma"]["generation_fd"],
            "socket": advertised["transports"]["cma"]["socket"],  # V's: it proves nothing for this connection
        }
        welcome = {
            "engine": "impostor",
            "engine_id": "impostor",
            "boot_id": boot_id(),
            "generation": advertised["generation"],
            "regions": regions,
            "transports": {"cma": cma, "tcp": {}},
        }
        peer.send_raw(peer.conn.welcome(welcome))
        peer.expect_closed(30)

    return script


def _victim_intact(victim: TargetProcess) -> None:
    for index in (1, 2):
        assert victim.read(index, 0, SIZE) == TargetProcess.expected(SIZE, 10 + index).tobytes()


def test_cma_is_refused_into_a_third_process_that_holds_planted_binding_bytes(victim: TargetProcess) -> None:
    with ScriptedTarget(_impostor(victim), SECRET) as fake, Engine("127.0.0.1", {"auth_secret": SECRET, "transport": "cma"}) as eng:
        local = hixl.empty(SIZE)
        eng.register_mem(local)
        with pytest.raises(Unsupported, match="socket"):
            eng.connect(fake.engine)
    _victim_intact(victim)


def test_an_impostor_naming_a_third_process_gets_tcp_and_no_copy(victim: TargetProcess) -> None:
    """With the transport chosen automatically, the impostor is served over TCP (itself), and
    nothing the initiator does reaches V."""
    with ScriptedTarget(_impostor(victim), SECRET) as fake, Engine("127.0.0.1", {"auth_secret": SECRET}) as eng:
        local = hixl.empty(SIZE)
        local[:] = 0xEE
        eng.register_mem(local)
        eng.connect(fake.engine)
        assert eng.transport_of(fake.engine) == "tcp"
    _victim_intact(victim)


@contextlib.contextmanager
def _impostor_process() -> Iterator[tuple[str, Callable[[dict], None]]]:
    """M in a child process (impostor_main.py): its address, and a function telling it what to lie about."""
    child = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("impostor_main.py")), SECRET],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(hixl.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])},
    )
    assert child.stdin is not None and child.stdout is not None
    stdin, stdout = child.stdin, child.stdout

    def lie(about: dict) -> None:
        stdin.write(json.dumps(about) + "\n")
        stdin.flush()
        assert stdout.readline().strip() == "ready"

    try:
        yield stdout.readline().strip(), lie
    finally:
        child.communicate(timeout=30)


def test_cma_is_refused_into_the_initiator_itself() -> None:
    """M names the initiator as the process to copy into, with the probe bytes planted in its
    unregistered memory and its own generation page: the initiator would write that memory."""
    with _impostor_process() as (address, lie), Engine("127.0.0.1", {"auth_secret": SECRET, "transport": "cma"}) as eng:
        spot = hixl.empty(4096)  # in this process, never registered
        generation_fd, generation = _own_generation()
        lie({"pid": os.getpid(), "probe_addr": int(spot.ctypes.data), "generation_fd": generation_fd,
             "generation": generation, "regions": [[int(spot.ctypes.data), 4096, 1]]})
        with pytest.raises(Unsupported, match="socket"):
            eng.connect(address)


# -- nothing a peer names can block --------------------------------------------------------------
@pytest.mark.parametrize("transport", ["cma", "auto"])
def test_a_fifo_named_as_the_generation_fd_cannot_hang_connect(tmp_path: Path, transport: str) -> None:
    """Opening a FIFO for reading blocks until a writer comes: connect must not wait for one."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    # Should connect() hang on the FIFO after all, a writer releases it after 10 s: the test
    # then fails on the time taken instead of hanging.
    release = threading.Timer(10.0, lambda: os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)))
    with _impostor_process() as (address, lie), Engine("127.0.0.1", {"auth_secret": SECRET, "transport": transport}) as eng:
        lie({"fifo": str(fifo)})
        release.start()
        try:
            started = time.monotonic()
            if transport == "cma":
                with pytest.raises(Unsupported, match="memfd|regular file"):
                    eng.connect(address, timeout=2.0)
            else:
                eng.connect(address, timeout=2.0)
                assert eng.transport_of(address) == "tcp"
            assert time.monotonic() - started < 2.0
        finally:
            release.cancel()


# -- a pid reused after the peer died is not the peer ----------------------------------------------
def test_a_pinned_process_stays_dead_when_its_pid_is_reused() -> None:
    """The kernel hands the dead peer's pid to a new process (forced through ns_last_pid): the
    pidfd taken at the probe still says the peer is gone, though the pid exists again."""
    first = subprocess.Popen(["sleep", "30"])
    pinned = PeerProcess(first.pid)
    try:
        assert pinned.alive()
        first.kill()
        first.wait()
        assert not pinned.alive()
        second = _start_with_pid(first.pid, ["sleep", "30"])
        try:
            os.kill(first.pid, 0)  # the pid is alive again ...
            assert not pinned.alive()  # ... but it is not the process we proved
        finally:
            second.kill()
            second.wait()
    finally:
        pinned.close()


_HOLDER = (
    "import ctypes, sys; held = ctypes.create_string_buffer(b'only this process holds these', 32); "
    "print(ctypes.addressof(held), flush=True); sys.stdin.read()"
)
"""A process holding 32 known bytes at the address it prints, until its stdin closes."""


def _holder(pid: int | None = None) -> tuple[subprocess.Popen, int]:
    command = [sys.executable, "-c", _HOLDER]
    child = _start_with_pid(pid, command, stdin=subprocess.PIPE, stdout=subprocess.PIPE) if pid else subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    return child, int(child.stdout.readline())  # type: ignore[union-attr]


def test_a_peer_memory_file_is_kept_only_where_it_holds_the_proof() -> None:
    """open_memory keeps /proc/<pid>/mem only where the bytes read through it are the expected ones."""
    child, addr = _holder()
    pinned = PeerProcess(child.pid)
    try:
        assert not pinned.open_memory(addr, b"x" * 32) and pinned.memory_fd == -1
        assert not pinned.open_memory(1 << 46, b"only this process holds these") and pinned.memory_fd == -1
        assert pinned.open_memory(addr, b"only this process holds these") and pinned.memory_fd >= 0
        fd = pinned.memory_fd
        pinned.close()
        assert pinned.memory_fd == -1
        with pytest.raises(OSError):
            os.fstat(fd)  # closed with the process handle
    finally:
        child.kill()
        child.wait()


def test_a_peer_memory_file_reads_nothing_once_its_pid_is_reused() -> None:
    """The file the probe opened stays bound to the dead peer's memory: through it nothing is read
    (or written) once the peer died, though its pid is alive again and holds the same bytes."""
    first, addr = _holder()
    pinned = PeerProcess(first.pid)
    try:
        assert pinned.open_memory(addr, b"only this process holds these")
        first.kill()
        first.wait()
        second, second_addr = _holder(first.pid)
        try:
            assert second.pid == first.pid
            assert os.pread(pinned.memory_fd, 32, addr) == b""
            assert os.pwrite(pinned.memory_fd, b"overwritten", second_addr) == 0
            fresh = PeerProcess(second.pid)
            try:
                assert fresh.open_memory(second_addr, b"only this process holds these")  # intact
            finally:
                fresh.close()
        finally:
            second.kill()
            second.wait()
    finally:
        pinned.close()


def test_a_cma_channel_holds_its_peers_memory_file(victim: TargetProcess) -> None:
    """Where /proc allows it (here: this very user), the probe proves and keeps the peer's memory
    file, and a small transfer_sync moves its bytes through it."""
    with Engine("127.0.0.1", {"auth_secret": SECRET, "transport": "cma"}) as eng:
        local = hixl.empty(SIZE)
        eng.register_mem(local)
        eng.connect(victim.engine)
        process = eng._peers[victim.engine].channel._process
        assert process.memory_fd >= 0
        assert os.readlink(f"/proc/self/fd/{process.memory_fd}") == f"/proc/{victim.pid}/mem"
        eng.transfer_sync(victim.engine, Op.READ, [(int(local.ctypes.data), victim.addrs[0], 4096)])
        assert np.array_equal(local[:4096], TargetProcess.expected(SIZE, 10)[:4096])


def _start_with_pid(pid: int, command: list[str], **popen: object) -> subprocess.Popen:
    """Start ``command`` as process ``pid`` (a few tries: other processes may take it first)."""
    for _ in range(20):
        try:
            Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        except OSError as exc:
            pytest.skip(f"cannot choose the next pid here: {exc}")
        child = subprocess.Popen(command, **popen)  # type: ignore[call-overload]
        if child.pid == pid:
            return child
        child.kill()
        child.wait()
    pytest.skip(f"other processes kept taking pid {pid}")
