"""One vLLM instance's KV events over ZMQ: its PUB socket and its replay socket, feeding an :class:`EventLog`.

:meth:`EventFeed.run` is one asyncio task per instance (on the proxy's event
loop, so the index is read and written on one thread, with no lock): it reads
the instance's published batches as they come and, when its log asks for one
(:meth:`EventLog.replay_due`), a replay. A replay unanswered within
``timeout / 3`` of its request or of its last batch is given up, and its socket
closed with it: the next replay goes out on a fresh socket, so that a late
answer (from a restarted instance, say) is never read as the next one's.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from .event_log import EventLog
from .kv_events import END_SEQ, BadEvents, decode_published, decode_replayed, replay_request

__all__ = ["EventFeed"]

log = logging.getLogger("hixl.proxy")

#: Seconds the feed waits for a batch at least, so that its loop never spins.
MIN_WAIT = 0.01
#: Published batches the SUB socket holds for the proxy while it handles a replay (vLLM's own PUB high-water mark).
SUB_HWM = 100_000


class EventFeed:
    """Instance ``name``'s events from ZMQ ``endpoint`` (its PUB) and ``replay`` (its replay ROUTER), into :attr:`log`."""

    def __init__(self, name: str, endpoint: str, replay: str, timeout: float) -> None:
        self.endpoint, self.replay = endpoint, replay
        self.log = EventLog(name, timeout, time.monotonic())
        self._wait = timeout / 3  # the longest a replay's answer may keep the feed waiting between two of its messages

    def live(self) -> bool:
        """Whether the instance's index may route requests now."""
        return self.log.live(time.monotonic())

    async def run(self, context: zmq.asyncio.Context) -> None:
        """Follow the instance's events until cancelled, with sockets of ``context``."""
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, SUB_HWM)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        dealer: zmq.asyncio.Socket | None = None
        try:
            sub.connect(self.endpoint)
            while True:
                start = self.log.replay_due(time.monotonic())
                if start is not None:
                    dealer = await self._replay(context, dealer, start)
                elif await sub.poll(max(self.log.next_probe(time.monotonic()), MIN_WAIT) * 1000):
                    self._published(await sub.recv_multipart())
                # A socket with a message waiting completes its future at once: without this, a flood of
                # events would keep the event loop, and the requests it serves, waiting.
                await asyncio.sleep(0)
        except zmq.ZMQError as exc:  # (an endpoint ZMQ cannot use): the instance stays routed by load
            log.error("%s: its KV events cannot be followed from %s / %s: %s", self.log.name, self.endpoint, self.replay, exc)
        finally:
            sub.close(linger=0)
            if dealer is not None:
                dealer.close(linger=0)

    def _published(self, frames: list[bytes]) -> None:
        try:
            seq, payload = decode_published(frames)
        except BadEvents as exc:  # left out: the next batch's number shows the gap, and a replay fills it
            log.warning("%s: a published message is not a KV event batch: %s", self.log.name, exc)
            return
        self.log.published(seq, payload, time.monotonic())

    async def _replay(self, context: zmq.asyncio.Context, dealer: zmq.asyncio.Socket | None, start: int) -> zmq.asyncio.Socket | None:
        """Ask for every batch from ``start`` on and hand the answer to the log; the socket to ask on next time."""
        if dealer is None:
            dealer = context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.replay)
        await dealer.send_multipart(replay_request(start))
        batches: list[tuple[int, bytes]] = []
        while await dealer.poll(self._wait * 1000):
            try:
                seq, payload = decode_replayed(await dealer.recv_multipart())
            except BadEvents as exc:
                log.warning("%s: its replay socket answered something else: %s", self.log.name, exc)
                break
            if seq == END_SEQ:
                self.log.replayed(start, batches, time.monotonic())
                return dealer
            batches.append((seq, payload))
        dealer.close(linger=0)
        return None

    def __repr__(self) -> str:
        return f"<EventFeed {self.endpoint} {self.log!r}>"
