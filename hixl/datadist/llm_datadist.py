"""LLMDataDist: one prefill or decode instance — its engine, its links, its caches.

Each instance owns one :class:`~hixl.Engine`. ``link_clusters`` connects that
engine to other instances (retrying while a peer is still starting — timing
skew between the two sides should not fail a link) and checks, through the
peer's published catalog, that the cluster id is the one expected. Links are
one-directional, like the engine's connections: the side that links is the
side that pulls or pushes.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from .._exceptions import HixlError, ParamInvalid
from .._memory import empty
from .._types import NotifyDesc, Op, TransferOpDesc
from ..engine import Engine
from ._catalog import CATALOG_KEY, Catalog, encode_catalog
from ._errors import LLMException, LLMStatusCode, status_of, translate_errors
from ._types import LLMClusterInfo, LLMConfig, LLMRole, TransferDone
from .cache_manager import DONE_NOTIFY, CacheManager

__all__ = ["LLMDataDist"]

log = logging.getLogger("hixl.datadist")
_PROBE_WORDS = 256
T = TypeVar("T")


class LLMDataDist:
    """A DataDist instance; call :meth:`init` before use, :meth:`finalize` (or ``with``) after."""

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        if not isinstance(role, LLMRole):
            raise TypeError(f"role must be an LLMRole, not {role!r}")
        if not isinstance(cluster_id, int) or cluster_id < 0:
            raise ValueError(f"cluster_id must be a non-negative int, not {cluster_id!r}")
        self.role = role
        self.cluster_id = cluster_id
        self.config = LLMConfig()
        self._engine: Engine | None = None
        self._generation: np.ndarray | None = None
        # Words that peers' generation counters are read into; one per check in flight.
        self._probe_words = empty(_PROBE_WORDS, np.uint64)
        self._probe_next = itertools.count()
        self._cache_manager: CacheManager | None = None
        self._links: dict[int, str] = {}
        self._catalogs: dict[int, Catalog] = {}
        self._lock = threading.Lock()
        self._done: list[TransferDone] = []
        self._app_notifies: list[NotifyDesc] = []

    # -- life cycle ------------------------------------------------------------------------
    def init(self, config: LLMConfig) -> None:
        """Start the engine (listening on ``config.listen_ip_info`` if given)."""
        if self._engine is not None:
            raise LLMException("already initialised", LLMStatusCode.PARAM_INVALID)
        if not isinstance(config, LLMConfig):
            raise TypeError(f"init takes an LLMConfig, not {type(config).__name__}")
        # DataDist retries links itself (link_retry_count), so the engine's connect fails fast.
        options = {"transport": config.transport, "connect_fail_fast": True, **config.engine_options}
        with translate_errors("init"):
            self._engine = Engine(config.listen_ip_info or config.local_ip, options)
            # Where we read peers' catalog generations into, and where they read ours.
            self._engine.register_mem(self._probe_words)
            if config.listen_ip_info:
                self._generation = empty(1, np.uint64)
                self._engine.register_mem(self._generation)
        self.config = config
        self._cache_manager = CacheManager(self)
        self._publish()

    def finalize(self) -> None:
        """Unlink everything and stop the engine; idempotent."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.finalize()
        self._links.clear()
        self._catalogs.clear()

    def __enter__(self) -> LLMDataDist:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.finalize()

    @property
    def engine(self) -> Engine:
        """The underlying engine (raises if not initialised)."""
        if self._engine is None:
            raise LLMException("call init() first", LLMStatusCode.NOT_INITIALIZED)
        return self._engine

    @property
    def cache_manager(self) -> CacheManager:
        """Cache registration and transfers."""
        if self._cache_manager is None or self._engine is None:
            raise LLMException("call init() first", LLMStatusCode.NOT_INITIALIZED)
        return self._cache_manager

    @property
    def local_ip_info(self) -> str:
        """The ``"ip:port"`` peers link to (the real port if 0 was asked for)."""
        return self.engine.local_engine

    def switch_role(self, role: LLMRole) -> None:
        """Change this instance's role (published to peers with its catalog)."""
        if not isinstance(role, LLMRole):
            raise TypeError(f"role must be an LLMRole, not {role!r}")
        self.role = role
        self._publish()

    # -- links -----------------------------------------------------------------------------
    def link_clusters(self, clusters: Sequence[LLMClusterInfo], timeout: float | None = None) -> list[LLMStatusCode]:
        """Link to each cluster; returns one status per cluster (SUCCESS, ALREADY_LINK, LINK_FAILED, ...).

        Each link retries up to ``config.link_retry_count`` times within
        ``timeout`` (default ``config.link_timeout``) while the peer is not up yet.
        """
        timeout = self.config.link_timeout if timeout is None else float(timeout)
        return [self._link_one(info, timeout) for info in _cluster_infos(clusters)]

    def _link_one(self, info: LLMClusterInfo, timeout: float) -> LLMStatusCode:
        engine = self.engine
        if info.remote_cluster_id in self._links:
            return LLMStatusCode.ALREADY_LINK
        deadline = time.monotonic() + timeout
        attempts = max(1, self.config.link_retry_count + 1)
        for attempt in range(attempts):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                engine.connect(info.remote_ip_info, timeout=left)
            except ParamInvalid as exc:
                log.warning("link to cluster %d: %s", info.remote_cluster_id, exc)
                return LLMStatusCode.PARAM_INVALID
            except HixlError as exc:
                log.info("link to cluster %d, attempt %d: %s", info.remote_cluster_id, attempt + 1, exc)
                time.sleep(min(0.05 * 2**attempt, max(0.0, deadline - time.monotonic()) / 2))
                continue
            return self._verify_link(info, max(0.001, deadline - time.monotonic()))
        return LLMStatusCode.LINK_FAILED

    def _verify_link(self, info: LLMClusterInfo, timeout: float) -> LLMStatusCode:
        engine = self.engine
        try:
            catalog = Catalog.decode(engine.get_remote_metadata(info.remote_ip_info, CATALOG_KEY, timeout))
        except (HixlError, ValueError) as exc:
            log.warning("link to cluster %d: %s is not a DataDist peer: %s", info.remote_cluster_id, info.remote_ip_info, exc)
            engine.disconnect(info.remote_ip_info)
            return LLMStatusCode.LINK_FAILED
        if catalog.cluster_id != info.remote_cluster_id:
            log.warning("link: %s is cluster %d, not %d", info.remote_ip_info, catalog.cluster_id, info.remote_cluster_id)
            engine.disconnect(info.remote_ip_info)
            return LLMStatusCode.LINK_FAILED
        with self._lock:
            self._links[info.remote_cluster_id] = info.remote_ip_info
            self._catalogs[info.remote_cluster_id] = catalog
        return LLMStatusCode.SUCCESS

    def unlink_clusters(self, clusters: Sequence[LLMClusterInfo], timeout: float | None = None, force: bool = False) -> list[LLMStatusCode]:
        """Drop links; NOT_YET_LINK for a cluster that was not linked. In-flight transfers fail."""
        results = []
        for info in _cluster_infos(clusters):
            with self._lock:
                name = self._links.pop(info.remote_cluster_id, None)
                self._catalogs.pop(info.remote_cluster_id, None)
            if name is None:
                results.append(LLMStatusCode.NOT_YET_LINK)
                continue
            try:
                self.engine.disconnect(name)
            except HixlError as exc:
                results.append(LLMStatusCode.SUCCESS if force else status_of(exc))
            else:
                results.append(LLMStatusCode.SUCCESS)
        return results

    def linked_clusters(self) -> dict[int, str]:
        """``{cluster_id: "ip:port"}`` of every link."""
        with self._lock:
            return dict(self._links)

    # -- notifications -----------------------------------------------------------------------
    def get_notifies(self) -> list[NotifyDesc]:
        """Application notifications received (DataDist's own are filtered out); drains."""
        self._drain_engine_notifies()
        with self._lock:
            drained, self._app_notifies = self._app_notifies, []
        return drained

    def _take_done(self) -> list[TransferDone]:
        self._drain_engine_notifies()
        with self._lock:
            drained, self._done = self._done, []
        return drained

    def _drain_engine_notifies(self) -> None:
        for notify in self.engine.get_notifies():
            if notify.name != DONE_NOTIFY:
                with self._lock:
                    self._app_notifies.append(notify)
                continue
            try:
                doc = json.loads(notify.msg)
                done = TransferDone(int(doc["cluster_id"]), int(doc["req_id"]), str(doc["op"]))
            except (KeyError, TypeError, ValueError):
                log.warning("ignoring malformed completion notification %r", notify.msg)
                continue
            with self._lock:
                self._done.append(done)

    # -- catalogs ----------------------------------------------------------------------------
    def _publish(self) -> None:
        """Publish this instance's identity and caches, then bump the generation word.

        Bumped after the new catalog is in place, so a peer that sees the new
        generation also fetches the new catalog (see :mod:`._catalog`).
        """
        engine = self._engine
        if engine is None or self._generation is None:
            return  # a client-only instance has nobody to publish to
        caches = self._cache_manager.caches() if self._cache_manager else []
        generation = int(self._generation[0]) + 1
        catalog = encode_catalog(self.cluster_id, self.role.name, caches, generation, int(self._generation.ctypes.data))
        engine.set_metadata(CATALOG_KEY, catalog)
        self._generation[0] = generation

    def _fetch_catalog(self, cluster_id: int, name: str) -> Catalog:
        with translate_errors(f"fetch catalog of cluster {cluster_id}"):
            catalog = Catalog.decode(self.engine.get_remote_metadata(name, CATALOG_KEY))
        with self._lock:
            self._catalogs[cluster_id] = catalog
        return catalog

    def generation_read(self, catalog: Catalog) -> tuple[TransferOpDesc, Callable[[], bool]]:
        """A descriptor reading the owner's generation word, and a check to call once it landed.

        The check is True while the catalog is current. Each read gets its own
        word, so concurrent checks don't overwrite each other.
        """
        index = next(self._probe_next) % _PROBE_WORDS
        word = int(self._probe_words.ctypes.data) + 8 * index
        return TransferOpDesc(word, catalog.generation_addr, 8), lambda: int(self._probe_words[index]) == catalog.generation

    def _remote_cache(
        self, cluster_id: int, find: Callable[[Catalog], T | None], key: Any, timeout: float, verify: bool = True
    ) -> tuple[str, T, Catalog]:
        """Find a peer's cache with ``find`` in its catalog, refetching it once on a miss.

        With ``verify``, the owner's generation word is read first (one small
        transfer) and a stale catalog refetched; without, the caller must run
        :meth:`generation_read` itself, ahead of its data.
        """
        with self._lock:
            name = self._links.get(cluster_id)
            catalog = self._catalogs.get(cluster_id)
        if name is None or catalog is None:
            raise LLMException(f"cluster {cluster_id} is not linked", LLMStatusCode.NOT_YET_LINK)
        if verify:
            desc, current = self.generation_read(catalog)
            with translate_errors(f"check catalog of cluster {cluster_id}"):
                self.engine.transfer_sync(name, Op.READ, [desc], timeout)
            if not current():
                catalog = self._fetch_catalog(cluster_id, name)
        found = find(catalog)
        if found is None:
            catalog = self._fetch_catalog(cluster_id, name)
            found = find(catalog)
        if found is None:
            raise LLMException(f"cluster {cluster_id} has no cache {key}", LLMStatusCode.KV_CACHE_NOT_EXIST)
        return name, found, catalog

    def __repr__(self) -> str:
        state = "uninitialised" if self._engine is None else self._engine.local_engine
        return f"<LLMDataDist {self.role.name} cluster={self.cluster_id} {state} links={sorted(self._links)}>"


def _cluster_infos(clusters: Sequence[LLMClusterInfo]) -> list[LLMClusterInfo]:
    infos = list(clusters)
    if not infos or any(not isinstance(c, LLMClusterInfo) for c in infos):
        raise TypeError("clusters must be a non-empty list of LLMClusterInfo")
    return infos
