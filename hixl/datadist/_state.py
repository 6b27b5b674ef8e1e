"""The state one DataDist instance shares between :class:`LLMDataDist` and :class:`CacheManager`.

:class:`DataDistState` is its one owner, under one lock: this instance's caches
and the catalog it publishes about them (with the generation word peers read),
the links to other clusters with the catalogs fetched from them, and which
served connection speaks for which cluster. ``LLMDataDist`` (links, life cycle)
and ``CacheManager`` (registration, transfers) both work through it and never
through each other.

Publishing happens under the lock, with the snapshot of the caches taken under
the same lock: two concurrent registrations publish in some order, and the last
catalog published (with the highest generation) is always the newest.

Completion notifications are bound to their link. An instance that links to
another announces its cluster id over that connection (:data:`HELLO_NOTIFY`).
The receiver decides as the announcement arrives (an engine notification
handler, on the serving thread): it binds the cluster id to that connection
(``NotifyDesc.sender``), or refuses the announcement — the announcer's
``send_notify`` raises — if the cluster is bound to another connection that is
still served, or if this connection already speaks for another cluster. A
refusal is final: nothing of it is kept, so a refused claim can never take
over later. A binding moves only to a connection that announces after the old
one is gone (the announcer retries within its link timeout, which covers an
unlink followed at once by a link, before the close has been seen here). A
completion (:data:`DONE_NOTIFY`) is accepted only from the connection bound to
the cluster it names, and while that cluster has fewer than
:attr:`LLMConfig.max_pending_done` completions not yet taken; anything else is refused
(the sender is told, this side logs it) and never reaches ``take_done``.

With a metadata store, the store arbitrates cluster ids: every instance claims
its id there at init (:class:`ClusterRecord`), announces its engine's
incarnation with its cluster id, and an announcement is refused unless the
store's live record of that id names that incarnation — before any of the
rules above. Without a store the first announcement wins, as above.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from .._exceptions import (
    AccessDenied,
    AlreadyConnected,
    HixlError,
    ParamInvalid,
    ResourceExhausted,
)
from .._memory import empty
from .._types import MemDesc, MemHandle, NotifyDesc, Op, TransferOpDesc
from ..engine import Engine
from ._catalog import CATALOG_KEY, Catalog, encode_catalog
from ._discovery import ClusterRecord, lookup_cluster
from ._errors import LLMException, LLMStatusCode, translate_errors
from ._types import Cache, CacheDesc, LLMConfig, LLMRole, TransferDone

__all__ = ["DONE_NOTIFY", "HELLO_NOTIFY", "DataDistState", "Link"]

log = logging.getLogger("hixl.datadist")

DONE_NOTIFY = "hixl.datadist.done"
HELLO_NOTIFY = "hixl.datadist.hello"
_PROBE_WORDS = 256
T = TypeVar("T")


@dataclass(frozen=True)
class Link:
    """A link to another cluster: its address, the incarnation linked to, its latest catalog."""

    name: str
    incarnation: str
    catalog: Catalog


class DataDistState:
    """Caches, catalogs, generation words, links and completion bindings of one instance, under one lock."""

    def __init__(self, engine: Engine, cluster_id: int, role: LLMRole, config: LLMConfig) -> None:
        self.engine = engine
        self.cluster_id = cluster_id
        self.config = config
        self._role = role
        self._lock = threading.Lock()
        self._senders: dict[int, str] = {}  # cluster id -> the served connection that speaks for it
        self._done: list[TransferDone] = []
        self._pending: collections.Counter[int] = collections.Counter()  # completions in _done, per cluster
        if config.listen_ip_info:
            # Before the catalog is published: a peer announces itself only after reading it.
            engine.handle_notifies(HELLO_NOTIFY, self._on_hello)
            engine.handle_notifies(DONE_NOTIFY, self._on_done)
        # Words that peers' generation counters are read into; one per check in flight.
        self._probe_words = empty(_PROBE_WORDS, np.uint64)
        self._probe_next = itertools.count()
        engine.register_mem(self._probe_words)
        # Where peers read this instance's generation; only a listening instance has peers.
        self._generation: np.ndarray | None = None
        if config.listen_ip_info:
            self._generation = empty(1, np.uint64)
            engine.register_mem(self._generation)
        self._caches: dict[int, Cache] = {}
        self._handles: dict[int, list[MemHandle]] = {}
        self._next_id = 1
        self._links: dict[int, Link] = {}
        with self._lock:
            self._publish_locked()
        # Last: peers that find this instance in the store can link to it at once. One that only
        # links out claims its id too: its announcements are checked against the claim.
        self._record: ClusterRecord | None = None
        store = engine.metadata_store
        if store is not None:
            address = engine.local_engine if config.listen_ip_info else None
            self._record = ClusterRecord(store, cluster_id, address, engine.incarnation, role.name)

    def __del__(self) -> None:
        # The engine's threads may still be landing data in memory this state keeps alive
        # (probe words, caches' tensors) — e.g. an instance dropped with a pull in flight:
        # stop them before that memory is freed along with this object.
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.finalize()

    # -- this instance's caches and catalog --------------------------------------------------
    def add_cache(
        self, desc: CacheDesc, addrs: list[int], keys: list[Any], is_blocks: bool, tensors: Sequence[Any], access: str = "rw"
    ) -> Cache:
        """Register a cache's memory (``access``: as :meth:`Engine.register_mem`'s), record it and publish the new catalog."""
        with self._lock:
            for other in self._caches.values():
                clash = [k for k in keys if k is not None and k in other.keys]
                if clash:
                    raise ValueError(f"key {clash[0]} is already registered (cache {other.cache_id})")
            with translate_errors("register cache"):
                # Per-layer tensors are often views into one storage: register the
                # covering spans once, not each view.
                handles = [self.engine.register_mem(MemDesc(a, n), access=access) for a, n in _spans(addrs, desc.tensor_bytes)]
            cache = Cache(self._next_id, desc, addrs, is_blocks, keys, keepalive=list(tensors))
            self._next_id += 1
            self._caches[cache.cache_id] = cache
            self._handles[cache.cache_id] = handles
            self._publish_locked()
        self._publish_record()
        return cache

    def remove_cache(self, cache_id: int) -> None:
        """Forget a cache, deregister the memory no other cache covers, publish the new catalog."""
        with self._lock:
            cache = self._caches.pop(cache_id, None)
            if cache is None:
                raise LLMException(f"no cache {cache_id}", LLMStatusCode.KV_CACHE_NOT_EXIST)
            handles = self._handles.pop(cache_id)
            still_used = {h.id for hs in self._handles.values() for h in hs}
            # The catalog without it goes out first, so peers stop planning transfers into it.
            self._publish_locked()
        self._publish_record()
        with translate_errors("unregister cache"):
            for handle in handles:
                if handle.id not in still_used:
                    self.engine.deregister_mem(handle)

    def caches(self) -> list[Cache]:
        """Every registered cache."""
        with self._lock:
            return list(self._caches.values())

    def registered(self, cache: Cache) -> bool:
        """True if ``cache`` is registered here (the very object ``add_cache`` returned)."""
        with self._lock:
            return self._caches.get(cache.cache_id) is cache

    def set_role(self, role: LLMRole) -> None:
        """Change the role this instance publishes."""
        with self._lock:
            self._role = role
            self._publish_locked()
        self._publish_record()

    def _publish_locked(self) -> None:
        """Publish identity and caches, then bump the generation word (caller holds the lock).

        Bumped after the new catalog is in place, so a peer that sees the new
        generation also fetches the new catalog (see :mod:`._catalog`).
        """
        if self._generation is None:
            return  # a client-only instance has nobody to publish to
        generation = int(self._generation[0]) + 1
        caches = list(self._caches.values())
        raw = encode_catalog(self.cluster_id, self._role.name, caches, generation, int(self._generation.ctypes.data))
        self.engine.set_metadata(CATALOG_KEY, raw)
        self._generation[0] = generation

    def _publish_record(self) -> None:
        """Bring this instance's record in the metadata store up to date, outside the lock (a
        network write). It only summarises: a failure is logged, the catalog stays the truth."""
        if self._record is None:
            return
        try:
            self._record.update(self._record_snapshot)
        except LLMException as exc:
            log.warning("cluster %d: the metadata store's record is behind: %s", self.cluster_id, exc)

    def _record_snapshot(self) -> tuple[str, list[Cache]]:
        with self._lock:
            return self._role.name, list(self._caches.values())

    # -- links and the catalogs fetched over them --------------------------------------------
    def add_link(self, cluster_id: int, link: Link) -> None:
        """Record a verified link (replacing a dead one for the same cluster)."""
        with self._lock:
            self._links[cluster_id] = link

    def link(self, cluster_id: int) -> Link | None:
        """The link to ``cluster_id``, if any."""
        with self._lock:
            return self._links.get(cluster_id)

    def drop_link(self, cluster_id: int, only: Link | None = None) -> Link | None:
        """Forget the link to ``cluster_id`` (only if it is still ``only``, when given); returns it."""
        with self._lock:
            link = self._links.get(cluster_id)
            if link is None or (only is not None and link is not only):
                return None
            del self._links[cluster_id]
            return link

    def links(self) -> dict[int, str]:
        """``{cluster_id: "ip:port"}`` of every link."""
        with self._lock:
            return {cluster: link.name for cluster, link in self._links.items()}

    def clear_links(self) -> None:
        """Forget every link (the engine is going away)."""
        with self._lock:
            self._links.clear()

    def alive(self, link: Link) -> bool:
        """True while ``link``'s connection is up and still reaches the incarnation it linked to."""
        try:
            return self.engine.peer_incarnation(link.name) == link.incarnation
        except HixlError:
            return False

    def reachable(self, link: Link, timeout: float) -> bool:
        """:meth:`alive`, confirmed by a round trip (so a peer killed a moment ago is noticed now).

        A peer too slow to answer within ``timeout`` counts as there: only a
        connection that is known to be gone may be replaced.
        """
        if not self.alive(link):
            return False
        try:
            self.is_current(link.name, link.catalog, timeout)
        except ConnectionError:
            return False
        except LLMException:
            return True
        return self.alive(link)

    def _live_link(self, cluster_id: int) -> Link:
        link = self.link(cluster_id)
        if link is None:
            raise LLMException(f"cluster {cluster_id} is not linked", LLMStatusCode.NOT_YET_LINK)
        with translate_errors(f"link to cluster {cluster_id} at {link.name}"):
            incarnation = self.engine.peer_incarnation(link.name)
        if incarnation != link.incarnation:
            # A restarted peer at the same address is a stranger: its memory is not the
            # memory the catalog describes, so nothing of this link may be used again.
            raise LLMException(f"cluster {cluster_id} at {link.name} restarted; link again", LLMStatusCode.LINK_FAILED)
        return link

    def _refetch(self, cluster_id: int, link: Link) -> Catalog:
        with translate_errors(f"fetch catalog of cluster {cluster_id}"):
            catalog = Catalog.decode(self.engine.get_remote_metadata(link.name, CATALOG_KEY))
        with self._lock:
            if self._links.get(cluster_id) is link:
                self._links[cluster_id] = Link(link.name, link.incarnation, catalog)
        return catalog

    def generation_read(self, catalog: Catalog) -> tuple[TransferOpDesc, Callable[[], bool]]:
        """A descriptor reading the owner's generation word, and a check to call once it landed.

        The check is True while the catalog is current. Each read gets its own
        word, so concurrent checks don't overwrite each other.
        """
        index = next(self._probe_next) % _PROBE_WORDS
        word = int(self._probe_words.ctypes.data) + 8 * index
        return TransferOpDesc(word, catalog.generation_addr, 8), lambda: int(self._probe_words[index]) == catalog.generation

    def is_current(self, name: str, catalog: Catalog, timeout: float) -> bool:
        """Read the owner's generation word now (one small transfer): is ``catalog`` still its latest?"""
        desc, current = self.generation_read(catalog)
        with translate_errors(f"check the catalog of {name}"):
            self.engine.transfer_sync(name, Op.READ, [desc], timeout)
        return current()

    def remote_cache(
        self, cluster_id: int, find: Callable[[Catalog], T | None], key: Any, timeout: float, verify: bool = True
    ) -> tuple[str, T, Catalog]:
        """Find a peer's cache with ``find`` in its catalog, refetching it once on a miss.

        With ``verify``, the owner's generation word is read first and a stale
        catalog refetched; without, the caller must run :meth:`generation_read`
        itself, ahead of its data.
        """
        link = self._live_link(cluster_id)
        catalog = link.catalog
        if verify and not self.is_current(link.name, catalog, timeout):
            catalog = self._refetch(cluster_id, link)
        found = find(catalog)
        if found is None:
            catalog = self._refetch(cluster_id, link)
            found = find(catalog)
        if found is None:
            raise LLMException(f"cluster {cluster_id} has no cache {key}", LLMStatusCode.KV_CACHE_NOT_EXIST)
        return link.name, found, catalog

    # -- notifications, bound to the connection they came on -----------------------------------
    def announce(self, name: str, timeout: float) -> None:
        """Tell the peer at ``name`` which cluster this connection speaks for (first thing on a link),
        and which engine incarnation claims it (checked against the peer's metadata store, if any)."""
        hello = {"cluster_id": self.cluster_id, "incarnation": self.engine.incarnation}
        self.engine.send_notify(name, NotifyDesc(HELLO_NOTIFY, json.dumps(hello)), timeout)

    def send_done(self, name: str, req_id: int, op: str) -> None:
        """Tell the peer at ``name`` that request ``req_id`` finished (``op``: "pull" or "push")."""
        msg = json.dumps({"cluster_id": self.cluster_id, "req_id": req_id, "op": op})
        with translate_errors("completion notification"):
            self.engine.send_notify(name, NotifyDesc(DONE_NOTIFY, msg))

    def take_done(self) -> list[TransferDone]:
        """Completions received from the connections of the clusters they name; drains."""
        with self._lock:
            drained, self._done = self._done, []
            self._pending.clear()
        return drained

    def take_app_notifies(self) -> list[NotifyDesc]:
        """Notifications that are not DataDist's own (those never reach the engine's queue); drains."""
        return self.engine.get_notifies()

    def _on_hello(self, notify: NotifyDesc) -> None:
        """Bind the announced cluster to the connection it came on, or refuse (see the module docstring)."""
        cluster, incarnation = _parsed(notify, lambda doc: (int(doc["cluster_id"]), doc.get("incarnation")))
        self._check_claim(cluster, incarnation, notify.sender)  # a read of the store: outside the lock
        with self._lock:
            # Read under the lock: a connection bound by an announcement just before is in it.
            served = self.engine.served_connections()
            who = served.get(notify.sender, notify.sender)
            # Bindings of closed connections go: nobody can send on them any more.
            self._senders = {c: s for c, s in self._senders.items() if s in served}
            bound = self._senders.get(cluster)
            if bound is not None and bound != notify.sender:
                log.warning("refusing %s's claim to be cluster %d: cluster %d is linked from %s", who, cluster, cluster, served[bound])
                raise AlreadyConnected(f"cluster {cluster} is linked from {served[bound]}, a live connection")
            other = next((c for c, s in self._senders.items() if s == notify.sender and c != cluster), None)
            if other is not None:
                log.warning("refusing %s's claim to be cluster %d: it speaks for cluster %d", who, cluster, other)
                raise AlreadyConnected(f"this connection speaks for cluster {other}, not {cluster}")
            self._senders[cluster] = notify.sender

    def _check_claim(self, cluster: int, incarnation: object, sender: str) -> None:
        """With a metadata store, refuse a claim to be ``cluster`` unless the store's record of it
        names the claimant's ``incarnation``; without one, every claim goes on to the binding rules.

        A store that cannot be read refuses too (with its error): a claim that cannot be checked
        is not taken.
        """
        store = self.engine.metadata_store
        if store is None:
            return
        entry = lookup_cluster(store, cluster)
        if entry is None or entry.incarnation != incarnation:
            holder = "held by nobody" if entry is None else f"incarnation {entry.incarnation} at {entry.address or '(links out only)'}"
            log.warning("refusing connection %s's claim to be cluster %d: in %s it is %s", sender, cluster, store.url, holder)
            raise AlreadyConnected(f"the metadata store says cluster {cluster} is {holder}, not this connection's engine")

    def _on_done(self, notify: NotifyDesc) -> None:
        """Accept a completion from the connection bound to its cluster, within its bound; else refuse."""
        done = _parsed(notify, lambda doc: TransferDone(int(doc["cluster_id"]), int(doc["req_id"]), str(doc["op"])))
        cluster = done.cluster_id
        with self._lock:
            if self._senders.get(cluster) != notify.sender:
                log.warning("refusing a completion claiming cluster %d from a connection that does not speak for it", cluster)
                raise AccessDenied(f"this connection does not speak for cluster {cluster}")
            if self._pending[cluster] >= self.config.max_pending_done:
                raise ResourceExhausted(
                    f"cluster {cluster} has {self._pending[cluster]} completions not yet taken by completed_requests()"
                )
            self._done.append(done)
            self._pending[cluster] += 1


def _parsed(notify: NotifyDesc, read: Callable[[Any], T]) -> T:
    """``read`` applied to a DataDist notification's JSON message; :class:`ParamInvalid` (logged),
    which refuses the notification, if the message is malformed."""
    try:
        return read(json.loads(notify.msg))
    except (KeyError, TypeError, ValueError, OverflowError, RecursionError):
        log.warning("refusing malformed %s notification %r", notify.name, notify.msg)
        raise ParamInvalid(f"malformed {notify.name} notification") from None


def _spans(addrs: list[int], nbytes: int) -> list[tuple[int, int]]:
    """Union of ``[a, a+nbytes)`` over ``addrs`` as sorted, disjoint (addr, len) spans."""
    spans: list[list[int]] = []
    for addr in sorted(addrs):
        if spans and addr <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], addr + nbytes)
        else:
            spans.append([addr, addr + nbytes])
    return [(start, end - start) for start, end in spans]
