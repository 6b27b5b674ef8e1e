"""Copy lanes: one large same-host transfer split over several threads.

One ``process_vm_readv`` runs at the speed of one core's copy loop; a transfer
cut into ``lanes`` parts of about equal bytes, each copied by its own thread,
runs at several. The calling thread copies the first part itself; the others go
to a small pool of lane threads, started the first time a transfer is large
enough (``LANE_FROM``) and shared by every channel of the transport. Each part
keeps every rule a whole transfer has: it holds the link's lease chunk by chunk,
checks the request's cancellation under a lock of its own (which ``cancel`` and
expiry wait for too: :meth:`TransferReq.lane_lock`), and stops at the first
error; the request completes only once every part has.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

from .._exceptions import TransferTimeout

__all__ = ["LANE_FROM", "Lanes", "split_even"]

LANE_FROM = 16 << 20
"""A transfer of fewer bytes runs in one lane: the hand-off would cost more than the second core gains."""
_ALIGN = 4096  # parts start on page boundaries of the copy (no page copied by two lanes)


def split_even(descs: np.ndarray, parts: int) -> list[np.ndarray]:
    """``descs`` ((N, 3): local, remote, len) cut into ``parts`` runs of about equal bytes, in order.

    A descriptor that straddles a cut is split in two; every cut but the last falls
    on a multiple of 4 KiB of the transfer. Fewer runs come back if there are too
    few bytes for ``parts``.
    """
    lens = descs[:, 2].astype(np.uint64)
    total = int(lens.sum(dtype=np.uint64))
    step = -(-total // parts // _ALIGN) * _ALIGN
    if parts <= 1 or step == 0 or step >= total:
        return [descs]
    ends = np.cumsum(lens, dtype=np.uint64)
    out: list[np.ndarray] = []
    start_row, start_skip = 0, 0  # the current run begins ``start_skip`` bytes into row ``start_row``
    for cut in range(step, total, step):
        row = int(np.searchsorted(ends, np.uint64(cut), side="right"))  # the row holding byte ``cut``
        into = cut - (int(ends[row - 1]) if row else 0)  # bytes of that row before the cut
        out.append(_run(descs, start_row, start_skip, row, into))
        start_row, start_skip = row, into
    out.append(_run(descs, start_row, start_skip, len(descs), 0))
    return [run for run in out if len(run)]


def _run(descs: np.ndarray, first: int, skip: int, last: int, keep: int) -> np.ndarray:
    """Rows ``first`` (less its first ``skip`` bytes) up to ``last`` (plus its first ``keep`` bytes)."""
    rows = descs[first:last].copy() if last > first else descs[:0].copy()
    if keep and last < len(descs):
        tail = descs[last : last + 1].copy()
        tail[0, 2] = keep
        rows = np.concatenate([rows, tail])
    if skip and len(rows):
        rows[0, 0] += np.uint64(skip)
        rows[0, 1] += np.uint64(skip)
        rows[0, 2] -= np.uint64(skip)
        if rows[0, 2] == 0:
            rows = rows[1:]
    return rows


class Lanes:
    """The lane threads of one transport: ``count`` lanes, the caller being the first."""

    def __init__(self, count: int) -> None:
        self.count = max(1, int(count))
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def run(self, parts: list[Callable[[], object]], deadline: float | None) -> list[BaseException | None]:
        """Run ``parts[0]`` here and the others on lane threads; each one's exception (or None), a
        part not ended by ``deadline`` as :class:`~hixl.TransferTimeout` (it stops at its next
        chunk: its request is expired by then, and it looks before each)."""
        futures: list[Future[object]] = [self._executor().submit(part) for part in parts[1:]] if len(parts) > 1 else []
        outcomes: list[BaseException | None] = []
        try:
            parts[0]()
            outcomes.append(None)
        except BaseException as exc:  # noqa: BLE001  (reported with the others')
            outcomes.append(exc)
        for future in futures:
            try:
                outcomes.append(future.exception(None if deadline is None else max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                outcomes.append(TransferTimeout("a copy lane did not finish its part by the deadline"))
        return outcomes

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.count - 1, thread_name_prefix="hixl-lane")
            return self._pool

    def close(self) -> None:
        """Stop the lane threads (after the parts they run)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
