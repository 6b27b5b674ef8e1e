"""DataDist instances in the metadata store: each instance's record, resolution, watches.

Every instance with a store claims ``/hixl/clusters/<cluster_id>``:
``{cluster_id, role, address, incarnation, caches}`` (JSON; ``address`` is
``None`` for an instance that only links out; ``caches`` is a summary — id,
tensors, shape, dtype — the addresses stay in the catalog, which is fetched
over the authenticated connection). The record is *claimed*, not overwritten
(:meth:`~hixl.discovery.MetadataStore.create_owned`): a cluster id that a live
lease holds cannot be taken, and one held by a record without a lease (nobody's)
is taken over. A restarted instance finds its old record still there until the
old lease runs out (a SIGKILLed process cannot revoke it), so it waits that long
before it gives up with CLUSTER_ID_CONFLICT. Updates (a cache registered, the
role switched) are written outside DataDist's lock, newest last.

Readers trust nothing in a record: anyone who can write to etcd can write
anything there. :func:`parse_record` accepts only what hixl writes — a JSON
object of bounded size, at the canonical key of the cluster id it names, with a
well-formed address and incarnation — and everything else is *no record*: a
lookup answers None (so ``link_clusters`` answers LINK_FAILED) and a watch
treats the key as gone, never an exception.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .._exceptions import HixlError
from .._session.address import parse_address
from ..discovery import MetadataStore, StoreEvent, StoreEventKind
from ._errors import LLMException, LLMStatusCode, translate_errors
from ._types import Cache, ClusterEvent, ClusterEventKind

__all__ = ["CLUSTERS_PREFIX", "MAX_RECORD_BYTES", "ClusterEntry", "ClusterRecord", "ClusterWatch", "lookup_cluster", "parse_record"]

log = logging.getLogger("hixl.datadist")

CLUSTERS_PREFIX = "/hixl/clusters/"
MAX_RECORD_BYTES = 1 << 20
"""The largest record read (etcd itself takes at most 1.5 MiB by default); a cache summary is ~100 bytes."""
_MAX_FIELD = 256  # characters of an address or incarnation (an engine's are ~50 and 16)


def _key(cluster_id: int) -> str:
    return f"{CLUSTERS_PREFIX}{cluster_id}"


def _caches(caches: Sequence[Cache]) -> list[dict[str, Any]]:
    return [
        {"cache_id": c.cache_id, "num_tensors": c.cache_desc.num_tensors, "shape": list(c.cache_desc.shape), "dtype": c.cache_desc.data_type.name}
        for c in caches
    ]


@dataclass(frozen=True)
class ClusterEntry:
    """What a reader takes from a well-formed record: the cluster, where it listens, which incarnation."""

    cluster_id: int
    address: str | None
    """``"ip:port"``, or None for an instance that only links out."""
    incarnation: str


class _Malformed(Exception):
    """What :func:`_parse` found wrong with a record."""


def parse_record(key: str, raw: bytes) -> ClusterEntry | None:
    """The record at ``key`` if it is one hixl could have written, else None (logged). Never raises."""
    try:
        return _parse(key, raw)
    except _Malformed as exc:
        log.warning("ignoring a malformed record at %.80r in the metadata store: %s", key, exc)
        return None


def _parse(key: str, raw: bytes) -> ClusterEntry:
    """:func:`parse_record`'s checks; :class:`_Malformed` says which failed."""
    cluster_id = _cluster_of(key)
    if cluster_id is None:
        raise _Malformed("not a cluster id's key")
    if len(raw) > MAX_RECORD_BYTES:
        raise _Malformed(f"{len(raw)} bytes, more than {MAX_RECORD_BYTES}")
    try:
        doc = json.loads(raw)
    except RecursionError:  # nested deeper than the parser goes: not a record hixl writes
        raise _Malformed("nested too deeply") from None
    except ValueError as exc:  # not JSON, or not UTF-8
        raise _Malformed(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise _Malformed(f"a JSON {type(doc).__name__}, not an object")
    named, address, incarnation = doc.get("cluster_id"), doc.get("address"), doc.get("incarnation")
    if type(named) is not int or named != cluster_id:
        raise _Malformed(f"its cluster_id is not {cluster_id}")
    if address is not None:
        if not isinstance(address, str) or len(address) > _MAX_FIELD:
            raise _Malformed("its address is not an 'ip:port'")
        try:
            parse_address(address, require_port=True)
        except HixlError as exc:
            raise _Malformed(f"its address: {exc}") from None
    if not isinstance(incarnation, str) or not 0 < len(incarnation) <= _MAX_FIELD or not incarnation.isprintable():
        raise _Malformed("its incarnation is not an engine's")
    return ClusterEntry(cluster_id, address, incarnation)


def _cluster_of(key: str) -> int | None:
    """The cluster id whose canonical key ``key`` is (``/hixl/clusters/7``, not ``/07`` or ``/+7``)."""
    tail = key[len(CLUSTERS_PREFIX):] if key.startswith(CLUSTERS_PREFIX) else ""
    if not (0 < len(tail) <= 20 and tail.isascii() and tail.isdigit()) or (tail[0] == "0" and tail != "0"):
        return None
    return int(tail)


class ClusterRecord:
    """This instance's record in the store: claimed at init, kept current, gone with the instance."""

    def __init__(self, store: MetadataStore, cluster_id: int, address: str | None, incarnation: str, role: str) -> None:
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
                        f"cluster id {cluster_id} is held in {store.url} by {holder!r:.200}; another live instance has it",
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
                if not self._store.put_owned(self._key, self._encoded()):
                    raise LLMException(f"{self._key} in {self._store.url} is held by another live lease now", LLMStatusCode.CLUSTER_ID_CONFLICT)


def lookup_cluster(store: MetadataStore, cluster_id: int) -> ClusterEntry | None:
    """The live record of ``cluster_id``; None if there is none, or none hixl could have written.

    Raises :class:`LLMException` only if the store cannot be read.
    """
    with translate_errors("read the metadata store"):
        raw = store.get(_key(cluster_id))
    return None if raw is None else parse_record(_key(cluster_id), raw)


class ClusterWatch:
    """Tells ``callback`` when a cluster appears, goes away, or comes back as a new incarnation.

    Started from a snapshot of the store, so a cluster already there is not
    reported as added, and one that restarts is told apart from one whose
    record was merely updated. A key whose value stops being a well-formed
    record counts as gone. ``callback`` runs on the store's watch thread: it
    must be quick.
    """

    def __init__(self, store: MetadataStore, callback: Callable[[ClusterEvent], None]) -> None:
        self._callback = callback
        self._known: dict[int, str] = {}  # cluster id -> incarnation last seen
        self._gone: dict[int, str] = {}  # removed while watched -> its last incarnation
        self._lock = threading.Lock()
        self._stop = store.watch_prefix(CLUSTERS_PREFIX, self._on_event)
        # Read after the watch started: a change in between is seen by both, and reported once.
        try:
            with translate_errors("read the metadata store"):
                snapshot = store.get_prefix(CLUSTERS_PREFIX)
        except BaseException:
            self._stop()
            raise
        for key, raw in snapshot.items():
            entry = parse_record(key, raw)
            if entry is not None:
                with self._lock:
                    self._known.setdefault(entry.cluster_id, entry.incarnation)

    def _on_event(self, event: StoreEvent) -> None:
        cluster_id = _cluster_of(event.key)
        if cluster_id is None:
            return
        entry = None if event.kind is StoreEventKind.DELETE else parse_record(event.key, event.value or b"")
        if entry is None:
            with self._lock:
                known = self._known.pop(cluster_id, None)
                if known is not None:
                    self._gone[cluster_id] = known
            if known is not None:
                self._callback(ClusterEvent(ClusterEventKind.REMOVED, cluster_id, None, known))
            return
        with self._lock:
            known = self._known.get(cluster_id)
            before = known or self._gone.pop(cluster_id, None)
            self._known[cluster_id] = entry.incarnation
        if known == entry.incarnation:
            return  # the same instance updated its record
        # A record is claimed only once the old one is gone, so a restart shows as REMOVED, then
        # RESTARTED: the id came back under a new incarnation. The same incarnation back (its
        # record was detached from its lease, and restored) is ADDED again.
        kind = ClusterEventKind.RESTARTED if before is not None and before != entry.incarnation else ClusterEventKind.ADDED
        self._callback(ClusterEvent(kind, cluster_id, entry.address, entry.incarnation))

    def cancel(self) -> None:
        """Stop watching; idempotent."""
        self._stop()
