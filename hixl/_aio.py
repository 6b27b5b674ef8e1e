"""Waiting from asyncio for what hixl's own threads finish, without a thread per wait.

Requests complete, layers get submitted and notifications arrive on hixl's
threads. An ``await`` subscribes a *wake* callback there, and all the callback
does is schedule a wake-up on the waiting loop with
``loop.call_soon_threadsafe`` (one byte down the loop's self-pipe). A waiting
coroutine therefore costs one small future and no CPU until something
happens; the loop re-checks its condition when woken, so a spurious or late
wake-up is harmless.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

__all__ = ["Wake", "Wakes", "wait_until"]

Wake = Callable[..., None]
"""A wake-up callback; safe to call from any thread, with any arguments (they are ignored)."""


class Wakes:
    """The wake-ups subscribed by asyncio waiters on one thing; any thread may wake them all."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wakes: set[Wake] = set()

    def subscribe(self, wake: Wake) -> None:
        """Add ``wake`` (pass this as ``wait_until``'s ``subscribe``)."""
        with self._lock:
            self._wakes.add(wake)

    def unsubscribe(self, wake: Wake) -> None:
        """Remove ``wake`` if present (``wait_until``'s ``unsubscribe``)."""
        with self._lock:
            self._wakes.discard(wake)

    def wake_all(self) -> None:
        """Call every subscribed wake-up; they only schedule work on their loops, so this is quick."""
        with self._lock:
            wakes = list(self._wakes)
        for wake in wakes:
            wake()


async def wait_until(
    ready: Callable[[], bool],
    subscribe: Callable[[Wake], None],
    unsubscribe: Callable[[Wake], None],
    timeout: float | None,
) -> bool:
    """Wait until ``ready()`` is true or ``timeout`` seconds (None: no limit) pass; return ``ready()``.

    ``subscribe(wake)`` must arrange for ``wake()`` to be called, from any
    thread, whenever ``ready()`` may have turned true; ``unsubscribe(wake)``
    undoes it. ``ready()`` runs on the loop's thread. Cancelling the caller
    only unsubscribes: whatever was being waited for carries on unaffected.
    """
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    while not ready():
        if deadline is not None and loop.time() >= deadline:
            return False
        woken: asyncio.Future[None] = loop.create_future()

        def wake(*_: object) -> None:
            try:
                loop.call_soon_threadsafe(_resolve, woken)
            except RuntimeError:
                pass  # that loop is closed: nobody is waiting any more

        subscribe(wake)
        timer = None if deadline is None else loop.call_at(deadline, _resolve, woken)
        try:
            if not ready():  # it may have turned true before we subscribed
                await woken
        finally:
            unsubscribe(wake)
            if timer is not None:
                timer.cancel()
    return True


def _resolve(woken: asyncio.Future[None]) -> None:
    if not woken.done():  # already woken, timed out, or cancelled with its waiter
        woken.set_result(None)
