"""A soak target (``python -m hixl.testing._soak_target FD``): registers and deregisters under its peers.

Its memory is one arena cut into slots. A slot is either *registered* — one
region somewhere inside it, filled with a fresh fill tag (see
:mod:`hixl.testing.soakwords`), ``access="r"`` or ``"rw"`` by slot — or *in
quarantine* after deregistration, filled with canary words. Everything of a
slot outside its region is canary too. The target checks, and reports every
word that breaks the rules as corrupted:

- right after ``deregister_mem`` returns: the region holds only its fill tag
  (read-only) or its fill tag and well-formed WRITE words (read-write);
- before a quarantined slot is registered again, and on the guards of
  registered slots all along: nothing but canary — a byte there moved after
  the owner had let the memory go.

The parent sends a config, gets ``("ready", address, pid)``, then one
``("stats", dict)`` about every half second; ``("stop",)`` ends the churn,
deregisters and checks everything, finalizes the engine and answers
``("final", dict)`` with the leak check.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from .. import Engine, MemHandle, empty
from .._tools.child import child_connection
from . import soakwords
from .leaks import Snapshot

_STATS_EVERY = 0.5


@dataclass
class _Slot:
    start: int  # byte offset of the slot in the arena
    access: str
    handle: MemHandle | None = None
    region: tuple[int, int] = (0, 0)  # offset in the slot, length
    tag: int = 0
    since: float = 0.0  # when it was registered or quarantined


class _Target:
    def __init__(self, config: dict[str, Any]) -> None:
        self.rng = random.Random(config["seed"])
        self.slot_size = int(config["slot_size"])
        self.quarantine = float(config["quarantine"])
        self.hold = float(config["hold"])
        self.arena = empty(self.slot_size * int(config["slots"]))
        self.base = int(self.arena.ctypes.data)
        soakwords.fill(self.arena, self.base, soakwords.CANARY)
        # Fill tags count up from a random start, so a restarted target's tags differ from its predecessor's.
        self.next_tag = self.rng.randrange(1, soakwords.CANARY // 2)
        self.slots = [_Slot(i * self.slot_size, "r" if i % 3 == 0 else "rw") for i in range(int(config["slots"]))]
        self.stats = {"registrations": 0, "deregistrations": 0, "checked_bytes": 0, "corrupted_bytes": 0}
        self.violations: list[str] = []
        self.before = Snapshot.take()  # the arena is already mapped: it is not the engine's
        self.engine = Engine(config.get("address", "127.0.0.1:0"), config.get("options") or {})
        layout = {"base": self.base, "slot_size": self.slot_size, "access": [s.access for s in self.slots]}
        self.engine.set_metadata("soak", json.dumps(layout).encode())
        for slot in self.slots:
            self.register(slot)

    def view(self, slot: _Slot, offset: int, length: int) -> np.ndarray:
        return self.arena[slot.start + offset : slot.start + offset + length]

    def expect(self, slot: _Slot, offset: int, length: int, allowed: Any, what: str) -> None:
        """Count the words of a slot's range that are malformed or whose tag ``allowed`` refuses."""
        data = self.view(slot, offset, length)
        addr = self.base + slot.start + offset
        bad = ~soakwords.valid(data, addr) | ~allowed(soakwords.tags(data))
        self.stats["checked_bytes"] += length
        if bad.any():
            self.stats["corrupted_bytes"] += int(bad.sum()) * 8
            self.violations.append(f"{what}: {soakwords.describe(data, addr, bad)}")

    def check_canary(self, slot: _Slot, what: str, skip: tuple[int, int] = (0, 0)) -> None:
        """Every word of ``slot`` outside ``skip`` (offset, length) must be canary."""
        off, length = skip
        for start, end in ((0, off), (off + length, self.slot_size)):
            self.expect(slot, start, end - start, lambda t: t == soakwords.CANARY, what)
            # Mend it, so that one stray byte is counted once, not at every later check.
            soakwords.fill(self.view(slot, start, end - start), self.base + slot.start + start, soakwords.CANARY)

    def register(self, slot: _Slot) -> None:
        self.check_canary(slot, "quarantined memory")
        words = self.slot_size // 8
        first = self.rng.randrange(1, words // 4)
        count = self.rng.randrange(words // 4, words - first)  # at least one guard word after it too
        slot.region = (first * 8, count * 8)
        slot.tag = self.next_tag
        self.next_tag += 1
        soakwords.fill(self.view(slot, *slot.region), self.base + slot.start + slot.region[0], slot.tag)
        slot.handle = self.engine.register_mem(self.view(slot, *slot.region), access=slot.access)
        slot.since = time.monotonic()
        self.stats["registrations"] += 1

    def deregister(self, slot: _Slot) -> None:
        assert slot.handle is not None
        self.engine.deregister_mem(slot.handle)
        slot.handle = None
        fill_tag = slot.tag
        if slot.access == "r":
            self.expect(slot, *slot.region, lambda t: t == fill_tag, "read-only region after deregistration")
        else:
            self.expect(
                slot, *slot.region, lambda t: (t == fill_tag) | (t >= soakwords.WRITE_BIT), "read-write region after deregistration"
            )
        self.check_canary(slot, "guard at deregistration", slot.region)
        soakwords.fill(self.view(slot, *slot.region), self.base + slot.start + slot.region[0], soakwords.CANARY)
        slot.since = time.monotonic()
        self.stats["deregistrations"] += 1

    def churn_once(self) -> None:
        """One step: deregister a region held long enough, or bring a quarantined slot back."""
        slot = self.rng.choice(self.slots)
        age = time.monotonic() - slot.since
        if slot.handle is not None:
            self.check_canary(slot, "guard of a registered slot", slot.region)
            if age >= self.hold * self.rng.uniform(0.5, 1.5):
                self.deregister(slot)
        elif age >= self.quarantine:
            self.register(slot)

    def finish(self) -> dict[str, Any]:
        """Deregister everything, check it after one more quarantine, finalize, look for leaks."""
        for slot in self.slots:
            if slot.handle is not None:
                self.deregister(slot)
        self.engine.finalize()
        time.sleep(self.quarantine)
        for slot in self.slots:
            self.check_canary(slot, "memory after finalize")
        leaked = Snapshot.take(5.0, self.before).leaked_since(self.before)
        return {**self.report(), "leaks": leaked}

    def report(self) -> dict[str, Any]:
        return {**self.stats, "violations": self.violations[:20]}


def _run(conn: Connection) -> None:
    config = conn.recv()
    target = _Target(config)
    conn.send(("ready", target.engine.local_engine, os.getpid()))
    period = float(config["period"])
    last = time.monotonic()
    while not conn.poll(target.rng.uniform(0.5, 1.5) * period):
        target.churn_once()
        if time.monotonic() - last >= _STATS_EVERY:
            conn.send(("stats", target.report()))
            last = time.monotonic()
    conn.recv()  # ("stop",)
    conn.send(("final", target.finish()))


if __name__ == "__main__":
    _run(child_connection())
