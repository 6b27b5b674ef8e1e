"""``hixl bench --scenario ps``: a parameter server's random row gathers, one-sided against two-sided.

A table of ``--rows`` rows of 256 bytes (1 Mi rows, 256 MiB, by default;
:mod:`hixl.bench.ps_server`) is served by a child process twice: as a hixl
:class:`~hixl.weights.Table` and, for the baseline, by a Python + numpy RPC
server in another child that answers each batch of indices with the gathered
rows over a TCP socket. This process is the worker. For each transport (forced
on the worker's client-only engine) two contenders are timed interleaved
(:func:`hixl.bench.timing.interleaved_reps`), each repetition the same batches
of 1024 random row indices:

* ``pull_rows`` — :meth:`Subscriber.pull_rows <hixl.weights.Subscriber.pull_rows>`,
  one batched READ per batch (and the row checks: sequence word and hash);
* ``rpc`` — one request and its answer per batch.

During each repetition the CPU time of the serving process is read from
``/proc`` (:mod:`hixl.bench.procstat`). Rows per transport: rows/s of
``pull_rows`` against the RPC server's (target >= 2x), and the server's CPU
(% of one core) during ``pull_rows`` next to the RPC server's during its own
(target on cma and shm: <= 2 %, i.e. none — one-sided reads need no server CPU).

Before anything is timed, a few batches of each contender are compared byte for
byte with the table's known contents; a mismatch aborts the run.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from contextlib import ExitStack

import numpy as np

from .. import Engine
from ..weights import Subscriber
from . import procstat
from .config import BenchConfig, format_size
from .progress import Progress
from .ps_server import ROW_WORDS, TABLE_NAME, RpcClient, ServerProcess, expected_rows
from .results import Row, ScenarioResult, Target, median
from .timing import SelfTimed, interleaved_reps

__all__ = ["BATCH", "FULL_ROWS", "QUICK_ROWS", "describe", "knobs", "run"]

FULL_ROWS = 1 << 20
QUICK_ROWS = 1 << 14
BATCH = 1024
ROW_BYTES = 8 * ROW_WORDS

# The targets.
VS_RPC = Target(">=", 2.0)
IDLE_SERVER = Target("<=", 2.0, on="value")  # % of one core: on cma and shm the server takes no part

TIMEOUT = 60.0
_CHECKED_BATCHES = 4


def knobs(config: BenchConfig) -> tuple[int, int]:
    """Table rows, and batches per timed repetition."""
    rows = int(config.extra.get("ps_rows", QUICK_ROWS if config.quick else FULL_ROWS))  # type: ignore[call-overload]
    return rows, 20 if config.quick else 400


def describe(config: BenchConfig) -> str:
    """One line for the run's header."""
    rows, batches = knobs(config)
    return (
        f"ps table {rows} rows x {ROW_BYTES} B ({format_size(rows * ROW_BYTES)}), {batches} random batches of "
        f"{BATCH} rows per repetition"
    )


class _Worker:
    """This process's side of one transport: both contenders, their checks, and the servers' CPU."""

    def __init__(self, transport: str, table: ServerProcess, rpc: ServerProcess, batches: np.ndarray) -> None:
        self.transport, self.table, self.rpc, self.batches = transport, table, rpc, batches
        self.engine = Engine("127.0.0.1", {"transport": transport})  # a worker only reads: client-only
        self.subscriber = Subscriber(self.engine, table.address, timeout=TIMEOUT)
        self.client = RpcClient(rpc.address)
        self.out = np.zeros((BATCH, ROW_WORDS), dtype=np.uint64)
        self.cpu: dict[str, list[tuple[int, int]]] = {"pull_rows": [], "rpc": []}
        """Per timed repetition: (server CPU ns, wall ns)."""

    def pull_rows(self, indices: np.ndarray) -> None:
        """One hixl gather."""
        self.subscriber.pull_rows(TABLE_NAME, indices, self.out, timeout=TIMEOUT)

    def rpc_gather(self, indices: np.ndarray) -> None:
        """One RPC gather."""
        self.client.gather(indices, self.out)

    def check(self, name: str, gather: Callable[[np.ndarray], None]) -> None:
        """Gather a few batches and compare every byte with the table's contents; raises on a mismatch."""
        for indices in self.batches[:_CHECKED_BATCHES]:
            self.out.fill(0)
            gather(indices)
            wrong = np.flatnonzero((self.out != expected_rows(indices)).any(axis=1))
            if len(wrong):
                raise RuntimeError(
                    f"ps self-check failed on {self.transport}: {name} returned wrong bytes in row "
                    f"{int(indices[wrong[0]])} ({len(wrong)} of {len(indices)} rows wrong)"
                )

    def timed(self, name: str, gather: Callable[[np.ndarray], None], server_pid: int) -> SelfTimed:
        """``gather`` as a contender: ``calls`` batches, the server's CPU recorded alongside."""

        def repetition(calls: int) -> int:
            batches = self.batches
            cpu, start = procstat.cpu_ns(server_pid), time.perf_counter_ns()
            for i in range(calls):
                gather(batches[i % len(batches)])
            wall = time.perf_counter_ns() - start
            self.cpu[name].append((procstat.cpu_ns(server_pid) - cpu, wall))
            return wall

        return SelfTimed(repetition)

    def close(self) -> None:
        self.client.close()
        self.subscriber.close()
        self.engine.finalize()


def _cpu_percent(samples: list[tuple[int, int]]) -> float:
    """The server's CPU over the timed repetitions, in % of one core."""
    return 100.0 * sum(cpu for cpu, _ in samples) / max(1, sum(wall for _, wall in samples))


def run(config: BenchConfig, progress: Progress) -> ScenarioResult:
    """Run the ``ps`` scenario (see the module docstring) and return its rows."""
    rows, per_rep = knobs(config)
    progress.expect(1 + len(config.transports))
    batches = np.random.default_rng(0).integers(0, rows, size=(per_rep, BATCH), dtype=np.int64)
    out: list[Row] = []
    notes: list[str] = []
    with ExitStack() as stack:
        with progress.step(f"ps: fill a {format_size(rows * ROW_BYTES)} table in two servers"):
            table = stack.enter_context(ServerProcess("table", rows))
            rpc = stack.enter_context(ServerProcess("rpc", rows))
        for transport in config.transports:
            with progress.step(f"ps {transport}: gathers of {BATCH} rows"):
                worker = _Worker(transport, table, rpc, batches)
                try:
                    if worker.engine.transport_of(table.address) != transport:  # forced; never measure another
                        raise RuntimeError(f"asked for {transport}, connected over {worker.engine.transport_of(table.address)}")
                    worker.check("pull_rows", worker.pull_rows)
                    worker.check("the RPC server", worker.rpc_gather)
                    contenders = {
                        "pull_rows": worker.timed("pull_rows", worker.pull_rows, table.pid),
                        "rpc": worker.timed("rpc", worker.rpc_gather, rpc.pid),
                    }
                    times = interleaved_reps(contenders, per_rep, config.repeat, config.warmup)
                    out += _rows(transport, times, worker.cpu, per_rep)
                finally:
                    worker.close()
    if rows != FULL_ROWS:
        notes.append(f"ps: scaled-down table ({describe(config)}); the issue's has at least {FULL_ROWS} rows")
    return ScenarioResult(out, notes)


def _rows(transport: str, times: dict[str, list[int]], cpu: dict[str, list[tuple[int, int]]], per_rep: int) -> list[Row]:
    def rows_per_s(name: str) -> float:
        return per_rep * BATCH / (median(times[name]) / 1e9)

    row = functools.partial(Row, transport=transport, op="READ", size=BATCH * ROW_BYTES, scenario="ps")
    return [
        row(
            name=f"pull_rows, {BATCH}-row batches",
            value=rows_per_s("pull_rows"),
            unit="rows/s",
            baseline=rows_per_s("rpc"),
            baseline_name="two-sided RPC server (Python + numpy, TCP)",
            target=VS_RPC,
        ),
        row(
            name="server CPU during gathers",
            value=_cpu_percent(cpu["pull_rows"][-len(times["pull_rows"]) :]),
            unit="% core",
            baseline=_cpu_percent(cpu["rpc"][-len(times["rpc"]) :]),
            baseline_name="the RPC server's during its gathers",
            target=IDLE_SERVER if transport in ("cma", "shm") else None,
            note="table server idle: one-sided reads" if transport in ("cma", "shm") else "the target serves each READ",
        ),
    ]
