"""The ``engine`` scenario: hixl's Engine measured against the raw calls it is built on.

First a memcpy reference (aligned, and with source and destination a few
bytes apart in page offset). Then, for each transport, on one fresh
connection to the bench target (:mod:`hixl.bench.target`):

1. **RSS** — move ``rss_size`` bytes READ then WRITE and report how much
   each side's peak RSS grew (zero-copy means: not at all). The same
   transfer is the run's self-check that the right bytes arrived.
2. **Bandwidth** — single transfers of each size, READ and WRITE, against a
   bare ``process_vm_readv``/``writev`` loop (cma; up to
   :data:`hixl._accel.PROC_MEM_MAX` bytes, the ``pread``/``pwrite`` on
   ``/proc/<pid>/mem`` that hixl makes there), a plain socket stream
   (tcp) over the *same* buffers, or a memcpy of the same bytes (shm: the
   initiator copies in its own process, through its mapping of the target's
   pool memory; the baseline maps that very memory too and copies it with one memcpy
   — from 16 MiB also with glibc's streaming stores, in a helper process
   (:mod:`hixl.bench.streaming_memcpy`), and the faster of the two is the baseline).
   From 16 MiB, cma also reports "raw lanes": the same range cut over ``copy_lanes``
   threads of bare syscalls, the ceiling the copy lanes are held to.
3. **Alignment** (cma) — READ with the remote source shifted by a few bytes.
4. **Latency** — every ``transfer_sync`` of 8 B / 4 KiB timed alone, against
   one raw syscall (cma: the ``pread``/``pwrite`` on ``/proc/<pid>/mem`` hixl
   makes for these, with one ``process_vm_*`` call beside it for reference),
   one raw 8-byte request/response (tcp) or one memcpy (shm), in alternating
   bursts (:func:`~hixl.bench.timing.interleaved_latency`).
5. **Batch** — a paged KV cache in miniature: many 16 KiB blocks, shuffled
   on both sides so nothing merges, against IOV_MAX-per-call raw batches (cma),
   the same bytes streamed (tcp) or a numpy gather of the same blocks (shm).
6. **Idle CPU** of both processes while the connection sits unused.

With tcp among the transports, TCP with ``encrypt=True`` is then measured against plaintext TCP
in the same run, READ and WRITE from 16 MiB (:mod:`hixl.bench.encrypt_bench`).

With ``target_netns`` (``--target-netns``) the TCP phases run once more, as transport
``tcp-veth``: the target in a network namespace of its own (:class:`hixl.testing.hosts.Hosts`),
reached over a veth pair and a bridge (a 1500-byte MTU, as on an Ethernet link between hosts,
where loopback has 64 KiB), and the raw stream over the same path.

Buffers come from :func:`hixl.empty` (page-aligned; the target's from the
shared-memory pool for shm), are filled before anything is timed, and are
freed after each phase.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import PAGE_SIZE, Engine, HixlError, Op, TransferOpDesc, _accel, empty
from ..testing.hosts import Hosts
from .baselines import (
    Copier,
    RawStream,
    cma_batch_copier,
    cma_copier,
    cma_lanes_copier,
    gather_copier,
    memcpy_copier,
    proc_mem_copier,
    proc_mem_opens,
)
from .config import BenchConfig, format_size
from .encrypt_bench import encrypted_rows, encrypted_sizes
from .procstat import cpu_ns, memory, reset_peak_rss
from .progress import Progress
from .results import Row, ScenarioResult, Target, median, percentile
from .streaming_memcpy import NON_TEMPORAL_FROM, StreamingMemcpy, streaming_stores_here
from .target import BenchTarget, RemoteBuffer, sample_bytes
from .timing import SelfTimed, interleaved_latency, interleaved_reps

__all__ = ["VETH", "run"]

SCENARIO = "engine"
VETH = "tcp-veth"
"""The rows' transport when the target is in another network namespace (``--target-netns``)."""
MiB = 1 << 20
OPS = (Op.READ, Op.WRITE)
_PROCESS_VM = {Op.READ: "process_vm_readv", Op.WRITE: "process_vm_writev"}

# The issues' targets: hixl may cost this much relative to the raw calls (issue 14's for cma and tcp).
# cma against one raw process_vm_* call of the same bytes, by size (the smallest size a target
# applies from): from 16 MiB the copy lanes must beat one syscall.
CMA_LANES_FROM = 16 * MiB
CMA_BANDWIDTH = ((CMA_LANES_FROM, Target(">=", 1.4)), (1 * MiB, Target(">=", 0.9)), (64 * 1024, Target(">=", 0.9)), (4096, Target(">=", 0.7)))
# TCP against a plain socket stream, by size:
TCP_BANDWIDTH = ((16 * MiB, Target(">=", 0.95)), (1 * MiB, Target(">=", 0.8)), (64 * 1024, Target(">=", 0.5)))
TCP_LATENCY = Target("<=", 2.0)  # transfer_sync 8 B / 4 KiB against an 8-byte socket round trip
CMA_BATCH = Target(">=", 0.85)
CMA_LATENCY = Target("<=", 1.3)
SHM_BANDWIDTH = Target(">=", 0.9)  # single transfers >= 1 MiB, against the faster memcpy of the same bytes
SHM_BANDWIDTH_FROM = 1 * MiB
STREAMING_MEMCPY = "memcpy, streaming stores, same bytes"  # shm's other baseline (when it is the faster)
SHM_BATCH = Target(">=", 0.85)  # against a numpy gather of the same blocks
# Absolute limits hold at any size, so a --quick smoke run judges them too.
IDLE_CPU = Target("<", 1.0, on="value", in_smoke=True)  # % of one core
RSS_GROWTH = Target("<", 16.0, on="value", in_smoke=True)  # MiB


def run(config: BenchConfig, progress: Progress) -> ScenarioResult:
    """Run the scenario (see the module docstring) and return its rows."""
    veth = ("tcp",) if config.target_netns else ()
    encrypted = 2 * len(encrypted_sizes(config)) if "tcp" in config.transports else 0
    progress.expect(1 + sum(_transport_steps(config, t) for t in (*config.transports, *veth)) + encrypted)
    result = ScenarioResult(_memcpy_rows(config, progress), [])
    with BenchTarget() as target:
        for transport in config.transports:
            _measure(result, _Setup(transport, target), config, progress)
    if encrypted:
        rows, notes = encrypted_rows(config, progress, SCENARIO)
        result.rows += rows
        result.notes += notes
    if veth:
        # Its own address, so the engines may only talk with a secret: a fresh one for the run.
        secret = {"auth_secret": secrets.token_hex(16)}
        with Hosts(1, here=True) as hosts, BenchTarget(secret, host=hosts[0]) as target:
            _measure(result, _Setup("tcp", target, hosts[1].ip, VETH, secret), config, progress)
    return result


def _measure(result: ScenarioResult, setup: _Setup, config: BenchConfig, progress: Progress) -> None:
    """Run one transport's phases into ``result`` (or note why it could not connect)."""
    try:
        bench = _TransportBench(setup, config, progress)
    except HixlError as exc:
        result.notes.append(f"{setup.label}: skipped, the target is unreachable this way ({exc})")
        progress.skip(_transport_steps(config, setup.transport))
        return
    with bench:
        bench.run()
    result.rows += bench.rows
    result.latency_samples.update(bench.latency_samples)


def _transport_steps(config: BenchConfig, transport: str) -> int:
    alignment = 1 if transport == "cma" else 0
    return 1 + 2 * len(config.sizes) + alignment + 2 * len(config.latency_sizes) + 2 + 1


def _iterations(config: BenchConfig, nbytes: int) -> int:
    """Transfers per timed repetition: enough bytes to time reliably, not too many calls."""
    return max(1, min(config.max_iterations, config.bytes_per_rep // nbytes))


def _gib_per_s(nbytes: int, ns: float) -> float:
    return nbytes / (ns / 1e9) / (1 << 30)


def _descs(local_addr: int, remote_addr: int, nbytes: int) -> list[TransferOpDesc]:
    """One transfer, in the form an application writes it (and the one the engine's latency path takes)."""
    return [TransferOpDesc(int(local_addr), int(remote_addr), int(nbytes))]


def _alignments(offset: int) -> dict[str, tuple[int, int]]:
    """(source, destination) byte offsets from page alignment for each alignment case."""
    return {"aligned": (0, 0), "src": (offset, 0), "dst": (0, offset)}


def _misaligned_rows(
    times: dict[str, list[int]], nbytes: int, iterations: int, transport: str, op: str, what: str, offset: int
) -> list[Row]:
    """One row per misaligned case (``nbytes`` per transfer), its bandwidth against the aligned one."""
    aligned = _gib_per_s(nbytes * iterations, median(times["aligned"]))
    return [
        Row(
            f"misaligned {case}",
            transport,
            op,
            nbytes,
            _gib_per_s(nbytes * iterations, median(times[case])),
            "GiB/s",
            baseline=aligned,
            baseline_name=f"aligned {what}",
            scenario=SCENARIO,
            note=f"{case} page offset +{offset} B",
        )
        for case in ("src", "dst")
    ]


def _memcpy_rows(config: BenchConfig, progress: Progress) -> list[Row]:
    n = config.align_size
    iterations = _iterations(config, n)
    with progress.step(f"memcpy {format_size(n)}"):
        dst, src = empty(n + PAGE_SIZE), empty(n + PAGE_SIZE)
        dst.fill(1)
        src.fill(2)
        copiers = {
            case: memcpy_copier(dst[d : d + n], src[s : s + n])
            for case, (s, d) in _alignments(config.align_offset).items()
        }
        times = interleaved_reps(copiers, iterations, config.repeat, config.warmup)
    aligned = _gib_per_s(n * iterations, median(times["aligned"]))
    reference = Row(
        "memcpy", "local", "copy", n, aligned, "GiB/s", scenario=SCENARIO, note="memcpy, page-aligned"
    )
    return [reference, *_misaligned_rows(times, n, iterations, "local", "copy", "memcpy", config.align_offset)]


@dataclass(frozen=True)
class _Setup:
    """What one transport's phases run against: the target, and how this side reaches it."""

    transport: str
    target: BenchTarget
    local_ip: str = "127.0.0.1"
    label: str = ""
    """The rows' transport column (default: ``transport``)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Options of the initiator engine, besides ``transport``."""


class _TransportBench:
    """One transport's phases over one initiator engine connected to the bench target."""

    def __init__(self, setup: _Setup, config: BenchConfig, progress: Progress) -> None:
        self.transport = transport = setup.transport
        self.label = setup.label or transport
        self.target = target = setup.target
        self.config = config
        self.progress = progress
        self.engine = Engine(setup.local_ip, {**setup.options, "transport": transport})
        # shm is chosen at connect only if the target has pool memory registered then.
        self._anchor = target.alloc(PAGE_SIZE, shared=True) if transport == "shm" else None
        self._mirror: np.ndarray | None = None  # shm: the target's buffer, mapped here, for the baselines
        self._streaming: StreamingMemcpy | None = None  # shm: the same, copied with streaming stores elsewhere
        # cma: up to PROC_MEM_MAX bytes, hixl (and so the baseline) copies through /proc/<pid>/mem where it opens.
        self._proc_mem_max = _accel.PROC_MEM_MAX if transport == "cma" and proc_mem_opens(target.pid) else 0
        try:
            self.engine.connect(target.engine)
            self.stream = RawStream(target.raw_address) if transport == "tcp" else None
            self.echo = RawStream(target.raw_address, echo=True) if transport == "tcp" else None
        except BaseException:
            self.engine.finalize()
            self._free_anchor()
            raise
        self.rows: list[Row] = []
        self.latency_samples: dict[tuple[str, str, int, str], list[float]] = {}

    def __enter__(self) -> _TransportBench:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for raw in (self.stream, self.echo):
            if raw is not None:
                raw.close()
        self.engine.finalize()
        self._free_anchor()

    def _free_anchor(self) -> None:
        if self._anchor is not None:
            self.target.free(self._anchor)
            self._anchor = None

    def run(self) -> None:
        """Every phase, in order, into ``rows`` and ``latency_samples``."""
        self._big_buffer_phases()
        self._latency_phase()
        self._batch_phase()
        self._idle_phase()

    # -- helpers ---------------------------------------------------------------------------
    def _row(
        self,
        name: str,
        op: str,
        size: int | None,
        value: float,
        unit: str,
        *,
        baseline: float | None = None,
        baseline_name: str = "",
        target: Target | None = None,
        note: str = "",
    ) -> None:
        self.rows.append(
            Row(name, self.label, op, size, value, unit, baseline, baseline_name, target, SCENARIO, note)
        )

    @contextlib.contextmanager
    def _buffers(self, size: int, seed: int) -> Iterator[tuple[np.ndarray, RemoteBuffer]]:
        """A local and a target buffer of ``size`` bytes, filled and registered; freed afterwards."""
        local = empty(size)
        local.fill(0x11)
        handle = self.engine.register_mem(local)
        shm = self.transport == "shm"
        try:
            remote = self.target.alloc(size, seed, shared=shm)
            try:
                if shm:
                    self._mirror = self.target.mapped(remote)
                # The first transfer after a registration may set up state (shm maps the new memory):
                # done here, untimed.
                self.engine.transfer_sync(self.target.engine, Op.READ, _descs(int(local.ctypes.data), remote.addr, 1))
                yield local, remote
            finally:
                self._mirror = None
                self.target.free(remote)
        finally:
            self.engine.deregister_mem(handle)

    @contextlib.contextmanager
    def _streaming_baseline(self, remote: RemoteBuffer) -> Iterator[None]:
        """shm, where glibc has streaming stores and the run copies ``NON_TEMPORAL_FROM`` bytes or
        more: meanwhile ``_streaming`` is a helper copying ``remote`` with them (:mod:`.streaming_memcpy`)."""
        if self._mirror is None or not streaming_stores_here() or self.config.largest < NON_TEMPORAL_FROM:
            yield
            return
        with StreamingMemcpy(self.target.memfd_path(remote), remote.size) as helper:
            self._streaming = helper
            try:
                yield
            finally:
                self._streaming = None

    def _hixl(self, op: Op, descs: list[TransferOpDesc] | np.ndarray) -> Copier:
        sync, peer = self.engine.transfer_sync, self.target.engine

        def copy() -> None:
            sync(peer, op, descs)

        return copy

    def _raw(self, op: Op, local: np.ndarray, remote_addr: int) -> Copier:
        if self.stream is not None:
            return self.stream.copier(op, local.data, remote_addr)
        if self._mirror is not None:
            mirror = self._mirror[: local.nbytes]
            return memcpy_copier(local, mirror) if op is Op.READ else memcpy_copier(mirror, local)
        if local.nbytes <= self._proc_mem_max:  # the call hixl makes for these, bare
            return proc_mem_copier(self.target.pid, op, int(local.ctypes.data), remote_addr, local.nbytes)
        return cma_copier(self.target.pid, op, int(local.ctypes.data), remote_addr, local.nbytes)

    def _raw_name(self, op: Op, nbytes: int) -> str:
        if self.stream is not None:
            return "socket stream"
        if self.transport == "shm":
            return "memcpy, same bytes"
        if nbytes <= self._proc_mem_max:
            return f"{'pread' if op is Op.READ else 'pwrite'} /proc/<pid>/mem"
        return _PROCESS_VM[op]

    # -- phases ----------------------------------------------------------------------------
    def _big_buffer_phases(self) -> None:
        size = self.config.largest + PAGE_SIZE
        with self._buffers(size, seed=7) as (local, remote):
            self._rss(local, remote, seed=7)
            with self._streaming_baseline(remote):
                for op in OPS:
                    for nbytes in self.config.sizes:
                        self._bandwidth(op, nbytes, local, remote)
            if self.transport == "cma":
                self._alignment(local, remote)

    def _rss(self, local: np.ndarray, remote: RemoteBuffer, seed: int) -> None:
        n = self.config.rss_size
        descs = _descs(int(local.ctypes.data), remote.addr, n)
        expected = sample_bytes(seed, n)
        k = len(expected)
        with self.progress.step(f"{self.label} RSS while moving {format_size(n)}"):
            pids = {"initiator": os.getpid(), "target": self.target.pid}
            peak_reset = all([reset_peak_rss(pid) for pid in pids.values()])  # noqa: C419  (reset both, always)
            before = {side: memory(pid) for side, pid in pids.items()}
            self.engine.transfer_sync(self.target.engine, Op.READ, descs)
            read_ok = np.array_equal(local[:k], expected)
            np.bitwise_xor(local[:k], 0xFF, out=local[:k])
            self.engine.transfer_sync(self.target.engine, Op.WRITE, descs)
            after = {side: memory(pid) for side, pid in pids.items()}
            write_ok = self.target.read(remote, 0, k) == local[:k].tobytes()
        if not (read_ok and write_ok):
            raise RuntimeError(f"bench self-check failed on {self.label}: READ ok={read_ok}, WRITE ok={write_ok}")
        for side in pids:
            b, a = before[side], after[side]
            growth = max(a.rss - b.rss, a.hwm - (b.rss if peak_reset else b.hwm), 0)
            self._row(
                f"rss growth {side}",
                "READ+WRITE",
                n,
                growth / MiB,
                "MiB",
                target=RSS_GROWTH,
                note="peak (VmHWM)" if peak_reset else "VmRSS/VmHWM deltas",
            )

    def _bandwidth(self, op: Op, nbytes: int, local: np.ndarray, remote: RemoteBuffer) -> None:
        iterations = _iterations(self.config, nbytes)
        contenders: dict[str, Copier | SelfTimed] = {
            "hixl": self._hixl(op, _descs(int(local.ctypes.data), remote.addr, nbytes)),
            "raw": self._raw(op, local[:nbytes], remote.addr),
        }
        if self._streaming is not None and nbytes >= NON_TEMPORAL_FROM:
            contenders["streaming"] = self._streaming.copier(op, nbytes)
        lanes = int(self.engine.options["copy_lanes"])
        if self.transport == "cma" and nbytes >= CMA_LANES_FROM and lanes > 1:
            # Where the lanes must beat one syscall, what bare syscalls on as many threads reach.
            local_addr = int(local.ctypes.data)
            contenders["raw lanes"] = cma_lanes_copier(self.target.pid, op, local_addr, remote.addr, nbytes, lanes)
        with self.progress.step(f"{self.label} {op.name} {format_size(nbytes)}"):
            times = interleaved_reps(contenders, iterations, self.config.repeat, self.config.warmup)
        if self.transport == "cma":
            target = next((t for floor, t in CMA_BANDWIDTH if nbytes >= floor), None)
        elif self.transport == "shm":
            target = SHM_BANDWIDTH if nbytes >= SHM_BANDWIDTH_FROM else None
        else:
            target = next((t for floor, t in TCP_BANDWIDTH if nbytes >= floor), None)
        speed = {name: _gib_per_s(nbytes * iterations, median(laps)) for name, laps in times.items()}
        versus = {"baseline": speed["raw"], "baseline_name": self._raw_name(op, nbytes)}
        note = ""
        if "streaming" in speed:  # shm: the faster of the two plain copies is the baseline
            note = f"memcpy {speed['raw']:.3g} GiB/s, with streaming stores {speed['streaming']:.3g} GiB/s"
            if speed["streaming"] > speed["raw"]:
                versus = {"baseline": speed["streaming"], "baseline_name": STREAMING_MEMCPY}
        self._row("bandwidth", op.name, nbytes, speed["hixl"], "GiB/s", **versus, target=target, note=note)
        if "raw lanes" in speed:
            note = f"the kernel's ceiling: the range cut in {lanes}, one bare syscall on a thread each"
            self._row("raw lanes bandwidth", op.name, nbytes, speed["raw lanes"], "GiB/s", **versus, note=note)

    def _alignment(self, local: np.ndarray, remote: RemoteBuffer) -> None:
        n, off = self.config.align_size, self.config.align_offset
        iterations = _iterations(self.config, n)
        addr = int(local.ctypes.data)
        with self.progress.step(f"{self.label} READ {format_size(n)} misaligned"):
            # READ: the source is remote, the destination local.
            copiers = {
                case: self._hixl(Op.READ, _descs(addr + d, remote.addr + s, n))
                for case, (s, d) in _alignments(off).items()
            }
            times = interleaved_reps(copiers, iterations, self.config.repeat, self.config.warmup)
        self.rows += _misaligned_rows(times, n, iterations, self.label, "READ", "READ", off)

    def _latency_phase(self) -> None:
        iterations = self.config.iterations
        warmup = max(10, iterations // 10)
        size = max(self.config.latency_sizes) + PAGE_SIZE
        with self._buffers(size, seed=11) as (local, remote):
            for op in OPS:
                for nbytes in self.config.latency_sizes:
                    with self.progress.step(f"{self.label} latency {op.name} {format_size(nbytes)}"):
                        # TCP is judged against a plain 8-byte round trip between the same two processes.
                        raw = self.echo.round_trip() if self.echo is not None else self._raw(op, local[:nbytes], remote.addr)
                        contenders = {
                            "hixl": self._hixl(op, _descs(int(local.ctypes.data), remote.addr, nbytes)),
                            "raw": raw,
                        }
                        if nbytes <= self._proc_mem_max:
                            local_addr = int(local.ctypes.data)
                            contenders["process_vm"] = cma_copier(self.target.pid, op, local_addr, remote.addr, nbytes)
                        samples = interleaved_latency(contenders, iterations, warmup)
                    for contender in ("hixl", "raw"):  # (the plot's curves: the reference is a row only)
                        self.latency_samples[(self.label, op.name, nbytes, contender)] = [t / 1000 for t in samples[contender]]
                    raw_name = "socket round trip, 8 B" if self.echo is not None else f"{self._raw_name(op, nbytes)} (1 call)"
                    median_target = {"cma": CMA_LATENCY, "tcp": TCP_LATENCY}.get(self.transport)
                    for label, pct, target in (("median", 50.0, median_target), ("p99", 99.0, None)):
                        self._row(
                            f"latency {label}",
                            op.name,
                            nbytes,
                            percentile(samples["hixl"], pct) / 1000,
                            "us",
                            baseline=percentile(samples["raw"], pct) / 1000,
                            baseline_name=raw_name,
                            target=target,
                            note=f"transfer_sync, {iterations} calls",
                        )
                    if "process_vm" in samples:
                        self._row(
                            "process_vm latency median",
                            op.name,
                            nbytes,
                            percentile(samples["process_vm"], 50.0) / 1000,
                            "us",
                            baseline=percentile(samples["raw"], 50.0) / 1000,
                            baseline_name=raw_name,
                            note=f"{_PROCESS_VM[op]} (1 call), for reference",
                        )

    def _batch_phase(self) -> None:
        blocks, block = self.config.batch_blocks, self.config.batch_block_size
        total = blocks * block
        with self._buffers(total, seed=13) as (local, remote):
            local_blocks, remote_blocks = _unmergeable_orders(blocks)
            descs = np.empty((blocks, 3), dtype=np.uint64)
            descs[:, 0] = int(local.ctypes.data) + local_blocks * block
            descs[:, 1] = remote.addr + remote_blocks * block
            descs[:, 2] = block
            iterations = _iterations(self.config, total)
            for op in OPS:
                if self.stream is not None:
                    raw, raw_name = self.stream.copier(op, local.data, remote.addr), "socket stream (same bytes)"
                elif self._mirror is not None:
                    raw, raw_name = self._gather(op, local, local_blocks, remote_blocks), "numpy gather, same blocks"
                else:
                    raw = cma_batch_copier(self.target.pid, op, descs[:, [0, 2]], descs[:, [1, 2]])
                    raw_name = f"{_PROCESS_VM[op]} batched"
                with self.progress.step(f"{self.label} batch {op.name} {blocks} x {format_size(block)}"):
                    times = interleaved_reps(
                        {"hixl": self._hixl(op, descs), "raw": raw}, iterations, self.config.repeat, self.config.warmup
                    )
                self._row(
                    "batch",
                    op.name,
                    total,
                    _gib_per_s(total * iterations, median(times["hixl"])),
                    "GiB/s",
                    baseline=_gib_per_s(total * iterations, median(times["raw"])),
                    baseline_name=raw_name,
                    target={"cma": CMA_BATCH, "shm": SHM_BATCH}.get(self.transport),
                    note=f"{blocks} x {format_size(block)} shuffled blocks",
                )

    def _gather(self, op: Op, local: np.ndarray, local_blocks: np.ndarray, remote_blocks: np.ndarray) -> Copier:
        """shm's batch baseline: the same block moves, between the same memory, as one numpy gather.
        Block ``local_blocks[i]`` pairs with ``remote_blocks[i]``; each side is a permutation of all
        blocks, so walking the destination in order is one ``take``."""
        block = self.config.batch_block_size
        mirror = self._mirror
        assert mirror is not None
        here, there = local.reshape(-1, block), mirror[: local.nbytes].reshape(-1, block)
        if op is Op.READ:
            return gather_copier(here, there, remote_blocks[np.argsort(local_blocks)])
        return gather_copier(there, here, local_blocks[np.argsort(remote_blocks)])

    def _idle_phase(self) -> None:
        seconds = self.config.idle_seconds
        pids = {"initiator": os.getpid(), "target": self.target.pid}
        with self.progress.step(f"{self.label} idle CPU for {seconds:g} s"):
            time.sleep(min(0.2, seconds))  # let the last transfer's stragglers finish
            start = {side: cpu_ns(pid) for side, pid in pids.items()}
            t0 = time.perf_counter_ns()
            time.sleep(seconds)
            wall = time.perf_counter_ns() - t0
            used = {side: cpu_ns(pid) - start[side] for side, pid in pids.items()}
        for side in pids:
            self._row(
                f"idle cpu {side}",
                "idle",
                None,
                100.0 * used[side] / wall,
                "% core",
                target=IDLE_CPU,
                note=f"connected, {seconds:g} s",
            )


def _unmergeable_orders(blocks: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Block orders for both sides in which no two neighbouring descriptors are contiguous on both."""
    rng = np.random.default_rng(seed)
    while True:
        local, remote = rng.permutation(blocks), rng.permutation(blocks)
        if blocks < 2 or not ((np.diff(local) == 1) & (np.diff(remote) == 1)).any():
            return local.astype(np.uint64), remote.astype(np.uint64)
