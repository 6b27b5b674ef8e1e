"""A man in the middle between engines on different hosts (network namespaces): a relay process
(mitm_main.py) that forwards the handshake between two engines that both know the secret — the
relayed-handshake case of docs/engine.md's threat model — and then sits in the connection,
recording everything and altering what it likes.

With ``encrypt=True`` it can neither read a KV block (its bytes are not in the recording), nor
alter one undetected (a flipped bit fails the transfer, and nothing of it lands), nor slip in a
request of its own. Each test also runs without encryption, where the same attack succeeds: so
the test can fail, and shows what ``encrypt`` changes.

Hosts: 0 the target, 1 the relay, 2 this process's own namespace (the initiator).
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import hixl
from hixl import Engine, IntegrityError, Op, PeerDisconnected
from hixl.testing import TargetProcess
from hixl.testing.hosts import Host, Hosts, hosts_fixture

pytestmark = pytest.mark.timeout(120)

SECRET = "mitm test secret"
BLOCK = 60 << 10
"""A KV block: random bytes, one sealed record's worth with its frame."""
RELAY = Path(__file__).with_name("mitm_main.py")

hosts = hosts_fixture(2, here=True)


class Mitm:
    """The relay process on ``host``, relaying to ``upstream`` (see mitm_main.py)."""

    def __init__(self, host: Host, upstream: str, recording: Path, sealed: bool) -> None:
        self.recording = recording
        args = [sys.executable, str(RELAY), host.ip, upstream, str(recording), *(["--sealed"] if sealed else [])]
        self.proc = host.popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.address = f"{host.ip}:{self._answer()}"

    def _answer(self, timeout: float = 30.0) -> object:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"the relay did not answer (exit status {self.proc.poll()})")
        return json.loads(line)

    def command(self, **command: object) -> object:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def recorded(self, direction: str) -> bytes:
        path = Path(f"{self.recording}.{direction}")
        return path.read_bytes() if path.exists() else b""

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture(params=[True, False], ids=["encrypted", "plaintext"])
def encrypt(request: pytest.FixtureRequest) -> bool:
    """Whether both engines encrypt: the attack must fail with it, and succeeds without."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def target(hosts: Hosts, encrypt: bool) -> Iterator[TargetProcess]:
    """The target on host 0: buffer 0 holds random KV blocks (to READ), buffer 1 takes WRITEs."""
    with hosts[0].target([4 * BLOCK, 4 * BLOCK], {"auth_secret": SECRET, "encrypt": encrypt}) as tp:
        tp.fill(0, 21)
        tp.fill(1, 22)
        yield tp


@pytest.fixture
def mitm(hosts: Hosts, target: TargetProcess, encrypt: bool, tmp_path: Path) -> Iterator[Mitm]:
    relay = Mitm(hosts[1], target.engine, tmp_path / "recording", sealed=encrypt)
    try:
        yield relay
    finally:
        relay.close()


@pytest.fixture
def initiator(hosts: Hosts, mitm: Mitm, encrypt: bool) -> Iterator[tuple[Engine, np.ndarray]]:
    """An engine in this process, connected to the target through the relay (TCP: it is not the
    target's process at the far end, so nothing same-host is offered)."""
    with Engine(hosts[2].ip, {"auth_secret": SECRET, "encrypt": encrypt, "transport": "tcp"}) as eng:
        local = hixl.empty(4 * BLOCK)
        local[:] = np.random.default_rng(23).integers(0, 256, local.size, dtype=np.uint8)
        eng.register_mem(local)
        eng.connect(mitm.address)  # (the handshake goes through the relay: both proofs pass)
        yield eng, local


def _seen(block: bytes, recording: bytes) -> bool:
    """Whether any 32-byte piece of ``block`` (one every KiB) is in ``recording``."""
    return any(block[k : k + 32] in recording for k in range(0, len(block) - 32, 1024))


def test_the_relay_reads_no_kv_block(initiator, mitm: Mitm, target: TargetProcess, encrypt: bool) -> None:
    eng, local = initiator
    base = int(local.ctypes.data)
    eng.transfer_sync(mitm.address, Op.READ, [(base, target.addrs[0], BLOCK)])
    read = target.read(0, 0, BLOCK)
    assert local[:BLOCK].tobytes() == read
    written = local[BLOCK : 2 * BLOCK].tobytes()
    eng.transfer_sync(mitm.address, Op.WRITE, [(base + BLOCK, target.addrs[1], BLOCK)])
    assert target.read(1, 0, BLOCK) == written
    eng.disconnect(mitm.address)
    recorded = mitm.recorded("t2i") + mitm.recorded("i2t")
    assert len(recorded) > 2 * BLOCK  # (it relayed both blocks...)
    assert _seen(read, recorded) is not encrypt  # (...and, unless sealed, read them)
    assert _seen(written, recorded) is not encrypt


def test_a_bit_flipped_in_a_read_fails_it_and_lands_nothing(hosts, initiator, mitm: Mitm, target: TargetProcess, encrypt: bool) -> None:
    eng, local = initiator
    before = local[:BLOCK].tobytes()
    mitm.command(flip="t2i")
    if encrypt:
        with pytest.raises(IntegrityError):
            eng.transfer_sync(mitm.address, Op.READ, [(int(local.ctypes.data), target.addrs[0], BLOCK)])
        assert local[:BLOCK].tobytes() == before  # byte for byte untouched
        assert mitm.command(flips=1) == 1
        with pytest.raises(PeerDisconnected):  # the link is closed
            eng.transfer_sync(mitm.address, Op.READ, [(int(local.ctypes.data), target.addrs[0], 8)])
    else:
        eng.transfer_sync(mitm.address, Op.READ, [(int(local.ctypes.data), target.addrs[0], BLOCK)])
        assert mitm.command(flips=1) == 1
        landed, sent = local[:BLOCK], np.frombuffer(target.read(0, 0, BLOCK), np.uint8)
        assert int(np.unpackbits(landed ^ sent).sum()) == 1  # the altered block landed, unnoticed
    _still_serves(hosts, target, encrypt)


def test_a_bit_flipped_in_a_write_fails_it_and_lands_nothing(hosts, initiator, mitm: Mitm, target: TargetProcess, encrypt: bool) -> None:
    eng, local = initiator
    before = target.read(1, 0, BLOCK)
    mitm.command(flip="i2t")
    if encrypt:
        with pytest.raises(IntegrityError):
            eng.transfer_sync(mitm.address, Op.WRITE, [(int(local.ctypes.data), target.addrs[1], BLOCK)])
        assert mitm.command(flips=1) == 1
        assert target.read(1, 0, BLOCK) == before  # byte for byte untouched
    else:
        eng.transfer_sync(mitm.address, Op.WRITE, [(int(local.ctypes.data), target.addrs[1], BLOCK)])
        assert mitm.command(flips=1) == 1
        landed = np.frombuffer(target.read(1, 0, BLOCK), np.uint8)
        assert int(np.unpackbits(landed ^ local[:BLOCK]).sum()) == 1
    _still_serves(hosts, target, encrypt)


def test_after_a_relayed_handshake_the_relay_cannot_slip_in_a_write(hosts, initiator, mitm: Mitm, target: TargetProcess, encrypt: bool) -> None:
    """The relay forwarded the handshake, so it holds a connection both engines authenticated —
    but not its keys: a WRITE frame of its own (or anything else it sends) is refused."""
    eng, local = initiator
    eng.transfer_sync(mitm.address, Op.READ, [(int(local.ctypes.data), target.addrs[0], 8)])  # (the link works)
    before = target.read(1, 2 * BLOCK, 4096)
    mitm.command(inject_write=[target.addrs[1] + 2 * BLOCK, 4096, 0xEE])
    if encrypt:
        # The target finds a record that is no record, tells this end so and closes the connection;
        # its memory is untouched.
        deadline = time.monotonic() + 10
        with pytest.raises(IntegrityError):
            while time.monotonic() < deadline:  # (until the target's refusal reaches this end)
                eng.transfer_sync(mitm.address, Op.READ, [(int(local.ctypes.data), target.addrs[0], 8)])
                time.sleep(0.01)
        assert target.read(1, 2 * BLOCK, 4096) == before
    else:
        _wait_for(lambda: target.read(1, 2 * BLOCK, 4096) == b"\xee" * 4096)  # the forged WRITE landed
    _still_serves(hosts, target, encrypt)


def _still_serves(hosts: Hosts, target: TargetProcess, encrypt: bool) -> None:
    """Whatever that connection met, the target serves others as before."""
    with Engine(hosts[2].ip, {"auth_secret": SECRET, "encrypt": encrypt, "transport": "tcp"}) as other:
        buf = hixl.empty(4096)
        other.register_mem(buf)
        other.connect(target.engine)
        other.transfer_sync(target.engine, Op.READ, [(int(buf.ctypes.data), target.addrs[0], 4096)])
        assert buf.tobytes() == target.read(0, 0, 4096)


def _wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "it did not happen in time"
        time.sleep(0.02)
