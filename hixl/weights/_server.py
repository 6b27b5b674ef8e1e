"""Serving versions from one engine: header words, leases, subscriptions and announcements.

A :class:`VersionServer` is what a :class:`~hixl.weights.Publisher` and a
:class:`~hixl.weights.Relay` share. It owns

- the *header words*, one per slot, in a page of pool memory registered read-only
  (created first, so that a peer connecting at once already finds pool memory and
  can use the ``shm`` transport): a slot's word is 0 while the slot is written
  and its version once it is complete (:meth:`invalidate`, :meth:`commit`);
- the :class:`~._ledger.Ledger` of slots and leases, fed by the ACQUIRE and
  RELEASE notifications readers send (handled on the engine's serving threads);
- the subscribers, and one thread (``hixl-weights-announce``) that connects back
  to each new subscriber and tells every subscriber of each new version.

Handlers must be quick and must not block: they decode, check, and hand
anything slow (connecting, notifying) to the announcing thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

import numpy as np

from .._exceptions import AlreadyConnected, HixlError, ParamInvalid
from .._memory import empty
from .._types import NotifyDesc
from ..engine import Engine
from . import _wire
from ._ledger import Ledger
from ._manifest import Manifest

__all__ = ["NOTIFY_TIMEOUT", "VersionServer"]

log = logging.getLogger("hixl.weights")

NOTIFY_TIMEOUT = 2.0
"""Seconds a subscriber may take to accept a notification; one that takes longer is dropped (it
still pulls, and its next ``wait_version`` subscribes it again)."""


@dataclass(frozen=True)
class _Subscriber:
    address: str
    incarnation: str
    token: str


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0]


class VersionServer:
    """See the module docstring. ``engine`` must listen: it is the target of every READ."""

    def __init__(self, engine: Engine, slots: int, lease: float) -> None:
        if ":" not in engine.local_engine:
            raise ParamInvalid("a publisher's engine must listen (\"ip:port\"): subscribers read its memory")
        if not lease > 0:
            raise ParamInvalid(f"lease must be a positive number of seconds, not {lease!r}")
        self.engine = engine
        self.slots = slots
        self.headers = empty(slots, np.uint64, shared=True)
        self._header_handle = engine.register_mem(self.headers, access="r")
        self.ledger = Ledger(slots, lease, lambda: set(engine.served_connections()))
        self._subscribers: dict[str, _Subscriber] = {}
        self._dialed: set[str] = set()  # addresses this server connected to (and so disconnects)
        self._jobs: queue.SimpleQueue[_Subscriber | tuple[int, int] | None] = queue.SimpleQueue()
        self._closed = False
        engine.set_metadata(_wire.LATEST_KEY, _wire.encode(version=0, slot=0, slots=slots).encode())
        engine.handle_notifies(_wire.SUBSCRIBE, self._on_subscribe)
        engine.handle_notifies(_wire.ACQUIRE, self._on_acquire)
        engine.handle_notifies(_wire.RELEASE, self._on_release)
        self._thread = threading.Thread(target=self._announce, name="hixl-weights-announce", daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def header(self, slot: int) -> int:
        """Address of slot ``slot``'s header word."""
        return int(self.headers.ctypes.data) + 8 * slot

    def invalidate(self, slot: int) -> None:
        """Before a byte of slot ``slot`` changes: its header word no longer names a version."""
        self.headers[slot] = 0

    def commit(self, manifest: Manifest) -> None:
        """Once its slot holds every byte of ``manifest``: make the version readable and announce it."""
        self.headers[manifest.slot] = manifest.version  # after the data: a reader checks it after its READ
        self.engine.set_metadata(_wire.slot_key(manifest.slot), manifest.encode())
        self.ledger.ready(manifest.slot, manifest.version)
        latest = _wire.encode(version=manifest.version, slot=manifest.slot, slots=self.slots)
        self.engine.set_metadata(_wire.LATEST_KEY, latest.encode())
        self._jobs.put((manifest.version, manifest.slot))

    # -- the engine's serving threads -------------------------------------------------------------
    def _on_subscribe(self, notify: NotifyDesc) -> None:
        self._check_open()
        doc = _wire.decode(notify.msg, address=str, engine=str, token=str)
        # Connect back only to the host the subscription came from: a peer cannot point this
        # engine at a third machine.
        came_from = self.engine.served_connections().get(notify.sender, "")
        if _host(doc["address"]) != _host(came_from) or not doc["token"].isalnum():
            raise ParamInvalid(f"a subscriber at {came_from} cannot subscribe {doc['address']!r} (token {doc['token']!r})")
        self._jobs.put(_Subscriber(doc["address"], doc["engine"], doc["token"]))

    def _on_acquire(self, notify: NotifyDesc) -> None:
        self._check_open()
        self.ledger.acquire(notify.sender, _wire.decode(notify.msg, version=int)["version"])

    def _on_release(self, notify: NotifyDesc) -> None:
        self.ledger.release(notify.sender, _wire.decode(notify.msg, version=int)["version"])

    def _check_open(self) -> None:
        if self._closed:
            raise HixlError(f"the publisher at {self.engine.local_engine} is closed")

    # -- the announcing thread --------------------------------------------------------------------
    def _announce(self) -> None:
        while True:
            jobs = [self._jobs.get()]
            while not self._jobs.empty():
                jobs.append(self._jobs.get())
            newest: tuple[int, int] | None = None  # coalesced: only the newest version is worth telling
            for job in jobs:
                if job is None:
                    return
                if isinstance(job, _Subscriber):
                    self._add(job)
                elif newest is None or job > newest:
                    newest = job
            if newest is not None:
                for sub in list(self._subscribers.values()):
                    self._tell(sub, *newest)

    def _add(self, sub: _Subscriber) -> None:
        if self._subscribers.get(sub.token) == sub:
            return  # subscribed again while still subscribed (it cannot know it was not dropped)
        try:
            try:
                self.engine.connect(sub.address, timeout=NOTIFY_TIMEOUT)
                self._dialed.add(sub.address)
            except AlreadyConnected:
                pass
            if self.engine.peer_incarnation(sub.address) != sub.incarnation:
                raise ParamInvalid(f"{sub.address} is not the engine that subscribed")
        except HixlError as exc:
            log.warning("hixl.weights: cannot connect back to subscriber %s: %s", sub.address, exc)
            return
        self._subscribers[sub.token] = sub  # it asked for the newest itself, after subscribing

    def _tell(self, sub: _Subscriber, version: int, slot: int) -> None:
        message = _wire.encode(version=version, slot=slot, publisher=self.engine.incarnation)
        try:
            self.engine.send_notify(sub.address, NotifyDesc(_wire.version_name(sub.token), message), NOTIFY_TIMEOUT)
        except HixlError as exc:
            log.info("hixl.weights: dropped subscriber %s: %s", sub.address, exc)
            self._subscribers.pop(sub.token, None)

    def close(self) -> None:
        """Refuse further requests, stop announcing and disconnect from the subscribers it dialled."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._thread.join(NOTIFY_TIMEOUT * (len(self._subscribers) + 1))
        for address in self._dialed:
            try:
                self.engine.disconnect(address)
            except HixlError:
                pass  # gone already
        try:
            self.engine.deregister_mem(self._header_handle)
        except HixlError:
            pass  # the engine was finalized first: its registrations are gone
