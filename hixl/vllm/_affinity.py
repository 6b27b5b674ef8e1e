"""Keep hixl's threads off the core vLLM pins its compute to.

vLLM's CPU worker binds its OpenMP threads — the main thread among them — to
the cores in ``VLLM_CPU_OMP_THREADS_BIND``, and a thread inherits the
affinity of the thread that starts it. So hixl's I/O threads (DataDist's
serving loop, its workers, the lease keeper, links' readers), all started
from vLLM's main thread, would be bound to that core too, behind the model's
compute and behind vLLM's own busy-waiting: its worker spins on
``sched_yield`` for a second after every step it reads, and a prefill that
holds blocks steps without pause. With two instances bound to one core,
threads there were measured runnable yet not run for up to 21 s (their
``/proc/.../schedstat`` run-queue time), long enough to fail a 5 s handshake
and to break a link by its heartbeat. Threads started inside :func:`unpinned`
may run on every CPU the process is allowed (the cpuset still applies); they
sleep almost always, so they take little from the compute cores. vLLM's NIXL
connector moves its transfer threads off the compute cores the same way.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["unpinned"]


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """Threads started in this block may run on any CPU the process may use; the caller's own binding
    is restored after. Where affinity cannot be read or set, it does nothing."""
    get, set_ = getattr(os, "sched_getaffinity", None), getattr(os, "sched_setaffinity", None)
    if get is None or set_ is None:
        yield
        return
    pinned = get(0)  # (0: the calling thread, on Linux)
    try:
        set_(0, range(os.cpu_count() or 1))  # the kernel keeps only the CPUs the cpuset allows
    except OSError:
        yield
        return
    try:
        yield
    finally:
        set_(0, pinned)
