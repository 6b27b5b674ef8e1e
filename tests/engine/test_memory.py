"""Registration and descriptor handling: hixl.empty, register_mem, RegionTable, merge_adjacent,
as_desc_array. Pure in-process unit tests (no peers)."""

from __future__ import annotations

import fcntl
import gc
import mmap
import os
from collections.abc import Iterator

import numpy as np
import pytest

import hixl
from hixl import (
    PAGE_SIZE,
    Engine,
    MemDesc,
    MemHandle,
    MemoryRangeError,
    MemType,
    Op,
    ParamInvalid,
    TransferOpDesc,
)
from hixl import _shm_pool
from hixl._memory import RegionTable, Registry, as_desc_array, merge_adjacent

U64_MAX = (1 << 64) - 1


@pytest.fixture
def engine() -> Iterator[Engine]:
    with Engine("127.0.0.1") as eng:
        yield eng


# -- hixl.empty ------------------------------------------------------------------------
@pytest.mark.parametrize("shared", [False, True], ids=["anonymous", "pool"])
@pytest.mark.parametrize(
    ("shape", "dtype"),
    [(1, np.uint8), (4097, np.uint8), ((3, 5), np.float32), ([2, 3, 4], np.int64), ((7,), np.float16), (0, np.uint8)],
)
def test_empty_is_page_aligned_and_zeroed(shape, dtype, shared: bool) -> None:  # type: ignore[no-untyped-def]
    for _ in range(3):  # several allocations, not one lucky one
        arr = hixl.empty(shape, dtype, shared=shared)
        assert arr.ctypes.data % PAGE_SIZE == 0
        assert arr.shape == ((shape,) if isinstance(shape, int) else tuple(shape))
        assert arr.dtype == np.dtype(dtype)
        assert arr.flags.c_contiguous and arr.flags.writeable
        assert not arr.any()


def _vm_flags(addr: int) -> list[str]:
    """The kernel's VmFlags of the mapping holding ``addr`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= addr < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_empty_is_private_memory_with_huge_pages_asked_for() -> None:
    """Private (a forked child gets a copy) and madvised for huge pages, which the kernel pins far
    faster for a peer's process_vm_* (docs/engine.md, "Memory"); the pool's memory is shared."""
    for nbytes in (mmap.PAGESIZE, 3 << 20, 8 << 20):
        buf = hixl.empty(nbytes)
        flags = _vm_flags(int(buf.ctypes.data))
        assert "sh" not in flags and "hg" in flags, (nbytes, flags)
    pooled = hixl.empty(mmap.PAGESIZE, shared=True)
    assert "sh" in _vm_flags(int(pooled.ctypes.data))


def test_empty_rejects_negative_sizes() -> None:
    with pytest.raises(ParamInvalid):
        hixl.empty(-1)


def test_page_size() -> None:
    assert PAGE_SIZE == mmap.PAGESIZE


def _mapping_of(addr: int) -> str:
    with open("/proc/self/maps") as f:
        for line in f:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= addr < end:
                return line
    raise AssertionError(f"{addr:#x} is not mapped")


def test_shared_empty_is_a_sealed_memfd_released_with_the_array() -> None:
    arr = hixl.empty(3 * PAGE_SIZE + 5, shared=True)
    addr = int(arr.ctypes.data)
    assert "/memfd:hixl-pool" in _mapping_of(addr) and "rw-s" in _mapping_of(addr)  # shared, not private
    (entry,) = _shm_pool.overlapping(addr, 1)
    assert (entry.addr, entry.length, entry.size) == (addr, 3 * PAGE_SIZE + 5, 4 * PAGE_SIZE)
    seals = fcntl.fcntl(entry.fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW  # a peer holding it cannot resize it
    view = arr[PAGE_SIZE:]
    del arr
    assert _shm_pool.overlapping(addr, 1) == [entry]  # a view keeps it
    del view
    gc.collect()
    assert _shm_pool.overlapping(addr, 1) == []
    with pytest.raises(OSError):
        os.fstat(entry.fd)


def test_a_torch_tensor_on_pool_memory_moves_over_shm() -> None:
    """The documented recipe: ``torch.from_numpy(hixl.empty(..., shared=True))`` (and a byte array
    viewed as a dtype numpy lacks) is pool memory, which a peer reaches over shm."""
    torch = pytest.importorskip("torch")
    keys = torch.from_numpy(hixl.empty((64, 32), np.float16, shared=True))
    values = torch.from_numpy(hixl.empty(64 * 32 * 2, shared=True)).view(torch.bfloat16).reshape(64, 32)
    keys[:] = 1.5
    values[:] = -2.0
    with Engine("127.0.0.1:0") as target, Engine("127.0.0.1", {"transport": "shm"}) as initiator:
        for tensor in (keys, values):
            target.register_mem(tensor)
        local = torch.zeros(2, 64, 32, dtype=torch.float16)
        initiator.register_mem(local)
        initiator.connect(target.local_engine)
        assert initiator.transport_of(target.local_engine) == "shm"
        initiator.transfer_sync(
            target.local_engine,
            Op.READ,
            [(local[0].data_ptr(), keys.data_ptr(), 4096), (local[1].data_ptr(), values.data_ptr(), 4096)],
        )
    assert (local[0] == 1.5).all() and (local[1].view(torch.bfloat16) == -2.0).all()


# -- register_mem ------------------------------------------------------------------------
def _buffers() -> dict[str, tuple[object, int, int]]:
    """name -> (buffer, expected address, expected length)."""
    arr = hixl.empty((16, 16), np.float32)
    ba = bytearray(1000)
    ba_addr = int(np.frombuffer(ba, np.uint8).ctypes.data)
    mv_source = bytearray(300)
    mv = memoryview(mv_source)[100:]
    mv_addr = int(np.frombuffer(mv_source, np.uint8).ctypes.data) + 100
    mm = mmap.mmap(-1, 8192)
    mm_addr = int(np.frombuffer(mm, np.uint8).ctypes.data)
    raw = hixl.empty(4096)
    return {
        "numpy": (arr, int(arr.ctypes.data), 1024),
        "bytearray": (ba, ba_addr, 1000),
        "memoryview": (mv, mv_addr, 200),
        "mmap": (mm, mm_addr, 8192),
        "MemDesc": (MemDesc(int(raw.ctypes.data), 4096), int(raw.ctypes.data), 4096),
        "keepalive": (raw, 0, 0),  # keeps the MemDesc's memory alive; not registered
    }


@pytest.mark.parametrize("kind", ["numpy", "bytearray", "memoryview", "mmap", "MemDesc"])
def test_register_kinds(engine: Engine, kind: str) -> None:
    buffers = _buffers()
    buf, addr, nbytes = buffers[kind]
    handle = engine.register_mem(buf)
    assert isinstance(handle, MemHandle)
    assert (handle.addr, handle.len, handle.mem_type) == (addr, nbytes, MemType.HOST)
    assert engine.local_mems() == [MemDesc(addr, nbytes)]
    assert engine.register_mem(buf) == handle  # idempotent
    engine.deregister_mem(handle)
    assert engine.local_mems() == []


def test_register_torch_cpu_tensor(engine: Engine) -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.zeros(64, 32, dtype=torch.float16)
    handle = engine.register_mem(tensor)
    assert (handle.addr, handle.len) == (tensor.data_ptr(), 64 * 32 * 2)
    with pytest.raises(ParamInvalid, match="contiguous"):
        engine.register_mem(tensor.t())
    with pytest.raises(ParamInvalid, match="empty"):
        engine.register_mem(torch.zeros(0))


def test_same_range_same_handle(engine: Engine) -> None:
    buf = hixl.empty(8192)
    first = engine.register_mem(buf)
    assert engine.register_mem(buf.view(np.int32)) == first  # other dtype, same bytes
    assert engine.register_mem(MemDesc(int(buf.ctypes.data), 8192)) == first
    half = engine.register_mem(buf[:4096])
    assert half != first and half.id != first.id
    assert sorted(engine.local_mems()) == sorted([MemDesc(first.addr, 8192), MemDesc(first.addr, 4096)])


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((8, 8), np.uint8)[:, ::2],
        np.zeros((8, 8), np.uint8).T,
        np.zeros(16, np.uint8)[::2],
        np.zeros(0, np.uint8),
        bytearray(),
        [1, 2, 3],
        42,
        "text",
        MemDesc(0, 16),
        MemDesc(4096, 0),
        MemDesc(4096, -1),
        MemDesc(-4096, 16),
        MemDesc(U64_MAX - 8, 16),
    ],
    ids=[
        "strided-columns", "transposed", "strided-1d", "empty-array", "empty-bytearray", "list", "int", "str",
        "MemDesc-null", "MemDesc-empty", "MemDesc-negative-len", "MemDesc-negative-addr", "MemDesc-wraps",
    ],
)
def test_register_refuses(engine: Engine, bad: object) -> None:
    with pytest.raises(ParamInvalid):
        engine.register_mem(bad)
    assert engine.local_mems() == []


def test_registry_notifies_listeners() -> None:
    registry = Registry()
    seen: list[tuple[int, int]] = []
    registry.listeners.append(lambda table, generation: seen.append((len(table), generation)))
    a, b = hixl.empty(4096), hixl.empty(4096)
    handle = registry.register(a)
    registry.register(a)  # no change, no notification
    registry.register(b)
    registry.deregister(handle)
    registry.clear()
    assert seen == [(1, 1), (2, 2), (1, 3), (0, 4)]  # every change is a new generation
    assert registry.generation == 4


# -- RegionTable -------------------------------------------------------------------------
def _outside(table: RegionTable, ranges: list[tuple[int, int]]) -> list[int]:
    arr = np.array(ranges, dtype=np.uint64).reshape(-1, 2)
    return table.outside(arr[:, 0], arr[:, 1]).tolist()  # type: ignore[no-any-return]


def test_region_table_bounds() -> None:
    table = RegionTable([(1000, 100)])
    ranges = [(1000, 100), (1000, 1), (1099, 1), (999, 1), (999, 2), (1100, 1), (1099, 2), (0, 1), (5000, 10)]
    assert _outside(table, ranges) == [3, 4, 5, 6, 7, 8]


def test_region_table_merges_adjacent_and_overlapping_regions() -> None:
    table = RegionTable([(1100, 50), (1000, 100), (1120, 100), (2000, 10)])
    assert len(table) == 4
    inside = [(1000, 220), (1050, 100), (1149, 71), (2000, 10)]
    outside = [(1000, 221), (1210, 20), (1500, 1), (1990, 20), (2009, 2)]
    assert _outside(table, inside + outside) == list(range(len(inside), len(inside) + len(outside)))


def test_region_table_empty() -> None:
    assert _outside(RegionTable([]), [(1, 1), (2, 2)]) == [0, 1]


def test_region_table_at_the_top_of_the_address_space() -> None:
    # Ranges reaching a RegionTable never wrap past 2**64: as_desc_array and the
    # protocol's parser refuse those first (tested with them).
    top = U64_MAX - 4095
    table = RegionTable([(top, 4095)])
    assert _outside(table, [(top, 4095), (top + 4094, 1), (top - 1, 2), (top - 1, 1)]) == [2, 3]


def test_region_table_check_names_the_first_bad_descriptor() -> None:
    table = RegionTable([(1000, 100)])
    addrs = np.array([1000, 2000, 3000], dtype=np.uint64)
    lens = np.array([10, 10, 10], dtype=np.uint64)
    with pytest.raises(MemoryRangeError, match=r"descriptor 1 .*2 descriptor\(s\) affected"):
        table.check(addrs, lens, "remote")
    table.check(addrs[:1], lens[:1], "remote")


def test_region_table_scalar_and_vector_checks_agree() -> None:
    rng = np.random.default_rng(0)
    regions = [(int(a), int(n)) for a, n in zip(rng.integers(0, 1 << 20, 50), rng.integers(1, 4096, 50))]
    table = RegionTable(regions)
    addrs = rng.integers(0, 1 << 20, 5000).astype(np.uint64)
    lens = rng.integers(1, 8192, 5000).astype(np.uint64)
    outside = set(table.outside(addrs, lens).tolist())
    assert 0 < len(outside) < 5000  # both kinds occur
    for i, (a, n) in enumerate(zip(addrs.tolist(), lens.tolist())):
        assert table.contains(a, n) == (i not in outside)


def test_region_table_a_large_batch_mostly_in_one_region() -> None:
    # A KV pull's shape: thousands of blocks in one registration, a few ranges elsewhere — in
    # another region, in none, or running past the end of the bulk's. Tested against the scalar check.
    regions = [(1 << 30, 1 << 30), (4 << 30, 4096), (8 << 30, 1 << 20)]
    table = RegionTable(regions)
    rng = np.random.default_rng(1)
    addrs = ((1 << 30) + rng.integers(0, (1 << 15) - 1, 4096).astype(np.uint64) * np.uint64(32768)).astype(np.uint64)
    lens = np.full(4096, 32768, dtype=np.uint64)
    odd = {0: (4 << 30, 8), 7: (4 << 30, 4097), 100: (3 << 30, 1), 2000: ((2 << 30) - 8, 16), 4095: (8 << 30, 1 << 20)}
    for i, (a, n) in odd.items():
        addrs[i], lens[i] = a, n
    assert table.outside(addrs, lens).tolist() == [7, 100, 2000]
    # ... and when the middle range lies in no region at all, the others are still judged one by one.
    addrs[2048] = 0
    expected = [i for i, (a, n) in enumerate(zip(addrs.tolist(), lens.tolist())) if not table.contains(a, n)]
    assert table.outside(addrs, lens).tolist() == expected == [7, 100, 2000, 2048]


# -- merge_adjacent ----------------------------------------------------------------------
def _descs(rows: list[tuple[int, int, int]]) -> np.ndarray:
    return np.array(rows, dtype=np.uint64).reshape(-1, 3)


def test_merge_adjacent_merges_runs_contiguous_on_both_sides() -> None:
    rows = [(0, 100, 10), (10, 110, 10), (20, 120, 5), (50, 200, 5), (55, 205, 5), (90, 300, 1)]
    assert merge_adjacent(_descs(rows)).tolist() == [[0, 100, 25], [50, 200, 10], [90, 300, 1]]


def test_merge_adjacent_needs_both_sides() -> None:
    local_only = _descs([(0, 100, 10), (10, 500, 10)])
    remote_only = _descs([(0, 100, 10), (500, 110, 10)])
    backwards = _descs([(10, 110, 10), (0, 100, 10)])
    for descs in (local_only, remote_only, backwards):
        assert merge_adjacent(descs).tolist() == descs.tolist()


def test_merge_adjacent_many() -> None:
    n = 10_000
    offs = np.arange(n, dtype=np.uint64) * 64
    descs = np.stack([offs + 4096, offs + 8192, np.full(n, 64, np.uint64)], axis=1)
    assert merge_adjacent(descs).tolist() == [[4096, 8192, 64 * n]]
    assert merge_adjacent(descs[:1]).tolist() == [[4096, 8192, 64]]


# -- as_desc_array -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "given",
    [
        [TransferOpDesc(1, 2, 3), TransferOpDesc(4, 5, 6)],
        [(1, 2, 3), (4, 5, 6)],
        [[1, 2, 3], [4, 5, 6]],
        np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int32),
        np.array([[1, 2, 3], [4, 5, 6]], dtype=np.uint64),
        np.array([[1, 9, 2, 9, 3], [4, 9, 5, 9, 6]], dtype=np.int64)[:, ::2],  # not contiguous
        (d for d in [(1, 2, 3), (4, 5, 6)]),
    ],
    ids=["TransferOpDesc", "tuples", "lists", "int32", "uint64", "strided", "generator"],
)
def test_as_desc_array_accepts(given: object) -> None:
    descs = as_desc_array(given)
    assert descs.dtype == np.uint64 and descs.flags.c_contiguous
    assert descs.tolist() == [[1, 2, 3], [4, 5, 6]]


def test_as_desc_array_at_the_top_of_the_address_space() -> None:
    edge = [(U64_MAX - 16, U64_MAX - 16, 16)]  # ends exactly at 2**64 - 1
    assert as_desc_array(edge).tolist() == [list(edge[0])]


@pytest.mark.parametrize(
    "given",
    [
        [],
        np.zeros((0, 3), np.uint64),
        np.zeros((2, 2), np.uint64),
        np.zeros(3, np.uint64),
        np.ones((2, 3), np.float32),
        np.array([[1, 2, -3]], np.int64),
        [(1, 2, 0)],
        [(1, 2)],
        [(1, 2, 3, 4)],
        [(-1, 2, 3)],
        [(1 << 64, 2, 3)],
        TransferOpDesc(1, 2, 3),
        [(U64_MAX, 0, 2)],
        [(0, U64_MAX - 1, 2)],
        [(1, 1, U64_MAX)],
        None,
    ],
    ids=[
        "empty", "empty-array", "N2", "1d", "float", "negative", "zero-len", "short", "long", "neg-addr",
        "too-big", "single", "local-wraps", "remote-wraps", "len-wraps", "none",
    ],
)
def test_as_desc_array_refuses(given: object) -> None:
    with pytest.raises(ParamInvalid):
        as_desc_array(given)



def _readonly() -> np.ndarray:
    arr = np.zeros(64, dtype=np.uint8)
    arr.flags.writeable = False
    return arr


@pytest.mark.parametrize(
    "make",
    [
        lambda: b"immutable bytes",
        lambda: memoryview(bytearray(64)).toreadonly(),
        lambda: np.frombuffer(b"x" * 64, dtype=np.uint8),
        _readonly,
    ],
    ids=["bytes", "readonly-memoryview", "array-over-bytes", "readonly-array"],
)
def test_read_only_buffers_are_refused(make) -> None:
    """A peer may WRITE into anything registered: immutable memory must never be offered."""
    with hixl.Engine("127.0.0.1") as engine:
        with pytest.raises(hixl.ParamInvalid, match="read-only"):
            engine.register_mem(make())
        assert engine.local_mems() == []


# -- the mistakes a newcomer makes first ------------------------------------------------
@pytest.mark.parametrize(
    ("given", "says"),
    [
        ([TransferOpDesc(hixl.empty(4096), 0x1000, 4096)], "descriptor 0: local_addr is of type ndarray, not int"),
        ([(1, 2, 3), (4, np.zeros(2), 6)], "descriptor 1: remote_addr is of type ndarray, not int"),
        ([(1, 2)], "descriptor 0 (tuple (1, 2)) is not a TransferOpDesc(local_addr, remote_addr, len)"),
        ([(1, -2, 3)], "descriptor 0: remote_addr = -2 is outside 0 .. 2**64-1"),
    ],
    ids=["array-as-address", "second-desc", "short", "negative"],
)
def test_bad_descriptors_say_which_field_is_wrong(given: object, says: str) -> None:
    with pytest.raises(ParamInvalid) as exc:
        as_desc_array(given)
    assert says in str(exc.value)
    assert "inhomogeneous" not in str(exc.value)  # numpy's wording stays out of it
    if "of type" in says:
        assert "buf.ctypes.data for a numpy array, tensor.data_ptr() for a torch tensor" in str(exc.value)


def test_an_array_as_a_memdesc_address_is_a_clear_param_invalid(engine: Engine) -> None:
    buf = hixl.empty(4096)
    with pytest.raises(ParamInvalid, match=r"MemDesc\(addr, len\) takes two ints, not \(ndarray, int\).*data_ptr"):
        engine.register_mem(MemDesc(buf, 4096))  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_unregistered_local_buffer_asks_whether_it_was_registered(shared_target) -> None:  # type: ignore[no-untyped-def]
    with hixl.Engine("127.0.0.1") as engine:
        engine.connect(shared_target.engine)
        remote = engine.remote_mems(shared_target.engine)[0]
        local = hixl.empty(4096)  # never registered
        descs = [TransferOpDesc(int(local.ctypes.data), remote.addr, 4096)]
        with pytest.raises(MemoryRangeError, match="local range .* did you register it with register_mem"):
            engine.transfer_sync(shared_target.engine, Op.READ, descs)
        assert not local.any()


@pytest.mark.timeout(30)
def test_remote_mems_lists_the_peers_registrations_oldest_first(make_target) -> None:  # type: ignore[no-untyped-def]
    target = make_target([8192, 4096, 12288])
    with hixl.Engine("127.0.0.1") as engine:
        engine.connect(target.engine)
        sizes = [8192, 4096, 12288]
        assert engine.remote_mems(target.engine) == [MemDesc(a, n) for a, n in zip(target.addrs, sizes)]
        target.deregister(1)
        added = target.add_buffer(4096)  # registered last, listed last
        assert engine.remote_mems(target.engine) == [
            MemDesc(target.addrs[0], 8192),
            MemDesc(target.addrs[2], 12288),
            MemDesc(added, 4096),
        ]
