"""One instance's KV-event stream, checked: sequence numbers, gaps, restarts, silence (no I/O; times are given).

The index (:class:`PrefixIndex`) is only as good as the run of events it was
fed: a batch missed could be an eviction, and the index would then claim blocks
the instance no longer has. So :class:`EventLog` applies a published batch only
when its sequence number follows the last one applied, and otherwise asks its
driver (:mod:`event_feed`) for a *replay* from vLLM's replay socket:

- **the start**, **a restart**: nothing is trusted yet, so the log asks for
  every batch from 0 (vLLM keeps the last ``buffer_steps``, 10 000 by default)
  and builds the index from what comes back. If the oldest have been dropped,
  the index misses their blocks — counted as not cached, never as cached.
- **a gap** (a batch's number is past the next one: the SUB socket dropped some,
  over its high-water mark): a replay from the last batch applied.
- **proof of continuity**: every replay except a full one starts at the last
  batch applied, which must come back first, byte for byte. Any other answer
  means the instance behind the endpoint is not the one the index was built
  from (it restarted; its replay buffer holds another history): the index is
  dropped and rebuilt from a full replay. So is it when a published number goes
  backwards (and is not a batch the log has already applied, which a replay and
  the PUB socket may both deliver).
- **silence**: vLLM sends nothing while its cache does not change, and no
  heartbeat, so an idle instance and a stopped one look alike on the PUB socket.
  After ``timeout / 3`` without a batch the log asks for a replay from the last
  batch applied — an idle instance answers with just that batch, proving it is
  alive and that nothing was missed. Nothing heard (batch or answer) for
  ``timeout``: the log is not :meth:`live`, and the router does not use its
  index until the instance answers again.
"""

from __future__ import annotations

import enum
import hashlib
import logging
from collections import deque
from collections.abc import Sequence

from .kv_events import BadEvents, decode_batch
from .prefix_index import PrefixIndex

__all__ = ["EventLog", "LogState"]

log = logging.getLogger("hixl.proxy")

#: Applied batches whose digests are kept, to recognise one delivered again (by a replay and by the PUB socket).
RECENT = 4096


class LogState(enum.Enum):
    """Where the log is."""

    SYNCING = "syncing"  # nothing trusted: a full replay is due
    LIVE = "live"  # the index follows an unbroken run of the instance's batches, and the instance was heard lately
    SILENT = "silent"  # an index, but nothing heard from the instance for `timeout`: not used


class EventLog:
    """One instance's batches, in order, into its :attr:`index`; which replay to ask for, and when.

    ``name``: the instance, for the log; ``timeout``: seconds without a batch or a replay's answer after which the
    instance's events count as stopped; ``now``: the driver's clock (monotonic seconds)."""

    def __init__(self, name: str, timeout: float, now: float) -> None:
        self.name = name
        self.index = PrefixIndex()
        self.timeout = timeout
        self.resyncs = 0
        """Times the index was dropped because the instance's history was not the one it was built from."""
        self._applied: int | None = None  # the last batch applied; -1: a full replay found none; None: nothing trusted
        self._recent: dict[int, bytes] = {}  # seq -> digest of the batches applied lately
        self._order: deque[int] = deque()  # _recent's keys, oldest first
        self._wanted: int | None = 0  # the replay due (its first seq), or None
        self._heard = now

    def state(self, now: float) -> LogState:
        """The log's state at ``now``."""
        if self._applied is None:
            return LogState.SYNCING
        return LogState.LIVE if now - self._heard < self.timeout else LogState.SILENT

    def live(self, now: float) -> bool:
        """Whether the index may route requests now."""
        return self.state(now) is LogState.LIVE

    def replay_due(self, now: float) -> int | None:
        """The first seq of the replay to ask for now, or None: a full one, a gap's, or a probe of a silent instance."""
        if self._wanted is not None:
            return self._wanted
        assert self._applied is not None  # (nothing trusted: a full replay is wanted)
        if now - self._heard >= self.timeout / 3:
            return max(self._applied, 0)
        return None

    def next_probe(self, now: float) -> float:
        """Seconds from ``now`` until :meth:`replay_due` asks for a probe if nothing is heard meanwhile."""
        return max(0.0, self._heard + self.timeout / 3 - now)

    def published(self, seq: int, payload: bytes, now: float) -> None:
        """A batch from the PUB socket."""
        self._heard = now
        applied = self._applied
        if applied is None:
            return  # (the full replay due will hold it, or a later one)
        if seq == applied + 1:
            self._apply(seq, payload)
        elif seq <= applied:
            if self._recent.get(seq) != _digest(payload):
                self._restarted(f"its sequence went back from {applied} to {seq}")
        elif self._wanted is None:
            self._wanted = max(applied, 0)  # a gap: what was missed, with the last applied as proof

    def replayed(self, start: int, batches: Sequence[tuple[int, bytes]], now: float) -> None:
        """The answer to a replay from ``start`` (every batch before the end marker, in order)."""
        self._heard = now
        self._wanted = None
        if self._applied is None or self._applied < 0:
            self._rebuild(batches)
            return
        if not batches or batches[0][0] != start or self._recent.get(start) != _digest(batches[0][1]):
            self._restarted(f"its replay from {start} does not start with the batch applied last")
            return
        for seq, payload in batches[1:]:
            if seq != self._applied + 1:
                self._restarted(f"its replay skips from {self._applied} to {seq}")
                return
            if not self._apply(seq, payload):
                return

    def _rebuild(self, batches: Sequence[tuple[int, bytes]]) -> None:
        """A full replay: the index from its batches alone (any run of them: the oldest may have been dropped)."""
        self.index.clear()
        self._recent.clear()
        self._order.clear()
        self._applied = -1
        for seq, payload in batches:
            if self._applied >= 0 and seq != self._applied + 1:
                self._restarted(f"its full replay skips from {self._applied} to {seq}")
                return
            self._applied = seq - 1  # (the first batch starts the run wherever the buffer starts)
            if not self._apply(seq, payload):
                return

    def _apply(self, seq: int, payload: bytes) -> bool:
        """Apply batch ``seq``; False if it could not be read (the index is then dropped)."""
        try:
            events = decode_batch(payload)
        except BadEvents as exc:
            self._restarted(f"batch {seq} could not be read: {exc}")
            return False
        self.index.apply(events)
        self._applied = seq
        self._recent[seq] = _digest(payload)
        self._order.append(seq)
        if len(self._order) > RECENT:
            self._recent.pop(self._order.popleft(), None)
        return True

    def _restarted(self, why: str) -> None:
        """The index cannot be trusted any more: drop it, and ask for a full replay."""
        self.resyncs += 1
        log.warning("%s: its prefix index is dropped and rebuilt from a full replay: %s", self.name, why)
        self.index.clear()
        self._applied = None
        self._wanted = 0

    def __repr__(self) -> str:
        return f"<EventLog applied {self._applied}, wanted {self._wanted}, {self.index!r}>"


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()
