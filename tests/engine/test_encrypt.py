"""Encrypted links (``encrypt=True``) over 127.0.0.1, with real processes: every kind of traffic
arrives byte for byte — READ and WRITE, small and large, one range and many, sync and async,
notifications, either engine initiating — over a link whose bytes are sealed records; an engine
that encrypts refuses one that does not, in either role, and nothing falls back to plaintext.
What a man in the middle can do to such a link: tests/hosts/test_encrypt_mitm.py."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import hixl
from hixl import (
    EncryptionMismatch,
    Engine,
    NotifyDesc,
    Op,
    ParamInvalid,
    TransferStatus,
    _accel,
)
from hixl._protocol import seal
from hixl.testing import TargetProcess

pytestmark = pytest.mark.timeout(90)

SECRET = "correct horse battery staple"
SEALED = {"auth_secret": SECRET, "encrypt": True}
SIZE = 8 << 20


@pytest.fixture(scope="module")
def target() -> TargetProcess:
    """An encrypting target with two buffers: the first random (to READ), the second to WRITE into.
    When it initiates, it does so over TCP."""
    with TargetProcess([SIZE, SIZE], {**SEALED, "transport": "tcp"}) as tp:
        tp.fill(0, 5)
        yield tp


@pytest.fixture
def engine(target: TargetProcess) -> tuple[Engine, np.ndarray]:
    """An encrypting initiator (over TCP) connected to ``target``, with a registered buffer."""
    with Engine("127.0.0.1", {**SEALED, "transport": "tcp"}) as eng:
        local = hixl.empty(SIZE)
        eng.register_mem(local)
        eng.connect(target.engine)
        yield eng, local


def _link(eng: Engine, name: str) -> Any:
    """White-box: the link to ``name`` (its wire, its latency path)."""
    return eng._peers[name].link


# Sizes about the records' edges: one byte, a latency-path size, exactly one record, one byte
# more, and many records ending mid-record.
SIZES = [1, 8, 4096, seal.RECORD_MAX, seal.RECORD_MAX + 1, 3 * seal.RECORD_MAX - 7, (5 << 20) + 13]


@pytest.mark.parametrize("nbytes", SIZES)
def test_reads_arrive_byte_for_byte(engine, target, nbytes: int) -> None:
    eng, local = engine
    local[:nbytes] = 0
    eng.transfer_sync(target.engine, Op.READ, [(int(local.ctypes.data), target.addrs[0] + 3, nbytes)])
    assert local[:nbytes].tobytes() == target.read(0, 3, nbytes)


@pytest.mark.parametrize("nbytes", SIZES)
def test_writes_arrive_byte_for_byte(engine, target, nbytes: int) -> None:
    eng, local = engine
    local[:nbytes] = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    eng.transfer_sync(target.engine, Op.WRITE, [(int(local.ctypes.data), target.addrs[1] + 5, nbytes)])
    assert target.read(1, 5, nbytes) == local[:nbytes].tobytes()


@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
def test_many_scattered_ranges_in_one_request(engine, target, op: Op) -> None:
    """A paged KV cache's shape: blocks shuffled on both sides, of sizes that straddle records."""
    eng, local = engine
    rng = np.random.default_rng(11)
    block, count = 5000, 600  # (not a multiple of 8, nor of a record)
    mine, theirs = rng.permutation(count), rng.permutation(count)
    descs = np.stack([int(local.ctypes.data) + mine * block, target.addrs[op] + theirs * block, np.full(count, block)], axis=1)
    if op is Op.WRITE:
        local[: count * block] = rng.integers(0, 256, count * block, dtype=np.uint8)
    else:
        local[: count * block] = 0
    eng.transfer_sync(target.engine, op, descs.astype(np.uint64))
    index = 0 if op is Op.READ else 1
    remote = target.read(index, 0, count * block)
    for m, t in zip(mine[:50], theirs[:50]):  # (a sample: each read is a round trip to the child)
        assert local[m * block : (m + 1) * block].tobytes() == remote[t * block : (t + 1) * block]


def test_async_requests_in_flight_together(engine, target) -> None:
    eng, local = engine
    size = 1 << 20
    local[: 4 * size] = 0
    reqs = [
        eng.transfer_async(target.engine, Op.READ, [(int(local.ctypes.data) + k * size, target.addrs[0] + k * size, size)])
        for k in range(4)
    ]
    local[4 * size : 6 * size] = 0x5A
    reqs.append(eng.transfer_async(target.engine, Op.WRITE, [(int(local.ctypes.data) + 4 * size, target.addrs[1], 2 * size)]))
    for req in reqs:
        req.wait(30)
        assert req.status is TransferStatus.COMPLETED
    assert local[: 4 * size].tobytes() == target.read(0, 0, 4 * size)
    assert target.read(1, 0, 2 * size) == b"\x5a" * (2 * size)


def test_notifications_arrive(engine, target) -> None:
    eng, local = engine
    target.notifies()
    local[:4096] = 7
    eng.transfer_sync(target.engine, Op.WRITE, [(int(local.ctypes.data), target.addrs[1], 4096)])
    eng.send_notify(target.engine, NotifyDesc("kv ready", "layer 3"))
    notes, seen = target.wait_notifies(10, 1, 0, 4096)
    assert notes == [("kv ready", "layer 3")]
    assert seen == b"\x07" * 4096  # (the notification came after the WRITE's data, as on plaintext links)


def test_the_target_initiates_too(target) -> None:
    """This process listens, encrypting; the target process connects to it and moves bytes both ways."""
    with Engine("127.0.0.1:0", SEALED) as here:
        mine = hixl.empty(1 << 20)
        mine[:] = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)
        here.register_mem(mine)
        target.call("connect", here.local_engine)
        try:
            assert target.call("transport_of", here.local_engine) == "tcp"
            target.call("transfer_sync", here.local_engine, Op.READ, [(target.addrs[1], int(mine.ctypes.data), 1 << 20)])
            assert target.read(1, 0, 1 << 20) == mine.tobytes()
            target.call("transfer_sync", here.local_engine, Op.WRITE, [(target.addrs[0], int(mine.ctypes.data), 4096)])
            assert mine[:4096].tobytes() == target.read(0, 0, 4096)
        finally:
            target.call("disconnect", here.local_engine)


# -- sealed, and only sealed -------------------------------------------------------------------------
def test_the_link_is_sealed_and_takes_no_plaintext_fast_path(engine, target) -> None:
    eng, _ = engine
    link = _link(eng, target.engine)
    assert link.wire.seal is not None
    assert link.compiled_exchange() is None


def test_a_plaintext_link_keeps_its_fast_path() -> None:
    with TargetProcess([4096]) as plain, Engine("127.0.0.1", {"transport": "tcp"}) as eng:
        eng.connect(plain.engine)
        link = _link(eng, plain.engine)
        assert link.wire.seal is None
        assert (link.compiled_exchange() is not None) == _accel.NATIVE


def test_same_host_copies_stay_as_they_are_and_the_socket_beside_them_is_sealed(target) -> None:
    """transport="auto": cma is still chosen on the same host (the kernel is the boundary); the
    link's own socket, which carries its control frames, is sealed."""
    with Engine("127.0.0.1", SEALED) as eng:
        local = hixl.empty(4096)
        eng.register_mem(local)
        eng.connect(target.engine)
        assert eng.transport_of(target.engine) == "cma"
        assert _link(eng, target.engine).wire.seal is not None
        eng.transfer_sync(target.engine, Op.READ, [(int(local.ctypes.data), target.addrs[0], 4096)])
        assert local.tobytes() == target.read(0, 0, 4096)


@pytest.mark.parametrize(("initiator", "target_options"), [(SEALED, {"auth_secret": SECRET}), ({"auth_secret": SECRET}, SEALED)], ids=["only-the-initiator-encrypts", "only-the-target-encrypts"])
def test_an_encrypting_engine_refuses_a_plaintext_link_in_either_role(initiator: dict, target_options: dict, caplog) -> None:
    with TargetProcess([4096], target_options) as other, Engine("127.0.0.1", initiator) as eng:
        with pytest.raises(EncryptionMismatch, match="encrypt"):
            eng.connect(other.engine)
        assert eng.connected_engines() == []
        _wait_for(lambda: other.call("served_connections") == {})  # (the target dropped it too)


def test_a_target_refuses_an_initiator_that_does_not_encrypt_and_logs_why(caplog) -> None:
    with (
        caplog.at_level(logging.WARNING, logger="hixl"),
        Engine("127.0.0.1:0", SEALED) as here,
        TargetProcess([4096], {"auth_secret": SECRET}) as plain,
        pytest.raises(EncryptionMismatch),
    ):
        plain.call("connect", here.local_engine)
    assert any("refused" in r.getMessage() and "encrypt=True" in r.getMessage() for r in caplog.records)


def test_encrypt_needs_a_secret(monkeypatch) -> None:
    monkeypatch.delenv("HIXL_AUTH_SECRET", raising=False)
    with pytest.raises(ParamInvalid, match="encrypt needs auth_secret"):
        Engine("127.0.0.1", {"encrypt": True})
    with pytest.raises(ParamInvalid, match="encrypt must be True or False"):
        Engine("127.0.0.1", {"auth_secret": SECRET, "encrypt": "yes"})


def test_an_engine_that_does_not_encrypt_never_imports_cryptography() -> None:
    """encrypt is an extra: the base install stays numpy-only."""
    code = "import sys, hixl; hixl.Engine('127.0.0.1:0').finalize(); print(sorted(m for m in sys.modules if 'cryptography' in m))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"


def test_encrypt_without_cryptography_says_what_to_install() -> None:
    code = (
        "import sys; sys.modules['cryptography'] = None  # (as if it were not installed)\n"
        "import hixl\n"
        "try:\n    hixl.Engine('127.0.0.1', {'auth_secret': 's', 'encrypt': True})\n"
        "except hixl.Unsupported as exc:\n    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "pip install hixl[encrypt]" in done.stdout


def _wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "it did not happen in time"
        time.sleep(0.02)
