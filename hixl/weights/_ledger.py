"""Which version each slot holds, and who may be reading it: the publisher's one piece of shared state.

Theory of operation. A slot is FREE (never written), WRITING (being filled: no
one may start reading it), READY (holds :attr:`Slot.version`) or RETIRING (a
zero-copy version whose owner wants its memory back: no new readers). A
subscriber *acquires* a READY version before reading it; that grants it a
*lease* on the slot until it *releases* it or ``lease`` seconds pass, and no
slot with a live lease is written again. A lease also ends when the connection
that took it is gone (``live()`` no longer names its holder): a SIGKILLed reader
holds a slot for at most one lease, usually far less.

The acquisition and the publisher's choice of a slot to overwrite both happen
under this ledger's lock, so a reader is either granted its lease before the
slot is chosen (and the slot is not chosen) or refused (the slot is WRITING or
holds another version). A lease that ran out while its reader still reads is
caught by the reader's check of the slot's header word afterwards.

The engine's serving threads (acquire, release) and the publishing thread
(claim, ready, retire) call in here; nothing here blocks on I/O.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .._exceptions import HixlTimeout
from ._errors import Superseded

__all__ = ["Ledger", "SlotState"]


class SlotState(enum.Enum):
    """The life of a slot (see the module docstring)."""

    FREE = "FREE"
    WRITING = "WRITING"
    READY = "READY"
    RETIRING = "RETIRING"


@dataclass
class _Slot:
    state: SlotState = SlotState.FREE
    version: int = 0
    leases: list[tuple[str, float, float]] = field(default_factory=list)
    """(holder, granted, expires) on the monotonic clock, one per acquisition not yet released."""


class Ledger:
    """Slot states and leases under one lock (see the module docstring).

    ``live()`` returns the holders whose connections are still open (the engine's
    served connection ids); it is called with the ledger's lock not held.
    """

    def __init__(self, slots: int, lease: float, live: Callable[[], set[str]]) -> None:
        self.lease = lease
        self._slots = [_Slot() for _ in range(slots)]
        self._live = live
        self._newest = -1
        self._changed = threading.Condition()

    def acquire(self, holder: str, version: int) -> int:
        """Grant ``holder`` a lease on ``version``'s slot and return the slot; :class:`Superseded` if
        no slot holds it READY any more (overwritten, being written, or retiring)."""
        with self._changed:
            for index, slot in enumerate(self._slots):
                if slot.version == version and slot.state is SlotState.READY:
                    now = time.monotonic()
                    slot.leases.append((holder, now, now + self.lease))
                    return index
        raise Superseded(f"version {version} is no longer published here")

    def release(self, holder: str, version: int) -> None:
        """End one of ``holder``'s leases on ``version`` (nothing if it has none: it may have run out)."""
        with self._changed:
            for slot in self._slots:
                if slot.version == version:
                    for i, (who, _, _) in enumerate(slot.leases):
                        if who == holder:
                            del slot.leases[i]
                            self._changed.notify_all()
                            return

    def claim(self, timeout: float) -> int:
        """Choose a slot for the next version and mark it WRITING; waits for one whose leases have all
        ended (never the newest READY slot, whose version stays readable meanwhile)."""
        deadline = time.monotonic() + timeout
        while True:
            seen, live = time.monotonic(), self._live()
            with self._changed:
                next_expiry = self._expire(seen, live)
                candidates = [
                    (slot.state is not SlotState.FREE, slot.version, i)
                    for i, slot in enumerate(self._slots)
                    if i != self._newest and slot.state is not SlotState.WRITING and not slot.leases
                ]
                if candidates:
                    index = min(candidates)[2]
                    self._slots[index] = _Slot(SlotState.WRITING)
                    return index
                left = deadline - time.monotonic()
                if left <= 0:
                    raise HixlTimeout(f"every slot was still being read after {timeout} s: {self!r}")
                # Woken by a release; else when the next lease runs out (or, rarely, to look at live() again).
                self._changed.wait(min(left, next_expiry - time.monotonic(), 1.0))

    def claim_now(self, index: int) -> None:
        """Mark slot ``index`` WRITING at once, whoever holds it (zero-copy: its memory changed already)."""
        with self._changed:
            self._slots[index] = _Slot(SlotState.WRITING)
            if self._newest == index:
                self._newest = -1

    def abandon(self, index: int) -> None:
        """Slot ``index`` was claimed but not filled: it holds nothing readable."""
        with self._changed:
            self._slots[index] = _Slot()
            self._changed.notify_all()

    def ready(self, index: int, version: int) -> None:
        """Slot ``index`` now holds ``version`` (its header word says so): readers may acquire it."""
        with self._changed:
            self._slots[index] = _Slot(SlotState.READY, version)
            self._newest = index

    def retire(self, version: int, timeout: float) -> int:
        """Refuse new readers of ``version`` and wait until its leases have ended; returns its slot.

        Raises :class:`HixlTimeout` if they have not within ``timeout`` (the version stays RETIRING)
        and :class:`Superseded` if no slot holds it.
        """
        deadline = time.monotonic() + timeout
        with self._changed:
            index = next((i for i, s in enumerate(self._slots) if s.version == version and s.state is not SlotState.WRITING), None)
            if index is None:
                raise Superseded(f"version {version} is not published here")
            self._slots[index].state = SlotState.RETIRING
        while True:
            seen, live = time.monotonic(), self._live()
            with self._changed:
                next_expiry = self._expire(seen, live)
                if not self._slots[index].leases:
                    return index
                left = deadline - time.monotonic()
                if left <= 0:
                    raise HixlTimeout(f"version {version} was still being read after {timeout} s")
                self._changed.wait(min(left, next_expiry - time.monotonic(), 1.0))

    def newest(self) -> tuple[int, int]:
        """``(version, slot)`` of the newest READY version, ``(0, -1)`` if there is none."""
        with self._changed:
            if self._newest < 0:
                return 0, -1
            return self._slots[self._newest].version, self._newest

    def versions(self) -> list[int]:
        """The versions readers may acquire now, oldest first."""
        with self._changed:
            return sorted(s.version for s in self._slots if s.state is SlotState.READY)

    def _expire(self, seen: float, live: set[str]) -> float:
        """Caller holds the lock: drop leases that ran out, or whose holder was gone when ``live`` was
        taken at ``seen`` (a lease granted since may be a connection newer than that); the next expiry."""
        now, soonest = time.monotonic(), float("inf")
        for slot in self._slots:
            slot.leases = [
                (who, since, until) for who, since, until in slot.leases if until > now and (who in live or since > seen)
            ]
            soonest = min([soonest, *(until for _, _, until in slot.leases)])
        return soonest

    def __repr__(self) -> str:
        with self._changed:
            slots = ", ".join(f"{s.state.value}:v{s.version}/{len(s.leases)} lease(s)" for s in self._slots)
        return f"<Ledger [{slots}] newest={self._newest}>"
