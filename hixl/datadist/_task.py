"""CacheTask: an async, layer-by-layer cache transfer, waited for from threads or asyncio.

A task holds one slot per layer. The thread that plans the transfer (or, for
a push, the helper thread that follows prefill's compute) *submits* each
layer's engine requests into its slot, or records why the layer cannot run.
Waiting for a layer is two steps — until its slot is submitted, then until
its requests are final — and both can be done blocking (a condition variable
and the requests' events) or from asyncio (wake-up callbacks, :mod:`hixl._aio`).

A task made with ``req_id`` also carries its *completion*: the notification
telling the other side that the data has landed. It is sent by whoever first
finishes :meth:`CacheTask.synchronize` (or ``await task``), in that caller's
own flow — not by a background thread that could race ``finalize`` — so when
``synchronize`` returns, the peer has the notification.

:meth:`CacheTask.cancel` stops a task: a layer not yet started never starts
(starting one and cancelling exclude each other), and every request already
started is cancelled, so once it returns no further byte of the task lands.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

from .._aio import Wakes, wait_until
from .._exceptions import HixlError
from .._request import TransferReq
from ._errors import LLMException, LLMStatusCode, status_of, translate_errors

__all__ = ["CacheTask", "TaskControl"]


class _LayerSlot:
    """One layer of a :class:`CacheTask`: its engine requests once submitted, or its error.

    Plain attributes under the task's one condition variable: a task of 80 layers
    is built on the path to layer 0, and 80 Events would cost a layer's head start.
    """

    __slots__ = ("error", "reqs", "submitted")

    def __init__(self) -> None:
        self.submitted = False
        self.reqs: list[TransferReq] = []
        self.error: LLMException | None = None


class _Completion:
    """Sends a task's completion notification exactly once; later callers wait for that one send."""

    def __init__(self, send: Callable[[], None]) -> None:
        self._send: Callable[[], None] | None = send
        self._lock = threading.Lock()  # held while sending, so nobody returns before it went
        self._error: LLMException | None = None

    def run(self) -> None:
        """Send unless already sent; raise the send's error (now or for every later call)."""
        with self._lock:
            send, self._send = self._send, None
            if send is not None:
                try:
                    send()
                except LLMException as exc:
                    self._error = exc
            if self._error is not None:
                raise self._error


class CacheTask:
    """An async layer-by-layer transfer; ``wait_layer(i)`` returns once layer ``i`` landed.

    ``layers`` are the *local* cache's layer indices, in transfer order. From
    asyncio: ``await task.wait_layer_async(i)`` and ``await task`` (same as
    :meth:`synchronize_async`).
    """

    def __init__(self, layers: Sequence[int], timeout: float) -> None:
        self.layers = list(layers)
        self.timeout = timeout
        self._slots = {layer: _LayerSlot() for layer in self.layers}
        self._changed = threading.Condition()
        self._wakes = Wakes()  # asyncio waiters for a slot to be submitted
        # (request reading the source's catalog generation, check that it is unchanged)
        self._guard: tuple[TransferReq, Callable[[], bool]] | None = None
        self._completion: _Completion | None = None
        self._starting = threading.Lock()  # held while a layer starts, so cancel() sees it started
        self._cancelled = False

    # -- waiting, blocking -----------------------------------------------------------------
    def wait_layer(self, layer_index: int, timeout: float | None = None) -> None:
        """Block until layer ``layer_index`` has landed; raise :class:`LLMException` if it failed."""
        slot = self._slot(layer_index)
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        self._raise_if_cancelled()
        with self._changed:
            submitted = self._changed.wait_for(lambda: slot.submitted, max(0.0, deadline - time.monotonic()))
        if not submitted:
            raise LLMException(f"layer {layer_index} was not started in time", LLMStatusCode.TIMEOUT)
        self._raise_if_cancelled()
        if slot.error is not None:
            raise slot.error
        with translate_errors(f"layer {layer_index}"):
            self._check_guard(deadline)
            for req in slot.reqs:
                if not req.wait(max(0.0, deadline - time.monotonic())).is_final:
                    raise LLMException(f"layer {layer_index} did not land in time", LLMStatusCode.TIMEOUT)

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait for every layer, raising the first failure; then send the completion notification.

        With ``req_id``, the notification has been handed to the peer when this
        returns (the first caller sends it; a concurrent caller waits for it).
        """
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        for layer in self.layers:
            self.wait_layer(layer, max(0.0, deadline - time.monotonic()))
        if self._completion is not None:
            self._completion.run()

    # -- waiting, asyncio ------------------------------------------------------------------
    async def wait_layer_async(self, layer_index: int, timeout: float | None = None) -> None:
        """:meth:`wait_layer` for asyncio: ``await task.wait_layer_async(i)``.

        The event loop is woken by hixl's threads (no thread per await, no
        polling). Cancelling the await leaves the transfer running.
        """
        slot = self._slot(layer_index)
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        if await wait_until(lambda: slot.submitted, self._wakes.subscribe, self._wakes.unsubscribe, left()):
            for req in self._guard_reqs() + slot.reqs:
                try:
                    await req.wait_async(left())
                except HixlError:
                    break  # reported, translated, by wait_layer below
        # Everything this layer depends on has ended, or the time is up: the
        # blocking wait now returns at once, with the same result or error.
        self.wait_layer(layer_index, 0.0)

    async def synchronize_async(self, timeout: float | None = None) -> None:
        """:meth:`synchronize` for asyncio; ``await task`` is the same without a timeout.

        The completion notification (a round trip to the peer) is sent from the
        loop's default executor rather than blocking the loop.
        """
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        for layer in self.layers:
            await self.wait_layer_async(layer, max(0.0, deadline - time.monotonic()))
        if self._completion is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._completion.run)

    def __await__(self) -> Generator[Any, None, None]:
        """``await task``: :meth:`synchronize_async` with the task's own timeout."""
        return self.synchronize_async().__await__()

    # -- cancelling ------------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop the task; when this returns, no further byte of it lands.

        Layers not started yet are never started, and every request already
        started is cancelled (:meth:`hixl.TransferReq.cancel`: a READ stops at
        once; a WRITE to a TCP target, which lands data itself, is waited for
        until the target answered or its deadline passed). Afterwards every
        wait raises CANCELLED, :attr:`status` is CANCELLED, and no completion
        notification is sent.
        """
        with self._starting:  # a layer being started right now finishes starting first
            self._cancelled = True
        self._change(lambda: None)  # wake waiters, which now raise CANCELLED
        for req in self._guard_reqs() + [r for s in self._slots.values() for r in s.reqs]:
            req.cancel()

    def _raise_if_cancelled(self) -> None:
        if self._cancelled:
            raise LLMException("the task was cancelled", LLMStatusCode.CANCELLED)

    # -- state -----------------------------------------------------------------------------
    def landed_at(self, layer_index: int) -> float | None:
        """``time.monotonic()`` when layer ``layer_index`` finished landing, or None if it hasn't."""
        slot = self._slots[layer_index]
        if not slot.submitted or slot.error is not None or not all(r.done() for r in slot.reqs):
            return None
        return max((r.finished_at or 0.0) for r in slot.reqs) if slot.reqs else None

    def done(self) -> bool:
        """True once every layer has ended (landed or failed), or the task was cancelled."""
        return self._cancelled or all(
            s.submitted and (s.error is not None or all(r.done() for r in s.reqs))
            for s in self._slots.values()
        )

    @property
    def status(self) -> LLMStatusCode:
        """SUCCESS once every layer landed, the first failure's code, or WAIT_PROCESS_TIMEOUT while running."""
        if self._cancelled:
            return LLMStatusCode.CANCELLED
        guard = self._guard_reqs()
        for slot in self._slots.values():
            if slot.error is not None:
                return slot.error.status_code
            for req in guard + slot.reqs:
                if req.status.is_final and req.error is not None:  # ``status`` applies the deadline
                    return status_of(req.error)
        if self._guard is not None and self._guard[0].done() and not self._guard[1]():
            return LLMStatusCode.KV_CACHE_NOT_EXIST
        return LLMStatusCode.SUCCESS if self.done() else LLMStatusCode.WAIT_PROCESS_TIMEOUT

    def _slot(self, layer_index: int) -> _LayerSlot:
        slot = self._slots.get(layer_index)
        if slot is None:
            raise ValueError(f"layer {layer_index} is not part of this task (layers {self.layers})")
        return slot

    def _guard_reqs(self) -> list[TransferReq]:
        return [self._guard[0]] if self._guard else []

    def _check_guard(self, deadline: float) -> None:
        if self._guard is None:
            return
        req, current = self._guard
        if not req.wait(max(0.0, deadline - time.monotonic())).is_final:
            raise LLMException("the source's catalog could not be checked in time", LLMStatusCode.TIMEOUT)
        if not current():
            raise LLMException(
                "the source changed its caches while this pull was in flight; pull again",
                LLMStatusCode.KV_CACHE_NOT_EXIST,
            )

    # -- fed by the cache manager, through a TaskControl -------------------------------------
    def _set_guard(self, req: TransferReq, current: Callable[[], bool]) -> None:
        self._guard = (req, current)

    def _on_success(self, send: Callable[[], None]) -> None:
        """Have :meth:`synchronize` call ``send`` (once) after every layer landed."""
        self._completion = _Completion(send)

    def _start(self, position: int, start: Callable[[], list[TransferReq]]) -> bool:
        """Start the layer at ``position`` with ``start`` unless cancelled; False if it did not start.

        ``start`` raising :class:`LLMException` fails that layer and every later one.
        """
        layer = self.layers[position]
        with self._starting:
            if self._cancelled:
                return False
            try:
                reqs = start()
            except LLMException as exc:
                self._fail_from(position, exc)
                return False
            self._submit(layer, reqs)
        return True

    def _submit(self, layer: int, reqs: list[TransferReq]) -> None:
        slot = self._slots[layer]

        def submit() -> None:
            slot.reqs = reqs
            slot.submitted = True

        self._change(submit)

    def _fail_from(self, layer_pos: int, error: LLMException) -> None:
        def fail() -> None:
            for layer in self.layers[layer_pos:]:
                slot = self._slots[layer]
                slot.error = error
                slot.submitted = True

        self._change(fail)

    def _change(self, change: Callable[[], None]) -> None:
        """Apply ``change`` to the slots and wake every waiter, blocking or asyncio."""
        with self._changed:
            change()
            self._changed.notify_all()
        self._wakes.wake_all()

    def __repr__(self) -> str:
        landed = sum(1 for s in self._slots.values() if s.submitted and all(r.done() for r in s.reqs))
        return f"<CacheTask {landed}/{len(self.layers)} layers ended, {self.status.name}>"


class TaskControl:
    """The driving side of one :class:`CacheTask`: what the cache manager does to it.

    A task's users only watch it (wait, await, cancel); the one that moves its
    layers holds this. Both live in this module, which owns the task's state.
    """

    def __init__(self, layers: Sequence[int], timeout: float) -> None:
        self.task = CacheTask(layers, timeout)
        """The task its users get."""

    def guard(self, req: TransferReq, current: Callable[[], bool]) -> None:
        """The task stands only if ``req`` (a read of the source's generation word, ahead of its
        data) lands with ``current()`` true; else every layer fails KV_CACHE_NOT_EXIST."""
        self.task._set_guard(req, current)

    def on_success(self, send: Callable[[], None]) -> None:
        """Have ``synchronize`` call ``send`` (once) after every layer landed."""
        self.task._on_success(send)

    def start(self, position: int, start: Callable[[], list[TransferReq]]) -> bool:
        """Start the layer at ``position`` with ``start`` unless cancelled; False if it did not start
        (``start`` raising :class:`LLMException` fails that layer and every later one)."""
        return self.task._start(position, start)

    def submit(self, layer: int, reqs: list[TransferReq]) -> None:
        """The requests that move ``layer``."""
        self.task._submit(layer, reqs)

    def fail_from(self, layer_pos: int, error: LLMException) -> None:
        """Fail the layer at ``layer_pos`` and every later one with ``error``."""
        self.task._fail_from(layer_pos, error)
