"""The raw baselines must move the right bytes, or their ratios mean nothing."""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from hixl import Op, empty
from hixl.bench.baselines import (
    GIL_HELD_BELOW,
    IOV_MAX,
    RawStream,
    _cma_call,
    cma_batch_copier,
    cma_copier,
    cma_lanes_copier,
    gather_copier,
    memcpy_copier,
    proc_mem_copier,
)
from hixl.bench.streaming_memcpy import NON_TEMPORAL_FROM, StreamingMemcpy, _tunables, streaming_stores_here
from hixl.bench.target import STREAM_LOWAT_FROM, BenchTarget, recv_exact, sample_bytes

pytestmark = pytest.mark.timeout(60)

SIZE = 256 << 10
SEED = 5


@pytest.fixture(scope="module")
def target() -> Iterator[BenchTarget]:
    with BenchTarget() as t:
        yield t


def _cma_allowed(target: BenchTarget, local: np.ndarray, remote_addr: int) -> bool:
    try:
        cma_copier(target.pid, Op.READ, int(local.ctypes.data), remote_addr, 16)()
    except OSError:
        return False
    return True


def test_raw_stream_reads_and_writes_the_target_buffer(target: BenchTarget) -> None:
    remote = target.alloc(SIZE, SEED)
    local = empty(SIZE)
    stream = RawStream(target.raw_address)
    try:
        stream.copier(Op.READ, local.data, remote.addr)()
        assert np.array_equal(local[: len(sample_bytes(SEED, SIZE))], sample_bytes(SEED, SIZE))
        assert local[-1] == 0x5A  # the fill after the sample
        local[:] = 7
        stream.copier(Op.WRITE, local[100:200].data, remote.addr + 100)()
        assert target.read(remote, 96, 108) == bytes(sample_bytes(SEED, SIZE)[96:100]) + b"\x07" * 100 + bytes(
            sample_bytes(SEED, SIZE)[200:204]
        )
    finally:
        stream.close()
        target.free(remote)


def test_the_round_trip_baseline_echoes_eight_bytes(target: BenchTarget) -> None:
    echo = RawStream(target.raw_address, echo=True)
    try:
        round_trip = echo.round_trip()
        for _ in range(100):
            round_trip()  # each call waits for the 8-byte answer: a lost one would hang, then time out
        echo.sock.send(b"12345678")
        assert echo.sock.recv(8, 0) == b"12345678"
    finally:
        echo.close()


def test_cma_copiers_move_single_ranges_and_scattered_blocks(target: BenchTarget) -> None:
    remote = target.alloc(SIZE, SEED)
    local = empty(SIZE)
    try:
        if not _cma_allowed(target, local, remote.addr):
            pytest.skip("process_vm_readv is not permitted here")
        cma_copier(target.pid, Op.READ, int(local.ctypes.data), remote.addr, SIZE)()
        expected = sample_bytes(SEED, SIZE)
        assert np.array_equal(local[: len(expected)], expected)

        block, blocks = 4096, 16
        order = np.random.default_rng(0).permutation(blocks).astype(np.uint64)
        local_iov = np.stack([local.ctypes.data + order * block, np.full(blocks, block, dtype=np.uint64)], axis=1)
        remote_iov = np.stack([remote.addr + np.arange(blocks, dtype=np.uint64) * block, local_iov[:, 1]], axis=1)
        local[:] = 0
        cma_batch_copier(target.pid, Op.READ, local_iov, remote_iov)()
        for i, slot in enumerate(order):
            start = int(slot) * block
            assert np.array_equal(local[start : start + block], expected[i * block : (i + 1) * block])

        # Split over lanes: more iovecs than one call takes (IOV_MAX), in runs over three threads.
        small = 16  # (all within the SAMPLE bytes whose pattern is known)
        count = 2 * IOV_MAX + 5
        order = np.random.default_rng(1).permutation(count).astype(np.uint64)
        local_iov = np.stack([local.ctypes.data + order * small, np.full(count, small, dtype=np.uint64)], axis=1)
        remote_iov = np.stack([remote.addr + np.arange(count, dtype=np.uint64) * small, local_iov[:, 1]], axis=1)
        local[:] = 0
        cma_batch_copier(target.pid, Op.READ, local_iov, remote_iov, lanes=3)()
        for i, slot in enumerate(order):
            start = int(slot) * small
            assert np.array_equal(local[start : start + small], expected[i * small : (i + 1) * small])
        with pytest.raises(OSError):  # a lane's failure reaches the caller
            cma_batch_copier(target.pid, Op.READ, local_iov, remote_iov + np.array([1 << 63, 0], dtype=np.uint64), lanes=3)()  # (not user space)

        local[:] = 9
        cma_copier(target.pid, Op.WRITE, int(local.ctypes.data), remote.addr + 8, 32)()
        assert target.read(remote, 8, 32) == b"\x09" * 32
    finally:
        target.free(remote)


def test_the_proc_mem_copier_reads_and_writes_one_small_range(target: BenchTarget) -> None:
    remote = target.alloc(SIZE, SEED)
    local = empty(SIZE)
    try:
        try:
            read = proc_mem_copier(target.pid, Op.READ, int(local.ctypes.data) + 1, remote.addr + 3, 4096)
        except OSError:
            pytest.skip("/proc/<pid>/mem is not permitted here")
        local[:] = 0
        read()
        assert np.array_equal(local[1:4097], sample_bytes(SEED, SIZE)[3:4099]) and local[0] == 0 and local[4097] == 0
        local[:] = 6
        proc_mem_copier(target.pid, Op.WRITE, int(local.ctypes.data), remote.addr + 8, 8)()
        assert target.read(remote, 7, 10) == bytes(sample_bytes(SEED, SIZE)[7:8]) + b"\x06" * 8 + bytes(
            sample_bytes(SEED, SIZE)[16:17]
        )
        with pytest.raises(OSError):  # an address the target has not mapped
            proc_mem_copier(target.pid, Op.READ, int(local.ctypes.data), 1 << 46, 8)()
    finally:
        target.free(remote)


@pytest.mark.parametrize(("nbytes", "lanes"), [(SIZE, 3), (SIZE - 3, 2), (5000, 4)])
def test_the_lanes_copier_moves_one_range_in_parts(target: BenchTarget, nbytes: int, lanes: int) -> None:
    remote = target.alloc(SIZE, SEED)
    local = empty(SIZE)
    try:
        if not _cma_allowed(target, local, remote.addr):
            pytest.skip("process_vm_readv is not permitted here")
        before = np.frombuffer(target.read(remote, 0, SIZE), dtype=np.uint8).copy()
        local[:] = 0
        cma_lanes_copier(target.pid, Op.READ, int(local.ctypes.data), remote.addr, nbytes, lanes)()
        assert np.array_equal(local[:nbytes], before[:nbytes]) and not local[nbytes:].any()
        pattern = np.random.default_rng(nbytes).integers(0, 256, SIZE, dtype=np.uint8)
        local[:] = pattern
        cma_lanes_copier(target.pid, Op.WRITE, int(local.ctypes.data), remote.addr, nbytes, lanes)()
        after = np.frombuffer(target.read(remote, 0, SIZE), dtype=np.uint8)
        assert np.array_equal(after[:nbytes], pattern[:nbytes]) and np.array_equal(after[nbytes:], before[nbytes:])
    finally:
        target.free(remote)


def test_memcpy_copier() -> None:
    src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    memcpy_copier(dst, src)()
    assert np.array_equal(dst, src)


def test_gather_copier_moves_the_blocks_in_the_order_given() -> None:
    src = np.arange(8 * 16, dtype=np.uint8).reshape(8, 16)
    dst = np.zeros((8, 16), dtype=np.uint8)
    order = np.array([3, 1, 7, 0, 6, 2, 5, 4])
    gather_copier(dst, src, order)()
    assert np.array_equal(dst, src[order])


def test_the_target_maps_its_pool_buffer_here(target: BenchTarget) -> None:
    """What shm's baselines copy: the target's very memory, through its memfd."""
    remote = target.alloc(SIZE, SEED, shared=True)
    try:
        mapped = target.mapped(remote)
        assert np.array_equal(mapped[: len(sample_bytes(SEED, SIZE))], sample_bytes(SEED, SIZE))
        mapped[:4] = 0xAB
        assert target.read(remote, 0, 4) == b"\xab" * 4
        del mapped
    finally:
        target.free(remote)


def _loader() -> str | None:
    """The x86-64 dynamic loader, which lists glibc's tunables as a process started so would see them."""
    path = "/lib64/ld-linux-x86-64.so.2"
    return path if streaming_stores_here() and os.path.exists(path) else None


@pytest.mark.skipif(_loader() is None, reason="glibc's streaming-store threshold is an x86-64 tunable")
def test_the_helpers_glibc_takes_the_lowered_streaming_threshold() -> None:
    """glibc ignores a tunable it finds out of bounds, silently (its least, 0x4040, is one):
    the helper must start with a value its glibc really uses, or it copies like plain memcpy."""
    env = {**os.environ, "GLIBC_TUNABLES": _tunables()}
    listing = subprocess.run([str(_loader()), "--list-tunables"], env=env, capture_output=True, text=True, check=True)
    (line,) = [ln for ln in listing.stdout.splitlines() if ln.startswith("glibc.cpu.x86_non_temporal_threshold:")]
    assert int(line.split()[1], 16) == NON_TEMPORAL_FROM, line


def test_the_streaming_memcpy_helper_copies_the_targets_pool_buffer(target: BenchTarget) -> None:
    """READ lands the target's bytes in the helper's private memory, WRITE the helper's in the target's."""
    size = NON_TEMPORAL_FROM + 3 * 4096 + 77  # large enough to stream, a ragged end
    remote = target.alloc(size, SEED, shared=True)
    try:
        with StreamingMemcpy(target.memfd_path(remote), size, fill=0x3C) as helper:
            assert helper.copier(Op.WRITE, size - 100).run(1) > 0
            assert target.read(remote, 0, 4096) == b"\x3c" * 4096
            assert target.read(remote, size - 100, 100) == b"\x5a" * 100  # past the copy: untouched
            pattern = sample_bytes(SEED, size)  # back into the target's buffer, through a mapping of ours
            target.mapped(remote)[: len(pattern)] = pattern
            assert helper.copier(Op.READ, size).run(2) > 0
            assert helper.private(0, len(pattern)) == pattern.tobytes()
            assert helper.private(size - 100, 100) == b"\x5a" * 100
    finally:
        target.free(remote)


def test_target_reports_failures(target: BenchTarget) -> None:
    with pytest.raises(RuntimeError, match="could not free"):
        target._do("free", 12345)


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two connected, blocking TCP sockets on 127.0.0.1 (the path the raw stream takes)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname(), timeout=10)
        server, _ = listener.accept()
    client.settimeout(10)
    server.settimeout(10)
    return client, server


def _lowat(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)


def test_recv_exact_fills_a_large_message_and_leaves_the_low_water_mark_at_one() -> None:
    client, server = _tcp_pair()
    with client, server:
        message = np.random.default_rng(3).integers(0, 256, STREAM_LOWAT_FROM + 12345, dtype=np.uint8)
        into = np.zeros_like(message)
        sender = threading.Thread(target=server.sendall, args=(message.data,))
        sender.start()
        assert recv_exact(client, into.data)
        sender.join()
        assert np.array_equal(into, message)
        assert _lowat(client) == 1  # a 1-byte ack read next must not wait for 256 KiB
        server.sendall(b"\x01")
        assert client.recv(1) == b"\x01"


def test_recv_exact_tells_a_clean_end_from_one_mid_message() -> None:
    client, server = _tcp_pair()
    with client:
        server.close()
        assert recv_exact(client, memoryview(bytearray(8))) is False
    for size in (8, STREAM_LOWAT_FROM + 1):  # below and above the size that raises the mark
        client, server = _tcp_pair()
        with client:
            server.sendall(b"x" * (size // 2))
            server.close()
            with pytest.raises(ConnectionError, match="mid-message"):
                recv_exact(client, memoryview(bytearray(size)))
            assert _lowat(client) == 1


def test_raw_stream_moves_transfers_larger_than_the_low_water_mark_both_ways(target: BenchTarget) -> None:
    size = STREAM_LOWAT_FROM + 4099  # not a multiple of anything the stream chunks by
    remote = target.alloc(size + 4096, SEED)
    local = empty(size + 4096)
    stream = RawStream(target.raw_address, timeout=10)  # a stuck read raises TimeoutError, not hangs
    try:
        stream.copier(Op.READ, local[:size].data, remote.addr)()
        assert np.array_equal(local[: len(sample_bytes(SEED, size))], sample_bytes(SEED, size))
        assert (local[len(sample_bytes(SEED, size)) : size] == 0x5A).all()
        assert _lowat(stream.sock) == 1
        pattern = np.random.default_rng(4).integers(0, 256, size, dtype=np.uint8)
        local[:size] = pattern
        stream.copier(Op.WRITE, local[:size].data, remote.addr)()  # its ack: read at mark 1
        assert target.read(remote, 0, size) == pattern.tobytes()
        stream.copier(Op.READ, local[:8].data, remote.addr + 8)()  # the server's mark is back at 1 too
        assert local[:8].tobytes() == pattern[8:16].tobytes()
    finally:
        stream.close()
        target.free(remote)


def test_raw_stream_times_out_instead_of_hanging() -> None:
    """A server that accepts and never answers (a fault: a stuck peer) costs the timeout, not the run."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        for echo in (True, False):
            stream = RawStream(silent.getsockname(), timeout=0.3, echo=echo)
            try:
                copy = stream.round_trip() if echo else stream.copier(Op.READ, memoryview(bytearray(64)), 0)
                start = time.monotonic()
                with pytest.raises(TimeoutError, match="within 0.3 s"):
                    copy()
                assert time.monotonic() - start < 5
            finally:
                stream.close()


def test_cma_copiers_hold_the_gil_only_for_small_copies() -> None:
    assert _cma_call(Op.READ, GIL_HELD_BELOW - 1) is not _cma_call(Op.READ, GIL_HELD_BELOW)
    assert isinstance(_cma_call(Op.WRITE, 8), ctypes._CFuncPtr)  # type: ignore[attr-defined]
    assert _cma_call(Op.WRITE, 8).__class__._flags_ & ctypes._FUNCFLAG_PYTHONAPI  # type: ignore[attr-defined]
    assert not _cma_call(Op.WRITE, 1 << 20).__class__._flags_ & ctypes._FUNCFLAG_PYTHONAPI  # type: ignore[attr-defined]


def test_memcpy_copier_refuses_buffers_of_different_sizes() -> None:
    with pytest.raises(ValueError, match="64-byte destination, 32-byte source"):
        memcpy_copier(np.zeros(64, dtype=np.uint8), np.zeros(32, dtype=np.uint8))
