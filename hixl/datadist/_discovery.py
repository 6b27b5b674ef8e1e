"""DataDist instances in the metadata store: each listening instance's record, resolution, watches.

A listening instance with a store publishes ``/hixl/clusters/<cluster_id>``:
``{cluster_id, role, address, incarnation, caches}`` (JSON; ``caches`` is a
summary — id, tensors, shape, dtype — the addresses stay in the catalog, which
is fetched over the authenticated connection). The record is *created*, not
overwritten: a cluster id that a live instance holds cannot be taken. A
restarted instance finds its old record still there until the old lease runs
out (a SIGKILLed process cannot revoke it), so it waits that long before it
gives up with CLUSTER_ID_CONFLICT. Updates (a cache registered, the role
switched) are written outside DataDist's lock, newest last.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..discovery import MetadataStore, StoreEvent, StoreEventKind
from ._errors import LLMException, LLMStatusCode, translate_errors
from ._types import Cache, ClusterEvent, ClusterEventKind

__all__ = ["CLUSTERS_PREFIX", "ClusterRecord", "ClusterWatch", "resolve_cluster"]

CLUSTERS_PREFIX = "/hixl/clusters/"


def _key(cluster_id: int) -> str:
    return f"{CLUSTERS_PREFIX}{cluster_id}"


def _caches(caches: Sequence[Cache]) -> list[dict[str, Any]]:
    return [
        {"cache_id": c.cache_id, "num_tensors": c.cache_desc.num_tensors, "shape": list(c.cache_desc.shape), "dtype": c.cache_desc.data_type.name}
        for c in caches
    ]


class ClusterRecord:
    """This instance's record in the store: created at init, kept current, gone with the instance."""

    def __init__(self, store: MetadataStore, cluster_id: int, address: str, incarnation: str, role: str) -> None:
        self._store = store
        self._key = _key(cluster_id)
        self._doc: dict[str, Any] = {"cluster_id": cluster_id, "role": role, "address": address, "incarnation": incarnation, "caches": []}
        self._lock = threading.Lock()  # one write at a time, the newest document last
        deadline = time.monotonic() + store.lease_ttl + 2  # an old incarnation's lease runs out by then
        with translate_errors("publish to the metadata store"):
            while not store.create_owned(self._key, self._encoded()):
                holder = store.get(self._key)
                if time.monotonic() >= deadline:
                    raise LLMException(
                        f"cluster id {cluster_id} is held in {store.url} by {holder!r}; another live instance has it",
                        LLMStatusCode.CLUSTER_ID_CONFLICT,
                    )
                time.sleep(0.2)

    def _encoded(self) -> bytes:
        return json.dumps(self._doc).encode()

    def update(self, snapshot: Callable[[], tuple[str, Sequence[Cache]]]) -> None:
        """Write the record again with the role and caches ``snapshot()`` gives (called outside
        DataDist's lock). The snapshot is taken under this record's lock, so of two updates
        racing, the one written last is also the one that looked last."""
        with self._lock:
            role, caches = snapshot()
            self._doc = {**self._doc, "role": role, "caches": _caches(caches)}
            with translate_errors("update the metadata store"):
                self._store.put_owned(self._key, self._encoded())


def resolve_cluster(store: MetadataStore, cluster_id: int) -> tuple[str, str] | None:
    """``(address, incarnation)`` of the live instance holding ``cluster_id``, or None."""
    with translate_errors("read the metadata store"):
        raw = store.get(_key(cluster_id))
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
        return str(doc["address"]), str(doc["incarnation"])
    except (KeyError, TypeError, ValueError):
        return None  # not a record hixl wrote: nobody usable holds it


class ClusterWatch:
    """Tells ``callback`` when a cluster appears, goes away, or comes back as a new incarnation.

    Started from a snapshot of the store, so a cluster already there is not
    reported as added, and one that restarts is told apart from one whose
    record was merely updated. ``callback`` runs on the store's watch thread:
    it must be quick.
    """

    def __init__(self, store: MetadataStore, callback: Callable[[ClusterEvent], None]) -> None:
        self._callback = callback
        self._known: dict[int, str] = {}  # cluster id -> incarnation last seen
        self._gone: dict[int, str] = {}  # removed while watched -> its last incarnation
        self._lock = threading.Lock()
        self._stop = store.watch_prefix(CLUSTERS_PREFIX, self._on_event)
        # Read after the watch started: a change in between is seen by both, and reported once.
        with translate_errors("read the metadata store"):
            for key, raw in store.get_prefix(CLUSTERS_PREFIX).items():
                parsed = _parse(key, raw)
                if parsed is not None:
                    with self._lock:
                        self._known.setdefault(parsed[0], parsed[2])

    def _on_event(self, event: StoreEvent) -> None:
        try:
            cluster_id = int(event.key[len(CLUSTERS_PREFIX):])
        except ValueError:
            return
        if event.kind is StoreEventKind.DELETE:
            with self._lock:
                known = self._known.pop(cluster_id, None)
                if known is not None:
                    self._gone[cluster_id] = known
            if known is not None:
                self._callback(ClusterEvent(ClusterEventKind.REMOVED, cluster_id, None, known))
            return
        parsed = _parse(event.key, event.value or b"")
        if parsed is None:
            return
        _, address, incarnation = parsed
        with self._lock:
            before = self._known.get(cluster_id) or self._gone.pop(cluster_id, None)
            self._known[cluster_id] = incarnation
        if before == incarnation:
            return  # the same instance updated its record
        # A record is created only once the old one is gone, so a restart shows as REMOVED, then
        # RESTARTED: the id came back under a new incarnation.
        kind = ClusterEventKind.ADDED if before is None else ClusterEventKind.RESTARTED
        self._callback(ClusterEvent(kind, cluster_id, address, incarnation))

    def cancel(self) -> None:
        """Stop watching; idempotent."""
        self._stop()


def _parse(key: str, raw: bytes) -> tuple[int, str, str] | None:
    try:
        doc = json.loads(raw)
        return int(doc["cluster_id"]), str(doc["address"]), str(doc["incarnation"])
    except (KeyError, TypeError, ValueError):
        return None
