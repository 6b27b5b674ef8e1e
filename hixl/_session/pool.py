"""A fixed, small number of threads for the target's bulk work, however many peers it serves.

The I/O loop never blocks; what may (a READ's data sent to a peer that reads it
slowly, a WRITE's data landing as it arrives) runs here, one request per job,
in the order the jobs were given. Threads start on demand up to ``size`` and
stay; a connection waits its turn while all are busy. So 64 peers reading at
once are served round robin by ``size`` threads — each job is one request,
then the connection goes back to the loop and queues again — and a slow peer
holds one thread at most until its request's deadline.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

__all__ = ["WorkerPool"]

log = logging.getLogger("hixl")

Job = Callable[[], None]


class WorkerPool:
    """Runs jobs on at most ``size`` threads named ``name-N`` (see the module docstring)."""

    def __init__(self, size: int, name: str) -> None:
        if size < 1:
            raise ValueError("a worker pool needs at least one thread")
        self.size = size
        self._name = name
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, job: Job) -> None:
        """Run ``job`` on a pool thread, after those submitted before it. Its exceptions are its own
        to handle: one that escapes is logged."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the worker pool is closed")
            if self._idle == 0 and len(self._threads) < self.size:
                thread = threading.Thread(target=self._work, name=f"{self._name}-{len(self._threads) + 1}", daemon=True)
                self._threads.append(thread)
                thread.start()
            else:
                self._idle -= 1  # (may go below zero while jobs queue: each thread takes one when free)
        self._jobs.put(job)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:
                log.exception("hixl: a worker job failed")
            with self._lock:
                self._idle += 1

    @property
    def threads(self) -> int:
        """Threads started so far."""
        return len(self._threads)

    def close(self, timeout: float) -> None:
        """Let the queued jobs finish, then stop every thread (each waited for up to ``timeout``)."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._jobs.put(None)
        for thread in threads:
            thread.join(timeout)
