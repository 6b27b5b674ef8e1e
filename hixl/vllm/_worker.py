"""The worker half of the connector: vLLM's KV cache as a DataDist blocks cache, pulls, and releases.

vLLM's CPU backend hands ``register_kv_caches`` one tensor per layer, shaped
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` — K and V
interleaved inside a block, all layers views into one storage. So a block of
a layer is one contiguous row, and the whole cache is a DataDist blocks cache
of ``num_layers`` tensors, one per layer (``tensor_num_per_layer=1``),
registered with the engine once, as the one span the views cover.

Decode pulls by block id, only from prefill ranks its
:class:`~._leases.LeaseKeeper` has linked to and only while the request's
leases are usable; prefill's worker keeps its held requests in a
:class:`~._leases.LeaseTable` (fed by DataDist's completion notifications and
decode's lease messages) to tell vLLM which finished requests' blocks it may
free.

Tensor parallelism: every TP rank is a worker with its own DataDist (cluster
id ``cluster_id + rank``) holding its own KV heads (:mod:`._heads`), and on
prefill its own lease table. A decode rank pulls each head it holds from the
lowest prefill rank that holds it — a head range of the same block ids, one
pull per prefill rank it reads from (see :meth:`CacheManager.pull_blocks`'s
``src_heads``). Completions: several decode ranks may read one prefill rank,
and a prefill rank must not free blocks another decode rank still reads. So
pulls carry no ``req_id``; at the end of the step every decode rank waits for
the others (a barrier on vLLM's TP group, one per step that pulled), and
then, for each prefill rank, only the lowest decode rank that read from it
sends the completion (:meth:`CacheManager.notify_pulled`): exactly one per
(prefill rank, request). It is sent whether or not the pulls succeeded —
either way decode is done with prefill's blocks. A prefill rank decode never
reads (it holds only replicas of heads a lower rank holds) releases its blocks
at once. Leases: every decode rank's keeper extends (and, for a request
dropped unpulled, releases) the lease at every prefill rank that holds one,
see :mod:`._leases`.

Push mode (``mode: "push"``, :mod:`._push`): the cache is registered read-only
for peers; decode's worker (a :class:`~._push.Receiver`) opens write windows
over the blocks it grants and withdraws them before vLLM may reuse the blocks;
prefill's (a :class:`~._push.Pusher`) writes each layer into them as soon as
vLLM has computed it (:meth:`WorkerSide.save_layer`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .._exceptions import HixlError
from ..datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheTask,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMLinkError,
    LLMRole,
    LLMStatusCode,
)
from ._affinity import unpinned
from ._config import ConnectorConfig, LoadMode, Mode
from ._follow import Spans, client_id, transports
from ._heads import HeadRead, is_read, notifiers, plan_reads, rank_heads
from ._leases import LEASE_NOTIFY, LeaseKeeper, LeaseTable
from ._params import Endpoint, KvSpec, LinkReport, LoadSpec, StepMetadata
from ._push import PUSH_NOTIFY, Pusher, Receiver, dispatch
from ._stats import HixlKVConnectorStats
from ._timeline import Timeline, Trace

__all__ = ["WorkerSide"]

# A child of vLLM's logger: these lines show in vLLM's log, with its format and level.
log = logging.getLogger("vllm.hixl")

_TENSORS_PER_LAYER = 1  # K and V share a tensor (interleaved per head inside a block)
# A step that runs nothing waits this long for what it steps for (instead of spinning): decode, for a
# link its requests wait on; prefill, for decode to finish with the blocks it holds.
_LINK_PACE_S = 0.05
_HOLD_PACE_S = 0.01


@dataclass
class _Pull:
    """One request's pull within the current step: one part per prefill rank it reads from."""

    spec: LoadSpec
    started: float
    whole: bool = False  # one transfer of every layer, landed before start() returns
    tasks: list[CacheTask] = field(default_factory=list)  # layer-wise pulls only: one per part issued
    issued: int = 0  # parts (prefill ranks read from) issued so far
    retried: bool = False  # its link broke and it was relinked for a retry (once a request)
    retired: list[CacheTask] = field(default_factory=list)  # tasks a retry replaced: their landed layers count
    notify: list[Endpoint] = field(default_factory=list)  # prefill ranks this rank tells the request is done
    sources: list[Endpoint] = field(default_factory=list)  # prefill ranks it reads from
    reads: list[HeadRead] = field(default_factory=list)  # what it reads from each of them
    ended: float | None = None  # whole pulls only
    error: Exception | None = None
    trace: Trace | None = None  # with the timeline on


class WorkerSide:
    """One worker's (TP rank's) DataDist instance, its in-flight pulls and kept leases, and its held sends.

    ``barrier`` waits for every TP rank of this instance (None with TP = 1); ``spans``: where its loads go
    as OpenTelemetry spans (None: nowhere, see :mod:`._follow`).
    """

    def __init__(
        self,
        config: ConnectorConfig,
        serves_kv: bool,
        pulls_kv: bool,
        num_blocks: int,
        kv: KvSpec,
        tp_rank: int = 0,
        barrier: Callable[[], None] | None = None,
        spans: Spans | None = None,
    ) -> None:
        self.config = config
        self.serves_kv = serves_kv
        if config.mode is Mode.PUSH and pulls_kv and not serves_kv:
            raise ValueError("in push mode decode's workers listen too (prefill connects to them to write): serves_kv=True")
        self.num_blocks = num_blocks
        self.kv = kv
        self.tp_rank = tp_rank
        self._barrier = barrier
        self.heads = rank_heads(kv.num_kv_heads, kv.tp_size, tp_rank)
        self._all_heads = [rank_heads(kv.num_kv_heads, kv.tp_size, r) for r in range(kv.tp_size)]  # this instance's ranks
        self.cluster_id = config.cluster_id + tp_rank
        role = LLMRole.MIX if serves_kv and pulls_kv else LLMRole.PROMPT if serves_kv else LLMRole.DECODER
        self.datadist = LLMDataDist(role, self.cluster_id)
        with unpinned():  # DataDist's and the keeper's threads, not on vLLM's compute core (see _affinity)
            self.datadist.init(
                LLMConfig(
                    listen_ip_info=f"{config.host}:{config.port}" if serves_kv else None,
                    local_ip=config.host,
                    sync_kv_timeout=config.transfer_timeout,
                    transport=config.transport,
                    link_retry_count=0,  # the keeper retries links itself, with backoff
                )
            )
            self.keeper = LeaseKeeper(self.datadist) if pulls_kv else None
        self.layers: dict[str, int] = {}
        self._cache: Cache | None = None
        self._pulls: list[_Pull] = []
        self._failed_blocks: set[int] = set()
        # Prefill side: a rank decode never reads from has nothing to wait for.
        self._read_by_decode = is_read(self._all_heads, tp_rank)
        self.leases = LeaseTable(config.lease_s, config.release_timeout) if serves_kv else None
        if self.leases is not None:
            self.datadist.engine.handle_notifies(LEASE_NOTIFY, self.leases.on_notify)
        self.stats = HixlKVConnectorStats()  # vLLM takes it after each step (HixlConnector.get_kv_connector_stats)
        # None unless asked for: then it costs nothing.
        # (a push-mode prefill records its pushes)
        self.timeline = Timeline.open(log, config.records or None, spans) if pulls_kv or config.mode is Mode.PUSH else None
        # Push mode: made once the cache is registered (register).
        self.pusher: Pusher | None = None
        self.receiver: Receiver | None = None

    # -- set-up ------------------------------------------------------------------------------
    def register(self, kv_caches: dict[str, Any]) -> None:
        """Register vLLM's per-layer KV tensors (layer order as vLLM gives them) as one blocks cache."""
        names, tensors = list(kv_caches), list(kv_caches.values())
        if not tensors:
            raise ValueError("vLLM registered no KV cache tensors")
        shape, dtype = tuple(tensors[0].shape), tensors[0].dtype
        if any(tuple(t.shape) != shape or t.dtype != dtype for t in tensors):
            raise ValueError("hixl needs every layer's KV tensor to have the same shape and dtype")
        expected = (self.num_blocks, len(self.heads), self.kv.block_size, 2 * self.kv.head_size)
        if shape != expected:
            raise ValueError(
                f"hixl needs one KV tensor per layer shaped {self.kv.layout} = {expected}; "
                f"got shape {shape}: this vLLM backend's layout is not supported"
            )
        desc = CacheDesc(len(tensors), shape, DataType.of(tensors[0]))
        key = BlocksCacheKey(self.cluster_id) if self.serves_kv else None
        push = self.config.mode is Mode.PUSH
        # Push mode: no peer writes a byte of it, except into the windows decode grants (see _push).
        self._cache = self.datadist.cache_manager.register_blocks_cache(desc, tensors, key, access="r" if push else "rw")
        self.layers = {name: i for i, name in enumerate(names)}
        if push:
            with unpinned():  # the receiver's and the pusher's threads, not on vLLM's compute core (see _affinity)
                self._start_push(self._cache)
        log.info(
            "hixl: registered %d layers x %d blocks (%s, %d bytes a block) on DataDist %s",
            len(tensors), shape[0], desc.data_type.value, desc.row_bytes, self.endpoint() or "(pull only)",
        )

    def _start_push(self, cache: Cache) -> None:
        """Push mode: a pusher where this worker serves KV, a receiver where it takes it, and their handler."""
        if self.serves_kv:
            self.pusher = Pusher(self.datadist, cache, self.kv, self.cluster_id, self.config.transfer_timeout, self.tp_rank, self.timeline)
        endpoint = self.endpoint()
        if self.keeper is not None and endpoint is not None:
            self.receiver = Receiver(
                self.datadist, self.keeper, cache, self.kv, self.tp_rank, endpoint, self.config.push_timeout, self.timeline
            )
        self.datadist.engine.handle_notifies(PUSH_NOTIFY, dispatch(self.pusher.grants if self.pusher is not None else None, self.receiver))

    def endpoint(self) -> Endpoint | None:
        """Where peers pull from this worker, or None if it only pulls."""
        if not self.serves_kv:
            return None
        return Endpoint(self.datadist.local_ip_info, self.cluster_id, (self.heads.start, self.heads.stop))

    def close(self) -> None:
        """Stop keeping leases and pushes, finalize DataDist: links and registrations go."""
        if self.receiver is not None:
            self.receiver.close()
        if self.pusher is not None:
            self.pusher.close()
        if self.keeper is not None:
            self.keeper.close()
        if self.timeline is not None:
            self.timeline.close()
        self.datadist.finalize()

    # -- every step --------------------------------------------------------------------------
    def take_push_orders(self, meta: StepMetadata) -> None:
        """Push mode, before the step's forward: open and withdraw grants (decode), start and cancel pushes
        (prefill).

        Taken when vLLM binds the step's metadata, not in :meth:`take_orders`: vLLM (0.32) starts a step's
        loads only after its forward unless one of them is synchronous, and by then every layer has been
        computed (:meth:`save_layer`) — a push started there would write nothing.
        """
        if self.receiver is not None:
            self.receiver.grant(meta.grants)
            self.receiver.revoke(meta.revokes)
        if self.pusher is not None:
            self.pusher.cancel(meta.cancels)
            self.pusher.start(meta.pushes)

    def take_orders(self, meta: StepMetadata) -> None:
        """This step's orders (:meth:`take_push_orders` aside): hold newly finished requests, keep or release
        leases, then start pulls."""
        self.hold(meta.sends)
        if self.keeper is not None:
            self.keeper.watch(meta.watch)
            self.keeper.drop(meta.drop, release=True)
            if meta.idle and not meta.loads:
                self._pace(self.keeper)
        if self.pusher is not None and meta.idle and meta.awaiting and not meta.loads:
            self.pusher.wait_for_grants(_LINK_PACE_S)
        elif self.leases is not None and meta.idle and not meta.loads:
            self.leases.wait_for_end(_HOLD_PACE_S)
        self.start(meta.loads)

    def _pace(self, keeper: LeaseKeeper) -> None:
        """A decode step that runs nothing waits for what its requests wait for, instead of letting vLLM step
        again at once: a push to end (where pushes are pending: their links are up, so a wait for a link
        would return at once), else a link to come up."""
        if self.receiver is None or not self.receiver.wait_for_end(_LINK_PACE_S):
            keeper.wait_for_link(_LINK_PACE_S)

    def link_report(self) -> LinkReport | None:
        """For the scheduler: the prefill ranks this worker is linked to, and those it finds down; on a
        pushing prefill, the pushes it holds every grant for (None on a pull-mode prefill-only worker)."""
        granted = self.pusher.granted() if self.pusher is not None else frozenset()
        if self.keeper is not None:
            return LinkReport(self.keeper.ready(), self.keeper.down(), granted)
        return LinkReport(frozenset(), frozenset(), granted) if self.pusher is not None else None

    # -- push mode -----------------------------------------------------------------------------
    def save_layer(self, layer_name: str) -> None:
        """Prefill, push mode: ``layer_name`` is computed; start writing it for every push of this step."""
        layer = self.layers.get(layer_name)
        if self.pusher is not None and layer is not None:
            self.pusher.save_layer(layer)

    def finished_pushes(self) -> tuple[set[str], set[str]]:
        """Decode, push mode: (requests whose grants were withdrawn after they ended here: their blocks may be
        freed; requests whose push landed or failed, windows withdrawn — the failed ones' blocks in
        :meth:`take_failed_blocks`)."""
        return self.receiver.finished() if self.receiver is not None else (set(), set())

    # -- decode: pulls -----------------------------------------------------------------------
    def start(self, specs: Iterable[LoadSpec]) -> None:
        """Issue this step's pulls: layer by layer (returns at once) or whole (returns when landed).

        A request pulls whole under ``load_mode="sync"``, or when its KV on this
        rank is under ``whole_below_bytes``: one inline copy of every layer then
        costs less than the layer-wise path's hand-offs to the engine's thread and
        wake-ups of this one, which only pay off when a layer's copy is long
        enough to overlap the forward's earlier layers.
        """
        for spec in specs:
            remote = spec.remote
            prefill_heads = [r.head_range for r in remote.ranks]
            pull = _Pull(spec, time.monotonic())
            nbytes = self._nbytes(spec)
            pull.whole = self.config.load_mode is LoadMode.SYNC or nbytes < self.config.whole_below_bytes
            if self.timeline is not None:
                pull.trace = Trace("hixl", spec.request_id, self.tp_rank, pull.started, "whole" if pull.whole else "layerwise", nbytes)
            self._pulls.append(pull)
            try:
                # Which prefill ranks this rank speaks for: computed before anything can fail,
                # so that prefill hears even of a pull that never started.
                pull.notify = [remote.ranks[p] for p, d in notifiers(prefill_heads, self._all_heads).items() if d == self.tp_rank]
                mismatches = remote.kv.mismatches(self.kv)
                if mismatches:
                    raise ValueError(f"prefill's and decode's KV caches differ ({'; '.join(mismatches)}): nothing pulled")
                pull.reads = plan_reads(prefill_heads, self.heads)
                pull.sources = [remote.ranks[read.prefill_rank] for read in pull.reads]
                try:
                    self._issue(pull)
                except LLMLinkError as exc:
                    if not self._relinked(pull, pull.sources[pull.issued :], exc):
                        raise
                    self._issue(pull)  # the parts not issued yet, again
                if pull.whole:
                    pull.ended = time.monotonic()
                if pull.trace is not None:
                    pull.trace.issued = time.monotonic()
            except (HixlError, ValueError, TypeError) as exc:
                pull.error = exc

    def _nbytes(self, spec: LoadSpec) -> int:
        """Bytes of the request's KV this rank pulls (all its heads, every layer)."""
        desc = self._local_cache().cache_desc
        return len(spec.local_blocks) * desc.row_bytes * desc.num_tensors

    def _issue(self, pull: _Pull) -> None:
        """Pull every part not issued yet: whole (landed on return) or layer-wise (a task each)."""
        todo = list(zip(pull.reads, pull.sources))[pull.issued :]
        self._check_pullable(pull.spec, [endpoint for _, endpoint in todo])
        for read, endpoint in todo:
            task = self._pull_part(pull.spec, endpoint, read, pull.whole, self._left(pull))
            if task is not None:
                pull.tasks.append(task)
            pull.issued += 1

    def _budget(self, spec: LoadSpec) -> float:
        """Seconds a request's pull may take: a usable lease is held at least half a lease more."""
        return min(self.config.transfer_timeout, spec.remote.lease_s / 2)

    def _left(self, pull: _Pull) -> float:
        """What is left of the pull's time (:meth:`_budget` from its start)."""
        return pull.started + self._budget(pull.spec) - time.monotonic()

    def _relinked(self, pull: _Pull, endpoints: list[Endpoint], exc: LLMLinkError) -> bool:
        """The pull broke on its link to ``endpoints``: relink to each and have it confirm the request's
        lease, once a request and within its time; True if the pull may be retried.

        The confirmation (:meth:`~._leases.LeaseKeeper.confirm`: an extension prefill accepted just now)
        is what makes reading again safe: prefill holds the blocks for at least another lease, and a
        prefill that freed them, or a new process at its address, refuses it. A timeout, bad
        parameters or a lease prefill no longer holds are not link errors and are never retried.
        """
        assert self.keeper is not None, "a pull on a worker that does not pull KV"
        request = pull.spec.request_id
        if pull.retried:
            return False
        pull.retried = True
        self.stats.record_retry()
        began = time.monotonic()
        log.warning("hixl: request %s: its pull broke on the link (%s); relinking to retry it once", request, exc)
        for endpoint in dict.fromkeys(endpoints):
            if self._left(pull) <= 0:
                why = "its time ran out"
            elif not self.keeper.relink(endpoint, self._left(pull)):
                why = f"relinking to prefill {endpoint.ip_info} failed"
            elif not self.keeper.confirm(request, endpoint, self._left(pull)):
                why = f"prefill {endpoint.ip_info} no longer holds its lease"
            else:
                continue
            log.warning("hixl: request %s: not retried: %s after %.1f ms", request, why, (time.monotonic() - began) * 1e3)
            return False
        log.info("hixl: request %s: relinked and its lease confirmed in %.1f ms; pulling again", request, (time.monotonic() - began) * 1e3)
        return True

    def _check_pullable(self, spec: LoadSpec, sources: list[Endpoint]) -> None:
        """Raise unless the links to the prefill ranks read from are up and the blocks surely still held."""
        assert self.keeper is not None, "a pull on a worker that does not pull KV"
        for endpoint in sources:
            if not self.keeper.linked(endpoint):
                raise LLMException(f"not linked to prefill {endpoint.ip_info} (cluster {endpoint.cluster_id})", LLMStatusCode.LINK_FAILED)
        if not self.keeper.usable(spec.request_id):
            raise LLMException(
                f"the lease on request {spec.request_id}'s blocks at prefill may have run out; not pulling",
                LLMStatusCode.KV_CACHE_NOT_EXIST,
            )

    def _pull_part(
        self, spec: LoadSpec, endpoint: Endpoint, read: HeadRead, whole: bool, timeout: float, layers: range | None = None
    ) -> CacheTask | None:
        """Pull ``read``'s heads of the request's blocks (``layers``: all by default) from one prefill
        rank within ``timeout``: whole (landed on return), or layer-wise (the task)."""
        if timeout <= 0:
            raise LLMException(f"request {spec.request_id}'s pull ran out of time", LLMStatusCode.TIMEOUT)
        args = (BlocksCacheKey(endpoint.cluster_id), self._local_cache(), spec.remote_blocks, spec.local_blocks, layers, layers)
        kwargs: dict[str, Any] = {
            "tensor_num_per_layer": _TENSORS_PER_LAYER, "src_heads": read.src_heads, "dst_heads": read.dst_heads, "timeout": timeout,
        }
        manager = self.datadist.cache_manager
        if whole:
            manager.pull_blocks(*args, **kwargs)
            return None
        return manager.pull_blocks_async(*args, **kwargs)

    def wait_layer(self, layer_name: str) -> None:
        """Return once ``layer_name`` has landed for every pull of this step (or its pull failed)."""
        layer = self.layers.get(layer_name)
        if layer is None:
            return
        for pull in self._pulls:
            asked = time.monotonic() if pull.trace is not None else 0.0
            for part in range(len(pull.tasks)):
                if pull.error is None:
                    self._wait_part(pull, part, layer)
            if pull.trace is not None:
                pull.trace.asked(layer, asked, time.monotonic())

    def _wait_part(self, pull: _Pull, part: int, layer: int) -> None:
        """Wait for ``layer`` of one part of a layer-wise pull; if its link broke, pull that part again
        from this layer on (once, after relinking: see :meth:`_relinked`), or record the failure."""
        try:
            pull.tasks[part].wait_layer(layer)
            return
        except LLMLinkError as exc:
            if not self._relinked(pull, [pull.sources[part]], exc):
                pull.error = exc
                return
        except LLMException as exc:
            pull.error = exc
            return
        broken = pull.tasks[part]
        broken.cancel()  # no byte of it lands from now on: only the retry writes these blocks
        pull.retired.append(broken)
        try:
            retry = self._pull_part(
                pull.spec, pull.sources[part], pull.reads[part], False, self._left(pull), range(layer, len(self.layers))
            )
            assert retry is not None
            pull.tasks[part] = retry
            retry.wait_layer(layer)
        except (HixlError, ValueError) as exc:
            pull.error = exc

    def loading_blocks(self) -> list[int]:
        """Local block ids this step's pulls write into."""
        return [b for pull in self._pulls for b in pull.spec.local_blocks]

    def end_step(self) -> None:
        """Settle this step's pulls (timings, or the blocks of those that failed), then tell prefill; wait
        for this step's pushes (after a request's last step, decode is told)."""
        if self.pusher is not None:
            self.pusher.end_step()
        if not self._pulls:
            return
        assert self.keeper is not None, "a pull on a worker that does not pull KV"
        step_end = time.monotonic()
        for pull in self._pulls:
            if pull.trace is not None:
                pull.trace.step_end = step_end
            for task in pull.tasks:
                if pull.error is None:
                    try:
                        task.synchronize()
                    except LLMException as exc:
                        pull.error = exc
            if pull.error is not None:
                self._failed_blocks.update(pull.spec.local_blocks)
                self.stats.record_failed_pull()
                log.warning(
                    "hixl: pull of request %s failed: %s (client request id %s)", pull.spec.request_id, pull.error, client_id(pull.spec.request_id)
                )
                for endpoint in pull.sources:
                    self.keeper.check(endpoint)
            else:
                self._record(pull)
            if pull.trace is not None and self.timeline is not None:
                self._trace(pull, pull.trace, self.timeline)
            # Stop extending: the completion below frees the blocks, pulled or not.
            self.keeper.drop([pull.spec.request_id], release=False)
        if self._barrier is not None:
            self._barrier()  # every rank's pulls of this step are over: prefill may free its blocks
        for pull in self._pulls:
            for endpoint in pull.notify:
                self._notify(pull.spec, endpoint)
        self._pulls.clear()

    def _notify(self, spec: LoadSpec, endpoint: Endpoint) -> None:
        """Tell one prefill rank that decode is done with the request's blocks (its lease then ends)."""
        try:
            self.datadist.cache_manager.notify_pulled(endpoint.cluster_id, spec.remote.transfer_id)
        except (HixlError, ValueError) as exc:  # e.g. never linked: its lease runs out instead
            log.warning("hixl: cannot tell prefill %s that request %s is done: %s", endpoint.ip_info, spec.request_id, exc)

    def take_failed_blocks(self) -> set[int]:
        """Local blocks whose pull (or push) failed since the last call (vLLM then fails or recomputes them)."""
        failed, self._failed_blocks = self._failed_blocks, set()
        if self.receiver is not None:
            failed |= self.receiver.take_failed_blocks()
        return failed

    def _record(self, pull: _Pull) -> None:
        """Log the pull's figures: its KV transfer time and when its first layer was usable (on all parts)."""
        if pull.tasks:
            first, last = _landed(pull, 0), _landed(pull, len(self.layers) - 1)
        else:
            first = last = pull.ended or pull.started  # a sync pull is usable all at once
        desc = self._local_cache().cache_desc
        blocks = len(pull.spec.local_blocks)
        nbytes, seconds, first_seconds = blocks * desc.row_bytes * desc.num_tensors, last - pull.started, first - pull.started
        self.stats.record_pull(nbytes, seconds, first_seconds)
        log.info(
            "hixl: pulled request %s: %d blocks, %.2f MiB from %d prefill rank(s) in %.2f ms (%s), first layer usable after %.2f ms"
            " over %s (client request id %s)%s",
            pull.spec.request_id, blocks, nbytes / 2**20, len(pull.sources), seconds * 1e3, _mode(pull, self.config),
            first_seconds * 1e3, transports(self.datadist.engine, (e.ip_info for e in pull.sources)), client_id(pull.spec.request_id),
            "; retried after relinking" if pull.retried else "",
        )

    def _trace(self, pull: _Pull, trace: Trace, timeline: Timeline) -> None:
        """Complete a pull's trace (landed or failed) and write it; for the bench's file, time a whole pull of the
        same bytes too."""
        trace.client_id, trace.retried = client_id(pull.spec.request_id), pull.retried
        trace.transport = transports(self.datadist.engine, (e.ip_info for e in pull.sources))
        if pull.error is not None:
            trace.outcome = f"failed: {pull.error}"
        elif pull.tasks:
            trace.landed(_landed(pull, layer) for layer in range(len(self.layers)))
        else:
            trace.landed([pull.ended] * len(self.layers))
        if timeline.reference and pull.error is None:
            # The reference the bench holds the load against: the same bytes between the same processes, in
            # one transfer_sync (pull_blocks). It rewrites the same bytes, before prefill may free them.
            began = time.monotonic()
            try:
                for read, endpoint in zip(pull.reads, pull.sources):
                    self._pull_part(pull.spec, endpoint, read, True, self._budget(pull.spec))
            except (HixlError, ValueError) as exc:
                log.warning("hixl: timeline's reference pull of request %s failed: %s", pull.spec.request_id, exc)
            else:
                trace.sync_ref = time.monotonic() - began
        timeline.write(trace, pull.spec.trace_headers, pull.spec.arrived)

    def _local_cache(self) -> Cache:
        if self._cache is None:
            raise LLMException("vLLM has not registered its KV cache yet", LLMStatusCode.NOT_INITIALIZED)
        return self._cache

    # -- prefill: releases -------------------------------------------------------------------
    def hold(self, sends: dict[int, str]) -> None:
        """Hold the blocks of newly finished requests under a lease each (see :mod:`._leases`); a rank
        decode never reads releases them at once."""
        if sends:
            assert self.leases is not None, "a send on a worker that does not serve KV"
            self.leases.grant(sends, read=self._read_by_decode)

    def released(self) -> set[str]:
        """Request ids whose blocks vLLM may free now: pulled, released by decode, or their lease ran out."""
        if self.leases is None:
            return set()
        self.leases.pulled(done.req_id for done in self.datadist.cache_manager.completed_requests() if done.op == "pull")
        due = self.leases.due()
        for why in due.values():
            self.stats.record_release(expired=not why.pulled)
        return set(due)


def _landed(pull: _Pull, layer: int) -> float:
    """When ``layer`` of a layer-wise pull had landed from every prefill rank (a part retried from a later
    layer on landed the earlier ones by its first task)."""
    times = [t.landed_at(layer) for t in (*pull.tasks, *pull.retired) if layer in t.layers]
    return max((at for at in times if at is not None), default=pull.started)


def _mode(pull: _Pull, config: ConnectorConfig) -> str:
    """How the pull ran, for the log: ``layerwise``, ``sync`` (the setting) or ``whole`` (small enough)."""
    if not pull.whole:
        return LoadMode.LAYERWISE.value
    return LoadMode.SYNC.value if config.load_mode is LoadMode.SYNC else "whole"
