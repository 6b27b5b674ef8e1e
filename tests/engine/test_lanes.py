"""Copy lanes: a large cma or shm copy split over threads moves exactly the same bytes, in both
implementations of hixl._accel, and keeps every rule (a window's lanes all end before the call
returns: the lease and the request's lock cover them)."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import ModuleType

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hixl
from hixl import Engine, Op, TransferStatus, _accel
from hixl._accel import pure
from hixl._iov import IovWindows, iovecs
from hixl._request import TransferReq
from hixl._session.peer_regions import PeerRegions
from hixl.transports._peerproc import PeerProcess
from hixl.testing import TargetProcess

MakeTarget = Callable[..., TargetProcess]
MiB = 1 << 20
LANE_FROM = _accel.LANE_FROM


def _native() -> ModuleType | None:
    try:
        from hixl._accel import _native
    except ImportError:
        return None
    return _native


@pytest.fixture(params=["pure", "native"])
def impl(request: pytest.FixtureRequest) -> ModuleType:
    if request.param == "pure":
        return pure
    native = _native()
    if native is None:
        pytest.skip("the C extension is not built here")
    return native


def test_both_implementations_cut_at_the_same_size() -> None:
    native = _native()
    if native is None:
        pytest.skip("the C extension is not built here")
    assert (native.LANE_FROM, native.MAX_LANES) == (pure.LANE_FROM, pure.MAX_LANES)


@settings(max_examples=200, deadline=None)
@given(lens=st.lists(st.integers(1, 3 * MiB + 5), min_size=1, max_size=30), lanes=st.integers(1, 20))
def test_a_split_covers_every_byte_once_in_order(lens: list[int], lanes: int) -> None:
    array = np.array(lens, dtype=np.uint64)
    parts = pure.lane_parts(array, lanes)
    total = sum(lens)
    assert 1 <= len(parts) <= min(lanes, pure.MAX_LANES)
    ends = np.cumsum(lens)
    at = 0
    for first, offset, nbytes in parts:  # each part starts where the one before ended
        assert (int(ends[first - 1]) if first else 0) + offset == at and 0 <= offset < lens[first] and nbytes > 0
        at += nbytes
    assert at == total
    if len(parts) > 1:
        step = parts[0][2]
        assert total >= LANE_FROM and step % 4096 == 0 and all(p[2] == step for p in parts[:-1])
    else:
        assert lanes == 1 or total < LANE_FROM or -(-(-(-total // lanes)) // 4096) * 4096 >= total


def _rows(addr: int, count: int) -> list[tuple[int, int]]:
    """The ``count`` iovecs at ``addr``, as (base, len) pairs."""
    array = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * count)).from_address(addr)).reshape(count, 2)
    return [(int(base), int(length)) for base, length in array]


def _after(rows: list[tuple[int, int]], moved: int) -> list[tuple[int, int]]:
    """``rows`` less their first ``moved`` bytes."""
    rest = []
    for base, length in rows:
        skip = min(moved, length)
        moved -= skip
        if length > skip:
            rest.append((base + skip, length - skip))
    return rest


@settings(max_examples=300, deadline=None)
@given(
    lens=st.lists(st.integers(0, 5000), min_size=1, max_size=40),
    limit=st.integers(1, 6000),
    max_count=st.integers(1, 8),
    shorts=st.lists(st.floats(0, 1), max_size=6),
)
def test_windows_cover_every_byte_once_in_order_and_resume_after_a_short_count(
    lens: list[int], limit: int, max_count: int, shorts: list[float]
) -> None:
    """IovWindows (cma's copy loop): each window within ``limit`` bytes and one of its multiples,
    at most ``max_count`` entries, local and remote cut alike; all of them together are the
    entries given, in order; a short count leaves the rest of the window to move next."""
    count = len(lens)
    lengths = np.array(lens, dtype=np.uint64)
    local = np.uint64(1 << 30) + np.arange(count, dtype=np.uint64) * np.uint64(10_000)  # never touched: no copy here
    remote = np.uint64(1 << 40) + np.arange(count, dtype=np.uint64) * np.uint64(7_919)
    windows = IovWindows(iovecs(local, lengths), iovecs(remote, lengths), limit, max_count)
    assert windows.total == sum(lens)
    moved_at, pieces = 0, []
    while not windows.finished:
        local_ptr, remote_ptr, n, nbytes = windows.current()
        here, there = _rows(local_ptr, n), _rows(remote_ptr, n)
        assert 1 <= n <= max_count and 0 < nbytes <= limit and sum(length for _, length in here) == nbytes
        assert moved_at // limit == (moved_at + nbytes - 1) // limit  # never across a multiple of limit
        assert [length for _, length in here] == [length for _, length in there]
        pieces += [(lb, rb - lb, length) for (lb, length), (rb, _) in zip(here, there)]
        moved_at += nbytes
        if shorts and nbytes > 1:  # a short count first: the window's rest is what comes next
            short = 1 + int(shorts.pop() * (nbytes - 2))
            windows.advance(short)
            local_ptr, remote_ptr, n, rest = windows.current()
            assert rest == nbytes - short
            assert _rows(local_ptr, n) == _after(here, short) and _rows(remote_ptr, n) == _after(there, short)
            nbytes = rest
        windows.advance(nbytes)
    merged: list[tuple[int, int, int]] = []  # pieces that continue one another on both sides, joined again
    for base, offset, length in pieces:
        if merged and merged[-1][0] + merged[-1][2] == base and merged[-1][1] == offset:
            merged[-1] = (merged[-1][0], offset, merged[-1][2] + length)
        else:
            merged.append((base, offset, length))
    assert merged == [(int(lb), int(rb) - int(lb), n) for lb, rb, n in zip(local, remote, lens) if n]
    with pytest.raises(ValueError):
        IovWindows(iovecs(local, lengths), iovecs(remote, lengths), 0)


def _scattered(buf: np.ndarray, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` ranges of uneven lengths at scattered places in ``buf`` (none overlapping): addresses, lengths."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 2 * (buf.nbytes // count // 3), count).astype(np.uint64)
    slot = buf.nbytes // count
    starts = np.arange(count, dtype=np.uint64) * np.uint64(slot) + rng.integers(0, slot - lens.max(), count).astype(np.uint64)
    return np.uint64(buf.ctypes.data) + starts, lens


@pytest.mark.parametrize("lanes", [1, 2, 3, 16])
@pytest.mark.parametrize("write", [False, True], ids=["READ", "WRITE"])
def test_cma_window_moves_exactly_the_bytes_over_any_lanes(impl: ModuleType, lanes: int, write: bool) -> None:
    """This process as its own peer: scattered ranges of uneven lengths, many times LANE_FROM."""
    size = 6 * LANE_FROM
    here, there = hixl.empty(size), hixl.empty(size)
    here[:] = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    there.fill(0)
    a, lens = _scattered(here, 37, 2)
    b, _ = _scattered(there, 37, 3)
    # The bytes go from here's ranges (a) to there's (b): a WRITE from local to remote, a READ
    # from remote into local.
    local, remote = (iovecs(a, lens), iovecs(b, lens)) if write else (iovecs(b, lens), iovecs(a, lens))
    moved = impl.cma_window(os.getpid(), write, int(local.ctypes.data), int(remote.ctypes.data), len(lens), lanes)
    assert moved == int(lens.sum())
    want = np.zeros(size, np.uint8)
    base_here, base_there = int(here.ctypes.data), int(there.ctypes.data)
    for x, y, n in zip(a.tolist(), b.tolist(), lens.tolist()):
        want[y - base_there : y - base_there + n] = here[x - base_here : x - base_here + n]
    assert np.array_equal(there, want)  # those bytes, and nothing else


@pytest.mark.parametrize("lanes", [2, 4])
def test_laned_copies_from_many_threads_at_once_each_move_their_bytes(impl: ModuleType, lanes: int) -> None:
    """Copies running at once share the lane threads: each returns once its own bytes, all of
    them, have landed — whether the lane threads helped it or were busy with another copy."""
    size = 6 * LANE_FROM + 12345  # ranges of about a third of it: each copy over LANE_FROM, laned

    def copy_repeatedly(seed: int) -> str | None:
        """Five copies of scattered ranges; what went wrong, if anything."""
        source, dest = hixl.empty(size), hixl.empty(size)
        source[:] = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
        a, lens = _scattered(source, 13, seed)
        b = a - np.uint64(source.ctypes.data) + np.uint64(dest.ctypes.data)  # the same places in dest
        local, remote = iovecs(b, lens), iovecs(a, lens)  # a READ from source's ranges into dest's
        want = np.zeros(size, np.uint8)
        for at, n in zip((a - np.uint64(source.ctypes.data)).tolist(), lens.tolist()):
            want[at : at + n] = source[at : at + n]
        for _ in range(5):
            dest.fill(0)
            moved = impl.cma_window(os.getpid(), False, int(local.ctypes.data), int(remote.ctypes.data), len(lens), lanes)
            if moved != int(lens.sum()) or not np.array_equal(dest, want):
                return f"copy {seed}: {moved} of {int(lens.sum())} bytes, landed as given: {np.array_equal(dest, want)}"
        return None

    failures: list[str] = []

    def copy_or_report(seed: int) -> None:
        try:
            failure = copy_repeatedly(seed)
        except Exception as error:  # (a thread's exception would not fail the test by itself)
            failure = f"copy {seed}: {error!r}"
        if failure is not None:
            failures.append(failure)

    threads = [threading.Thread(target=copy_or_report, args=(seed,), daemon=True) for seed in range(6)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), "a laned copy hung"
    assert failures == []


@pytest.mark.parametrize("lanes", [1, 2, 3, 16])
@pytest.mark.parametrize("write", [False, True], ids=["READ", "WRITE"])
def test_cma_window_moves_runs_adjacent_on_one_side_only(impl: ModuleType, lanes: int, write: bool) -> None:
    """A paged pull in the remote blocks' order: blocks side by side on one side (all of here's,
    about half of there's) and scattered on the other, which the C copy sends as fewer, longer
    iovecs on each side — cut by the lanes inside runs, too."""
    block, count = 16 << 10, 1000
    here, there = hixl.empty(block * count), hixl.empty(2 * block * count)
    here[:] = np.random.default_rng(4).integers(0, 256, here.nbytes, dtype=np.uint8)
    there.fill(0)
    slots = np.random.default_rng(5).permutation(2 * count)[:count].astype(np.uint64)
    a = np.uint64(here.ctypes.data) + np.arange(count, dtype=np.uint64) * np.uint64(block)
    b = np.uint64(there.ctypes.data) + slots * np.uint64(block)
    lens = np.full(count, block, np.uint64)
    local, remote = (iovecs(a, lens), iovecs(b, lens)) if write else (iovecs(b, lens), iovecs(a, lens))
    moved = impl.cma_window(os.getpid(), write, int(local.ctypes.data), int(remote.ctypes.data), count, lanes)
    assert moved == block * count
    want = np.zeros(there.nbytes, np.uint8)
    want.reshape(-1, block)[slots.astype(np.int64)] = here.reshape(-1, block)
    assert np.array_equal(there, want)


def test_cma_window_reports_a_fault_in_any_lane(impl: ModuleType) -> None:
    size = 4 * LANE_FROM
    here = hixl.empty(size)
    lens = np.full(4, LANE_FROM, np.uint64)
    local = iovecs(np.uint64(here.ctypes.data) + np.arange(4, dtype=np.uint64) * np.uint64(LANE_FROM), lens)
    remote = local.copy()
    remote[3, 0] = 1 << 46  # nothing mapped there: the last lane's part faults
    for lanes in (1, 4):
        moved = impl.cma_window(os.getpid(), False, int(local.ctypes.data), int(remote.ctypes.data), 4, lanes)
        assert moved == (3 * LANE_FROM if lanes == 1 else -errno.EFAULT)  # one call: the bytes before it


@pytest.mark.parametrize("lanes", [1, 2, 5])
@pytest.mark.parametrize("write", [False, True], ids=["READ", "WRITE"])
def test_copy_pieces_over_lanes_moves_exactly_the_bytes(impl: ModuleType, lanes: int, write: bool) -> None:
    size = 6 * LANE_FROM
    local, mapped = hixl.empty(size), hixl.empty(size)
    src, dst = (local, mapped) if write else (mapped, local)
    src[:] = np.random.default_rng(4).integers(0, 256, size, dtype=np.uint8)
    dst.fill(0)
    a, lens = _scattered(local, 41, 5)
    h, _ = _scattered(mapped, 41, 6)
    pieces = np.ascontiguousarray(np.stack([a, np.zeros_like(a), lens], axis=1).astype(np.uint64))
    impl.copy_pieces(pieces, np.ascontiguousarray(h), write, lanes)
    want = np.zeros(size, np.uint8)
    s_base, d_base = int(src.ctypes.data), int(dst.ctypes.data)
    for x, y, n in zip(*(((a, h) if write else (h, a))), lens):
        x, y, n = int(x), int(y), int(n)
        want[y - d_base : y - d_base + n] = src[x - s_base : x - s_base + n]
    assert np.array_equal(dst, want)


@pytest.mark.parametrize("transport", ["cma", "shm"])
@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
@pytest.mark.parametrize("lanes", [1, 3])
def test_a_laned_copy_moves_exactly_the_bytes(make_target: MakeTarget, op: Op, lanes: int, transport: str) -> None:
    size = 4 * LANE_FROM + 12345  # not a multiple of anything
    target = make_target([size])
    target.fill(0, 5)
    with Engine("127.0.0.1", {"transport": transport, "copy_lanes": lanes}) as eng:
        buf = hixl.empty(size)
        eng.register_mem(buf)
        eng.connect(target.engine)
        for descs in ([(int(buf.ctypes.data), target.addrs[0], size)], _blocks(int(buf.ctypes.data), target.addrs[0], size)):
            if op is Op.READ:
                buf[:] = 0
                eng.transfer_sync(target.engine, op, descs)
                assert np.array_equal(buf, TargetProcess.expected(size, 5))
            else:
                buf[:] = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
                eng.transfer_sync(target.engine, op, descs)
                assert target.read(0, 0, size) == buf.tobytes()


def _blocks(local: int, remote: int, size: int, block: int = 16 << 10) -> np.ndarray:
    """The same bytes as 16 KiB blocks, in reverse order (nothing merges): a KV-style batch."""
    offsets = np.arange(0, size, block, dtype=np.uint64)[::-1]
    lens = np.minimum(np.uint64(block), np.uint64(size) - offsets)
    return np.stack([local + offsets, remote + offsets, lens], axis=1)


@pytest.mark.parametrize("transport", ["cma", "shm"])
def test_no_lane_goes_on_copying_after_cancel_returns(make_target: MakeTarget, transport: str) -> None:
    """A cancelled laned READ: once cancel() returned, no lane lands more (checked over time)."""
    size = 512 * MiB
    target = make_target([size])
    target.fill(0, 9)
    with Engine("127.0.0.1", {"transport": transport, "copy_lanes": 3}) as eng:
        buf = hixl.empty(size)
        eng.register_mem(buf)
        eng.connect(target.engine)
        for _ in range(3):
            buf[:] = 0
            req = eng.transfer_async(target.engine, Op.READ, [(int(buf.ctypes.data), target.addrs[0], size)])
            time.sleep(0.02)  # some windows landed, most not yet
            status = req.cancel()
            snapshot = buf.copy()
            time.sleep(0.3)  # a lane still copying would land more now
            assert np.array_equal(buf, snapshot), "a lane landed bytes after cancel() returned"
            assert status in (TransferStatus.FAILED, TransferStatus.COMPLETED)


def test_lanes_work_in_a_forked_child(impl: ModuleType) -> None:
    """The lane threads are the parent's: a child forked after they started starts its own."""
    size = 2 * LANE_FROM
    here, there = hixl.empty(size), hixl.empty(size)
    here.fill(7)
    pieces = np.array([[int(here.ctypes.data), 0, size]], dtype=np.uint64)
    heres = np.array([int(there.ctypes.data)], dtype=np.uint64)
    impl.copy_pieces(pieces, heres, True, 2)  # the lanes started here
    assert (there == 7).all()
    pid = os.fork()
    if pid == 0:  # the child: copy over lanes again, exit 0 if it lands (a hang is the failure)
        here.fill(9)
        impl.copy_pieces(pieces, heres, True, 2)
        os._exit(0 if (there == 9).all() else 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("a forked child's laned copy hung")


# -- cma_windows: the window loop with each window's checks -----------------------------------------


class _Windows:
    """One call of ``cma_windows`` with this process as its own peer: ``size`` bytes in scattered
    ranges of uneven lengths (some empty) from ``here`` into ``there``, with a real peer table,
    lease, generation page and request."""

    def __init__(self, size: int = 3 * LANE_FROM, count: int = 29, seed: int = 7) -> None:
        self.here, self.there = hixl.empty(size), hixl.empty(size)
        self.here[:] = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
        self.there.fill(0)
        self.a, self.lens = _scattered(self.here, count, seed)
        self.lens[::7] = 0
        self.b, _ = _scattered(self.there, count, seed + 1)
        # A READ from here's ranges (the "remote" side) into there's.
        self.local, self.remote = iovecs(self.b, self.lens), iovecs(self.a, self.lens)
        self.regions = PeerRegions([[int(self.here.ctypes.data), size, 1]], generation=5)
        self.page = mmap.mmap(-1, 8)
        self.page[:] = struct.pack("<Q", 5)
        self.process = PeerProcess(os.getpid())
        self.req = TransferReq("self", Op.READ, count, int(self.lens.sum()), timeout=None)

    def run(self, impl: ModuleType, start: int = 0, limit: int = LANE_FROM, lanes: int = 2) -> tuple[int, int]:
        return impl.cma_windows(
            os.getpid(), False, int(self.local.ctypes.data), int(self.remote.ctypes.data), len(self.lens), lanes,
            self.process.fd, start, limit, self.page, self.regions, self.regions.table, self.req,
        )

    def landed(self) -> np.ndarray:
        """Where every byte lands once all moved."""
        want = np.zeros(self.there.nbytes, np.uint8)
        base_here, base_there = int(self.here.ctypes.data), int(self.there.ctypes.data)
        for x, y, n in zip(self.a.tolist(), self.b.tolist(), self.lens.tolist()):
            want[y - base_there : y - base_there + n] = self.here[x - base_here : x - base_here + n]
        return want

    def assert_untouched(self) -> None:
        assert not self.there.any()
        assert not self.req.io_lock.locked()
        with self.regions.lease.exclusive(time.monotonic() + 0.5):  # (no token left: a REVOKE waits for none)
            pass


@settings(max_examples=25, deadline=None)
@given(
    start_share=st.floats(0, 1),
    limit=st.sampled_from([4096, 100_000, LANE_FROM, 3 * LANE_FROM]),
    lanes=st.integers(1, 4),
)
def test_cma_windows_moves_every_byte_from_start_on(start_share: float, limit: int, lanes: int) -> None:
    """Any start (inside an entry, at an empty one, at the end), any window size, any lanes: the
    bytes from ``start`` on land, none before it, in both implementations."""
    case = _Windows()
    total = int(case.lens.sum())
    start = int(total * start_share)
    want = case.landed()
    # The bytes before `start`: the first `start` bytes of the entries, in order.
    skipped = np.zeros(case.there.nbytes, bool)
    left, base = start, int(case.there.ctypes.data)
    for y, n in zip(case.b.tolist(), case.lens.tolist()):
        take = min(left, n)
        skipped[y - base : y - base + take] = True
        left -= take
    want[skipped] = 0
    for impl in [pure] + ([_native()] if _native() else []):
        case.there.fill(0)
        assert case.run(impl, start, limit, lanes) == (total - start, 0)
        assert np.array_equal(case.there, want)


def test_cma_windows_stops_before_a_window_a_check_refuses(impl: ModuleType) -> None:
    """Each check, refusing, stops the loop before its window moves a byte, and gives back the
    request's lock and the lease's token: a REVOKE under way, a cancelled request, a table
    replaced or a generation moved on since the caller checked, the page unmapped (the channel
    closed), the process gone."""
    case = _Windows()
    case.regions.lease.revoking = True
    assert case.run(impl) == (0, impl.CMA_REVOKING)
    case.regions.lease.revoking = False
    case.assert_untouched()

    case.req.cancelled = True
    assert case.run(impl) == (0, impl.CMA_CANCELLED)
    case.req.cancelled = False
    case.assert_untouched()

    checked = case.regions.table
    case.regions.table = PeerRegions([[int(case.here.ctypes.data), case.here.nbytes, 1]], 5).table
    assert impl.cma_windows(
        os.getpid(), False, int(case.local.ctypes.data), int(case.remote.ctypes.data), len(case.lens), 2,
        case.process.fd, 0, LANE_FROM, case.page, case.regions, checked, case.req,
    ) == (0, impl.CMA_STALE)
    case.assert_untouched()

    case.page[:] = struct.pack("<Q", 6)
    assert case.run(impl) == (0, impl.CMA_STALE)
    case.page.close()
    assert case.run(impl) == (0, impl.CMA_STALE)
    case.assert_untouched()

    case.page = mmap.mmap(-1, 8)
    case.page[:] = struct.pack("<Q", 5)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    gone = PeerProcess(child.pid)
    if impl is not pure:  # the C extension polls the pidfd: a process that exited is gone before it is reaped
        assert select.select([gone.fd], [], [], 10)[0]
        case.process = gone
        assert case.run(impl) == (0, impl.CMA_GONE)
        case.assert_untouched()
    child.wait()
    case.process = gone
    assert case.run(impl) == (0, impl.CMA_GONE)
    case.assert_untouched()


def test_cma_windows_stops_between_windows_with_what_moved(impl: ModuleType) -> None:
    """A request cancelled while a window is copied: that window's bytes count, the next one never
    starts. A fault in a later window: -errno, with the windows before it counted."""

    class CancelledAfterOneLook(TransferReq):
        looks = 0

        @property  # type: ignore[override]
        def cancelled(self) -> bool:
            self.looks += 1
            return self.looks > 1

        @cancelled.setter
        def cancelled(self, value: bool) -> None:
            pass

    case = _Windows()
    case.req = CancelledAfterOneLook("self", Op.READ, 1, 1, timeout=None)
    assert int(case.lens.sum()) > 2 * MiB
    moved, stop = case.run(impl, limit=MiB)
    assert (moved, stop) == (MiB, impl.CMA_CANCELLED)
    landed = case.there != 0
    assert np.array_equal(case.there[landed], case.landed()[landed])
    assert 0 < np.count_nonzero(case.there) < np.count_nonzero(case.landed())

    case = _Windows()
    last = int(np.flatnonzero(case.lens)[-1])
    case.remote[last, 0] = 1 << 46  # nothing mapped there
    before = int(case.lens[:last].sum())
    moved, stop = case.run(impl, limit=4096, lanes=1)
    assert stop == -errno.EFAULT and before - 4096 < moved <= before
