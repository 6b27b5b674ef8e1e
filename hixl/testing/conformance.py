"""A conformance suite every hixl transport must pass, run against a real target process.

Subclass :class:`TransportConformance` in a pytest module and name the
transport class; every test then runs an initiator engine in the test process
that has only that transport, against a target engine in a child process
(:class:`~hixl.testing.TargetProcess`) that has only that transport too — so
both halves of the transport are under test::

    from hixl.testing.conformance import TransportConformance

    class TestTcp(TransportConformance):
        transport = "tcp"
        transport_class = "hixl.transports.tcp:TcpTransport"

A transport from another package plugs in the same way, without touching the
engine. The checks cover what the Engine promises
whatever moves the bytes: READ/WRITE byte for byte from 1 byte to 64 MiB at odd
offsets, thousands of scattered descriptors in both accepted forms, merged
adjacent descriptors, async requests and their order, notifications and their
ordering after data, registrations made or withdrawn after connecting, and
ranges outside registered memory refused before any byte moves.

Importing this module needs pytest; :mod:`hixl.testing` itself does not.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from .. import (
    Engine,
    MemDesc,
    MemoryRangeError,
    NotifyDesc,
    Op,
    ParamInvalid,
    TransferOpDesc,
    TransferReq,
    TransferStatus,
    empty,
)
from ..transports.base import Transport
from .faults import FaultyTransport
from .peer import TargetProcess, load_transport

__all__ = ["TransportConformance"]

MiB = 1 << 20
BIG = 64 * MiB
"""Largest single transfer the suite moves."""
_SLACK = 2 * 4096
"""Room around BIG so that odd offsets and guard bytes fit in every buffer."""
_SEED = 20240611
_SENTINEL = 0xA5

# Target buffer indices (see the ``target`` fixture).
SRC, DST, SCRATCH = 0, 1, 2

#: (size, local offset, remote offset): 1 byte to 64 MiB; past the first, odd
#: offsets that differ on each side, so local and remote page offsets differ.
ROUND_TRIPS = [
    (1, 0, 0),
    (3, 1, 4095),
    (4096, 7, 3),
    (MiB + 7, 4095, 1),
    (BIG, 5, 11),
]


#: (segments, longest segment) of the scattered tests: many small ones, and ~20 MiB in blocks of up
#: to 40 000 bytes (a transfer past hixl._accel.STREAM_FROM: shm copies it with streaming stores).
SEGMENTS = [(4096, 300), (1024, 40_000)]
SEGMENT_IDS = ["small", "large"]


def _ids(case: tuple[int, int, int]) -> str:
    return f"{case[0]}B@{case[1]}->{case[2]}"


def _random(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _addr(buf: np.ndarray) -> int:
    return int(buf.ctypes.data)


def scattered_layout(count: int, seed: int, max_len: int = 300) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``count`` non-overlapping, non-adjacent segments laid out in a different order on each side.

    Returns ``(local_offsets, remote_offsets, lengths)``; gaps of at least one
    byte keep :func:`~hixl._memory.merge_adjacent` from joining any two.
    """
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, max_len + 1, count).astype(np.uint64)
    remote = np.cumsum(lens + rng.integers(1, 64, count).astype(np.uint64)) - lens
    order = rng.permutation(count)  # local segments in another order
    local_sorted = np.cumsum(lens[order] + rng.integers(1, 64, count).astype(np.uint64)) - lens[order]
    local = np.empty(count, dtype=np.uint64)
    local[order] = local_sorted
    return local, remote, lens


def _segment_index(offsets: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Flat byte indices of every segment, in descriptor order (for vectorised checks)."""
    offsets, lens = offsets.astype(np.int64), lens.astype(np.int64)
    firsts = np.cumsum(lens) - lens  # position of each segment's first byte in the flat result
    return np.repeat(offsets - firsts, lens) + np.arange(int(lens.sum()))


class TransportConformance:
    """Base class of the conformance suite; set :attr:`transport` in a subclass (see module doc)."""

    transport: str = ""
    """Name of the transport under test; forced through the engine's ``"transport"`` option."""
    transport_class: str = ""
    """``"package.module:Class"`` of the transport under test: both engines get only it."""

    # -- hooks for subclasses ----------------------------------------------------------
    # Classmethods, like the class-scoped fixtures that call them: those run once per
    # class, before (and apart from) any test instance.
    @classmethod
    def make_transport(cls) -> Transport:
        """A fresh instance of the transport under test."""
        return load_transport(cls.transport_class)()

    @classmethod
    def make_initiator(cls, options: dict[str, Any] | None = None, transport: Transport | None = None) -> Engine:
        """A client-only initiator engine with only the transport under test: ``transport`` (one
        wrapped in a :class:`~hixl.testing.faults.FaultyTransport`, say), else a fresh one."""
        transports = [transport or cls.make_transport()]
        return Engine("127.0.0.1", {"transport": cls.transport, **(options or {})}, transports=transports)

    @classmethod
    def make_target(cls, sizes: list[int], options: dict[str, Any] | None = None) -> TargetProcess:
        """A target engine in a child process, with only the transport under test and
        buffers of ``sizes`` registered."""
        return TargetProcess(sizes, options, transports=[cls.transport_class])

    # -- fixtures ----------------------------------------------------------------------
    @pytest.fixture(scope="class")
    @classmethod
    def target(cls) -> Iterator[TargetProcess]:
        """Target with SRC (seeded random), DST and SCRATCH buffers; shared by the class."""
        if not cls.transport or not cls.transport_class:
            pytest.fail("a TransportConformance subclass must set `transport` and `transport_class`")
        tp = cls.make_target([BIG + _SLACK, BIG + _SLACK, MiB])
        try:
            tp.fill(SRC, _SEED)
            yield tp
        finally:
            tp.close()

    @pytest.fixture(scope="class")
    @classmethod
    def src_expected(cls, target: TargetProcess) -> np.ndarray:
        """What the target's SRC buffer holds."""
        return TargetProcess.expected(BIG + _SLACK, _SEED)

    @pytest.fixture(scope="class")
    @classmethod
    def src(cls) -> np.ndarray:
        """The initiator's (registered) source buffer: seeded random bytes, never written."""
        buf = empty(BIG + _SLACK)
        buf[:] = _random(len(buf), _SEED + 1)
        return buf

    @pytest.fixture(scope="class")
    @classmethod
    def dst_buffer(cls) -> np.ndarray:
        """The initiator's (registered) destination buffer."""
        return empty(BIG + _SLACK)

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, target: TargetProcess, src: np.ndarray, dst_buffer: np.ndarray) -> Iterator[Engine]:
        """Initiator connected to ``target``, with ``src`` and ``dst_buffer`` registered."""
        eng = cls.make_initiator()
        try:
            eng.register_mem(src)
            eng.register_mem(dst_buffer)
            eng.connect(target.engine)
            yield eng
        finally:
            eng.finalize()

    @pytest.fixture
    def dst(self, engine: Engine, dst_buffer: np.ndarray) -> np.ndarray:
        """The initiator's destination buffer, reset to a sentinel for each test."""
        dst_buffer.fill(_SENTINEL)
        return dst_buffer

    # -- connection --------------------------------------------------------------------
    def test_forced_transport_is_used(self, engine: Engine, target: TargetProcess) -> None:
        assert engine.transport_of(target.engine) == self.transport
        assert engine.connected_engines() == [target.engine]

    # -- round trips -------------------------------------------------------------------
    @pytest.mark.parametrize("case", ROUND_TRIPS, ids=_ids)
    def test_read_round_trip(
        self, engine: Engine, target: TargetProcess, dst: np.ndarray, src_expected: np.ndarray, case: tuple
    ) -> None:
        size, loff, roff = case
        engine.transfer_sync(target.engine, Op.READ, [TransferOpDesc(_addr(dst) + loff, target.addrs[SRC] + roff, size)])
        assert np.array_equal(dst[loff : loff + size], src_expected[roff : roff + size])
        # Not a byte more: the neighbours of the destination range are untouched.
        assert dst[loff + size] == _SENTINEL
        if loff:
            assert dst[loff - 1] == _SENTINEL

    @pytest.mark.parametrize("case", ROUND_TRIPS, ids=_ids)
    def test_write_round_trip(self, engine: Engine, target: TargetProcess, src: np.ndarray, case: tuple) -> None:
        size, loff, roff = case
        guard = bytes([0x5A])
        target.write(DST, roff + size, guard)
        if roff:
            target.write(DST, roff - 1, guard)
        engine.transfer_sync(target.engine, Op.WRITE, [TransferOpDesc(_addr(src) + loff, target.addrs[DST] + roff, size)])
        landed = np.frombuffer(target.read(DST, roff, size), dtype=np.uint8)
        assert np.array_equal(landed, src[loff : loff + size])
        assert target.read(DST, roff + size, 1) == guard
        if roff:
            assert target.read(DST, roff - 1, 1) == guard

    # -- many descriptors --------------------------------------------------------------
    @pytest.mark.parametrize("segments", SEGMENTS, ids=SEGMENT_IDS)
    @pytest.mark.parametrize("form", ["uint64-array", "int64-array", "TransferOpDesc-list"])
    def test_scattered_read(
        self,
        engine: Engine,
        target: TargetProcess,
        dst: np.ndarray,
        src_expected: np.ndarray,
        form: str,
        segments: tuple[int, int],
    ) -> None:
        local, remote, lens = scattered_layout(segments[0], seed=1, max_len=segments[1])
        descs = np.stack([local + _addr(dst), remote + target.addrs[SRC], lens], axis=1)
        engine.transfer_sync(target.engine, Op.READ, self._as_form(descs, form))
        assert np.array_equal(dst[_segment_index(local, lens)], src_expected[_segment_index(remote, lens)])
        # Gap bytes between segments were not written.
        touched = np.zeros(int(local.max() + lens.max()) + 1, dtype=bool)
        touched[_segment_index(local, lens)] = True
        assert (dst[: len(touched)][~touched] == _SENTINEL).all()

    @pytest.mark.parametrize("segments", SEGMENTS, ids=SEGMENT_IDS)
    @pytest.mark.parametrize("form", ["uint64-array", "TransferOpDesc-list"])
    def test_scattered_write(
        self, engine: Engine, target: TargetProcess, src: np.ndarray, form: str, segments: tuple[int, int]
    ) -> None:
        local, remote, lens = scattered_layout(segments[0], seed=2, max_len=segments[1])
        span = int(remote.max() + lens.max())
        target.write(DST, 0, bytes([_SENTINEL]) * span)
        descs = np.stack([local + _addr(src), remote + target.addrs[DST], lens], axis=1)
        engine.transfer_sync(target.engine, Op.WRITE, self._as_form(descs, form))
        after = np.frombuffer(target.read(DST, 0, span), dtype=np.uint8)
        assert np.array_equal(after[_segment_index(remote, lens)], src[_segment_index(local, lens)])
        touched = np.zeros(span, dtype=bool)
        touched[_segment_index(remote, lens)] = True
        assert (after[~touched] == _SENTINEL).all()

    @staticmethod
    def _as_form(descs: np.ndarray, form: str) -> Any:
        if form == "uint64-array":
            return descs.astype(np.uint64)
        if form == "int64-array":
            return descs.astype(np.int64)
        return [TransferOpDesc(int(a), int(b), int(n)) for a, b, n in descs]

    def test_adjacent_descriptors(
        self, engine: Engine, target: TargetProcess, dst: np.ndarray, src_expected: np.ndarray
    ) -> None:
        # 1000 pieces contiguous on both sides (merged into one), then 100 pieces
        # contiguous locally but reversed remotely (must not be merged).
        n, piece = 1000, 1000
        base_l, base_r = _addr(dst) + 1, target.addrs[SRC] + 3
        offs = np.arange(n, dtype=np.uint64) * piece
        merged = np.stack([base_l + offs, base_r + offs, np.full(n, piece, np.uint64)], axis=1)
        m = 100
        loffs = n * piece + np.arange(m, dtype=np.uint64) * piece
        roffs = (np.arange(m, dtype=np.uint64)[::-1] + n) * piece
        crossed = np.stack([base_l + loffs, base_r + roffs, np.full(m, piece, np.uint64)], axis=1)
        engine.transfer_sync(target.engine, Op.READ, np.concatenate([merged, crossed]))
        assert np.array_equal(dst[1 : 1 + n * piece], src_expected[3 : 3 + n * piece])
        for i in range(m):
            got = dst[1 + int(loffs[i]) : 1 + int(loffs[i]) + piece]
            assert np.array_equal(got, src_expected[3 + int(roffs[i]) : 3 + int(roffs[i]) + piece])

    def test_range_spanning_two_adjacent_local_registrations(
        self, engine: Engine, target: TargetProcess, src_expected: np.ndarray
    ) -> None:
        buf = empty(8192)
        halves = [engine.register_mem(buf[:4096]), engine.register_mem(buf[4096:])]
        try:
            engine.transfer_sync(target.engine, Op.READ, [TransferOpDesc(_addr(buf) + 100, target.addrs[SRC], 8000)])
            assert np.array_equal(buf[100:8100], src_expected[:8000])
        finally:
            for handle in halves:
                engine.deregister_mem(handle)

    # -- async ------------------------------------------------------------------------
    def test_async_request_life_cycle(
        self, engine: Engine, target: TargetProcess, dst: np.ndarray, src_expected: np.ndarray
    ) -> None:
        size = 16 * MiB
        req = engine.transfer_async(target.engine, Op.READ, [(_addr(dst), target.addrs[SRC], size)], timeout=30)
        assert isinstance(req, TransferReq)
        assert req.op is Op.READ and req.num_descs == 1 and req.nbytes == size
        assert req.wait() is TransferStatus.COMPLETED
        assert req.done()
        assert req.status is TransferStatus.COMPLETED
        assert engine.get_transfer_status(req) is TransferStatus.COMPLETED
        assert req.error is None
        text = repr(req)
        assert "READ" in text and target.engine in text and "COMPLETED" in text and f"{size} B" in text
        assert np.array_equal(dst[:size], src_expected[:size])

    def test_async_requests_start_in_submission_order(
        self, engine: Engine, target: TargetProcess, src: np.ndarray, dst: np.ndarray
    ) -> None:
        # WRITE v0, READ, WRITE v1, READ, ... all to one remote range: each READ
        # must see the WRITE submitted just before it, and the last WRITE wins.
        size, rounds = 64 << 10, 32
        remote = target.addrs[SCRATCH]
        reqs = []
        for i in range(rounds):
            reqs.append(engine.transfer_async(target.engine, Op.WRITE, [(_addr(src) + i * size, remote, size)]))
            reqs.append(engine.transfer_async(target.engine, Op.READ, [(_addr(dst) + i * size, remote, size)]))
        for req in reqs:
            assert req.wait(30) is TransferStatus.COMPLETED
        for i in range(rounds):
            assert np.array_equal(dst[i * size : (i + 1) * size], src[i * size : (i + 1) * size]), f"round {i}"
        last = rounds - 1
        assert np.array_equal(
            np.frombuffer(target.read(SCRATCH, 0, size), dtype=np.uint8), src[last * size : (last + 1) * size]
        )

    # -- notifications ----------------------------------------------------------------
    def test_notifications_arrive_in_order_and_drain(self, engine: Engine, target: TargetProcess) -> None:
        target.notifies()  # start empty
        sent = [NotifyDesc(f"n{i}", f"message {i} \u00e9\u4e2d") for i in range(20)]
        sent.append(NotifyDesc("", ""))
        sent.append(NotifyDesc("x" * 1024, "\u00e9" * 512))  # both exactly at the 1 KiB limit
        for notify in sent:
            engine.send_notify(target.engine, notify)
        assert target.notifies() == [(n.name, n.msg) for n in sent]
        assert target.notifies() == []

    @pytest.mark.timeout(60)
    def test_notify_after_async_writes_sees_the_data(self, engine: Engine, target: TargetProcess, src: np.ndarray) -> None:
        """When the target sees a notification, the data of every WRITE started before it is
        there: checked in the child, the moment the notification arrives."""
        piece, count, roff = 4 * MiB, 8, 1
        size = piece * count
        target.write(DST, roff, bytes(size))
        target.notifies()
        seen: dict[str, Any] = {}

        def watch() -> None:
            seen["result"] = target.wait_notifies(20.0, DST, roff, size)

        watcher = threading.Thread(target=watch)
        watcher.start()
        # Several requests queued ahead of the notification, so that one that did
        # not wait for them would overtake most of them.
        reqs = [
            engine.transfer_async(
                target.engine, Op.WRITE, [(_addr(src) + 2 + i * piece, target.addrs[DST] + roff + i * piece, piece)]
            )
            for i in range(count)
        ]
        engine.send_notify(target.engine, NotifyDesc("kv", "ready"))
        watcher.join(30)
        assert not watcher.is_alive()
        notifies, snapshot = seen["result"]
        assert notifies == [("kv", "ready")]
        assert np.array_equal(np.frombuffer(snapshot, dtype=np.uint8), src[2 : 2 + size])
        for req in reqs:
            assert req.wait(30) is TransferStatus.COMPLETED

    # -- registrations ----------------------------------------------------------------
    def test_registration_after_connect(self, engine: Engine, target: TargetProcess, src: np.ndarray) -> None:
        size = MiB + 123
        addr = target.add_buffer(size)
        index = len(target.addrs) - 1
        # No reconnect, no explicit refresh: the transfer right away must work.
        engine.transfer_sync(target.engine, Op.WRITE, [(_addr(src) + 9, addr, size)])
        landed = np.frombuffer(target.read(index, 0, size), dtype=np.uint8)
        assert np.array_equal(landed, src[9 : 9 + size])
        assert MemDesc(addr, size) in engine.remote_mems(target.engine)
        target.deregister(index)

    @pytest.mark.parametrize("op", [Op.WRITE, Op.READ], ids=["WRITE", "READ"])
    @pytest.mark.parametrize("form", ["tuples", "array"])
    def test_deregistered_range_is_refused(self, target: TargetProcess, op: Op, form: str) -> None:
        """A transfer started after the target's deregister_mem returned is refused, and moves nothing.

        Fault injection: the target's REGIONS updates reach the initiator late (as over a slow
        network; :attr:`FaultyTransport.late_regions`), so the refusal can't lean on them having arrived.
        """
        size = 4096
        local = empty(size)  # a WRITE's source and a READ's destination: the sentinel shows what moved
        faulty = FaultyTransport(self.make_transport())
        with self.make_initiator(transport=faulty) as eng:
            eng.register_mem(local)
            eng.connect(target.engine)
            for round_ in range(3):
                addr = target.add_buffer(size)
                index = len(target.addrs) - 1
                target.write(index, 0, bytes([round_]) * size)
                eng.transfer_sync(target.engine, Op.READ, [(_addr(local), addr, size)])  # usable before
                local.fill(_SENTINEL)
                pair = (_addr(local), addr, size)
                descs: Any = [pair] if form == "tuples" else np.array([pair], dtype=np.uint64)
                faulty.late_regions = 0.1
                target.deregister(index)
                with pytest.raises(MemoryRangeError):
                    eng.transfer_sync(target.engine, op, descs)
                faulty.late_regions = 0.0
                assert target.read(index, 0, size) == bytes([round_]) * size  # the target's memory is unchanged
                assert (local == _SENTINEL).all()  # and nothing landed here
                assert MemDesc(addr, size) not in eng.remote_mems(target.engine)

    # -- ranges outside registered memory ---------------------------------------------
    @staticmethod
    def _outside(regions: list[MemDesc]) -> list[tuple[int, int]]:
        """(addr, len) ranges outside every one of ``regions``.

        Buffers from separate mappings may sit back to back (and then count as
        one region), so "just past a buffer" is taken at the extremes of the
        registered span, where no registration can be.
        """
        low = min(r.addr for r in regions)
        high = max(r.addr + r.len for r in regions)
        return [
            (high - 10, 11),  # runs one byte past the end of a region
            (high, 1),  # starts right after it
            (low - 1, 16),  # starts one byte before a region
            (4096, 16),  # nowhere near any region
        ]

    def test_remote_range_outside_regions_moves_nothing(
        self, engine: Engine, target: TargetProcess, src: np.ndarray, dst: np.ndarray
    ) -> None:
        target.write(SCRATCH, 0, bytes(4096))
        for remote, size in self._outside(engine.remote_mems(target.engine)):
            # A valid descriptor first: it must not move either.
            good = (_addr(dst), target.addrs[SCRATCH], 4096)
            with pytest.raises(MemoryRangeError):
                engine.transfer_sync(target.engine, Op.READ, [good, (_addr(dst) + 8192, remote, size)])
            assert (dst[: 8192 + size] == _SENTINEL).all()
            good = (_addr(src), target.addrs[SCRATCH], 4096)
            with pytest.raises(MemoryRangeError):
                engine.transfer_sync(target.engine, Op.WRITE, [good, (_addr(src), remote, size)])
            with pytest.raises(MemoryRangeError):
                engine.transfer_async(target.engine, Op.WRITE, [good, (_addr(src), remote, size)])
            assert target.read(SCRATCH, 0, 4096) == bytes(4096)

    def test_local_range_outside_registrations_moves_nothing(
        self, engine: Engine, target: TargetProcess, dst: np.ndarray
    ) -> None:
        unregistered = empty(4096)
        unregistered.fill(_SENTINEL)
        target.write(SCRATCH, 0, bytes(4096))
        outside = [(_addr(unregistered), 4096), *self._outside(engine.local_mems())]
        for local, size in outside:
            good_read = (_addr(dst), target.addrs[SRC], 4096)
            with pytest.raises(MemoryRangeError):
                engine.transfer_sync(target.engine, Op.READ, [good_read, (local, target.addrs[SRC], size)])
            assert (dst[:4096] == _SENTINEL).all()
            assert (unregistered == _SENTINEL).all()
            good_write = (_addr(dst), target.addrs[SCRATCH], 4096)
            with pytest.raises(MemoryRangeError):
                engine.transfer_sync(target.engine, Op.WRITE, [good_write, (local, target.addrs[SCRATCH] + 4096, size)])
            assert target.read(SCRATCH, 0, 4096) == bytes(4096)

    def test_wrapping_range_is_refused(self, engine: Engine, target: TargetProcess, dst: np.ndarray) -> None:
        top = (1 << 64) - 8
        with pytest.raises(ParamInvalid):
            engine.transfer_sync(target.engine, Op.READ, np.array([[_addr(dst), top, 16]], dtype=np.uint64))
        with pytest.raises(ParamInvalid):
            engine.transfer_sync(target.engine, Op.WRITE, np.array([[top, target.addrs[SCRATCH], 16]], dtype=np.uint64))
        assert (dst[:4096] == _SENTINEL).all()
