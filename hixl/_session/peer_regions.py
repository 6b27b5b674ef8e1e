"""A peer's registrations as an initiator knows them, and the lease its same-host copies hold.

One object per link owns them: the table (replaced, never changed in place), the
generation it is of, and the :class:`Lease`. The link's reading thread applies every
REGIONS and REVOKE to it in the order they arrive (the connection has already
checked that each follows on from the generation before); transports read the
table and hold the lease around each same-host copy; nothing else changes them.

Why a lease. A cma or shm copy touches the peer's memory without the peer's CPU:
nothing on its side would stop one into memory it has just deregistered. So a
copy checks the table (and, for cma, that the peer's published generation is the
table's) under a *shared* hold of the lease and keeps the hold until its syscall
returns — many copies at once, each at most one chunk. A REVOKE takes the lease
*exclusively*: it waits for the copies in flight, installs the new table and only
then is it confirmed, so once the peer has our REVOKED no copy of ours touches
what it withdrew.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from .. import _protocol as proto
from .._exceptions import HixlTimeout, TransferTimeout
from .._memory import RemoteRegions

__all__ = ["Lease", "PeerRegions"]

_POLL = 0.0002
"""Seconds between two looks by a REVOKE at copies still in flight (each holds at most a chunk)."""


class Lease:
    """Shared by same-host copies, exclusive for a REVOKE, which is served first.

    Cheap enough for the 8-byte latency path: taking a shared hold is a set insert
    and two attribute reads, no lock. It relies on the GIL making each of those steps
    atomic and the steps of all threads one sequence: a copy announces itself, then
    looks for a REVOKE; a REVOKE announces itself, then looks for copies — so either
    the copy sees the REVOKE and steps aside, or the REVOKE sees the copy and waits.
    """

    __slots__ = ("_changing", "_holders", "_no_revoke", "_tokens", "revoking")

    def __init__(self) -> None:
        self._holders: set[int] = set()
        self._tokens = itertools.count(1)
        self.revoking = False
        """A REVOKE wants (or holds) the lease: new copies step aside (:meth:`wait_for_revoke`)."""
        self._no_revoke = threading.Event()
        self._no_revoke.set()
        # One exclusive holder at a time: REVOKEs come from the one reading thread, and the
        # transports' own changes (shm's mappings) from callers.
        self._changing = threading.Lock()

    def enter(self) -> int:
        """Take a shared hold for one copy: its token, or 0 if a REVOKE is under way (hold nothing,
        wait for it with :meth:`wait_for_revoke`, look again)."""
        if self.revoking:
            return 0
        token = next(self._tokens)
        self._holders.add(token)
        if self.revoking:  # it came in between: it may not have seen us, so we give way
            self._holders.discard(token)
            return 0
        return token

    def leave(self, token: int) -> None:
        """Give back the shared hold ``token`` (from :meth:`enter`)."""
        self._holders.discard(token)

    @contextmanager
    def shared(self, deadline: float | None) -> Iterator[None]:
        """A shared hold for the block, once no REVOKE is under way (waiting until ``deadline``)."""
        while True:
            token = self.enter()
            if token:
                break
            self.wait_out_revoke(deadline)
        try:
            yield
        finally:
            self.leave(token)

    def wait_for_revoke(self, deadline: float | None) -> None:
        """Wait while a REVOKE is under way (until ``deadline`` at most)."""
        if self.revoking:
            self._no_revoke.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def wait_out_revoke(self, deadline: float | None) -> None:
        """Wait while a REVOKE is under way; :class:`TransferTimeout` once ``deadline`` has passed
        (for a copy that stepped aside for one: it may look again only before its deadline)."""
        self.wait_for_revoke(deadline)
        if deadline is not None and time.monotonic() >= deadline:
            raise TransferTimeout("a change of the peer's registrations held its memory past the deadline")

    @contextmanager
    def exclusive(self, deadline: float) -> Iterator[None]:
        """The lease alone, once every copy in flight has ended; :class:`HixlTimeout` if one still
        runs at ``deadline`` (the block does not run: nothing may be confirmed then)."""
        if not self._changing.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise HixlTimeout("another change of the peer's regions held the lease past the deadline")
        try:
            self._no_revoke.clear()
            self.revoking = True
            try:
                while self._holders:
                    if time.monotonic() >= deadline:
                        raise HixlTimeout(f"{len(self._holders)} same-host copies still ran at the deadline")
                    time.sleep(_POLL)
                yield
            finally:
                self.revoking = False
                self._no_revoke.set()
        finally:
            self._changing.release()


class PeerRegions:
    """The peer's registrations as of :attr:`generation`, and the :attr:`lease` (see the module docstring)."""

    def __init__(self, rows: object, generation: int) -> None:
        self.table = RemoteRegions.from_rows(rows)
        """The peer's regions with their access rights (replaced, never changed in place)."""
        self.generation = generation
        """The peer's registration generation :attr:`table` is of."""
        self.lease = Lease()
        self.revoke_hooks: list[Callable[[RemoteRegions], None]] = []
        """Called with the new table under the exclusive lease, before a REVOKE is confirmed: a
        transport that mapped the peer's memory unmaps what was withdrawn there."""

    def apply(self, update: proto.Regions | proto.Revoke) -> None:
        """Install a REGIONS or REVOKE (the connection checked it follows on from :attr:`generation`)."""
        if update.base == proto.WHOLE:
            self.table = RemoteRegions(np.asarray(update.added, dtype=np.uint64).reshape(-1, 3))
        elif len(update.added) or len(update.removed):
            self.table = self.table.changed(update.added, update.removed)
        self.generation = update.generation

    def revoke(self, update: proto.Revoke, deadline: float) -> None:
        """Install a REVOKE once no copy is in flight, and run the hooks, all under the exclusive
        lease: after this returns, no copy of ours touches what the peer withdrew."""
        with self.lease.exclusive(deadline):
            self.apply(update)
            for hook in self.revoke_hooks:
                hook(self.table)

    def check(self, addrs: np.ndarray, lens: np.ndarray, write: bool) -> None:
        """Raise for a range outside the peer's regions (or, for ``write``, its writable ones)."""
        self.table.check(addrs, lens, write, hint="remote_mems(peer) lists what the peer registered")

    def misses(self, addrs: np.ndarray, lens: np.ndarray, write: bool) -> bool:
        """Whether any range lies outside the peer's regions (or, for ``write``, its writable ones)."""
        return bool(len(self.table.outside(addrs, lens, write)))

    def __len__(self) -> int:
        return len(self.table)
