"""``Engine.transfer_async_split``: several requests from one validated call, started in order."""

from __future__ import annotations

import numpy as np
import pytest

import hixl
from hixl import MemoryRangeError, Op, ParamInvalid, TransferStatus

pytestmark = pytest.mark.timeout(60)

BLOCK = 4096


@pytest.fixture
def pair(transport, shared_target):
    with hixl.Engine("127.0.0.1", {"transport": transport}) as engine:
        local = hixl.empty(1 << 20)
        engine.register_mem(local)
        engine.connect(shared_target.engine)
        yield engine, local, shared_target


def _descs(local: np.ndarray, remote: int, blocks: list[int]) -> np.ndarray:
    rows = [(local.ctypes.data + i * BLOCK, remote + b * BLOCK, BLOCK) for i, b in enumerate(blocks)]
    return np.array(rows, dtype=np.uint64)


def test_groups_become_requests_in_order_and_all_land(pair):
    engine, local, target = pair
    blocks = [9, 3, 100, 4, 5, 6, 200, 1]  # scattered, with one run
    reqs = engine.transfer_async_split(target.engine, Op.READ, _descs(local, target.addrs[0], blocks), [1, 3, 4])
    assert [r.num_descs for r in reqs] == [1, 3, 4]
    assert [r.nbytes for r in reqs] == [BLOCK, 3 * BLOCK, 4 * BLOCK]
    for req in reqs:
        assert req.wait(10) is TransferStatus.COMPLETED
    finished = [r.finished_at for r in reqs]
    assert finished == sorted(finished)  # started, and so finished, in order
    expected = target.expected(1 << 20, 7)  # what shared_target put in its buffer 0
    for i, b in enumerate(blocks):
        np.testing.assert_array_equal(local[i * BLOCK : (i + 1) * BLOCK], expected[b * BLOCK : (b + 1) * BLOCK])


@pytest.mark.parametrize("counts", [[], [2, 2], [4, 5], [0, 8], [-1, 9], [[8]]])
def test_counts_must_cover_the_descriptors_exactly(pair, counts):
    engine, local, target = pair
    with pytest.raises(ParamInvalid):
        engine.transfer_async_split(target.engine, Op.READ, _descs(local, target.addrs[0], list(range(8))), counts)


def test_one_bad_descriptor_refuses_every_group_before_any_byte_moves(pair):
    engine, local, target = pair
    local[:] = 0
    descs = _descs(local, target.addrs[0], [0, 1, 2, 3])
    descs[3, 1] = target.addrs[0] + (1 << 20)  # past the end of the remote buffer
    with pytest.raises(MemoryRangeError):
        engine.transfer_async_split(target.engine, Op.READ, descs, [2, 2])
    assert not local.any()
