"""``hixl bench --scenario fleet``: one target engine, many authenticated TCP peers.

What a prefill instance serving a fleet of decode instances (and their TP
ranks) sees. A target in a child process (its connection limits raised to
fit) is connected to by ``--peers`` engines spread over ``--peer-processes``
child processes, all on 127.0.0.1. Measured, against what it would be with
one peer where a ratio makes sense:

- the target's thread count, RSS growth and idle CPU with every peer connected and idle;
- ``register_mem`` / ``deregister_mem`` on the target with every peer connected (medians; the
  command reaches the target over a pipe, whose round trip, ~0.1 ms, is included);
- the 8-byte ``transfer_sync`` READ latency of one peer, with every peer connected vs alone;
- 64 peers (``--readers``) READing 1 MiB at a time at once: aggregate throughput vs one peer
  alone, and the slowest peer's share vs the fastest's (fairness).
"""

from __future__ import annotations

import os
import resource
import time
from contextlib import ExitStack

from .. import MemDesc
from ..testing import TargetProcess
from . import procstat
from .config import BenchConfig
from .progress import Progress
from .results import Row, ScenarioResult, Target, median
from .fleet_peers import PeerGroup

__all__ = ["describe", "run"]

MiB = 1 << 20
_READ_SIZE = MiB


def _knobs(config: BenchConfig) -> tuple[int, int, int, float]:
    """Peers, peer processes, readers, seconds per throughput figure."""
    extra = config.extra
    peers = int(extra.get("fleet_peers", 40 if config.quick else 1000))  # type: ignore[call-overload]
    processes = int(extra.get("fleet_processes", 2 if config.quick else 4))  # type: ignore[call-overload]
    readers = min(peers, int(extra.get("fleet_readers", 8 if config.quick else 64)))  # type: ignore[call-overload]
    return peers, max(1, min(processes, peers)), readers, 1.0 if config.quick else 4.0


def describe(config: BenchConfig) -> str:
    """The scenario's shape, for the report's header."""
    peers, processes, readers, seconds = _knobs(config)
    return f"fleet: {peers} TCP peers from {processes} processes, {readers} readers for {seconds:g} s"


def _raise_fd_limit(needed: int) -> None:
    """Children inherit this process's fd limit: make it fit ``needed`` descriptors, if allowed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(needed, soft), hard), hard))


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _idle_cpu(pid: int, seconds: float) -> float:
    """Percent of one core the process used over ``seconds`` of idleness."""
    before, start = procstat.cpu_ns(pid), time.perf_counter()
    time.sleep(seconds)
    return 100.0 * (procstat.cpu_ns(pid) - before) / ((time.perf_counter() - start) * 1e9)


def _register_times(target: TargetProcess, repeat: int) -> tuple[list[float], list[float]]:
    """Seconds per register_mem and per deregister_mem of a 4 KiB range of the target's buffer."""
    registers, deregisters = [], []
    region = MemDesc(target.addrs[0] + 8 * MiB, 4096)  # a range of its own: registered, then not
    for _ in range(repeat):
        start = time.perf_counter()
        handle = target.call("register_mem", region)
        registers.append(time.perf_counter() - start)
        start = time.perf_counter()
        target.call("deregister_mem", handle)
        deregisters.append(time.perf_counter() - start)
    return registers, deregisters


def _read_rate(groups: list[PeerGroup], readers: int, addr: int, seconds: float) -> list[float]:
    """Bytes/s of each of ``readers`` peers (spread over ``groups``) reading at once."""
    per_group = [readers // len(groups) + (1 if i < readers % len(groups) else 0) for i in range(len(groups))]
    active = [(g, n) for g, n in zip(groups, per_group) if n]
    for group, count in active:  # all started before any is waited for: they read at once
        group.start_reading(count, addr, _READ_SIZE, seconds)
    return [moved / seconds for group, _ in active for moved in group.bytes_read()]


def run(config: BenchConfig, progress: Progress) -> ScenarioResult:
    """Measure the fleet figures (see the module docstring)."""
    peers, processes, readers, seconds = _knobs(config)
    repeat = 5 if config.quick else 21
    iterations = 200 if config.quick else 2000
    progress.expect(6)
    _raise_fd_limit(peers * 2 + 512)
    limits = {
        "max_connections": peers + 16,
        "max_connections_per_peer": peers + 16,
        "transport": "tcp",
    }
    peer_options = {"transport": "tcp"}
    rows: list[Row] = []

    def row(name: str, value: float, unit: str, target: Target | None = None, baseline: float | None = None,
            baseline_name: str = "", note: str = "") -> None:
        rows.append(Row(name, "tcp", "-", None, value, unit, baseline, baseline_name, target, "fleet", note))

    with ExitStack() as stack:
        target = stack.enter_context(TargetProcess([64 * MiB], limits))
        groups = [stack.enter_context(PeerGroup(target.engine, peer_options)) for _ in range(processes)]
        with progress.step("one peer"):
            groups[0].open(1)
            groups[0].latency(target.addrs[0], iterations)  # warm-up: first calls pay for imports and caches
            alone = median(groups[0].latency(target.addrs[0], iterations))
            single_rate = _read_rate(groups[:1], 1, target.addrs[0], seconds)[0]
            threads_before, memory_before = _threads(target.pid), procstat.memory(target.pid)
        with progress.step(f"connect {peers} peers"):
            started = time.perf_counter()
            for index, group in enumerate(groups):
                share = peers // processes + (1 if index < peers % processes else 0) - (1 if index == 0 else 0)
                group.open(share)
            connect_seconds = time.perf_counter() - started
        with progress.step("idle"):
            time.sleep(1.0)  # the connects' own work settles
            idle = _idle_cpu(target.pid, config.idle_seconds)
            threads, grown = _threads(target.pid), procstat.memory(target.pid).rss - memory_before.rss
        with progress.step("register/deregister"):
            registers, deregisters = _register_times(target, repeat)
        with progress.step("latency"):
            crowded = median(groups[0].latency(target.addrs[0], iterations))
        with progress.step(f"{readers} readers"):
            rates = _read_rate(groups, readers, target.addrs[0], seconds)
    row(f"target threads, {peers} peers connected", threads, "threads", Target("<=", 16, on="value"),
        note=f"{threads_before} with one peer")
    row(f"target RSS growth, {peers} peers connected", grown / MiB, "MiB", Target("<=", 64, on="value"))
    row(f"target idle CPU, {peers} idle peers", idle, "% core", Target("<", 2, on="value"))
    row(f"register_mem, {peers} peers connected", median(registers) * 1e3, "ms", Target("<=", 100, on="value"))
    row(f"deregister_mem, {peers} peers connected", median(deregisters) * 1e3, "ms", Target("<=", 100, on="value"))
    row(f"8 B READ transfer_sync, {peers} peers connected", crowded * 1e6, "µs", Target("<=", 1.2),
        alone * 1e6, "one peer connected")
    aggregate = sum(rates)
    row(f"{readers} peers reading 1 MiB at once, aggregate", aggregate / 2**30, "GiB/s", Target(">=", 0.9),
        single_rate / 2**30, "one peer alone")
    row(f"{readers} peers reading at once, slowest share", min(rates) / 2**30, "GiB/s", Target(">=", 0.5),
        max(rates) / 2**30, "fastest peer")
    notes = [f"fleet: {peers} peers connected in {connect_seconds:.1f} s"]
    return ScenarioResult(rows, notes)
