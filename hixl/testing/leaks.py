"""What a process holds that an engine could leak: threads, file descriptors, memory mappings.

Take a :class:`Snapshot` before the engine starts and compare one taken after
``finalize()`` with :meth:`Snapshot.leaked_since`. Mappings that the
interpreter or the C library keep on their own (shared libraries loaded on
first use, the heap, small allocator arenas, freed thread stacks glibc caches)
are not an engine's leak, so only *anonymous or memfd* mappings count (what
``hixl.empty`` and the cma generation page are), compared by address range, less Python's 1 MiB object
arenas, told apart by their size — the size of what is new, not of the mapping it is in: the kernel
merges an arena with private memory beside it. Run
the process with :data:`QUIET_MALLOC_ENV` so that glibc neither caches thread
stacks nor keeps per-thread arenas, which would otherwise look like leaks;
the one stack glibc keeps of the last thread that exited is recognised by its
guard page, and threads are counted by the kernel instead.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

__all__ = ["QUIET_MALLOC_ENV", "Snapshot", "open_fds"]

QUIET_MALLOC_ENV = {"GLIBC_TUNABLES": "glibc.pthread.stack_cache_size=0:glibc.malloc.arena_max=1"}
"""Environment for a child whose mappings are checked: freed thread stacks are unmapped at once."""

# Python's object allocator maps 1 MiB arenas (256 KiB before 3.10) and keeps
# those that still hold a live object; they are neither hixl's nor a leak.
_PYTHON_ARENA = 1 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _maps() -> frozenset[tuple[int, int, str]]:
    rows = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            rows.append((start, end, fields[1], fields[5].strip() if len(fields) > 5 else ""))
    found = set()
    for i, (start, end, perms, path) in enumerate(rows):
        if path and not path.startswith(("/memfd:", "/dev/zero", "[anon")):
            # A file mapping (a shared library) or [heap] / [stack] / [vvar]. Shared
            # anonymous memory (hixl.empty's mmap) shows as "/dev/zero (deleted)".
            continue
        if perms.startswith("---"):
            continue  # a guard page
        previous = rows[i - 1] if i else None
        if previous and previous[1] == start and previous[1] - previous[0] == _PAGE and previous[2].startswith("---"):
            # A thread stack below its guard page: Python's threads are detached, so
            # glibc keeps the last one that exited mapped for reuse. Threads are
            # counted (in /proc/self/task) instead.
            continue
        found.add((start, end, path))
    return frozenset(found)


def _uncovered(now: frozenset[tuple[int, int, str]], before: frozenset[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """The address ranges of ``now`` that no mapping of ``before`` covered.

    By range, not by mapping: the kernel merges a new anonymous mapping with an
    adjacent one, so a leak can show up as an old mapping grown.
    """
    old = sorted((s, e) for s, e, _ in before)
    left = []
    for start, end, path in sorted(now):
        pieces = [(start, end)]
        for s, e in old:
            if s >= end:
                break
            pieces = [p for a, b in pieces for p in ((a, min(b, s)), (max(a, e), b)) if p[0] < p[1]]
        left += [(a, b, path) for a, b in pieces]
    return left


def open_fds() -> frozenset[str]:
    """This process's open file descriptors, each as ``"fd->what it points to"``."""
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.add(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            pass  # the listing's own descriptor, closed already
    return frozenset(fds)


@dataclass(frozen=True)
class Snapshot:
    """Threads, open file descriptors and anonymous mappings of this process at one moment."""

    threads: frozenset[str]
    tasks: int
    fds: frozenset[str]
    maps: frozenset[tuple[int, int, str]]

    @classmethod
    def take(cls, settle: float = 0.0, than: Snapshot | None = None) -> Snapshot:
        """What this process holds now.

        With ``than``: wait up to ``settle`` seconds for the OS threads to be as
        few as in ``than`` (a Python thread that was joined may still be exiting).
        """
        deadline = time.monotonic() + settle
        while than is not None and len(os.listdir("/proc/self/task")) > than.tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        names = frozenset(f"{t.name}#{t.ident}" for t in threading.enumerate())
        return cls(names, len(os.listdir("/proc/self/task")), open_fds(), _maps())

    def leaked_since(self, before: Snapshot) -> dict[str, list[str]]:
        """What this snapshot holds that ``before`` did not, by kind (``threads``, ``tasks``, ``fds``, ``maps``)."""
        return {
            "threads": sorted(self.threads - before.threads),
            "tasks": [f"{self.tasks - before.tasks} more OS threads"] if self.tasks > before.tasks else [],
            "fds": sorted(self.fds - before.fds),
            "maps": [
                f"{s:#x}-{e:#x} {p}".rstrip()
                for s, e, p in _uncovered(self.maps, before.maps)
                if e - s != _PYTHON_ARENA  # an arena of Python's allocator, on its own or merged into a neighbour
            ],
        }
