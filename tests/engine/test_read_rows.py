"""``Engine.read_rows``: a gather of a table's rows moves what its descriptors would, checked as two
ranges — and every refusal of the descriptor path still happens on it: rows outside the peer's
regions, slots outside ours, memory the peer deregistered, malformed row numbers; nothing is
copied then. On shm the gather is one call of ``hixl._accel.gather_rows`` (counted: the ``gathers``
fixture)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

import hixl
from hixl import Engine, MemoryRangeError, ParamInvalid
from hixl.testing import TargetProcess

pytestmark = pytest.mark.timeout(60)

MakeTarget = Callable[..., TargetProcess]
STRIDE = 272  # a parameter server's row: two head words and 256 bytes
ROWS = 4096
SEED = 36


@pytest.fixture
def table(make_target: MakeTarget, transport: str) -> Iterator[tuple[TargetProcess, Engine, np.ndarray]]:
    """A target holding a table of ROWS rows, an engine connected to it, and registered slots."""
    target = make_target([ROWS * STRIDE])
    target.fill(0, SEED)
    with Engine("127.0.0.1", {"transport": transport}) as engine:
        engine.connect(target.engine)
        assert engine.transport_of(target.engine) == transport
        slots = hixl.empty(1024 * STRIDE)
        handle = engine.register_mem(slots)
        yield target, engine, slots
        engine.deregister_mem(handle)


def _rows_of(rows: np.ndarray) -> np.ndarray:
    return TargetProcess.expected(ROWS * STRIDE, SEED).reshape(ROWS, STRIDE)[rows]


def test_a_gather_lands_the_rows_asked_for(table: tuple[TargetProcess, Engine, np.ndarray], transport: str, gathers: list[int]) -> None:
    target, engine, slots = table
    rows = np.random.default_rng(1).integers(0, ROWS, 1024)
    rows[:3] = [ROWS - 1, 0, 0]  # the last row, and a row twice
    engine.read_rows(target.engine, int(slots.ctypes.data), target.addrs[0], STRIDE, rows, timeout=10)
    assert np.array_equal(slots.reshape(1024, STRIDE), _rows_of(rows))
    assert gathers == ([1024] if transport == "shm" else [])  # one call from row numbers to rows
    few = np.array([7, 3], dtype=np.int32)  # any integers
    engine.read_rows(target.engine, int(slots.ctypes.data), target.addrs[0], STRIDE, few, timeout=10)
    assert np.array_equal(slots[: 2 * STRIDE].reshape(2, STRIDE), _rows_of(few))


def test_a_gather_past_the_peer_region_is_refused(table: tuple[TargetProcess, Engine, np.ndarray], gathers: list[int]) -> None:
    target, engine, slots = table
    slots[:] = 9
    with pytest.raises(MemoryRangeError, match="remote range"):
        engine.read_rows(target.engine, int(slots.ctypes.data), target.addrs[0], STRIDE, np.array([5, ROWS]), timeout=10)
    assert (slots == 9).all() and gathers == []


def test_a_gather_into_unregistered_memory_is_refused(table: tuple[TargetProcess, Engine, np.ndarray], gathers: list[int]) -> None:
    target, engine, slots = table
    elsewhere = np.full(4 * STRIDE, 9, np.uint8)
    with pytest.raises(MemoryRangeError, match="local range"):
        engine.read_rows(target.engine, int(elsewhere.ctypes.data), target.addrs[0], STRIDE, np.arange(4), timeout=10)
    assert (elsewhere == 9).all() and gathers == []
    with pytest.raises(MemoryRangeError, match="local range"):  # slots that run past the registration
        engine.read_rows(target.engine, int(slots.ctypes.data) + STRIDE, target.addrs[0], STRIDE, np.arange(1024), timeout=10)
    assert gathers == []


def test_a_gather_of_deregistered_memory_is_refused(table: tuple[TargetProcess, Engine, np.ndarray], gathers: list[int]) -> None:
    target, engine, slots = table
    rows = np.arange(0, ROWS, 4)
    engine.read_rows(target.engine, int(slots.ctypes.data), target.addrs[0], STRIDE, rows, timeout=10)
    target.deregister(0)  # returns once every peer confirmed: no copy of ours touches it any more
    slots[:] = 9
    # (refused here, or on tcp by the target itself if its REVOKE is still on the way)
    with pytest.raises(MemoryRangeError, match="outside registered memory"):
        engine.read_rows(target.engine, int(slots.ctypes.data), target.addrs[0], STRIDE, rows, timeout=10)
    assert (slots == 9).all()
    assert len(gathers) <= 1  # (the one before)


@pytest.mark.parametrize(
    ("rows", "stride", "error"),
    [
        (np.array([1, -1]), STRIDE, "not addresses"),
        (np.array([1.0, 2.0]), STRIDE, "integer array of one dimension"),
        (np.array([[1, 2]]), STRIDE, "integer array of one dimension"),
        (np.array([1, 2]), 0, "stride must be a positive int"),
        (np.array([1 << 62]), STRIDE, "not addresses"),  # past the 64-bit address space
    ],
)
def test_malformed_rows_are_refused(
    table: tuple[TargetProcess, Engine, np.ndarray], gathers: list[int], rows: np.ndarray, stride: int, error: str
) -> None:
    target, engine, slots = table
    slots[:] = 9
    with pytest.raises(ParamInvalid, match=error):
        engine.read_rows(target.engine, int(slots.ctypes.data), target.addrs[0], stride, rows, timeout=10)
    assert (slots == 9).all() and gathers == []


def _checked(rows: int, row_bytes: int = STRIDE - 16, limit: int = ROWS, check: bool = True) -> hixl.CheckedRows:
    return hixl.CheckedRows(
        limit, row_bytes, np.full(rows * row_bytes, 0xA5, np.uint8), np.full(rows, -7, np.int64), np.full(rows, -9, np.int64), check
    )


def test_a_checked_gather_hands_over_whole_rows_and_names_torn_ones(
    table: tuple[TargetProcess, Engine, np.ndarray], transport: str, gathers: list[int]
) -> None:
    """The table's random bytes make about half its rows "mid-update" (an odd first word). On shm each row
    is checked as it is copied, straight into ``out``: the odd ones are named torn, the rest handed over
    with their versions, the slots not written. Elsewhere the rows land in the slots as read (-1), for
    the caller's own check, and ``out`` is untouched."""
    target, engine, slots = table
    slots[:] = 9
    rows = np.random.default_rng(2).integers(0, ROWS, 512)
    expected = _rows_of(rows)
    seq = expected[:, :8].copy().view(np.uint64)[:, 0]
    odd = np.flatnonzero(seq & np.uint64(1))
    assert 0 < len(odd) < len(rows)
    checked = _checked(len(rows))
    count = engine.read_rows(target.engine, int(slots.ctypes.data), target.addrs[0], STRIDE, rows, timeout=10, checked=checked)
    payloads = checked.out.reshape(len(rows), STRIDE - 16)
    if transport == "shm":
        whole = np.setdiff1d(np.arange(len(rows)), odd)
        assert count == len(odd) and np.array_equal(checked.torn[:count], odd) and gathers == [len(rows)]
        assert np.array_equal(payloads[whole], expected[whole, 16:])
        assert np.array_equal(checked.versions[whole], (seq[whole] >> np.uint64(1)).astype(np.int64))
        assert (slots == 9).all()
    else:
        assert count == -1 and gathers == []
        assert np.array_equal(slots[: len(rows) * STRIDE].reshape(len(rows), STRIDE), expected)
        assert (checked.out == 0xA5).all() and (checked.versions == -7).all()


def test_a_checked_gather_taken_as_it_came_hands_over_every_row(table: tuple[TargetProcess, Engine, np.ndarray], transport: str) -> None:
    """``check=False`` (tests only): on shm every row is handed over, odd or not."""
    target, engine, slots = table
    rows = np.arange(0, ROWS, 16)
    checked = _checked(len(rows), check=False)
    count = engine.read_rows(target.engine, int(slots.ctypes.data), target.addrs[0], STRIDE, rows, timeout=10, checked=checked)
    if transport == "shm":
        assert count == 0 and np.array_equal(checked.out.reshape(len(rows), -1), _rows_of(rows)[:, 16:])
    else:
        assert count == -1


@pytest.mark.parametrize("rows", [[5, ROWS], [5, -1], [1 << 40]], ids=["past-limit", "negative", "far"])
def test_a_checked_gather_past_its_table_is_refused(
    table: tuple[TargetProcess, Engine, np.ndarray], gathers: list[int], rows: list[int]
) -> None:
    """A row number outside ``[0, limit)`` is refused on every transport, nothing copied: the span the engine
    checked is the whole table, so each row number is checked against its limit before any copy."""
    target, engine, slots = table
    slots[:] = 9
    checked = _checked(len(rows))
    with pytest.raises(ParamInvalid, match=r"\[0, 4096\)|not addresses"):
        engine.read_rows(target.engine, int(slots.ctypes.data), target.addrs[0], STRIDE, np.array(rows), timeout=10, checked=checked)
    assert (slots == 9).all() and (checked.out == 0xA5).all() and gathers == []
