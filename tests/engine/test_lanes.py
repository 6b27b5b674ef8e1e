"""Copy lanes: a large cma copy split over threads moves the same bytes, and keeps every rule."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hixl
from hixl import Engine, Op, TransferReq, TransferStatus
from hixl.testing import TargetProcess
from hixl.transports._lanes import LANE_FROM, split_even

MakeTarget = Callable[..., TargetProcess]
MiB = 1 << 20


def _bytes_of(descs: np.ndarray) -> list[list[int]]:
    """The (local, remote, length) runs a descriptor list moves, neighbours that continue each
    other on both sides merged: the same for any split of the same transfer."""
    runs: list[list[int]] = []
    for local, remote, length in descs.tolist():
        if runs and runs[-1][0] + runs[-1][2] == local and runs[-1][1] + runs[-1][2] == remote:
            runs[-1][2] += length
        else:
            runs.append([local, remote, length])
    return runs


@settings(max_examples=200, deadline=None)
@given(
    lens=st.lists(st.integers(1, 3 * 4096 + 5), min_size=1, max_size=30),
    parts=st.integers(1, 6),
)
def test_a_split_moves_every_byte_once_in_order(lens: list[int], parts: int) -> None:
    rows, local, remote = [], 1 << 30, 1 << 40
    for n in lens:
        rows.append((local, remote, n))
        local, remote = local + n + 64, remote + n + 128  # gaps: nothing merges by accident
    descs = np.array(rows, dtype=np.uint64)
    runs = split_even(descs, parts)
    assert 1 <= len(runs) <= parts
    assert all(len(run) and (run[:, 2] > 0).all() for run in runs)
    joined = np.concatenate(runs)
    assert _bytes_of(joined) == _bytes_of(descs)
    sizes = [int(run[:, 2].sum()) for run in runs]
    total = sum(lens)
    if len(runs) > 1:
        step = sizes[0]
        assert step % 4096 == 0 and all(size == step for size in sizes[:-1]) and 0 < sizes[-1] <= step
    assert sum(sizes) == total


def test_a_small_transfer_stays_one_part() -> None:
    descs = np.array([[4096, 8192, 4096]], dtype=np.uint64)
    assert len(split_even(descs, 4)) == 1


@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
@pytest.mark.parametrize("lanes", [1, 3])
def test_a_laned_copy_moves_exactly_the_bytes(make_target: MakeTarget, op: Op, lanes: int) -> None:
    size = 4 * LANE_FROM + 12345  # not a multiple of anything
    target = make_target([size])
    target.fill(0, 5)
    with Engine("127.0.0.1", {"transport": "cma", "copy_lanes": lanes}) as eng:
        buf = hixl.empty(size)
        eng.register_mem(buf)
        eng.connect(target.engine)
        if op is Op.READ:
            eng.transfer_sync(target.engine, op, [(int(buf.ctypes.data), target.addrs[0], size)])
            assert np.array_equal(buf, TargetProcess.expected(size, 5))
        else:
            buf[:] = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
            eng.transfer_sync(target.engine, op, [(int(buf.ctypes.data), target.addrs[0], size)])
            assert target.read(0, 0, size) == buf.tobytes()
        lane_threads = [t for t in threading.enumerate() if t.name.startswith("hixl-lane")]
        assert len(lane_threads) == lanes - 1  # the caller is the first lane


def test_cancel_and_expiry_wait_for_a_lanes_chunk_in_flight() -> None:
    """The guarantee across lanes: a lane holds its own lock while it lands a chunk, and cancel()
    (or expiry) returns only once every lane's lock is free — so no byte lands after it returns."""
    for end in ("cancel", "expire"):
        req = TransferReq("127.0.0.1:1", Op.READ, 1, 4096, 0.05 if end == "expire" else None)
        lane = req.lane_lock()
        lane.acquire()  # a lane in the middle of a chunk
        # Expiry: someone looks at the status once the 50 ms deadline passed.
        ender = threading.Thread(target=req.cancel if end == "cancel" else lambda: (time.sleep(0.1), req.status))
        ender.start()
        time.sleep(0.3)
        assert ender.is_alive(), f"{end} did not wait for the lane's chunk"
        assert req.cancelled  # the lane sees it before its next chunk
        lane.release()
        ender.join(2)
        assert not ender.is_alive()
        assert req.status is (TransferStatus.FAILED if end == "cancel" else TransferStatus.TIMEOUT)


def test_no_lane_goes_on_copying_after_cancel_returns(make_target: MakeTarget) -> None:
    """A cancelled laned READ: once cancel() returned, no lane lands more (checked over time)."""
    size = 512 * MiB
    target = make_target([size])
    target.fill(0, 9)
    with Engine("127.0.0.1", {"transport": "cma", "copy_lanes": 3}) as eng:
        buf = hixl.empty(size)
        eng.register_mem(buf)
        eng.connect(target.engine)
        for _ in range(3):
            buf[:] = 0
            req = eng.transfer_async(target.engine, Op.READ, [(int(buf.ctypes.data), target.addrs[0], size)])
            time.sleep(0.02)  # some chunks landed in every lane, most not yet
            status = req.cancel()
            snapshot = buf.copy()
            time.sleep(0.3)  # a lane still copying would land more now
            assert np.array_equal(buf, snapshot), "a lane landed bytes after cancel() returned"
            assert status in (TransferStatus.FAILED, TransferStatus.COMPLETED)
