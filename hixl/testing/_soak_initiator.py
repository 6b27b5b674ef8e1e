"""A soak initiator (``python -m hixl.testing._soak_initiator FD``): many async READs and WRITEs, all checked.

It keeps ``concurrency`` requests in flight against the soak targets, each in
its own *local slot*: a piece of its registered buffer that is canary (see
:mod:`hixl.testing.soakwords`, keyed on local addresses) except where the
request's descriptors put data. Each request has 1..4 descriptors of random
length and place, on both sides.

- A COMPLETED READ is verified word by word: every word well-formed for the
  remote address it came from, no canary (that memory was not registered), one
  fill tag throughout a read-only region; local bytes outside the
  descriptors still canary.
- A WRITE goes only into this initiator's own stripe of a read-write slot
  (stripes are fixed target addresses, so no other writer touches them); once
  COMPLETED its range is refilled with local canary and READ back, and must
  hold exactly what was written — or a fill tag, if the target re-registered
  that memory meanwhile. An older WRITE of ours showing up is a byte that
  landed after its request was final.
- A request that did not complete leaves its local slot in quarantine: refilled
  with canary, and checked still canary before it is used again.

Protocol with the parent: a config, ``("ready", pid)``, ``("stats", dict)``
about every half second (counters, plus new ``deaths`` records: target,
submitted, failed — monotonic times — for requests that failed because their
peer went away), and after ``("stop",)``: drain, finalize, ``("final", dict)``
with the leak check.
"""

from __future__ import annotations

import json
import os
import queue
import random
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from .. import (
    Engine,
    HixlError,
    MemoryRangeError,
    Op,
    ResourceExhausted,
    TransferReq,
    TransferStatus,
    empty,
)
from .._tools.child import child_connection
from . import soakwords
from .leaks import Snapshot

_STATS_EVERY = 0.5
_REGIONS_EVERY = 0.3
_LOCAL_QUARANTINE = 0.2
_WORD = 8


@dataclass
class _Peer:
    """What this initiator knows of one target address (a new incarnation replaces it all)."""

    address: str
    connected: bool = False
    retry_at: float = 0.0
    base: int = 0
    slot_size: int = 0
    access: list[str] = field(default_factory=list)
    regions: list[tuple[int, int]] = field(default_factory=list)
    regions_at: float = 0.0

    def slot_of(self, addr: int) -> int:
        return (addr - self.base) // self.slot_size


@dataclass
class _Op:
    peer: _Peer
    op: Op
    descs: np.ndarray  # (n, 3): local, remote, len
    kind: str  # "read-r", "read-rw", "write", "readback"
    tag: int = 0
    submitted: float = 0.0
    req: TransferReq | None = None


def _sizes(rng: random.Random, length: int, parts: int, max_len: int) -> list[int]:
    """``parts`` lengths (multiples of 8, log-uniform: small and large alike) that fit ``length`` side by side."""
    room = min(length // parts, max_len) // _WORD
    return [max(1, int(room ** rng.random())) * _WORD for _ in range(parts)] if room >= 1 else []


def _place(rng: random.Random, start: int, length: int, sizes: list[int]) -> list[int]:
    """Random, non-overlapping, 8-byte aligned addresses in ``[start, start+length)`` for pieces of ``sizes``."""
    step = (length // len(sizes)) // _WORD * _WORD
    return [start + i * step + rng.randrange(0, (step - n) // _WORD + 1) * _WORD for i, n in enumerate(sizes)]


class _Initiator:
    def __init__(self, config: dict[str, Any]) -> None:
        self.rng = random.Random(config["seed"])
        self.index = int(config["index"])
        self.writer = int(config["writer"])
        self.stripes = int(config["stripes"])
        self.concurrency = int(config["concurrency"])
        self.max_len = int(config["max_len"])
        self.local_slot = 4 * self.max_len
        self.local = empty(self.local_slot * self.concurrency)
        self.local_base = int(self.local.ctypes.data)
        soakwords.fill(self.local, self.local_base, soakwords.CANARY)
        self.free = list(range(self.concurrency))
        self.quarantined: list[tuple[float, int]] = []
        self.peers = [_Peer(a) for a in config["targets"]]
        self.seq = 0
        self.done: queue.SimpleQueue[tuple[int, TransferReq, float]] = queue.SimpleQueue()
        self.pending: dict[int, _Op] = {}
        self.stats: dict[str, int] = {
            "submitted": 0,
            "completed": 0,
            "verified": 0,
            "verified_bytes": 0,
            "failed": 0,
            "refused": 0,
            "superseded": 0,
            "corrupted_bytes": 0,
        }
        self.violations: list[str] = []
        self.errors: dict[str, int] = {}  # failed requests by error
        self.deaths: list[tuple[str, float, float]] = []
        self.before = Snapshot.take()
        options = config.get("options") or {}
        self.transport = str(options.get("transport", "auto"))  # named in what it reports
        self.engine = Engine("127.0.0.1", options)
        self.engine.register_mem(self.local)

    # -- peers -----------------------------------------------------------------------------
    def ensure(self, peer: _Peer) -> bool:
        """Connected to ``peer`` with a fresh layout and regions, trying again at most every 0.2 s."""
        now = time.monotonic()
        if peer.connected:
            if now - peer.regions_at >= _REGIONS_EVERY:
                self.refresh(peer)
            return peer.connected
        if now < peer.retry_at:
            return False
        try:
            if peer.address in self.engine.connected_engines():
                self.engine.disconnect(peer.address)
            self.engine.connect(peer.address, timeout=1.0)
            layout = json.loads(self.engine.get_remote_metadata(peer.address, "soak"))
            peer.base, peer.slot_size, peer.access = layout["base"], layout["slot_size"], layout["access"]
            peer.connected = True
            self.refresh(peer)
        except (HixlError, OSError):
            peer.connected = False
            peer.retry_at = now + 0.2
        return peer.connected

    def refresh(self, peer: _Peer) -> None:
        try:
            peer.regions = [(m.addr, m.len) for m in self.engine.remote_mems(peer.address)]
            peer.regions_at = time.monotonic()
        except (HixlError, OSError):
            self.lost(peer)

    def lost(self, peer: _Peer) -> None:
        peer.connected = False
        peer.retry_at = time.monotonic() + 0.1

    # -- submitting ------------------------------------------------------------------------
    def plan(self, peer: _Peer, slot: int) -> _Op | None:
        """A READ or WRITE of 1..4 random pieces of one of ``peer``'s regions, into local slot ``slot``."""
        addr, length = self.rng.choice(peer.regions)
        access = peer.access[peer.slot_of(addr)]
        parts = self.rng.randint(1, 4)
        local_start = self.local_base + slot * self.local_slot
        if access == "rw" and self.rng.random() < 0.5:
            stripe_len = peer.slot_size // self.stripes
            stripe = peer.base + peer.slot_of(addr) * peer.slot_size + (self.index * self.concurrency + slot) * stripe_len
            lo, hi = max(addr, stripe), min(addr + length, stripe + stripe_len)
            sizes = _sizes(self.rng, hi - lo, parts, self.max_len)
            if sizes:
                return self.build(peer, Op.WRITE, sizes, _place(self.rng, lo, hi - lo, sizes), local_start, "write")
        sizes = _sizes(self.rng, length, parts, self.max_len)
        if not sizes:
            return None
        return self.build(peer, Op.READ, sizes, _place(self.rng, addr, length, sizes), local_start, f"read-{access}")

    def build(self, peer: _Peer, op: Op, sizes: list[int], remote: list[int], local_start: int, kind: str) -> _Op:
        local = _place(self.rng, local_start, self.local_slot, sizes)
        descs = np.array(list(zip(local, remote, sizes)), dtype=np.uint64)
        planned = _Op(peer, op, descs, kind)
        if op is Op.WRITE:
            self.seq += 1
            planned.tag = soakwords.write_tag(self.writer, self.seq)
            for lo_addr, r_addr, k in descs.tolist():
                soakwords.fill(self.at(lo_addr, k), r_addr, planned.tag)
        return planned

    def at(self, local_addr: int, nbytes: int) -> np.ndarray:
        off = local_addr - self.local_base
        return self.local[off : off + nbytes]

    def submit(self, planned: _Op, slot: int) -> bool:
        planned.submitted = time.monotonic()
        try:
            req = self.engine.transfer_async(planned.peer.address, planned.op, planned.descs, timeout=5.0)
        except MemoryRangeError:
            self.stats["refused"] += 1  # the region went away since we looked: refresh and move on
            self.refresh(planned.peer)
            return False
        except ResourceExhausted:
            return False
        except (HixlError, OSError):
            self.stats["refused"] += 1
            self.lost(planned.peer)
            return False
        planned.req = req
        self.pending[slot] = planned
        self.stats["submitted"] += 1
        def finished(req: TransferReq, slot: int = slot) -> None:
            self.done.put((slot, req, time.monotonic()))

        req.add_done_callback(finished)
        return True

    def fill_up(self) -> None:
        self.release_quarantined()
        while self.free:
            peers = [p for p in self.peers if self.ensure(p) and p.regions]
            if not peers:
                return
            slot = self.free.pop()
            planned = self.plan(self.rng.choice(peers), slot)
            if planned is None or not self.submit(planned, slot):
                self.reset(slot)
                self.free.append(slot)
                return

    # -- checking --------------------------------------------------------------------------
    def flag(self, data: np.ndarray, addr: int, bad: np.ndarray, what: str) -> None:
        if bad.any():
            self.stats["corrupted_bytes"] += int(bad.sum()) * _WORD
            self.violations.append(f"{self.transport} {what}: {soakwords.describe(data, addr, bad)}")

    def reset(self, slot: int) -> None:
        start = slot * self.local_slot
        soakwords.fill(self.local[start : start + self.local_slot], self.local_base + start, soakwords.CANARY)

    def check_slot_canary(self, slot: int, skip: np.ndarray, what: str) -> None:
        """Local slot ``slot`` is canary outside the local ranges of ``skip`` (descriptor rows)."""
        start = slot * self.local_slot
        view = self.local[start : start + self.local_slot]
        bad = ~soakwords.valid(view, self.local_base + start) | (soakwords.tags(view) != soakwords.CANARY)
        for lo_addr, _, k in skip.tolist():
            first = (lo_addr - self.local_base - start) // _WORD
            bad[first : first + k // _WORD] = False
        self.flag(view, self.local_base + start, bad, what)

    def verify(self, planned: _Op) -> bool:
        """Check a COMPLETED READ's data; False if the memory was re-registered meanwhile (not an error)."""
        fresh = True
        fill_tags: set[int] = set()
        for lo_addr, r_addr, k in planned.descs.tolist():
            data = self.at(lo_addr, k)
            t = soakwords.tags(data)
            bad = ~soakwords.valid(data, r_addr) | (t == soakwords.CANARY)
            if planned.kind == "readback":
                mine = t == planned.tag
                fill = t < soakwords.CANARY
                bad |= ~(mine | fill)
                fresh &= bool(mine.all())
            else:
                fill_tags.update(np.unique(t[t < soakwords.CANARY]).tolist())
            self.flag(data, r_addr, bad, f"{planned.kind} from {planned.peer.address}")
        if planned.kind == "read-r" and len(fill_tags) > 1:  # a read-only region holds one fill tag
            self.stats["corrupted_bytes"] += int(planned.descs[:, 2].sum())
            self.violations.append(f"{self.transport} read-only region read with several fill tags: {sorted(fill_tags)}")
        return fresh

    def finish(self, slot: int, when: float) -> None:
        planned = self.pending.pop(slot)
        assert planned.req is not None
        status = planned.req.status
        if status is TransferStatus.COMPLETED:
            self.stats["completed"] += 1
            self.check_slot_canary(slot, planned.descs, "local bytes outside the descriptors")
            if planned.op is Op.WRITE:
                self.readback(planned, slot)
                return
            if self.verify(planned):
                self.stats["verified"] += 1
                self.stats["verified_bytes"] += int(planned.descs[:, 2].sum())
            else:
                self.stats["superseded"] += 1
        else:
            self.stats["failed"] += 1
            name = type(planned.req.error).__name__ if planned.req.error else status.name
            self.errors[name] = self.errors.get(name, 0) + 1
            if isinstance(planned.req.error, ConnectionError):
                self.deaths.append((planned.peer.address, planned.submitted, when))
                self.lost(planned.peer)
            # Whatever of it is still on the way must never land: watch the slot for a while.
            self.reset(slot)
            self.quarantined.append((time.monotonic(), slot))
            return
        self.reset(slot)
        self.free.append(slot)

    def readback(self, written: _Op, slot: int) -> None:
        """READ back what a COMPLETED WRITE put there, into the same local ranges refilled with canary."""
        self.reset(slot)
        check = _Op(written.peer, Op.READ, written.descs, "readback", written.tag)
        if not self.submit(check, slot):
            self.free.append(slot)

    def release_quarantined(self) -> None:
        now = time.monotonic()
        while self.quarantined and now - self.quarantined[0][0] >= _LOCAL_QUARANTINE:
            _, slot = self.quarantined.pop(0)
            self.check_slot_canary(slot, np.zeros((0, 3), dtype=np.uint64), "local slot after a failed request")
            self.free.append(slot)

    def collect(self, wait: float) -> None:
        """Finish what completed (callbacks) or passed its deadline (only seen when asked)."""
        try:
            slot, req, when = self.done.get(timeout=wait)
            if slot in self.pending and self.pending[slot].req is req:  # not one finished by the scan below
                self.finish(slot, when)
        except queue.Empty:
            for slot, planned in list(self.pending.items()):
                if planned.req is not None and planned.req.done():
                    self.finish(slot, time.monotonic())

    def report(self) -> dict[str, Any]:
        deaths, self.deaths = self.deaths, []
        return {**self.stats, "errors": dict(self.errors), "violations": self.violations[:20], "deaths": deaths}

    def drain(self, limit: float) -> None:
        deadline = time.monotonic() + limit
        while (self.pending or self.quarantined) and time.monotonic() < deadline:
            self.collect(0.05)
            self.release_quarantined()


def _run(conn: Connection) -> None:
    config = conn.recv()
    initiator = _Initiator(config)
    conn.send(("ready", os.getpid()))
    last = time.monotonic()
    while not conn.poll(0):
        initiator.fill_up()
        initiator.collect(0.02)
        if time.monotonic() - last >= _STATS_EVERY:
            conn.send(("stats", initiator.report()))
            last = time.monotonic()
    conn.recv()  # ("stop",)
    initiator.drain(15.0)
    initiator.engine.finalize()
    leaked = Snapshot.take(5.0, initiator.before).leaked_since(initiator.before)
    conn.send(("final", {**initiator.report(), "leaks": leaked}))


if __name__ == "__main__":
    _run(child_connection())
