"""CPU time and memory of a process, read from ``/proc`` (Linux; no psutil).

CPU time comes from ``/proc/<pid>/task/*/schedstat`` — nanoseconds on CPU,
summed over every thread — because the clock-tick counters of
``/proc/<pid>/stat`` (10 ms steps) cannot resolve "under 1 % of a core" in a
few seconds. ``stat`` is the fallback where schedstat is missing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["MemorySnapshot", "cpu_ns", "memory", "reset_peak_rss"]

_TICK_NS = 1_000_000_000 // (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


def cpu_ns(pid: int) -> int:
    """Nanoseconds of CPU (user + system) used so far by every thread of ``pid``."""
    total = 0
    found = False
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tasks = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
                found = True
        except (OSError, ValueError, IndexError):
            continue  # a thread that just ended
    if found:
        return total
    with open(f"/proc/{pid}/stat") as f:
        # Fields after the ")" that closes the command name; utime and stime are the 12th and 13th.
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_NS


@dataclass(frozen=True)
class MemorySnapshot:
    """Resident set size now and its peak (high-water mark), in bytes."""

    rss: int
    hwm: int


def memory(pid: int) -> MemorySnapshot:
    """``VmRSS`` and ``VmHWM`` of ``pid``."""
    values = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) * 1024  # reported in kB
    return MemorySnapshot(values["VmRSS"], values["VmHWM"])


def reset_peak_rss(pid: int) -> bool:
    """Reset ``VmHWM`` to the current RSS (``clear_refs`` 5); False where not allowed."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True
