"""The hot path's two implementations (hixl._accel: the C extension and its pure-Python twin) land
exactly the bytes asked for and nothing else, and agree on every input — the small-request check
above all, which decides what the latency path may copy without the general path's checks."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hixl
from hixl import _accel
from hixl._accel import pure
from hixl._types import TransferOpDesc

BLOCK = 4096
BLOCKS = 64
U64 = 1 << 64
REQUIRE_NATIVE = "HIXL_REQUIRE_NATIVE"
"""Set (as CI sets it): the C extension must be built and loaded, not silently replaced."""


def _native() -> ModuleType | None:
    try:
        from hixl._accel import _native
    except ImportError:
        return None
    return _native


def test_the_extension_is_used_where_it_is_built() -> None:
    native = _native()
    if native is None:
        if os.environ.get(REQUIRE_NATIVE):
            pytest.fail(f"{REQUIRE_NATIVE} is set but the C extension is not built: {_accel.IMPLEMENTATION}")
        pytest.skip(f"the C extension is not built here: {_accel.IMPLEMENTATION}")
    if os.environ.get(_accel.PURE_ENV, "") not in ("", "0"):  # (HIXL_PURE_PYTHON=0 keeps the extension)
        assert not _accel.NATIVE and _accel.IMPLEMENTATION == "pure Python (HIXL_PURE_PYTHON=1)"
    else:
        assert _accel.NATIVE and _accel.check_small is native.check_small
    assert native.GIL_FREE_FROM == pure.GIL_FREE_FROM and native.SMALL_MAX == pure.SMALL_MAX
    assert native.STREAM_FROM == pure.STREAM_FROM


def test_hixl_pure_python_selects_the_twin() -> None:
    code = "from hixl import _accel; print(_accel.NATIVE, _accel.check_small.__module__)"
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, _accel.PURE_ENV: "1"}, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split() == ["False", "hixl._accel.pure"], out.stderr


@pytest.fixture(params=["pure", "native"])
def impl(request: pytest.FixtureRequest) -> ModuleType:
    if request.param == "pure":
        return pure
    native = _native()
    if native is None:
        if os.environ.get(REQUIRE_NATIVE):
            pytest.fail(f"{REQUIRE_NATIVE} is set but the C extension is not built")
        pytest.skip("the C extension is not built here")
    return native


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


def _pieces(locals_: np.ndarray, remotes: np.ndarray, lens: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.stack([locals_, remotes, lens], axis=1).astype(np.uint64))


@pytest.mark.parametrize("write", [False, True], ids=["READ", "WRITE"])
@pytest.mark.parametrize(
    "layout",
    ["destinations back to back", "sources back to back", "both scattered", "one destination twice", "off the grid"],
)
def test_copy_pieces_lands_exactly_the_blocks(
    impl: ModuleType, buffers: tuple[np.ndarray, np.ndarray], layout: str, write: bool
) -> None:
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
    lens = np.full(n, BLOCK, np.uint64)
    # A READ copies from the mapped (remote) side into local memory, a WRITE the other way.
    if write:
        impl.copy_pieces(_pieces(srcs, np.zeros(n, np.uint64), lens), dsts, True)
    else:
        impl.copy_pieces(_pieces(dsts, np.zeros(n, np.uint64), lens), srcs, False)
    if layout == "off the grid":
        want = np.full(BLOCKS * BLOCK, 0xEE, np.uint8)
        for i, s in enumerate(src_blocks.tolist()):
            want[i * BLOCK : (i + 1) * BLOCK] = src[s * BLOCK + 1 : (s + 1) * BLOCK + 1]
        assert np.array_equal(dst, want)
    else:
        assert np.array_equal(dst, _expect(src, dst_blocks, src_blocks))


def test_copy_pieces_of_mixed_and_large_blocks(impl: ModuleType, buffers: tuple[np.ndarray, np.ndarray]) -> None:
    src, dst = buffers
    big, source = hixl.empty(1 << 20), hixl.empty(1 << 20)
    big[:], source[:] = 9, 4
    lens = np.array([3, 4096, 1 << 20, 17], np.uint64)
    dsts = np.array([dst.ctypes.data, dst.ctypes.data + 8192, big.ctypes.data, dst.ctypes.data + 20000], np.uint64)
    srcs = np.array([src.ctypes.data + 5, src.ctypes.data, source.ctypes.data, src.ctypes.data + 100], np.uint64)
    impl.copy_pieces(_pieces(dsts, np.zeros(4, np.uint64), lens), srcs, False)
    assert dst[:3].tobytes() == src[5:8].tobytes() and dst[3] == 0xEE
    assert dst[8192 : 8192 + 4096].tobytes() == src[:4096].tobytes()
    assert (big == 4).all()
    assert dst[20000:20017].tobytes() == src[100:117].tobytes() and dst[20017] == 0xEE


@pytest.mark.parametrize("lanes", [1, 2])
@pytest.mark.parametrize("write", [False, True], ids=["READ", "WRITE"])
@pytest.mark.parametrize("told", [False, True], ids=["STREAM_FROM in the call", "told by the caller"])
def test_copies_large_enough_to_stream_land_exactly_their_bytes(
    impl: ModuleType, write: bool, lanes: int, told: bool
) -> None:
    """From STREAM_FROM bytes in a call, or when the caller says its transfer is that large, the C
    copies use streaming stores: a range's first bytes up to a cache line, whole lines, the rest.
    Ranges at every offset to a line, of lengths around it and below a page (plain memcpy), land
    exactly; the bytes between them stay."""
    offsets = [0, 1, 63, 64, 65, 4095, 17, 40]
    big = 3 << 20 if told else _accel.STREAM_FROM // 2  # told: a window of a larger transfer
    lens = [big + 13, 4095, 4096, 70_001, 64 * 3 + 1, 4096 + 63, 1 << 20, big]
    assert (sum(lens) >= _accel.STREAM_FROM) is not told
    gap = 4096 + 128
    size = sum(lens) + gap * (len(lens) + 1)
    src, dst = hixl.empty(size), hixl.empty(size)
    src[:] = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    dst.fill(0xEE)
    rows, want, at = [], np.full(size, 0xEE, np.uint8), gap
    for k, (off, n) in enumerate(zip(offsets, lens)):
        s_at, d_at = at + offsets[-1 - k], at + off  # source and destination off a line differently
        rows.append((int(dst.ctypes.data) + d_at, int(src.ctypes.data) + s_at, n))
        want[d_at : d_at + n] = src[s_at : s_at + n]
        at += n + gap
    table = np.array(rows, np.uint64)
    if write:  # the mapped side is the destination: local column = source, heres = destination
        impl.copy_pieces(_pieces(table[:, 1], np.zeros(len(rows), np.uint64), table[:, 2]), table[:, 0].copy(), True, lanes, told)
    else:
        impl.copy_pieces(_pieces(table[:, 0], np.zeros(len(rows), np.uint64), table[:, 2]), table[:, 1].copy(), False, lanes, told)
    assert np.array_equal(dst, want)


def test_a_small_list_large_enough_to_stream_lands_exactly(impl: ModuleType) -> None:
    """mapped_copy streams from STREAM_FROM bytes in all (C): one range a few bytes off a line."""
    n = _accel.STREAM_FROM + 77
    local, here = hixl.empty(n + 8192), hixl.empty(n + 8192)
    here[:] = np.random.default_rng(6).integers(0, 256, here.size, dtype=np.uint8)
    local.fill(0xEE)
    index = ([1 << 30], [(1 << 30) + here.size], [int(here.ctypes.data)], [True])
    at = int(local.ctypes.data)
    assert impl.mapped_copy([(at + 5, (1 << 30) + 3, n), (at, 1 << 30, 5)], False, *index) == 1
    assert local[:5].tobytes() == here[:5].tobytes()
    assert local[5 : 5 + n].tobytes() == here[3 : 3 + n].tobytes() and (local[5 + n :] == 0xEE).all()


@pytest.mark.parametrize("lanes", [2, 3])
@pytest.mark.parametrize("write", [False, True], ids=["read", "write"])
def test_a_small_list_split_over_lanes_lands_exactly(impl: ModuleType, write: bool, lanes: int) -> None:
    """mapped_copy from LANE_FROM bytes, over lanes: three ranges of odd lengths at odd offsets, each
    byte where it belongs and none past them (below and above STREAM_FROM in all)."""
    for total in (_accel.LANE_FROM + 4096 * 3 + 11, _accel.STREAM_FROM + 4096 + 7):
        lens = [total // 2 + 1, total // 3 - 5, total - (total // 2 + 1) - (total // 3 - 5)]
        local, here = hixl.empty(total + 8192), hixl.empty(total + 8192)
        rng = np.random.default_rng(total + lanes)
        src, dst = (local, here) if write else (here, local)
        src[:] = rng.integers(0, 256, src.size, dtype=np.uint8)
        dst.fill(0xEE)
        index = ([1 << 30], [(1 << 30) + here.size], [int(here.ctypes.data)], [True])
        at, descs, want = int(local.ctypes.data), [], np.full(dst.size, 0xEE, np.uint8)
        local_at, remote_at = 1, 4093  # each range a little further on, on both sides
        for n in lens:
            descs.append((at + local_at, (1 << 30) + remote_at, n))
            s_at, d_at = (local_at, remote_at) if write else (remote_at, local_at)
            want[d_at : d_at + n] = src[s_at : s_at + n]
            local_at, remote_at = local_at + n + 64, remote_at + n + 1
        assert impl.mapped_copy(descs, write, *index, lanes) == 1
        assert np.array_equal(dst, want)


def test_the_extension_refuses_arrays_it_cannot_read_as_rows() -> None:
    native = _native()
    if native is None:
        pytest.skip("the C extension is not built here")
    rows = np.zeros((4, 3), np.uint64)
    with pytest.raises(TypeError, match="uint64"):
        native.copy_pieces(rows.astype(np.int32), np.zeros(4, np.uint64), False)
    with pytest.raises(ValueError, match="C-contiguous"):  # (numpy refuses such a buffer itself)
        native.copy_pieces(np.zeros((4, 4), np.uint64)[:, :3], np.zeros(4, np.uint64), False)
    with pytest.raises(ValueError, match="as many rows"):
        native.copy_pieces(rows, np.zeros(3, np.uint64), False)


def test_batch_order_reorders_only_where_order_cannot_matter() -> None:
    rng = np.random.default_rng(1)
    n, base = 32, 1 << 30
    perm = rng.permutation(n).astype(np.uint64)
    lens = np.full(n, BLOCK, np.uint64)
    scattered = np.uint64(base) + rng.permutation(4 * n)[:n].astype(np.uint64) * np.uint64(BLOCK)
    back_to_back = np.uint64(base) + perm * np.uint64(BLOCK)
    order = pure.batch_order(back_to_back, scattered, lens)
    assert order is not None and (np.diff(back_to_back[order]) == BLOCK).all()  # by destination
    order = pure.batch_order(scattered, back_to_back, lens)
    assert order is not None and (np.diff(back_to_back[order]) == BLOCK).all()  # by source
    assert pure.batch_order(scattered, scattered, lens) is None  # neither side back to back
    twice = back_to_back.copy()
    twice[3] = twice[9]
    assert pure.batch_order(twice, scattered, lens) is None  # overlapping destinations: order matters
    mixed = lens.copy()
    mixed[0] = 8
    assert pure.batch_order(back_to_back, scattered, mixed) is None
    assert pure.batch_order(back_to_back[:4], scattered[:4], lens[:4]) is None  # too few for numpy


# -- the small-request check -----------------------------------------------------------------------

def _reference_total(descs: Any, local: tuple[list[int], list[int]], remote: tuple[list[int], list[int]]) -> int | None:
    """What check_small must answer, written the slow, obvious way."""
    if type(descs) is not list or not 0 < len(descs) <= pure.SMALL_MAX:
        return None
    total = 0
    for desc in descs:
        if not (isinstance(desc, tuple) or type(desc) is list) or len(desc) != 3:
            return None
        if any(type(v) is not int for v in desc):
            return None
        l_addr, r_addr, n = desc
        if n <= 0 or l_addr < 0 or r_addr < 0 or l_addr + n >= U64 or r_addr + n >= U64:
            return None
        for addr, (starts, ends) in ((l_addr, local), (r_addr, remote)):
            if not any(s <= addr and addr + n <= e for s, e in zip(starts, ends)):
                return None
        total += n
    return total if total < U64 else None


def _tables(raw: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Disjoint, sorted intervals from (start, length) pairs (overlaps dropped)."""
    starts: list[int] = []
    ends: list[int] = []
    for start, length in sorted(raw):
        if (not ends or start > ends[-1]) and start + length < U64:
            starts.append(start)
            ends.append(start + length)
    return starts, ends


_values = st.one_of(
    st.integers(0, 1 << 16),
    st.integers(U64 - (1 << 16), U64 + 4),
    st.integers(-4, 4),
    st.sampled_from([True, False, 2.0, None, "1"]),
)
_desc = st.one_of(
    st.tuples(_values, _values, _values),
    st.lists(_values, min_size=2, max_size=4),
    st.builds(TransferOpDesc, _values, _values, _values),
)
_intervals = st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(1, 1 << 12)), max_size=5)


@settings(max_examples=400, deadline=None)
@given(descs=st.lists(_desc, max_size=6), local=_intervals, remote=_intervals)
def test_check_small_agrees_with_the_obvious_rule_in_both_implementations(
    descs: list[Any], local: list[tuple[int, int]], remote: list[tuple[int, int]]
) -> None:
    local_t, remote_t = _tables(local), _tables(remote)
    want = _reference_total(descs, local_t, remote_t)
    assert pure.check_small(descs, *local_t, *remote_t) == want
    native = _native()
    if native is not None:
        assert native.check_small(descs, *local_t, *remote_t) == want


@pytest.mark.parametrize(
    "descs",
    [
        [(10, 100, 0)],
        [(U64 - 8, 100, 8)],  # a range that ends at 2**64 wraps in C: refused
        [(10, 100, 1 << 64)],
        [(10, 100, True)],
        ((10, 100, 8),),  # not a list
        [],
        [(10, 100, 8)] * (pure.SMALL_MAX + 1),
        [np.array([10, 100, 8])],
    ],
    ids=["empty range", "wraps", "huge length", "bool", "tuple of descs", "none", "too many", "array row"],
)
def test_check_small_declines_what_the_general_path_must_judge(impl: ModuleType, descs: Any) -> None:
    everything = ([0], [U64 - 1])
    assert impl.check_small(descs, *everything, *everything) is None


def test_check_small_needs_one_interval_to_hold_each_range(impl: ModuleType) -> None:
    local = ([0], [1 << 20])
    remote = ([1000, 2000], [2000, 3000])  # touching intervals are one region only once merged
    assert impl.check_small([(0, 1000, 1000), TransferOpDesc(5, 2000, 1000)], *local, *remote) == 2000
    assert impl.check_small([[0, 1500, 1000]], *local, *remote) is None
    assert impl.check_small([(0, 999, 2)], *local, *remote) is None


# -- copies through a peer's mapped memory -----------------------------------------------------------

@pytest.fixture
def mapped() -> tuple[np.ndarray, np.ndarray, tuple[list[int], list[int], list[int], list[bool]]]:
    """Local memory, and "the peer's" memory as mapped here: two mappings of 4 KiB at peer addresses
    1 MiB (writable) and 2 MiB (read-only), both in one local array."""
    local = hixl.empty(2 * BLOCK)
    local[:] = 1
    here = hixl.empty(2 * BLOCK)
    here[:BLOCK], here[BLOCK:] = 2, 3
    base = int(here.ctypes.data)
    index = ([1 << 20, 2 << 20], [(1 << 20) + BLOCK, (2 << 20) + BLOCK], [base, base + BLOCK], [True, False])
    return local, here, index


def test_mapped_copy_reads_and_writes_through_the_mappings(impl: ModuleType, mapped: Any) -> None:
    local, here, index = mapped
    at = int(local.ctypes.data)
    assert impl.mapped_copy([(at, (2 << 20) + 100, 50), (at + 60, (1 << 20), 4)], False, *index) == 1
    assert (local[:50] == 3).all() and local[50] == 1 and (local[60:64] == 2).all()
    assert impl.mapped_copy([(at + 1000, (1 << 20) + 8, 16)], True, *index) == 1
    assert (here[8:24] == 1).all() and here[7] == 2 and here[24] == 2


def test_mapped_copy_copies_nothing_unless_everything_is_mapped(impl: ModuleType, mapped: Any) -> None:
    local, here, index = mapped
    at = int(local.ctypes.data)
    before_local, before_here = local.copy(), here.copy()
    assert impl.mapped_copy([(at, 5 << 20, 8)], False, *index) == 0  # none mapped: TCP's to move
    assert impl.mapped_copy([(at, 1 << 20, 8), (at, 5 << 20, 8)], False, *index) == -1  # some
    assert impl.mapped_copy([(at, (1 << 20) + BLOCK - 4, 8)], False, *index) == 0  # runs past the end
    assert impl.mapped_copy([(at, 2 << 20, 8)], True, *index) == 0  # mapped read-only: not for a WRITE
    assert impl.mapped_copy([(at, 1 << 20, 8), (at, 2 << 20, 8)], True, *index) == -1
    assert impl.mapped_copy("not descriptors", False, *index) == -1
    assert np.array_equal(local, before_local) and np.array_equal(here, before_here)


# -- cma's latency-path call --------------------------------------------------------------------------

@pytest.fixture
def own_process() -> Any:
    """This process as its own cma peer: a pidfd pinning it, and a generation page saying 7."""
    import mmap
    import struct

    pidfd = os.pidfd_open(os.getpid())
    page = mmap.mmap(-1, mmap.PAGESIZE)
    struct.pack_into("<Q", page, 0, 7)
    yield os.getpid(), pidfd, page
    os.close(pidfd)
    page.close()


def test_cma_copy_moves_the_bytes_when_the_generation_and_the_process_are_current(impl: ModuleType, own_process: Any) -> None:
    pid, pidfd, page = own_process
    src, dst = hixl.empty(BLOCK), hixl.empty(BLOCK)
    src[:] = np.arange(BLOCK, dtype=np.uint8)
    dst.fill(0)
    s, d = int(src.ctypes.data), int(dst.ctypes.data)
    # READ: from the "remote" (src) into local (dst); WRITE: from local (src) to the "remote" (dst).
    assert impl.cma_copy(pid, pidfd, False, [(d, s, 100), (d + 200, s + 300, 50)], page, 7) == 150
    assert (dst[:100] == src[:100]).all() and (dst[200:250] == src[300:350]).all() and dst[100] == 0
    dst.fill(0)
    assert impl.cma_copy(pid, pidfd, True, [(s + 8, d + 16, 8)], page, 7) == 8
    assert (dst[16:24] == src[8:16]).all() and dst[15] == 0 and dst[24] == 0


def test_cma_copy_tries_nothing_on_a_stale_generation_or_a_gone_process(impl: ModuleType, own_process: Any) -> None:
    pid, pidfd, page = own_process
    src, dst = hixl.empty(BLOCK), hixl.empty(BLOCK)
    src.fill(1)
    dst.fill(0)
    descs = [(int(dst.ctypes.data), int(src.ctypes.data), 64)]
    assert impl.cma_copy(pid, pidfd, False, descs, page, 8) == pure.CMA_STALE
    assert impl.cma_copy(pid, -1, False, descs, page, 7) == pure.CMA_GONE
    assert impl.cma_copy(pid, pidfd, False, [(1, 2, 0)], page, 7) == pure.CMA_INELIGIBLE
    assert (dst == 0).all()
    import mmap

    closed = mmap.mmap(-1, mmap.PAGESIZE)
    closed.close()
    assert impl.cma_copy(pid, pidfd, False, descs, closed, 0) == pure.CMA_INELIGIBLE
    # An address nothing is mapped at: the kernel's EFAULT, as -errno.
    import errno

    assert impl.cma_copy(pid, pidfd, False, [(int(dst.ctypes.data), 1 << 46, 64)], page, 7) == -errno.EFAULT
    assert (dst == 0).all()


def test_cma_copy_moves_nothing_from_a_process_that_exited_and_is_not_yet_reaped(impl: ModuleType, own_process: Any) -> None:
    """Its pid is one reap from being free for another process. The C extension polls the pidfd,
    readable from the exit on: gone before the copy. The pure twin signals through it (a zombie
    still exists), and the kernel then refuses the copy (its memory is gone): ESRCH, reported the
    same by the channel (PeerDisconnected)."""
    import errno
    import select

    _, _, page = own_process
    local = hixl.empty(BLOCK)
    local.fill(0)
    child = os.fork()  # the same addresses mapped in the child
    if child == 0:
        os._exit(0)
    pidfd = os.pidfd_open(child)
    try:
        assert select.select([pidfd], [], [], 10)[0]  # it exited; nobody reaps it yet
        descs = [(int(local.ctypes.data), int(local.ctypes.data) + 1024, 64)]
        answer = impl.cma_copy(child, pidfd, False, descs, page, 7)
        assert answer == (pure.CMA_GONE if impl is not pure else -errno.ESRCH)
        assert not local.any()
    finally:
        os.close(pidfd)
        os.waitpid(child, 0)


def test_the_cma_answers_are_the_same_in_both_implementations() -> None:
    native = _native()
    if native is None:
        pytest.skip("the C extension is not built here")
    assert (native.CMA_INELIGIBLE, native.CMA_STALE, native.CMA_GONE) == (pure.CMA_INELIGIBLE, pure.CMA_STALE, pure.CMA_GONE)


# -- cma's whole latency path in one call (CmaSmall) ---------------------------------------------------

READ_ONLY_AT = 2 * BLOCK
"""The "peer's" region from this offset on is registered read-only."""


@pytest.fixture(params=["process_vm", "proc_mem"])
def proc_mem(request: pytest.FixtureRequest) -> Any:
    """-1 (every copy through process_vm_*), or this process's /proc/self/mem open for reading and
    writing (a copy of one descriptor of up to PROC_MEM_MAX bytes through it)."""
    if request.param == "process_vm":
        yield -1
        return
    fd = os.open("/proc/self/mem", os.O_RDWR | os.O_CLOEXEC)
    yield fd
    os.close(fd)


def _cma_small(impl: ModuleType, pid: int, pidfd: int, page: Any, local: np.ndarray, rows: list[list[int]], proc_mem: int) -> Any:
    """A CmaSmall whose engine registered ``local`` and whose peer has the regions ``rows`` (generation
    7), on a stand-in link (only .state and .regions are read); with its registry and regions."""
    from types import SimpleNamespace

    from hixl._memory import Registry
    from hixl._session.initiator import LinkState
    from hixl._session.peer_regions import PeerRegions
    from hixl._types import Op

    registry = Registry()
    registry.register(local)
    link = SimpleNamespace(state=LinkState.CONNECTED, regions=PeerRegions(rows, 7))
    path = impl.CmaSmall(pid, pidfd, page, registry, link, LinkState.CONNECTED, Op.READ, Op.WRITE, 1 << 20, 1, proc_mem)
    return SimpleNamespace(run=path.run, registry=registry, link=link, regions=link.regions)


@pytest.fixture
def small_path(impl: ModuleType, own_process: Any, proc_mem: int) -> Any:
    """A CmaSmall over this process as its own peer: real registrations on both sides (the local
    buffer read-write; the peer's first two blocks read-write, the rest read-only) and the real
    PeerRegions with its lease, on a stand-in link (only .state and .regions are read); with and
    without the peer's /proc/<pid>/mem."""
    from types import SimpleNamespace

    from hixl._types import Op

    pid, pidfd, page = own_process
    local, peer = hixl.empty(4 * BLOCK), hixl.empty(4 * BLOCK)
    p = int(peer.ctypes.data)
    rows = [[p, READ_ONLY_AT, 1], [p + READ_ONLY_AT, 4 * BLOCK - READ_ONLY_AT, 0]]
    path = _cma_small(impl, pid, pidfd, page, local, rows, proc_mem)
    return SimpleNamespace(run=path.run, local=local, peer=peer, l=int(local.ctypes.data), p=p, link=path.link,
                           registry=path.registry, regions=path.regions, page=page, READ=Op.READ, WRITE=Op.WRITE)


def test_cma_small_moves_exactly_the_bytes_asked_for(small_path: Any) -> None:
    s = small_path
    s.peer[:] = np.arange(4 * BLOCK, dtype=np.uint8)
    s.local.fill(0)
    assert s.run(s.READ, [(s.l + 8, s.p + 100, 16), TransferOpDesc(s.l + 64, s.p + READ_ONLY_AT, 8)]) is True
    expect = np.zeros(4 * BLOCK, dtype=np.uint8)
    expect[8:24] = s.peer[100:116]
    expect[64:72] = s.peer[READ_ONLY_AT : READ_ONLY_AT + 8]
    assert np.array_equal(s.local, expect)  # and nothing else
    s.local[:] = 0xAB
    before = s.peer.copy()
    assert s.run(s.WRITE, [(s.l, s.p + BLOCK, BLOCK)]) is True
    before[BLOCK : 2 * BLOCK] = 0xAB
    assert np.array_equal(s.peer, before)


def test_cma_small_copies_nothing_that_any_rule_refuses(small_path: Any) -> None:
    from hixl._session.initiator import LinkState

    s = small_path
    s.peer.fill(1)
    s.local.fill(0)
    ok = [(s.l, s.p, 8)]
    refused = {
        "local range outside registrations": (s.READ, [(s.l + 4 * BLOCK - 4, s.p, 8)]),
        "remote range outside regions": (s.READ, [(s.l, s.p + 4 * BLOCK - 4, 8)]),
        "local range before registrations": (s.READ, [(s.l - 8, s.p, 8)]),
        "remote range before regions": (s.READ, [(s.l, s.p - 8, 8)]),
        "WRITE into a read-only region": (s.WRITE, [(s.l, s.p + READ_ONLY_AT, 8)]),
        "one bad of two": (s.READ, [(s.l, s.p, 8), (s.l + 8, s.p + 5 * BLOCK, 8)]),
        "an op that is neither": ("READ", ok),
        "not a list": (s.READ, tuple(ok)),
        "an empty list": (s.READ, []),
        "a zero length": (s.READ, [(s.l, s.p, 0)]),
        "a negative address": (s.READ, [(-1, s.p, 8)]),
        "more than SMALL_MAX": (s.READ, ok * (pure.SMALL_MAX + 1)),
        "more than a chunk": (s.READ, [(s.l, s.p, 3 * BLOCK)] * 200),
    }
    for why, (op, descs) in refused.items():
        assert s.run(op, descs) is False, why
    assert (s.local == 0).all()
    # The state of the link, the lease and the peer's generation are looked at on every call.
    s.link.state = LinkState.CLOSED
    assert s.run(s.READ, ok) is False
    s.link.state = LinkState.CONNECTED
    s.regions.lease.revoking = True
    assert s.run(s.READ, ok) is False
    assert s.run(s.READ, [(s.l, s.p, 1 << 17)]) is False  # (the large way asks the lease for a token)
    s.regions.lease.revoking = False
    s.regions.generation = 8  # the page still says 7: our table is stale
    assert s.run(s.READ, ok) is False
    s.regions.generation = 7
    assert (s.local == 0).all()
    assert s.run(s.READ, ok) is True and (s.local[:8] == 1).all()


def test_cma_small_follows_both_tables_as_they_are_replaced(small_path: Any) -> None:
    s = small_path
    at = [(s.l, s.p + BLOCK, 8)]
    assert s.run(s.READ, at) is True
    from hixl import _protocol as proto

    # The peer withdraws its read-write region (a REVOKE installs the table without it).
    s.regions.apply(proto.Revoke(8, 7, np.zeros((0, 3), np.uint64), np.array([[s.p, READ_ONLY_AT, 1]], np.uint64)))
    struct.pack_into("<Q", s.page, 0, 8)
    assert s.run(s.READ, at) is False
    assert s.run(s.READ, [(s.l, s.p + READ_ONLY_AT, 8)]) is True
    # Our own buffer deregistered: nothing lands in it any more.
    (handle,) = s.registry._by_range.values()
    s.registry.deregister(handle)
    assert s.run(s.READ, [(s.l, s.p + READ_ONLY_AT, 8)]) is False


def test_cma_small_gives_its_lease_token_back(small_path: Any) -> None:
    s = small_path
    big = [(s.l, s.p, 2 * BLOCK), (s.l + 2 * BLOCK, s.p, 2 * BLOCK)] * 4  # 128 KiB: the GIL is released
    s.local.fill(0)
    s.peer.fill(3)
    assert s.run(s.READ, big) is True and (s.local == 3).all()
    assert not s.regions.lease._holders


def test_the_proc_mem_limit_is_the_same_in_both_implementations() -> None:
    native = _native()
    if native is None:
        pytest.skip("the C extension is not built here")
    assert native.PROC_MEM_MAX == pure.PROC_MEM_MAX == _accel.PROC_MEM_MAX == BLOCK


def test_cma_small_copies_one_small_descriptor_through_proc_mem_without_asking_the_pidfd(
    impl: ModuleType, own_process: Any
) -> None:
    """The /proc/<pid>/mem file is bound to the process's memory, so that way needs no pidfd: with
    a closed one (-1, "gone") one descriptor of up to PROC_MEM_MAX bytes still moves through the
    file, and only that; anything else takes process_vm_* and is refused without its pidfd."""
    from hixl._types import Op

    pid, _, page = own_process
    local, peer = hixl.empty(4 * BLOCK), hixl.empty(4 * BLOCK)
    l, p = int(local.ctypes.data), int(peer.ctypes.data)
    fd = os.open("/proc/self/mem", os.O_RDWR | os.O_CLOEXEC)
    try:
        run = _cma_small(impl, pid, -1, page, local, [[p, 4 * BLOCK, 1]], fd).run
        peer[:] = np.arange(4 * BLOCK, dtype=np.uint8)
        local.fill(0)
        assert run(Op.READ, [(l + 1, p + 5, BLOCK)]) is True  # a page, across two of them on each side
        assert np.array_equal(local[1 : BLOCK + 1], peer[5 : BLOCK + 5]) and local[0] == 0 and local[BLOCK + 1] == 0
        local[:] = 0xCD
        assert run(Op.WRITE, [(l, p + 3 * BLOCK, 8)]) is True
        assert (peer[3 * BLOCK : 3 * BLOCK + 8] == 0xCD).all() and peer[3 * BLOCK + 8] == (3 * BLOCK + 8) % 256
        before = peer.copy()
        local.fill(0)
        assert run(Op.READ, [(l, p, BLOCK + 1)]) is False  # over the limit: process_vm_*, whose pidfd is closed
        assert run(Op.READ, [(l, p, 8), (l + 8, p + 8, 8)]) is False  # two descriptors: the same
        struct.pack_into("<Q", page, 0, 8)
        assert run(Op.READ, [(l, p, 8)]) is False  # the generation page is still read first
        assert run(Op.WRITE, [(l, p, 8)]) is False
        struct.pack_into("<Q", page, 0, 7)
        assert (local == 0).all() and np.array_equal(peer, before)
    finally:
        os.close(fd)


def test_cma_small_moves_nothing_through_the_proc_mem_of_a_process_that_exited(
    impl: ModuleType, own_process: Any
) -> None:
    """A /proc/<pid>/mem opened while its process lived reads and writes nothing once it exited,
    whoever has its pid now: the copy is refused (and the general path then reports the peer gone)."""
    from hixl._types import Op

    _, pidfd, page = own_process
    local = hixl.empty(BLOCK)
    peer = np.full(BLOCK, 9, dtype=np.uint8)  # the child's copy is its own after fork
    l, p = int(local.ctypes.data), int(peer.ctypes.data)
    local.fill(0)
    hold, release = os.pipe()
    child = os.fork()  # the same addresses, its own copy of the bytes
    if child == 0:
        os.close(release)
        os.read(hold, 1)
        os._exit(0)
    os.close(hold)
    peer.fill(5)  # ours now differ from the child's
    fd = os.open(f"/proc/{child}/mem", os.O_RDWR | os.O_CLOEXEC)
    try:
        run = _cma_small(impl, child, pidfd, page, local, [[p, BLOCK, 1]], fd).run
        assert run(Op.READ, [(l, p, 8)]) is True and (local[:8] == 9).all()  # the child's bytes, through the file
        local.fill(0)
    finally:
        os.close(release)
        os.waitpid(child, 0)
    try:
        assert run(Op.READ, [(l, p, 8)]) is False
        assert run(Op.WRITE, [(l, p, 8)]) is False
        assert (local == 0).all() and (peer == 5).all()
    finally:
        os.close(fd)
