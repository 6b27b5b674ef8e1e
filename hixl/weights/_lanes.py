"""The per-tensor passes of a version (copies, checksums), spread over the engine's copy lanes.

A publish copies and checksums every tensor, and a verifying pull checksums what
it read: passes at memory speed, each tensor's independent of the others'. One
thread makes them at the speed of one core; the C passes release the GIL, so
``lanes`` threads (the caller's included: the engine's ``copy_lanes``) make them
side by side, each taking the next tensor as it frees up, the largest first.
Below :data:`SPREAD_FROM` bytes in all the calling thread does everything: a
thread's start costs more than such a pass saves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

__all__ = ["SPREAD_FROM", "spread"]

SPREAD_FROM = 8 << 20
"""Bytes of work below which :func:`spread` runs everything in the calling thread."""

T = TypeVar("T")
R = TypeVar("R")


def spread(work: Callable[[T], R], jobs: Sequence[T], sizes: Sequence[int], lanes: int) -> list[R]:
    """``[work(job) for job in jobs]``, run on up to ``lanes`` threads (``sizes``: each job's bytes).

    The first exception a job raises is raised here, once every thread has stopped.
    """
    if lanes <= 1 or len(jobs) <= 1 or sum(sizes) < SPREAD_FROM:
        return [work(job) for job in jobs]
    order = iter(sorted(range(len(jobs)), key=lambda i: -sizes[i]))  # largest first: the lanes end together
    results: list[R | None] = [None] * len(jobs)
    errors: list[BaseException] = []
    take = threading.Lock()

    def lane() -> None:
        while not errors:
            with take:
                index = next(order, None)
            if index is None:
                return
            try:
                results[index] = work(jobs[index])
            except BaseException as exc:  # noqa: BLE001  (raised by the caller, below)
                errors.append(exc)

    helpers = [threading.Thread(target=lane, name="hixl-weights-lane", daemon=True) for _ in range(min(lanes, len(jobs)) - 1)]
    for helper in helpers:
        helper.start()
    lane()
    for helper in helpers:
        helper.join()
    if errors:
        raise errors[0]
    return results  # type: ignore[return-value]  (every slot filled: no error)
