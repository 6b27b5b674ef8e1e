"""Descriptors passed on prove nothing: an insider cannot steer a same-host copy into a third engine.

Three real engine processes: the initiator I (this process), an insider M that knows the secret
(passer_main.py), and an honest engine V. M makes V hold what I would take as proof that V is M —
M's end of the authenticated I<->M socket, handed to V over V's own shm socket as fake grants, or
inherited by V from its start (taken with ``pidfd_getfd`` before V exec'd) — and plants the
connection's cma probe bytes in V's registered memory with an ordinary TCP WRITE. Or it forwards to
I the memfds V shared with it, as its own shm grants. Whatever M does, I's copies "to M" must not
touch V: its read-only, unregistered and pool memory stays byte for byte as V left it, and I neither
maps nor keeps anything of V's.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import hixl
from hixl import Engine, HixlError, Op, _shm_pool
from hixl.testing import TargetProcess
from hixl.transports import _peerproc

pytestmark = pytest.mark.timeout(90)

SECRET = "correct horse battery staple"
SIZE = 1 << 16

_GRAB = (
    "import ctypes, os, sys; pid, fd = int(sys.argv[1]), int(sys.argv[2]); "
    "got = ctypes.CDLL(None, use_errno=True).syscall(438, os.pidfd_open(pid), fd, 0); "  # pidfd_getfd
    "assert got >= 0, os.strerror(ctypes.get_errno()); os.set_inheritable(got, True); "
    "os.execv(sys.argv[3], sys.argv[3:])"
)
"""A prefix that takes descriptor ``fd`` of process ``pid`` and execs the rest, which inherits it."""


def _victim(prefix: Sequence[str] = (), shared: bool = False) -> TargetProcess:
    """V: an honest engine with a read-write buffer (0), a read-only one (1) and a deregistered one (2)."""
    target = TargetProcess([SIZE], {"auth_secret": SECRET}, prefix=prefix, shared=shared)
    try:
        target.add_buffer(SIZE, "r")
        target.add_buffer(SIZE)
        target.deregister(2)
        for index in range(3):
            target.fill(index, 10 + index)
    except BaseException:
        target.close()
        raise
    return target


def _intact(victim: TargetProcess, indices: Sequence[int]) -> None:
    for index in indices:
        assert victim.read(index, 0, SIZE) == TargetProcess.expected(SIZE, 10 + index).tobytes(), f"V's buffer {index} changed"


def _described(victim: TargetProcess) -> dict[str, Any]:
    return {"engine": victim.engine, "pid": victim.pid, "addrs": victim.addrs, "size": SIZE}


class _Insider:
    """M in a child process (passer_main.py): its address, what it says, and what it is told."""

    def __init__(self, mode: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("passer_main.py")), SECRET, mode],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(hixl.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])},
        )  # fmt: skip
        assert self.process.stdout is not None
        self.engine = self.process.stdout.readline().strip()

    def said(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line, "M exited"
        return json.loads(line)  # type: ignore[no-any-return]

    def tell(self, what: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(what) + "\n")
        self.process.stdin.flush()

    def close(self) -> None:
        try:
            self.process.communicate(timeout=60)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()


@contextlib.contextmanager
def _insider(mode: str) -> Iterator[_Insider]:
    insider = _Insider(mode)
    try:
        yield insider
    finally:
        insider.close()


@contextlib.contextmanager
def _initiator() -> Iterator[tuple[Engine, int]]:
    """I: any transport (auto), a registered buffer of 0xEE bytes to write with."""
    with Engine("127.0.0.1", {"auth_secret": SECRET}) as eng:
        local = hixl.empty(SIZE)
        local[:] = 0xEE
        eng.register_mem(local)
        yield eng, int(local.ctypes.data)


def _write_to_insider(eng: Engine, insider: _Insider, local: int, there: Sequence[int]) -> str:
    """Write to where M says its memory is (V's addresses); the transport I chose for M."""
    transport = eng.transport_of(insider.engine)
    with contextlib.suppress(HixlError):  # over TCP M takes it and never answers
        eng.transfer_sync(insider.engine, Op.WRITE, [(local, addr, SIZE) for addr in there], timeout=1.0)
    return transport


def _held_for(pid: int, inode: int, until: Future[Any], limit: float = 5.0) -> float:
    """How long process ``pid`` held socket ``inode`` (from first seen to last seen), looking every
    millisecond until ``until`` is done or ``limit`` seconds passed."""
    first = last = None
    deadline = time.monotonic() + limit
    while not until.done() and time.monotonic() < deadline:
        if _holds(pid, inode):
            last = time.monotonic()
            first = first if first is not None else last
        time.sleep(0.001)
    return 0.0 if first is None or last is None else last - first


def _holds(pid: int, inode: int) -> bool:
    """Whether process ``pid`` has socket ``inode`` open."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                return True
    return False


def test_cma_never_reaches_a_third_engine_handed_the_peers_socket_over_its_shm_socket() -> None:
    """M lures V into fetching shm grants from it and hands V its end of the I<->M socket as 250
    "memfds", then stalls: V drops them at once, and I's cma is refused (TCP)."""
    with _victim() as victim, _insider("shm-grant") as insider, _initiator() as (eng, local), ThreadPoolExecutor(2) as pool:
        connecting = pool.submit(eng.connect, insider.engine, 30.0)
        said = insider.said()
        insider.tell(_described(victim))
        lured = pool.submit(victim.call, "connect", said["lure"])  # V fetches the lure's "grants"
        held = _held_for(victim.pid, said["inode"], lured)
        connecting.result(timeout=60)
        transport = _write_to_insider(eng, insider, local, victim.addrs[1:])
        with contextlib.suppress(HixlError):
            lured.result(timeout=60)
        _intact(victim, (1, 2))
    # V waits up to its shm timeout (2 s) for the lure's last message: had it kept what it was handed
    # until then, it would have held the socket that long. Closed at once, it holds it for the few
    # instants between receiving and closing (longer only when this machine is loaded).
    assert held < 0.5, f"V kept the socket it was handed as a grant for {held:.2f} s"
    assert transport != "cma"


def test_cma_never_reaches_a_third_engine_that_inherited_the_peers_socket() -> None:
    """V starts holding M's end of the I<->M socket (taken with pidfd_getfd before it exec'd) for
    its whole life: I's cma is still refused, and V untouched."""
    with _insider("inherit") as insider, _initiator() as (eng, local), ThreadPoolExecutor(1) as pool:
        connecting = pool.submit(eng.connect, insider.engine, 60.0)
        said = insider.said()
        with _victim(prefix=[sys.executable, "-c", _GRAB, str(said["pid"]), str(said["fd"])]) as victim:
            assert _holds(victim.pid, said["inode"])  # the attack's premise
            insider.tell(_described(victim))
            connecting.result(timeout=60)
            transport = _write_to_insider(eng, insider, local, victim.addrs[1:])
            _intact(victim, (1, 2))
    assert transport != "cma"


def _memfd_inodes(pid: str) -> dict[int, str]:
    """The pool memfds process ``pid`` has open: inode -> what ``/proc/<pid>/fd/N`` names."""
    found = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            name = os.readlink(f"/proc/{pid}/fd/{fd}")
            if name.startswith("/memfd:hixl-pool"):
                found[os.stat(f"/proc/{pid}/fd/{fd}").st_ino] = name
    return found


def _victims_memory_here(victim: TargetProcess) -> tuple[list[str], list[str]]:
    """The mappings of V's pool memfds in this process, and the descriptors of them it holds."""
    theirs = _memfd_inodes(str(victim.pid))
    with open("/proc/self/maps") as f:
        maps = [line.strip() for line in f if "/memfd:" in line and int(line.split()[4]) in theirs]
    return maps, [name for inode, name in _memfd_inodes("self").items() if inode in theirs]


def test_shm_never_maps_memfds_an_insider_forwards_from_a_third_engine() -> None:
    """M fetches V's pool memfds as V's authenticated peer and offers them to I as its own grants:
    I refuses them (they are V's, not M's), maps and keeps none, and its WRITE "to M" leaves V's
    pool memory as it was."""
    with _victim(shared=True) as victim, _insider("forward-memfds") as insider, _initiator() as (eng, local):
        insider.tell(_described(victim))
        eng.connect(insider.engine, timeout=30.0)
        mapped, held = _victims_memory_here(victim)
        transport = _write_to_insider(eng, insider, local, victim.addrs[:1])
        _intact(victim, (0, 1, 2))
    assert transport != "shm"
    assert not mapped and not held, (mapped, held)


# -- the kernel's word, where it says less --------------------------------------------------------
_LISTENER = (
    "import socket, sys; s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); s.bind(sys.argv[1]); "
    "s.listen(); print('ready', flush=True); sys.stdin.read()"
)
"""A process listening at the path it is given, until its stdin closes."""


@pytest.mark.parametrize("peerpidfd", [True, False], ids=["SO_PEERPIDFD", "pid-only"])
def test_the_process_listening_at_a_socket_is_the_kernels_word(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, peerpidfd: bool
) -> None:
    """``listener`` names the process that listens, and pins it; on a kernel without SO_PEERPIDFD
    (here: an option number no kernel knows) from the pid alone."""
    if not peerpidfd:
        monkeypatch.setattr(_peerproc, "_SO_PEERPIDFD", 0x7FFF)
    path = str(tmp_path / "listener.sock")
    child = subprocess.Popen([sys.executable, "-c", _LISTENER, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.connect(path)
            pid, pidfd = _peerproc.listener(sock)
        own = os.pidfd_open(child.pid)
        try:
            assert pid == child.pid
            assert os.fstat(pidfd).st_ino == os.fstat(own).st_ino  # (pidfs: one inode per process)
            assert _shm_pool.identity(pidfd, pid) == _shm_pool.identity(own, child.pid)
        finally:
            os.close(own)
            os.close(pidfd)
    finally:
        child.communicate(timeout=30)


def test_without_pidfs_a_process_is_named_by_its_pid_and_start_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where pidfds are not in pidfs (before Linux 6.9), a process is named by its pid and start
    time, which only a process in our PID namespace can be (pid 0: outside it, not named)."""
    monkeypatch.setattr(_shm_pool, "_PIDFS_MAGIC", -1)
    with open("/proc/self/stat", "rb") as f:
        start = int(f.read().rsplit(b")", 1)[1].split()[19])
    pidfd = os.pidfd_open(os.getpid())
    try:
        assert _shm_pool.identity(pidfd, os.getpid()) == f"p{os.getpid()}.{start}"
        assert _shm_pool.identity(pidfd, 0) is None
    finally:
        os.close(pidfd)
