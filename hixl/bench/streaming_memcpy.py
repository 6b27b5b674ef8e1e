"""shm's second large-copy baseline: glibc's own ``memcpy``, told to use streaming stores, in a helper.

A plain store first reads the cache line it writes (to own it), so a copy too
large to stay in the caches moves every byte over the memory bus three
times; streaming (non-temporal) stores skip that read. glibc's ``memcpy``
switches to them only above its ``x86_non_temporal_threshold`` — 240 MiB on
the 2-vCPU VM — and hixl's shm copies use them from 16 MiB
(:data:`hixl._accel.STREAM_FROM`). A baseline that is to be the fastest plain
copy at those sizes must stream too, but must not be hixl's code (a change to
hixl would move its own yardstick): it is glibc's ``memcpy`` with that
threshold lowered to :data:`NON_TEMPORAL_FROM`. Tunables are read once, when a
process starts, so the copy runs in a helper process started with
``GLIBC_TUNABLES`` set: ``python -m hixl.bench._streaming_memcpy_main``.

The helper maps the same pool buffer of the bench target that the initiator
maps (through its memfd) and copies between it and private memory of its own
(the kind of memory the initiator's buffers are), one memoryview slice
assignment per call, as :func:`~hixl.bench.baselines.memcpy_copier` does. It
times each repetition itself (:class:`~hixl.bench.timing.SelfTimed`), so the
message that starts one is not counted. The engine scenario takes the faster
of the two copies as shm's bandwidth baseline, size by size: below the caches'
size the plain ``memcpy`` wins.
"""

from __future__ import annotations

import mmap
import os
import platform
import time
from multiprocessing.connection import Connection

import numpy as np

from .._tools.child import ChildProcess, CommandChild, serve_commands
from .._types import Op
from .target import map_memfd
from .timing import SelfTimed

__all__ = ["NON_TEMPORAL_FROM", "StreamingMemcpy", "streaming_stores_here"]

NON_TEMPORAL_FROM = 16 << 20
"""The helper's ``glibc.cpu.x86_non_temporal_threshold``: its ``memcpy`` streams every copy of this
many bytes or more, and the bench offers it from this size. Below, a copy stays in the caches and
the plain one wins (1 MiB: 23-26 against 37-43 GiB/s on the 2-vCPU VM) — and the helper's copy,
timed between the others' repetitions, would empty caches they find warm (a --quick run's 1 MiB
shm row fell from 38 to 21 GiB/s beside it)."""


def streaming_stores_here() -> bool:
    """Whether glibc's streaming-store threshold applies on this machine (an x86-64 tunable)."""
    return platform.machine() in ("x86_64", "AMD64")


def _tunables() -> str:
    ours = f"glibc.cpu.x86_non_temporal_threshold={NON_TEMPORAL_FROM:#x}"
    inherited = os.environ.get("GLIBC_TUNABLES")
    return f"{inherited}:{ours}" if inherited else ours


class StreamingMemcpy(CommandChild):
    """A helper process copying between the target's pool buffer at ``memfd_path`` and private memory.

    ``nbytes`` is the buffer's size; its private twin is as large, filled with ``fill``.
    A context manager; :meth:`close` stops the helper.
    """

    who = "streaming memcpy helper"

    def __init__(self, memfd_path: str, nbytes: int, fill: int = 0x11, timeout: float = 60.0) -> None:
        self._child = ChildProcess("hixl.bench._streaming_memcpy_main", timeout, env={"GLIBC_TUNABLES": _tunables()})
        try:
            self._do("map", memfd_path, nbytes, fill)
        except BaseException:
            self._child.kill()
            raise

    def copier(self, op: Op, nbytes: int) -> SelfTimed:
        """The first ``nbytes`` copied: the pool buffer into private memory (READ) or back (WRITE)."""
        return SelfTimed(lambda iterations: int(self._do("copy", op.name, nbytes, iterations)))

    def private(self, offset: int, nbytes: int) -> bytes:
        """Bytes of the helper's private buffer (what a READ copied there)."""
        return self._do("private", offset, nbytes)  # type: ignore[no-any-return]


def serve(conn: Connection) -> None:
    """The helper's main loop (see the module docstring)."""
    buffers: dict[str, np.ndarray] = {}

    def map_(path: str, nbytes: int, fill: int) -> None:
        private = np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8, count=nbytes)
        private.fill(fill)  # every page touched now, not inside a timed copy
        buffers.update(pool=map_memfd(path, nbytes), private=private)

    def copy(op: str, nbytes: int, iterations: int) -> int:
        pool, private = memoryview(buffers["pool"])[:nbytes], memoryview(buffers["private"])[:nbytes]
        src, dst = (pool, private) if op == Op.READ.name else (private, pool)
        start = time.perf_counter_ns()
        for _ in range(iterations):
            dst[:] = src
        return time.perf_counter_ns() - start

    def private(offset: int, nbytes: int) -> bytes:
        return buffers["private"][offset : offset + nbytes].tobytes()

    commands = {"map": map_, "copy": copy, "private": private}
    serve_commands(conn, lambda command, args: commands[command](*args))
