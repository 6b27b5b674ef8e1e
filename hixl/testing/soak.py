"""The soak test: many processes, many transfers, random crashes — and proof that no byte went astray.

:func:`run_soak` starts ``targets`` target processes, which register and
deregister regions under their peers (:mod:`hixl.testing._soak_target`), and
``initiators`` initiator processes, each keeping ``concurrency`` async READs and
WRITEs of random sizes and layouts in flight against all targets, half of them
over cma and half over TCP (:mod:`hixl.testing._soak_initiator`). A DataDist
prefill/decode pair pulls and pushes blocks alongside, each transfer checked
element by element. Every ``fault_interval`` seconds (on average) one process
— a target, an initiator, or the DataDist decode side — is SIGKILLed and
restarted (a target at the same address: a new incarnation there).

The invariants (Jepsen-style: checked from the outside, on real processes):

- every COMPLETED transfer is verified word by word (:mod:`hixl.testing.soakwords`);
- memory that was not registered at the time — guards around and between
  regions, regions in quarantine after deregistration, an initiator's bytes
  outside its descriptors or of a request that failed — holds canary words,
  checked again later: :attr:`SoakReport.corrupted_bytes` must be 0;
- the survivors, finalized, hold no thread, fd or mapping they did not hold
  before their engine started: :attr:`SoakReport.leaks` must be 0.

It also measures how long requests pending on a target that was killed took
to fail (:attr:`SoakReport.death_to_failure`).
"""

from __future__ import annotations

import random
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, cast

import numpy as np

from .._tools.child import ChildProcess
from .leaks import QUIET_MALLOC_ENV

__all__ = ["SoakConfig", "SoakReport", "run_soak"]


@dataclass(frozen=True)
class SoakConfig:
    """What a soak runs: its length, processes, load and fault rate."""

    duration: float = 60.0
    """Seconds of load and faults (setting up and the final checks come on top)."""
    targets: int = 2
    initiators: int = 4
    """Initiator processes; even-numbered ones use cma, odd ones TCP (``transports`` decides)."""
    concurrency: int = 16
    """Requests each initiator keeps in flight."""
    transports: tuple[str, ...] = ("cma", "tcp")
    fault_interval: float = 2.0
    """Mean seconds between two SIGKILLs (0: no faults)."""
    slots: int = 6
    slot_size: int = 1 << 20
    max_len: int = 64 << 10
    """Longest single descriptor."""
    hold: float = 0.5
    """Mean seconds a target keeps a region registered."""
    quarantine: float = 0.3
    """Seconds deregistered memory stays canary before it is checked and reused."""
    datadist: bool = True
    seed: int = 0


@dataclass
class SoakReport:
    """What a soak found. It passed when :attr:`corrupted_bytes` and :attr:`leaks` are 0 and nothing broke."""

    duration: float = 0.0
    transfers: int = 0
    """Requests submitted by the initiators (READ-backs of WRITEs included)."""
    completed: int = 0
    verified: int = 0
    """COMPLETED transfers whose data was checked and found right."""
    verified_bytes: int = 0
    superseded: int = 0
    """COMPLETED transfers whose memory the target re-registered before the check could see it (not errors)."""
    failed: int = 0
    refused: int = 0
    """Requests refused when submitted: the region or the peer had gone."""
    errors: dict[str, int] = field(default_factory=dict)
    """Failed requests by the error they failed with."""
    datadist_verified: int = 0
    datadist_failed: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    """SIGKILLs by victim: ``target``, ``initiator``, ``decode``."""
    death_to_failure: list[float] = field(default_factory=list)
    """Seconds from a target's SIGKILL to the failure of each request pending on it."""
    corrupted_bytes: int = 0
    leaks: int = 0
    violations: list[str] = field(default_factory=list)
    """The first few corruptions, leaks and broken processes, described."""

    @property
    def ok(self) -> bool:
        """No corrupted byte, no leak, nothing else broken, and something was verified."""
        return self.corrupted_bytes == 0 and self.leaks == 0 and not self.violations and self.verified > 0

    def summary(self) -> str:
        """The figures, one per line."""
        lat = self.death_to_failure
        faults = ", ".join(f"{n} {k}" for k, n in sorted(self.faults.items())) or "none"
        lines = [
            f"duration                  {self.duration:.1f} s",
            (
                f"transfers run             {self.transfers} ({self.completed} completed, {self.failed} failed, "
                f"{self.refused} refused at submit)"
            ),
            f"failed with               {', '.join(f'{n} {e}' for e, n in sorted(self.errors.items())) or '-'}",
            (
                f"transfers verified        {self.verified} ({self.verified_bytes / 2**20:.1f} MiB; "
                f"{self.superseded} superseded by re-registration)"
            ),
            f"datadist pulls/pushes     {self.datadist_verified} verified, {self.datadist_failed} failed",
            f"faults injected           {sum(self.faults.values())} SIGKILLs ({faults})",
            "death -> pending failed   "
            + (
                f"median {statistics.median(lat) * 1e3:.1f} ms, max {max(lat) * 1e3:.1f} ms ({len(lat)} requests)"
                if lat
                else "no request was pending on a killed target"
            ),
            f"corrupted bytes           {self.corrupted_bytes}",
            f"leaks                     {self.leaks}",
        ]
        shown = [f"violation: {v}" for v in self.violations[:_SHOWN]]
        if len(self.violations) > _SHOWN:
            shown.append(f"violation: ... and {len(self.violations) - _SHOWN} more (SoakReport.violations)")
        return "\n".join(lines + shown)

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON-able dict."""
        lat = self.death_to_failure
        return {
            **{k: v for k, v in vars(self).items() if k != "death_to_failure"},
            "death_to_failure_s": {
                "count": len(lat),
                "median": statistics.median(lat) if lat else None,
                "max": max(lat) if lat else None,
            },
            "ok": self.ok,
        }


_SHOWN = 12  # violations spelled out in a summary

_COUNTERS = ("transfers", "completed", "verified", "verified_bytes", "superseded", "failed", "refused")
_FROM_CHILD = {"transfers": "submitted"}


class _Proc:
    """One soak child and the last figures it sent."""

    def __init__(self, module: str, config: dict[str, Any]) -> None:
        self.child = ChildProcess(module, 30.0, env=QUIET_MALLOC_ENV)
        try:
            self.child.send(config)
            self.ready = self.child.receive()
        except BaseException:
            self.child.close()  # e.g. a restarted target whose port is not free yet: the caller tries again
            raise
        self.last: dict[str, Any] = {}
        self.final: dict[str, Any] | None = None


class _Soak:
    def __init__(self, config: SoakConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.report = SoakReport()
        self.kills: list[tuple[str, float]] = []  # (target address, monotonic time of SIGKILL)
        self.deaths: list[tuple[str, float, float]] = []
        self.retired: list[dict[str, Any]] = []  # last figures of killed processes
        self.incarnations = 0
        self.targets: list[_Proc] = []
        self.addresses: list[str] = []
        for i in range(config.targets):
            proc = self.start_target(i, "127.0.0.1:0")
            self.targets.append(proc)
            self.addresses.append(proc.ready[1])
        self.initiators = [self.start_initiator(i) for i in range(config.initiators)]

    def start_target(self, index: int, address: str) -> _Proc:
        self.incarnations += 1
        c = self.config
        return _Proc(
            "hixl.testing._soak_target",
            {
                "address": address,
                "seed": self.rng.getrandbits(32),
                "slots": c.slots,
                "slot_size": c.slot_size,
                "hold": c.hold,
                "quarantine": c.quarantine,
                "period": 0.01,
            },
        )

    def start_initiator(self, index: int) -> _Proc:
        self.incarnations += 1
        c = self.config
        return _Proc(
            "hixl.testing._soak_initiator",
            {
                "targets": self.addresses,
                "index": index,
                "writer": self.incarnations,
                "stripes": c.initiators * c.concurrency,
                "concurrency": c.concurrency,
                "max_len": min(c.max_len, c.slot_size // 4),
                "seed": self.rng.getrandbits(32),
                "options": {"transport": c.transports[index % len(c.transports)], "transfer_timeout": 5.0},
            },
        )

    def procs(self) -> list[_Proc]:
        return self.targets + self.initiators

    def take(self, proc: _Proc, message: tuple[Any, ...]) -> None:
        kind, figures = message[0], message[1]
        self.deaths += [tuple(d) for d in figures.pop("deaths", [])]  # type: ignore[misc]
        if kind == "final":
            proc.final = figures
        proc.last = figures

    def listen(self, seconds: float) -> None:
        """Take the children's messages for ``seconds``."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            conns: dict[Connection, _Proc] = {p.child.conn: p for p in self.procs()}
            for ready in wait(list(conns), left):
                conn = cast(Connection, ready)  # wait() returns what it was given: connections
                try:
                    self.take(conns[conn], conn.recv())
                except (EOFError, OSError):
                    pass  # it was killed: its last figures stand

    def kill(self) -> None:
        """SIGKILL one random target or initiator, and start its successor."""
        if self.rng.random() < 0.5:
            index = self.rng.randrange(len(self.targets))
            victim = self.targets[index]
            self.kills.append((self.addresses[index], time.monotonic()))
            victim.child.process.send_signal(signal.SIGKILL)
            self.bury(victim)
            self.targets[index] = self.restart_target(index)
            self.report.faults["target"] = self.report.faults.get("target", 0) + 1
        else:
            index = self.rng.randrange(len(self.initiators))
            victim = self.initiators[index]
            victim.child.process.send_signal(signal.SIGKILL)
            self.bury(victim)
            self.initiators[index] = self.start_initiator(index)
            self.report.faults["initiator"] = self.report.faults.get("initiator", 0) + 1

    def bury(self, victim: _Proc) -> None:
        victim.child.kill()
        while victim.child.conn.poll(0):  # figures it sent before it died
            try:
                self.take(victim, victim.child.conn.recv())
            except (EOFError, OSError):
                break
        victim.child.close()
        self.retired.append(victim.last)

    def restart_target(self, index: int) -> _Proc:
        """The killed target's successor, at the same address (its port may take a moment to free)."""
        for _ in range(50):
            try:
                return self.start_target(index, self.addresses[index])
            except (ChildProcessError, TimeoutError):
                time.sleep(0.1)
        raise RuntimeError(f"could not restart a target at {self.addresses[index]}")

    def stop(self) -> None:
        """Stop every survivor, initiators first (targets keep serving their last requests); gather figures."""
        for group in (self.initiators, self.targets):
            for proc in group:
                proc.child.send(("stop",))
            deadline = time.monotonic() + 60
            while any(p.final is None for p in group) and time.monotonic() < deadline:
                self.listen(0.2)
                for proc in group:
                    if proc.final is None and proc.child.process.poll() is not None:
                        self.report.violations.append(f"a soak child exited with {proc.child.process.returncode}")
                        proc.final = {}
        for proc in self.procs():
            if proc.final is None:
                self.report.violations.append(f"soak child {proc.child.pid} gave no final report")
            proc.child.close()

    def tally(self) -> SoakReport:
        r = self.report
        for figures in self.retired + [p.final or p.last for p in self.procs()]:
            for name in _COUNTERS:
                setattr(r, name, getattr(r, name) + int(figures.get(_FROM_CHILD.get(name, name), 0)))
            r.corrupted_bytes += int(figures.get("corrupted_bytes", 0))
            for name, count in figures.get("errors", {}).items():
                r.errors[name] = r.errors.get(name, 0) + count
            r.violations += figures.get("violations", [])
        for proc in self.procs():
            for kind, items in ((proc.final or {}).get("leaks") or {}).items():
                r.leaks += len(items)
                r.violations += [f"leaked {kind[:-1]}: {item}" for item in items[:5]]
        for address, killed in self.kills:
            r.death_to_failure += [
                failed - killed for a, submitted, failed in self.deaths if a == address and submitted < killed <= failed
            ]
        return r


def run_soak(config: SoakConfig) -> SoakReport:
    """Run the soak described by ``config`` and return what it found (it raises only if it cannot run)."""
    started = time.monotonic()
    soak = _Soak(config)
    riders = _DataDistRider(config, soak.rng.getrandbits(32)) if config.datadist else None
    try:
        end = time.monotonic() + config.duration
        while (left := end - time.monotonic()) > 0:
            pause = soak.rng.expovariate(1 / config.fault_interval) if config.fault_interval > 0 else left
            soak.listen(min(pause, left))
            if time.monotonic() < end and config.fault_interval > 0:
                if riders is not None and soak.rng.random() < 0.2:
                    riders.fault()
                    soak.report.faults["decode"] = soak.report.faults.get("decode", 0) + 1
                else:
                    soak.kill()
    finally:
        if riders is not None:
            riders.stop(soak.report)
        soak.stop()
    report = soak.tally()
    report.duration = time.monotonic() - started
    return report


class _DataDistRider:
    """A prefill/decode pair in two processes: decode pulls, prefill pushes, each transfer checked."""

    def __init__(self, config: SoakConfig, seed: int) -> None:
        from ..datadist import BlocksCacheKey, CacheDesc, DataType

        self.rng = random.Random(seed)
        self.transport = config.transports[-1]
        self.desc = CacheDesc(num_tensors=4, shape=(16, 16, 2, 32), data_type=DataType.DT_FLOAT16)
        self.keys = (BlocksCacheKey(1), BlocksCacheKey(2))
        self.verified = 0
        self.failed = 0
        self.violations: list[str] = []
        self.prefill = self.start(1)
        self.decode = self.start(2)
        self.lock = threading.Lock()  # a fault replaces decode while the loop is between transfers
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.loop, name="soak-datadist", daemon=True)
        self.thread.start()

    def start(self, cluster: int) -> Any:
        from ..datadist import LLMConfig, LLMRole
        from .datadist_peer import DataDistProcess

        role = LLMRole.PROMPT if cluster == 1 else LLMRole.DECODER
        peer = DataDistProcess(role, cluster, LLMConfig(listen_ip_info="127.0.0.1:0", transport=self.transport))
        peer.register_blocks_cache("kv", self.desc, self.keys[cluster - 1], seed=cluster)
        return peer

    def link(self) -> None:
        self.decode.datadist("link_clusters", [self.prefill.cluster_info()])
        self.prefill.datadist("link_clusters", [self.decode.cluster_info()])

    def loop(self) -> None:
        from .datadist_peer import CacheRef, PeerError, pattern

        linked = False
        seed = 100
        while not self.stopping.is_set():
            with self.lock:
                try:
                    if not linked:
                        self.link()
                        linked = True
                    seed += 1
                    pull = self.rng.random() < 0.5
                    blocks = self.rng.sample(range(self.desc.shape[0]), 4)
                    into = self.rng.sample(range(self.desc.shape[0]), 4)
                    values = pattern(self.desc, seed)
                    self.prefill.write("kv", values)  # prefill is the source both ways: decode pulls, it pushes
                    if pull:
                        self.decode.cache_manager("pull_blocks", self.keys[0], CacheRef("kv"), blocks, into)
                    else:
                        self.prefill.cache_manager("push_blocks", self.keys[1], CacheRef("kv"), blocks, into)
                    got = self.decode.read("kv", (slice(None), into))
                    if not np.array_equal(got, values[:, blocks]):
                        self.violations.append(f"datadist {'pull' if pull else 'push'} landed wrong data")
                    self.verified += 1
                except (PeerError, ChildProcessError, TimeoutError, OSError):
                    self.failed += 1
                    linked = False
            time.sleep(0.01)

    def fault(self) -> None:
        """SIGKILL the decode process and start another (the pair links again)."""
        from .datadist_peer import PeerError

        with self.lock:
            self.decode.kill()
            self.decode.close()
            try:
                self.prefill.datadist("unlink_clusters", [self.decode.cluster_info()], force=True)
            except PeerError:
                pass  # it was not linked (the loop had not got that far)
            self.decode = self.start(2)

    def stop(self, report: SoakReport) -> None:
        self.stopping.set()
        self.thread.join(30)
        self.prefill.close()
        self.decode.close()
        report.datadist_verified, report.datadist_failed = self.verified, self.failed
        report.violations += self.violations
