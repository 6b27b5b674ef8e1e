"""A peer's shared memory as an initiator maps it, kept in step with the peer's registrations.

Theory of operation. The link's region table (``link.regions.table``) is what the
engine checks every descriptor against; it is replaced, never mutated, when
the peer's registrations change. :class:`PeerMemory` remembers the table its
mappings were made for (``synced``). A copy goes through a mapping only while
``link.regions.table is synced``, checked under the link's lease, so:

- a REVOKE (the peer deregistering) unmaps, under the lease and before the
  link confirms it, every mapping the new table does not register in full
  (:meth:`PeerMemory.on_revoke`): once the peer's ``deregister_mem`` returns,
  the memory is no longer mapped here;
- any other change (a region registered, a REGIONS update) makes the next
  transfer call :meth:`PeerMemory.sync`, which asks the peer's Unix socket for
  its grants again — only if the new table names a region that is neither
  mapped nor known to be outside the pool — and installs them under the lease,
  against whatever the table is by then.

Regions not granted (not pool memory, or registered only in part) are
remembered as ``elsewhere``: their requests go over TCP without asking again.

Mapped memory outlives its owner, so before every copy the channel checks
:meth:`PeerMemory.alive`: the target's liveness pipe (see
:mod:`hixl._protocol.shm`) hangs up once the target process is gone, and a
copy is then refused, as cma refuses one into a process whose pidfd says it
exited. (A fork of the target inheriting the pipe would keep it "alive".)
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import threading
import time
from typing import TYPE_CHECKING

from .._exceptions import ProtocolError
from .._memory import RemoteRegions
from .._protocol import shm as shm_proto
from ._peerproc import Watched
from ._shm_maps import GrantLimits, SharedMappings
from ._shm_socket import Received, fetch

if TYPE_CHECKING:
    from .base import LinkSession

__all__ = ["Liveness", "PeerMemory"]

log = logging.getLogger("hixl")
RECHECK = 0.001
"""Seconds a look at the liveness pipe stays good for."""


class Liveness(Watched):
    """The read end of a target's liveness pipe: :meth:`alive` until every write end is closed.

    Asked before every copy, it looks at the pipe at most once per :data:`RECHECK` seconds: the
    syscall costs more than the check is worth on a small copy, and a target that dies is also
    seen at once through its TCP socket closing, which ends the link.
    """

    def __init__(self, fd: int) -> None:
        """Take ownership of ``fd``; ``ProtocolError`` (and ``fd`` closed) unless it is a pipe's read end."""
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                raise ProtocolError("the liveness descriptor is not a pipe")
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY:
                raise ProtocolError("the liveness descriptor is not a pipe's read end")
        except BaseException:
            os.close(fd)
            raise
        super().__init__(fd)
        self._seen_alive = -RECHECK  # time.monotonic() of the last look that found it alive

    def alive(self) -> bool:
        """False once the target (every holder of the write end) is gone, or this is closed."""
        now = time.monotonic()
        if self._fd >= 0 and now - self._seen_alive < RECHECK:
            return True
        if not super().alive():
            return False
        self._seen_alive = now
        return True


class PeerMemory:
    """One peer's shared memory, mapped here (see the module docstring)."""

    def __init__(self, link: LinkSession, path: str, timeout: float, limits: GrantLimits) -> None:
        self.link = link
        self.path = path
        self.timeout = timeout
        """Longest one exchange with the peer's socket (and mapping what it granted) may take."""
        self.limits = limits
        """The most this maps of the peer."""
        self.maps = SharedMappings()
        """The mappings; read under a shared hold of the link's lease, changed under it alone."""
        self.synced: RemoteRegions | None = None
        """The link's table ``maps`` are in step with (a copy needs ``link.regions.table is synced``)."""
        self._elsewhere: frozenset[tuple[int, int]] = frozenset()
        self._liveness: Liveness | None = None
        self._sync_lock = threading.Lock()  # one exchange at a time
        link.regions.revoke_hooks.append(self.on_revoke)

    def alive(self) -> bool:
        """Whether the target process still exists, as far as its liveness pipe tells."""
        liveness = self._liveness
        return liveness is not None and liveness.alive()

    def in_step(self) -> bool:
        """Whether the mappings are those of the link's current table (ask under the lease)."""
        return self.link.regions.table is self.synced

    def sync(self, timeout: float) -> str | None:
        """Bring the mappings in step with the link's current table; why the peer's grants could not
        be had, if they were needed and could not (its regions then go over TCP)."""
        link, regions = self.link, self.link.regions
        deadline = time.monotonic() + timeout
        with self._sync_lock:
            table = regions.table
            if table is self.synced:
                return None
            if self.maps.explains(table, self._elsewhere):
                with regions.lease.exclusive(deadline):
                    self.maps.keep_covered(regions.table)
                    if regions.table is table:
                        self.synced = table
                return None
            problem = None
            binding, proof = link.binding("shm"), link.binding("shm-target")
            received: list[Received] = []
            refused: list[str] = []
            liveness: Liveness | None = None
            deadline = min(deadline, time.monotonic() + self.timeout)
            try:
                fetched = fetch(self.path, binding, proof, deadline - time.monotonic(), self.limits.grants)
                try:
                    liveness = Liveness(fetched.liveness)
                except ProtocolError:
                    for grant in fetched.received:
                        os.close(grant.fd)
                    raise
            except (OSError, ProtocolError, shm_proto.Refused) as exc:
                problem = f"cannot get the peer's shared memory from {self.path}: {exc}"
                log.warning("hixl: %s: %s; its regions go over TCP", link.remote_engine, problem)
            else:
                received, refused = fetched.received, fetched.refused
            prepared = self.maps.prepare(received, table, self.limits, deadline)
            refused += prepared.refused
            for why in refused:
                log.warning("hixl: %s: a shared region was refused (it goes over TCP): %s", link.remote_engine, why)
            # (Copies look at the liveness pipe under the lease too: none sees the old one closed.)
            with regions.lease.exclusive(time.monotonic() + self.timeout):  # (installed whatever the time left)
                if liveness is not None:
                    liveness, self._liveness = self._liveness, liveness
                self.maps.install(prepared, regions.table)
                self._elsewhere = frozenset(
                    (a, n) for a, n in table.regions if self.maps.find(a, n, False) < 0
                )
                if regions.table is table:
                    self.synced = table
            if liveness is not None:
                liveness.close()  # the one it replaced
            return problem or ("; ".join(refused) if refused and not self.maps.items else None)

    def on_revoke(self, table: RemoteRegions) -> None:
        """The link's REVOKE hook (under the exclusive lease): unmap what ``table`` withdrew, at once."""
        self.maps.keep_covered(table)
        if self.synced is not None and self.maps.explains(table, self._elsewhere):
            self.synced = table

    def close(self) -> None:
        """Unmap everything and stop following the link."""
        regions = self.link.regions
        with regions.lease.exclusive(time.monotonic() + self.timeout):
            self.maps.close()
            self.synced = None
            if self._liveness is not None:
                self._liveness.close()
        if self.on_revoke in regions.revoke_hooks:
            regions.revoke_hooks.remove(self.on_revoke)

    def __repr__(self) -> str:
        return f"<PeerMemory {self.path} mapped={len(self.maps.items)} in_step={self.in_step()}>"
