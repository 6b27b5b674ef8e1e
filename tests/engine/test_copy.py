"""In-process copies (hixl._copy, what the shm channel copies with): every path lands exactly the
bytes asked for and nothing else — one numpy call for blocks of one length with one side back to
back, the block loop otherwise — and a batch is reordered only where the order cannot matter."""

from __future__ import annotations

import numpy as np
import pytest

import hixl
from hixl import _copy

BLOCK = 4096
BLOCKS = 64


def _addrs(buf: np.ndarray, blocks: np.ndarray, length: int = BLOCK) -> np.ndarray:
    return np.uint64(buf.ctypes.data) + blocks.astype(np.uint64) * np.uint64(length)


@pytest.fixture
def buffers() -> tuple[np.ndarray, np.ndarray]:
    src = hixl.empty(BLOCKS * BLOCK)
    src[:] = np.random.default_rng(3).integers(0, 256, src.size, dtype=np.uint8)
    dst = hixl.empty(BLOCKS * BLOCK)
    dst.fill(0xEE)
    return src, dst


def _expect(src: np.ndarray, dst_blocks: np.ndarray, src_blocks: np.ndarray) -> np.ndarray:
    want = np.full(BLOCKS * BLOCK, 0xEE, np.uint8).reshape(BLOCKS, BLOCK)
    for d, s in zip(dst_blocks.tolist(), src_blocks.tolist()):  # in order: the last writer wins
        want[d] = src.reshape(BLOCKS, BLOCK)[s]
    return want.reshape(-1)


@pytest.mark.parametrize(
    "layout",
    ["destinations back to back", "sources back to back", "both scattered", "one destination twice", "off the grid"],
)
def test_copy_many_lands_exactly_the_blocks(buffers: tuple[np.ndarray, np.ndarray], layout: str) -> None:
    src, dst = buffers
    rng = np.random.default_rng(7)
    n = 40
    if layout == "destinations back to back":
        dst_blocks, src_blocks = np.arange(5, 5 + n), rng.permutation(BLOCKS)[:n]
    elif layout == "sources back to back":
        dst_blocks, src_blocks = rng.permutation(BLOCKS)[:n], np.arange(3, 3 + n)
    elif layout == "both scattered":
        dst_blocks, src_blocks = rng.permutation(BLOCKS)[:n], rng.permutation(BLOCKS)[:n]
    elif layout == "one destination twice":
        dst_blocks, src_blocks = rng.permutation(BLOCKS)[:n], np.arange(n)
        dst_blocks[7] = dst_blocks[30]
    else:
        dst_blocks, src_blocks = np.arange(n), rng.permutation(BLOCKS - 1)[:n]
    dsts, srcs = _addrs(dst, dst_blocks), _addrs(src, src_blocks)
    if layout == "off the grid":
        srcs = srcs + np.uint64(1)  # a byte off every source block: no numpy rows fit them
    _copy.copy_many(dsts, srcs, np.full(n, BLOCK, np.uint64))
    if layout == "off the grid":
        want = np.full(BLOCKS * BLOCK, 0xEE, np.uint8)
        for i, s in enumerate(src_blocks.tolist()):
            want[i * BLOCK : (i + 1) * BLOCK] = src[s * BLOCK + 1 : (s + 1) * BLOCK + 1]
        assert np.array_equal(dst, want)
    else:
        assert np.array_equal(dst, _expect(src, dst_blocks, src_blocks))


def test_copy_many_of_mixed_and_large_blocks(buffers: tuple[np.ndarray, np.ndarray]) -> None:
    src, dst = buffers
    big = hixl.empty(1 << 20)
    big[:] = 9
    lens = np.array([3, 4096, 1 << 20, 17], np.uint64)
    dsts = np.array([dst.ctypes.data, dst.ctypes.data + 8192, big.ctypes.data, dst.ctypes.data + 20000], np.uint64)
    srcs = np.array([src.ctypes.data + 5, src.ctypes.data, src.ctypes.data, src.ctypes.data + 100], np.uint64)
    source = hixl.empty(1 << 20)
    source[:] = 4
    srcs[2] = source.ctypes.data
    _copy.copy_many(dsts, srcs, lens)
    assert dst[:3].tobytes() == src[5:8].tobytes() and dst[3] == 0xEE
    assert dst[8192 : 8192 + 4096].tobytes() == src[:4096].tobytes()
    assert (big == 4).all()
    assert dst[20000:20017].tobytes() == src[100:117].tobytes() and dst[20017] == 0xEE


def test_block_order_reorders_only_where_order_cannot_matter() -> None:
    rng = np.random.default_rng(1)
    n, base = 32, 1 << 30
    perm = rng.permutation(n).astype(np.uint64)
    lens = np.full(n, BLOCK, np.uint64)
    scattered = np.uint64(base) + rng.permutation(4 * n)[:n].astype(np.uint64) * np.uint64(BLOCK)
    back_to_back = np.uint64(base) + perm * np.uint64(BLOCK)
    order = _copy.block_order(back_to_back, scattered, lens)
    assert order is not None and (np.diff(back_to_back[order]) == BLOCK).all()  # by destination
    order = _copy.block_order(scattered, back_to_back, lens)
    assert order is not None and (np.diff(back_to_back[order]) == BLOCK).all()  # by source
    assert _copy.block_order(scattered, scattered, lens) is None  # neither side back to back
    twice = back_to_back.copy()
    twice[3] = twice[9]
    assert _copy.block_order(twice, scattered, lens) is None  # overlapping destinations: order matters
    mixed = lens.copy()
    mixed[0] = 8
    assert _copy.block_order(back_to_back, scattered, mixed) is None
    assert _copy.block_order(back_to_back[:4], scattered[:4], lens[:4]) is None  # too few for numpy
