""""Deregistered" means no peer touches that memory again: deregistration waits for requests
being served in it and for peers' confirmations (cutting off those that don't), same-host copies
stop before it returns, cancel() stops a request, and a restarted peer is a new peer. Checked in
the target's memory after it was "reused" (written with a new pattern)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest

import hixl
from hixl import Engine, MemoryRangeError, Op, PeerDisconnected, TransferCancelled, TransferStatus
from hixl import _protocol as proto
from hixl.testing import ScriptedPeer, ScriptedTarget, TargetProcess

pytestmark = pytest.mark.timeout(90)

MakeTarget = Callable[..., TargetProcess]
MiB = 1 << 20
REUSED = 0x77


def _timed(fn: Callable[[], object]) -> float:
    start = time.monotonic()
    fn()
    return time.monotonic() - start


# -- TCP: the target serves requests itself ---------------------------------------------------------
def test_a_write_being_served_holds_its_region_until_cut_off(make_target: MakeTarget) -> None:
    """A WRITE stalls mid-data; deregistration waits for it (deregister_timeout), cuts it off, and
    no byte the peer sends afterwards lands in the (reused) memory."""
    target = make_target([4 * MiB], {"deregister_timeout": 1.0})
    target.write(0, 0, b"\x11" * (4 * MiB))
    peer = ScriptedPeer.connect(target.engine)
    peer.handshake()
    descs = np.array([[target.addrs[0], 4 * MiB]], dtype=np.uint64)
    peer.send(proto.WriteRequest(1, descs, 4 * MiB), b"\x22" * (100 << 10))
    time.sleep(0.2)  # the serving thread lands those 100 KiB and waits for more
    took = _timed(lambda: target.deregister(0))
    assert 0.9 < took < 3.0, f"deregister_mem returned after {took:.2f} s"
    target.write(0, 0, bytes([REUSED]) * (4 * MiB))  # the memory is reused at once
    try:
        peer.send_raw(b"\x33" * (4 * MiB - (100 << 10)))
    except OSError:
        pass  # cut off: the target closed the connection
    time.sleep(0.5)
    assert target.read(0, 0, 4 * MiB) == bytes([REUSED]) * (4 * MiB)
    peer.close()


def test_a_read_being_served_is_cut_off_before_reused_memory_is_sent(make_target: MakeTarget) -> None:
    """A READ whose peer does not read: the reply stalls in the target's send; deregistration cuts
    it off, and what the peer reads afterwards never contains the memory's new contents."""
    size = 64 * MiB
    target = make_target([size], {"deregister_timeout": 1.0})
    target.write(0, 0, b"\x11" * size)
    peer = ScriptedPeer.connect(target.engine)
    peer.handshake()
    peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    peer.send(proto.ReadRequest(1, np.array([[target.addrs[0], size]], dtype=np.uint64)))
    time.sleep(0.3)  # the reply fills the socket buffers and stalls
    took = _timed(lambda: target.deregister(0))
    assert 0.9 < took < 3.0, f"deregister_mem returned after {took:.2f} s"
    target.write(0, 0, bytes([REUSED]) * size)
    got = bytearray()
    peer.sock.settimeout(5)
    try:
        while chunk := peer.sock.recv(1 << 20):
            got += chunk
    except OSError:
        pass
    assert len(got) < size + 100, "the whole reply went out: the request was not cut off"
    assert REUSED not in got, "bytes written after deregister_mem returned were sent to the peer"
    peer.close()


def test_an_idle_region_is_deregistered_at_once_with_peers_connected(make_target: MakeTarget) -> None:
    target = make_target([MiB, MiB], {"deregister_timeout": 5.0})
    with Engine("127.0.0.1", {"transport": "tcp"}) as a, Engine("127.0.0.1", {"transport": "cma"}) as b:
        a.connect(target.engine)
        b.connect(target.engine)
        assert _timed(lambda: target.deregister(0)) < 1.0  # both confirm at once
        buf = hixl.empty(MiB)
        for eng in (a, b):
            eng.register_mem(buf)
            with pytest.raises(MemoryRangeError):
                eng.transfer_sync(target.engine, Op.READ, [(int(buf.ctypes.data), target.addrs[0], 8)])
            eng.transfer_sync(target.engine, Op.READ, [(int(buf.ctypes.data), target.addrs[1], 8)])


def test_a_peer_that_does_not_confirm_is_disconnected(make_target: MakeTarget) -> None:
    target = make_target([MiB, MiB], {"deregister_timeout": 1.0})
    peer = ScriptedPeer.connect(target.engine)
    peer.handshake()  # and then never answers a REVOKE
    took = _timed(lambda: target.deregister(0))
    assert 0.9 < took < 3.0
    frames = peer.expect_closed(timeout=5)
    assert any(isinstance(f, proto.Revoke) for f in frames)
    with Engine("127.0.0.1") as eng:  # everyone else is still served
        eng.connect(target.engine)


# -- cma: the initiator copies, the target's CPU takes no part -----------------------------------------
def _scattered(local: int, remote: int, size: int, block: int = 4096) -> np.ndarray:
    """Every other block, so that nothing merges: many syscalls, each a chance to be stopped."""
    offsets = np.arange(0, size, 2 * block, dtype=np.uint64)
    return np.stack([local + offsets, remote + offsets, np.full(len(offsets), block, np.uint64)], axis=1)


@contextmanager
def _same_host(target: TargetProcess, size: int, transport: str) -> Iterator[tuple[Engine, np.ndarray, hixl.MemDesc]]:
    """An engine connected to ``target`` over ``transport`` (cma or shm) with three copy lanes (so a
    window of the copies below is split over threads), a registered local buffer of ``size`` bytes,
    and the target's first region (which the test deregisters and registers again)."""
    with Engine("127.0.0.1", {"transport": transport, "copy_lanes": 3}) as eng:
        buf = hixl.empty(size)
        eng.register_mem(buf)
        eng.connect(target.engine)
        yield eng, buf, hixl.MemDesc(target.addrs[0], size)


def _assert_nothing_after(op: Op, target: TargetProcess, buf: np.ndarray, size: int) -> None:
    """No copy landed in (WRITE) or read (READ) the target's memory once it was deregistered and reused."""
    if op is Op.WRITE:
        assert target.read(0, 0, size) == bytes([REUSED]) * size, "a copy landed after deregister_mem"
    else:
        assert REUSED not in buf, "a copy read memory after deregister_mem returned"


@pytest.mark.parametrize("transport", ["cma", "shm"])
@pytest.mark.parametrize("op", [Op.WRITE, Op.READ])
def test_same_host_copies_stop_before_deregistration_returns(make_target: MakeTarget, op: Op, transport: str) -> None:
    size = 64 * MiB
    target = make_target([size])
    with _same_host(target, size, transport) as (eng, buf, region):
        handle = target.call("register_mem", region)  # the registration it made (idempotent)
        outcomes = []
        for _ in range(3):
            buf[:] = 0x22
            target.write(0, 0, b"\x11" * size)
            req = eng.transfer_async(target.engine, op, _scattered(int(buf.ctypes.data), target.addrs[0], size))
            target.call("deregister_mem", handle)
            target.write(0, 0, bytes([REUSED]) * size)  # reused the moment deregister_mem returned
            try:
                req.wait(30)
            except MemoryRangeError:
                pass  # stopped mid-way: the region went away under it
            outcomes.append(req.status)
            _assert_nothing_after(op, target, buf, size)
            handle = target.call("register_mem", region)
        # Which ones were cut short varies; the invariant above is what counts — and that each ended.
        assert all(status in (TransferStatus.COMPLETED, TransferStatus.FAILED) for status in outcomes), outcomes


@pytest.mark.parametrize("transport", ["cma", "shm"])
@pytest.mark.parametrize("op", [Op.WRITE, Op.READ])
def test_parallel_same_host_copies_to_one_peer_all_stop_before_deregistration_returns(
    make_target: MakeTarget, op: Op, transport: str
) -> None:
    """Four threads copy to one peer at once (same-host copies share the link's lease, each of
    their windows split over lanes); a deregistration waits for every one of them, and none touches
    the memory once it has returned."""
    threads, part = 4, 8 * MiB
    size = threads * part
    target = make_target([size])
    with _same_host(target, size, transport) as (eng, buf, region):
        handle = target.call("register_mem", region)
        for _ in range(2):
            buf[:] = 0x22
            target.write(0, 0, b"\x11" * size)
            stop, copies = threading.Event(), [0] * threads

            def copy(i: int) -> None:
                descs = _scattered(int(buf.ctypes.data) + i * part, target.addrs[0] + i * part, part)
                while not stop.is_set():
                    try:
                        eng.transfer_sync(target.engine, op, descs, timeout=30)
                    except MemoryRangeError:
                        return  # the region went away under it (or before it started)
                    copies[i] += 1

            workers = [threading.Thread(target=copy, args=(i,)) for i in range(threads)]
            for worker in workers:
                worker.start()
            time.sleep(0.3)  # all of them copying
            target.call("deregister_mem", handle)
            target.write(0, 0, bytes([REUSED]) * size)  # reused the moment deregister_mem returned
            if op is Op.READ:
                buf[:] = 0x22  # what they read before it returned may hold anything; from now on, nothing
            time.sleep(0.2)  # any copy still running would land now
            stop.set()
            for worker in workers:
                worker.join(30)
            assert all(copies), f"some thread never copied: {copies}"
            _assert_nothing_after(op, target, buf, size)
            handle = target.call("register_mem", region)


# -- cancel -------------------------------------------------------------------------------------------
def test_cancel_stops_a_tcp_read_mid_data() -> None:
    go_on = threading.Event()
    region = (0x7000_0000_0000, 4 * MiB)

    def script(peer: ScriptedPeer) -> None:
        peer.accept_handshake([(*region, 1)])
        read = peer.recv()
        peer.send(proto.Data(read.req_id, 4 * MiB), b"\x01" * MiB)
        go_on.wait(10)
        peer.send_raw(b"\x02" * 3 * MiB)
        final = peer.recv()
        peer.send(proto.Data(final.req_id, 8), b"\x03" * 8)
        peer.expect_closed()

    with ScriptedTarget(script) as fake, Engine("127.0.0.1", {"transport": "tcp"}) as eng:
        buf = hixl.empty(5 * MiB)
        eng.register_mem(buf)
        eng.connect(fake.engine)
        req = eng.transfer_async(fake.engine, Op.READ, [(int(buf.ctypes.data), region[0], 4 * MiB)], timeout=20)
        deadline = time.monotonic() + 5
        while buf[MiB - 1] != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert req.cancel() is TransferStatus.FAILED
        with pytest.raises(TransferCancelled):
            req.wait()
        seen = buf[: 4 * MiB].copy()
        go_on.set()
        eng.transfer_sync(fake.engine, Op.READ, [(int(buf.ctypes.data) + 4 * MiB, region[0], 8)], timeout=10)
        assert buf[4 * MiB : 4 * MiB + 8].tobytes() == b"\x03" * 8  # the link carried on
        assert np.array_equal(buf[: 4 * MiB], seen), "bytes landed after cancel() returned"


@pytest.mark.parametrize("transport", ["cma", "shm", "tcp"])
def test_nothing_of_a_cancelled_write_lands_after_cancel_returns(make_target: MakeTarget, transport: str) -> None:
    size = 128 * MiB
    target = make_target([size])
    with Engine("127.0.0.1", {"transport": transport}) as eng:
        buf = hixl.empty(size)
        buf[:] = 0x22
        eng.register_mem(buf)
        eng.connect(target.engine)
        req = eng.transfer_async(target.engine, Op.WRITE, _scattered(int(buf.ctypes.data), target.addrs[0], size))
        status = req.cancel()
        assert status in (TransferStatus.FAILED, TransferStatus.COMPLETED)
        before = target.read(0, 0, size)
        time.sleep(0.5)
        assert target.read(0, 0, size) == before, "bytes landed after cancel() returned"


# -- incarnations ---------------------------------------------------------------------------------------
def test_a_restarted_peer_is_a_new_peer() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"127.0.0.1:{port}"
    with Engine("127.0.0.1", {"transport": "tcp", "connect_timeout": 10}) as eng:
        buf = hixl.empty(MiB)
        eng.register_mem(buf)
        first = TargetProcess([MiB], address=address)
        try:
            eng.connect(address)
            old = eng.peer_incarnation(address)
            old_addr = first.addrs[0]
            first.kill()
            with pytest.raises(PeerDisconnected):
                eng.transfer_sync(address, Op.READ, [(int(buf.ctypes.data), old_addr, 8)], timeout=5)
        finally:
            first.close()
        with TargetProcess([2 * MiB], address=address) as second:
            eng.connect(address)  # replaces the broken link
            assert eng.peer_incarnation(address) != old
            regions = eng.remote_mems(address)
            assert [r.addr for r in regions] == [second.addrs[0]]
            second.fill(0, 4)
            eng.transfer_sync(address, Op.READ, [(int(buf.ctypes.data), second.addrs[0], MiB)])
            assert buf.tobytes() == TargetProcess.expected(2 * MiB, 4)[:MiB].tobytes()


@pytest.mark.parametrize("transport", ["cma", "shm"])
def test_a_deregistration_waits_for_one_chunk_of_a_large_same_host_copy_not_all_of_it(
    make_target: MakeTarget, transport: str
) -> None:
    """A 1 GiB READ holds the link's lease a chunk at a time (16 MiB): a REVOKE for another region
    that arrives in the middle of it is confirmed within a chunk, not at the end of the copy."""
    size = 1 << 30
    target = TargetProcess([size, 4096], shared=transport == "shm")
    try:
        with Engine("127.0.0.1", {"transport": transport}) as eng:
            buf = hixl.empty(size)
            eng.register_mem(buf)
            eng.connect(target.engine)
            descs = [(int(buf.ctypes.data), target.addrs[0], size)]
            start = time.monotonic()
            eng.transfer_sync(target.engine, Op.READ, descs)
            whole = time.monotonic() - start
            req = eng.transfer_async(target.engine, Op.READ, descs)
            time.sleep(whole / 5)
            start = time.monotonic()
            target.deregister(1)
            took = time.monotonic() - start
            assert req.wait(30) is TransferStatus.COMPLETED
        assert took < whole / 2, f"the REVOKE waited {took * 1e3:.0f} ms of a {whole * 1e3:.0f} ms copy"
    finally:
        target.close()
