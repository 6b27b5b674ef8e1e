"""LLMDataDist: one prefill or decode instance — its engine, its links, its caches.

Each instance owns one :class:`~hixl.Engine`. ``link_clusters`` connects that
engine to other instances (retrying while a peer is still starting — timing
skew between the two sides should not fail a link), checks, through the
peer's published catalog, that the cluster id is the one expected, and then
announces its own cluster id over the new connection, so the peer accepts
completion notifications from it (see :mod:`._state`). Links are
one-directional, like the engine's connections: the side that links is the
side that pulls or pushes.

A cluster id is one instance: linking it at a second address while its link
at the first is alive answers CLUSTER_ID_CONFLICT. Once that link is dead (the
peer is gone, or restarted as a new incarnation), linking again — at the same
address or a new one — replaces it, and nothing of the old link is used again.
The same holds the other way round: a peer that still serves another live
connection speaking for *our* cluster id refuses our announcement; we retry
until the link timeout (our own old connection, unlinked a moment ago, is
closing), then answer CLUSTER_ID_CONFLICT. With a metadata store the peer also
refuses an announcement the store disagrees with (see :mod:`._state`): the same
CLUSTER_ID_CONFLICT.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

from .._exceptions import AlreadyConnected, HixlError, HixlTimeout, ParamInvalid
from .._session.address import format_address, parse_address
from .._types import NotifyDesc
from ..engine import Engine
from ._catalog import CATALOG_KEY, Catalog
from ._discovery import ClusterWatch, lookup_cluster
from ._errors import LLMException, LLMStatusCode, status_of, translate_errors
from ._state import DataDistState, Link
from ._types import ClusterEvent, LLMClusterInfo, LLMConfig, LLMRole
from .cache_manager import CacheManager

__all__ = ["LLMDataDist"]

log = logging.getLogger("hixl.datadist")


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
        self._state: DataDistState | None = None
        self._cache_manager: CacheManager | None = None
        self._watches: list[ClusterWatch] = []
        self._link_errors: dict[int, str] = {}

    # -- life cycle ------------------------------------------------------------------------
    def init(self, config: LLMConfig) -> None:
        """Start the engine (listening on ``config.listen_ip_info`` if given)."""
        if self._engine is not None:
            raise LLMException("already initialised", LLMStatusCode.PARAM_INVALID)
        if not isinstance(config, LLMConfig):
            raise TypeError(f"init takes an LLMConfig, not {type(config).__name__}")
        # DataDist retries links itself (link_retry_count), so the engine's connect fails fast.
        options = {"transport": config.transport, "connect_fail_fast": True, **config.engine_options}
        if config.metadata_server is not None:
            options["metadata_server"] = config.metadata_server
        if config.lease_ttl is not None:
            options["lease_ttl"] = config.lease_ttl
        with translate_errors("init"):
            engine = Engine(config.listen_ip_info or config.local_ip, options)
            try:
                self._state = DataDistState(engine, self.cluster_id, self.role, config)
            except BaseException:
                engine.finalize()
                raise
        self._engine = engine
        self.config = config
        self._cache_manager = CacheManager(self._state)

    def finalize(self) -> None:
        """Unlink everything and stop the engine; idempotent."""
        engine, self._engine = self._engine, None
        for watch in self._watches:
            watch.cancel()
        self._watches.clear()
        if engine is not None:
            engine.finalize()
        if self._state is not None:
            self._state.clear_links()

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
        if self._state is not None:
            self._state.set_role(role)

    # -- links -----------------------------------------------------------------------------
    def link_clusters(self, clusters: Sequence[LLMClusterInfo], timeout: float | None = None) -> list[LLMStatusCode]:
        """Link to each cluster; returns one status per cluster (SUCCESS, ALREADY_LINK, LINK_FAILED, ...).

        Each link retries up to ``config.link_retry_count`` times within
        ``timeout`` (default ``config.link_timeout``) while the peer is not up yet.
        A cluster id already linked at another, live address is CLUSTER_ID_CONFLICT
        (logged with both addresses); so is a peer that keeps refusing our
        announcement until the timeout, because another live connection speaks for
        our cluster id there.
        """
        timeout = self.config.link_timeout if timeout is None else float(timeout)
        statuses = []
        for info in _cluster_infos(clusters):
            self._link_errors.pop(info.remote_cluster_id, None)
            statuses.append(self._link_one(info, timeout))
        return statuses

    def link_error(self, cluster_id: int) -> str | None:
        """Why the last :meth:`link_clusters` to ``cluster_id`` did not succeed (what the status
        alone cannot say: refused, nobody listening, not a DataDist peer, ...); None if it did, or
        if it was never tried."""
        return self._link_errors.get(cluster_id)

    def _failed(self, cluster_id: int, status: LLMStatusCode, reason: str) -> LLMStatusCode:
        """Log and keep (for :meth:`link_error`) why linking ``cluster_id`` ended in ``status``."""
        log.warning("link to cluster %d: %s: %s", cluster_id, status.value, reason)
        self._link_errors[cluster_id] = reason
        return status

    def _link_one(self, info: LLMClusterInfo, timeout: float) -> LLMStatusCode:
        target = self._target_of(info)
        if isinstance(target, LLMStatusCode):
            return target
        engine, state = self.engine, self._live_state()
        old = state.link(target.cluster_id)
        if old is not None:
            if state.reachable(old, timeout):
                if _canonical(old.name) == _canonical(target.address):
                    return LLMStatusCode.ALREADY_LINK
                return self._failed(
                    target.cluster_id, LLMStatusCode.CLUSTER_ID_CONFLICT,
                    f"it is linked at {old.name}, and {target.address} claims it too",
                )
            # The old link is dead: forget it (and its catalog) before linking anew.
            self._drop(target.cluster_id, old)
        deadline = time.monotonic() + timeout
        attempts = max(1, self.config.link_retry_count + 1)
        last = f"no attempt fitted in the timeout ({timeout} s)"
        for attempt in range(attempts):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                engine.connect(target.address, timeout=left)
            except ParamInvalid as exc:
                return self._failed(target.cluster_id, LLMStatusCode.PARAM_INVALID, str(exc))
            except HixlError as exc:
                log.info("link to cluster %d, attempt %d: %s", target.cluster_id, attempt + 1, exc)
                last = f"{type(exc).__name__}: {exc}"
                time.sleep(min(0.05 * 2**attempt, max(0.0, deadline - time.monotonic()) / 2))
                continue
            return self._verify_link(target, max(0.001, deadline - time.monotonic()))
        return self._failed(
            target.cluster_id, LLMStatusCode.LINK_FAILED,
            f"could not connect to {target.address} in {attempt + 1} attempt(s) within {timeout} s; the last: {last}",
        )

    def _verify_link(self, target: _Target, timeout: float) -> LLMStatusCode:
        engine, state = self.engine, self._live_state()
        try:
            catalog = Catalog.decode(engine.get_remote_metadata(target.address, CATALOG_KEY, timeout))
            incarnation = engine.peer_incarnation(target.address)
        except (HixlError, ValueError) as exc:
            engine.disconnect(target.address)
            return self._failed(target.cluster_id, LLMStatusCode.LINK_FAILED, f"{target.address} is not a DataDist peer: {exc}")
        if target.incarnation is not None and incarnation != target.incarnation:
            # The store's record is of another incarnation (it restarted, or another process took
            # the address): not the instance the record describes.
            engine.disconnect(target.address)
            return self._failed(
                target.cluster_id, LLMStatusCode.LINK_FAILED,
                f"{target.address} is not the incarnation of the cluster the metadata store names",
            )
        if catalog.cluster_id != target.cluster_id:
            engine.disconnect(target.address)
            return self._failed(target.cluster_id, LLMStatusCode.LINK_FAILED, f"{target.address} is cluster {catalog.cluster_id}")
        status = self._announce(target, time.monotonic() + timeout)
        if status is not LLMStatusCode.SUCCESS:
            engine.disconnect(target.address)
            return status
        state.add_link(target.cluster_id, Link(target.address, incarnation, catalog))
        return LLMStatusCode.SUCCESS

    def _announce(self, target: _Target, deadline: float) -> LLMStatusCode:
        """Announce our cluster id over the new connection; retried while the peer refuses it.

        A refusal means the peer still serves another connection that speaks for our
        cluster id: our own old one, if we unlinked a moment ago (or restarted) and it
        has not seen that close yet — or another instance that claims our id; or the
        peer's metadata store says the id is another incarnation's.
        """
        pause = 0.01
        refused: AlreadyConnected | None = None
        while True:
            try:
                self._live_state().announce(target.address, max(0.001, deadline - time.monotonic()))
                return LLMStatusCode.SUCCESS
            except AlreadyConnected as exc:
                refused = exc
                if time.monotonic() + pause >= deadline:
                    break
            except HixlError as exc:
                if refused is not None and isinstance(exc, HixlTimeout):
                    break  # the time ran out on a retry: the refusals before it are the answer
                return self._failed(target.cluster_id, LLMStatusCode.LINK_FAILED, f"announcing ourselves to {target.address} failed: {exc}")
            time.sleep(pause)
            pause = min(0.2, pause * 2)
        return self._failed(
            target.cluster_id, LLMStatusCode.CLUSTER_ID_CONFLICT,
            f"{target.address} refuses us (cluster {self.cluster_id} at {self.engine.local_engine}): {refused}",
        )

    def _target_of(self, info: LLMClusterInfo) -> _Target | LLMStatusCode:
        """Where to link for ``info``: its address, or (none given) the one the metadata store names."""
        if info.remote_ip_info is not None:
            return _Target(info.remote_cluster_id, info.remote_ip_info, None)
        store = self.engine.metadata_store
        cluster_id = info.remote_cluster_id
        if store is None:
            return self._failed(cluster_id, LLMStatusCode.PARAM_INVALID, "no address given, and no metadata_server to look it up in")
        try:
            found = lookup_cluster(store, cluster_id)
        except LLMException as exc:
            return self._failed(cluster_id, LLMStatusCode.LINK_FAILED, str(exc))
        if found is None:
            # Not a connect timeout: the store says at once that nobody (usable) holds the id.
            return self._failed(cluster_id, LLMStatusCode.LINK_FAILED, f"it has no record in {store.url} (never started, finalized, or dead)")
        if found.address is None:
            return self._failed(cluster_id, LLMStatusCode.LINK_FAILED, "it only links out (it does not listen)")
        return _Target(info.remote_cluster_id, found.address, found.incarnation)

    def _drop(self, cluster_id: int, link: Link) -> None:
        if self._live_state().drop_link(cluster_id, link) is not None:
            try:
                self.engine.disconnect(link.name)
            except HixlError:
                pass  # already gone: that is why it is dropped

    def unlink_clusters(self, clusters: Sequence[LLMClusterInfo], timeout: float | None = None, force: bool = False) -> list[LLMStatusCode]:
        """Drop links; NOT_YET_LINK for a cluster that was not linked. In-flight transfers fail."""
        results = []
        state = self._live_state()
        for info in _cluster_infos(clusters):
            link = state.drop_link(info.remote_cluster_id)
            if link is None:
                results.append(LLMStatusCode.NOT_YET_LINK)
                continue
            try:
                self.engine.disconnect(link.name)
            except HixlError as exc:
                results.append(LLMStatusCode.SUCCESS if force else status_of(exc))
            else:
                results.append(LLMStatusCode.SUCCESS)
        return results

    def watch_clusters(self, callback: Callable[[ClusterEvent], None]) -> ClusterWatch:
        """Call ``callback(event)`` whenever a cluster appears in the metadata store, restarts as
        a new incarnation, or goes away (finalized, or dead and its lease run out).

        ``callback`` runs on a watch thread and must be quick. Clusters already in
        the store when the watch starts are not reported; read them with
        :meth:`link_clusters` by id. Stop with the returned watch's ``cancel()``
        (finalize stops it too). Needs a ``metadata_server``.
        """
        store = self.engine.metadata_store
        if store is None:
            raise LLMException("watch_clusters needs a metadata_server", LLMStatusCode.PARAM_INVALID)
        watch = ClusterWatch(store, callback)
        self._watches.append(watch)
        return watch

    def linked_clusters(self) -> dict[int, str]:
        """``{cluster_id: "ip:port"}`` of every link."""
        return self._state.links() if self._state is not None else {}

    # -- notifications -----------------------------------------------------------------------
    def get_notifies(self) -> list[NotifyDesc]:
        """Application notifications received (DataDist's own never show here); drains."""
        return self._live_state().take_app_notifies()

    def _live_state(self) -> DataDistState:
        if self._state is None or self._engine is None:
            raise LLMException("call init() first", LLMStatusCode.NOT_INITIALIZED)
        return self._state

    def __repr__(self) -> str:
        state = "uninitialised" if self._engine is None else self._engine.local_engine
        return f"<LLMDataDist {self.role.name} cluster={self.cluster_id} {state} links={sorted(self.linked_clusters())}>"


@dataclasses.dataclass(frozen=True)
class _Target:
    """Where one link goes: the cluster, its address, and the incarnation the store named (if any)."""

    cluster_id: int
    address: str
    incarnation: str | None


def _canonical(address: str) -> str:
    """The engine's spelling of an ``"ip:port"`` (as its connections are named), for comparing addresses."""
    try:
        host, port = parse_address(address, require_port=True)
    except HixlError:
        return address  # compared as given; connect() reports it as malformed
    assert port is not None  # require_port
    return format_address(host, port)


def _cluster_infos(clusters: Sequence[LLMClusterInfo]) -> list[LLMClusterInfo]:
    infos = list(clusters)
    if not infos or any(not isinstance(c, LLMClusterInfo) for c in infos):
        raise TypeError("clusters must be a non-empty list of LLMClusterInfo")
    return infos
