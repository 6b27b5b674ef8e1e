"""The raw baselines must move the right bytes, or their ratios mean nothing."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from hixl import Op, empty
from hixl.bench.baselines import (
    RawStream,
    cma_batch_copier,
    cma_copier,
    gather_copier,
    memcpy_copier,
)
from hixl.bench.target import BenchTarget, sample_bytes

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

        local[:] = 9
        cma_copier(target.pid, Op.WRITE, int(local.ctypes.data), remote.addr + 8, 32)()
        assert target.read(remote, 8, 32) == b"\x09" * 32
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


def test_target_reports_failures(target: BenchTarget) -> None:
    with pytest.raises(RuntimeError, match="could not free"):
        target._do("free", 12345)
