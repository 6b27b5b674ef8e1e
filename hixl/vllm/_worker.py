"""The worker half of the connector: vLLM's KV cache as a DataDist blocks cache, pulls, and releases.

vLLM's CPU backend hands ``register_kv_caches`` one tensor per layer, shaped
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` — K and V
interleaved inside a block, all layers views into one storage. So a block of
a layer is one contiguous row, and the whole cache is a DataDist blocks cache
of ``num_layers`` tensors, one per layer (``tensor_num_per_layer=1``),
registered with the engine once, as the one span the views cover.

Decode pulls by block id, only from a prefill its :class:`~._leases.LeaseKeeper`
has linked to and only while the request's lease is usable; prefill's worker
keeps its held requests in a :class:`~._leases.LeaseTable` (fed by DataDist's
completion notifications and decode's lease messages) to tell vLLM which
finished requests' blocks it may free.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
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
    LLMRole,
    LLMStatusCode,
)
from ._affinity import unpinned
from ._config import ConnectorConfig, LoadMode
from ._leases import LEASE_NOTIFY, LeaseKeeper, LeaseTable
from ._params import Endpoint, LinkReport, LoadSpec, StepMetadata

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
    """One request's pull within the current step."""

    spec: LoadSpec
    started: float
    task: CacheTask | None = None  # layer-wise pulls only
    ended: float | None = None  # sync pulls only
    error: Exception | None = None


class WorkerSide:
    """One worker's DataDist instance and its in-flight pulls and held sends."""

    def __init__(self, config: ConnectorConfig, serves_kv: bool, pulls_kv: bool, num_blocks: int) -> None:
        self.config = config
        self.serves_kv = serves_kv
        self.num_blocks = num_blocks
        role = LLMRole.MIX if serves_kv and pulls_kv else LLMRole.PROMPT if serves_kv else LLMRole.DECODER
        self.datadist = LLMDataDist(role, config.cluster_id)
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
        self.leases = LeaseTable(config.lease_s, config.release_timeout) if serves_kv else None
        if self.leases is not None:
            self.datadist.engine.handle_notifies(LEASE_NOTIFY, self.leases.on_notify)

    # -- set-up ------------------------------------------------------------------------------
    def register(self, kv_caches: dict[str, Any]) -> None:
        """Register vLLM's per-layer KV tensors (layer order as vLLM gives them) as one blocks cache."""
        names, tensors = list(kv_caches), list(kv_caches.values())
        if not tensors:
            raise ValueError("vLLM registered no KV cache tensors")
        shape, dtype = tuple(tensors[0].shape), tensors[0].dtype
        if any(tuple(t.shape) != shape or t.dtype != dtype for t in tensors):
            raise ValueError("hixl needs every layer's KV tensor to have the same shape and dtype")
        if shape[0] != self.num_blocks:
            raise ValueError(
                f"hixl needs one KV tensor per layer with blocks as rows ({self.num_blocks} blocks); "
                f"got shape {shape}: this vLLM backend's layout is not supported"
            )
        desc = CacheDesc(len(tensors), shape, DataType.of(tensors[0]))
        key = BlocksCacheKey(self.config.cluster_id) if self.serves_kv else None
        self._cache = self.datadist.cache_manager.register_blocks_cache(desc, tensors, key)
        self.layers = {name: i for i, name in enumerate(names)}
        log.info(
            "hixl: registered %d layers x %d blocks (%s, %d bytes a block) on DataDist %s",
            len(tensors), shape[0], desc.data_type.value, desc.row_bytes, self.endpoint() or "(pull only)",
        )

    def endpoint(self) -> Endpoint | None:
        """Where peers pull from this worker, or None if it only pulls."""
        return Endpoint(self.datadist.local_ip_info, self.config.cluster_id) if self.serves_kv else None

    def close(self) -> None:
        """Stop keeping leases, finalize DataDist: links and registrations go."""
        if self.keeper is not None:
            self.keeper.close()
        self.datadist.finalize()

    # -- every step --------------------------------------------------------------------------
    def take_orders(self, meta: StepMetadata) -> None:
        """This step's orders: hold newly finished requests, keep or release leases, then start pulls."""
        self.hold(meta.sends)
        if self.keeper is not None:
            self.keeper.watch(meta.watch)
            self.keeper.drop(meta.drop, release=True)
            if meta.idle and not meta.loads:
                self.keeper.wait_for_link(_LINK_PACE_S)
        if self.leases is not None and meta.idle and not meta.loads:
            self.leases.wait_for_end(_HOLD_PACE_S)
        self.start(meta.loads)

    def link_report(self) -> LinkReport | None:
        """For the scheduler: the prefills this worker is linked to, and those it finds down
        (None on a prefill-only worker)."""
        return LinkReport(self.keeper.ready(), self.keeper.down()) if self.keeper is not None else None

    # -- decode: pulls -----------------------------------------------------------------------
    def start(self, specs: Iterable[LoadSpec]) -> None:
        """Issue this step's pulls: layer by layer (returns at once) or whole (returns when landed)."""
        for spec in specs:
            pull = _Pull(spec, time.monotonic())
            self._pulls.append(pull)
            try:
                self._check_pullable(spec)
                key, cache = BlocksCacheKey(spec.remote.endpoint.cluster_id), self._local_cache()
                args = (key, cache, spec.remote_blocks, spec.local_blocks)
                manager, tid = self.datadist.cache_manager, spec.remote.transfer_id
                # A usable lease is held at least half a lease more: the pull must end within it.
                timeout = min(self.config.transfer_timeout, spec.remote.lease_s / 2)
                if self.config.load_mode is LoadMode.SYNC:
                    manager.pull_blocks(*args, tensor_num_per_layer=_TENSORS_PER_LAYER, req_id=tid, timeout=timeout)
                    pull.ended = time.monotonic()
                else:
                    pull.task = manager.pull_blocks_async(
                        *args, tensor_num_per_layer=_TENSORS_PER_LAYER, req_id=tid, timeout=timeout
                    )
            except (HixlError, ValueError, TypeError) as exc:
                pull.error = exc

    def _check_pullable(self, spec: LoadSpec) -> None:
        """Raise unless the link to the request's prefill is up and its blocks are surely still held."""
        assert self.keeper is not None, "a pull on a worker that does not pull KV"
        endpoint = spec.remote.endpoint
        if not self.keeper.linked(endpoint):
            raise LLMException(f"not linked to prefill {endpoint.ip_info} (cluster {endpoint.cluster_id})", LLMStatusCode.LINK_FAILED)
        if not self.keeper.usable(spec.request_id):
            raise LLMException(
                f"the lease on request {spec.request_id}'s blocks at {endpoint.ip_info} may have run out; not pulling",
                LLMStatusCode.KV_CACHE_NOT_EXIST,
            )

    def wait_layer(self, layer_name: str) -> None:
        """Return once ``layer_name`` has landed for every pull of this step (or its pull failed)."""
        layer = self.layers.get(layer_name)
        if layer is None:
            return
        for pull in self._pulls:
            if pull.task is not None and pull.error is None:
                try:
                    pull.task.wait_layer(layer)
                except LLMException as exc:
                    pull.error = exc

    def loading_blocks(self) -> list[int]:
        """Local block ids this step's pulls write into."""
        return [b for pull in self._pulls for b in pull.spec.local_blocks]

    def end_step(self) -> None:
        """Settle this step's pulls: record timings, or the blocks of those that failed."""
        for pull in self._pulls:
            if pull.task is not None and pull.error is None:
                try:
                    pull.task.synchronize()
                except LLMException as exc:
                    pull.error = exc
            assert self.keeper is not None
            if pull.error is not None:
                self._failed_blocks.update(pull.spec.local_blocks)
                log.warning("hixl: pull of request %s failed: %s", pull.spec.request_id, pull.error)
                self.keeper.check(pull.spec.remote.endpoint)
            else:
                self._record(pull)
            # Pulled: DataDist's completion frees the blocks. Failed: release them now.
            self.keeper.drop([pull.spec.request_id], release=pull.error is not None)
        self._pulls.clear()

    def take_failed_blocks(self) -> set[int]:
        """Local blocks whose pull failed since the last call (vLLM then fails or recomputes them)."""
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def _record(self, pull: _Pull) -> None:
        """Log the pull's figures: its KV transfer time and when its first layer was usable."""
        if pull.task is not None:
            first, last = pull.task.landed_at(pull.task.layers[0]), pull.task.landed_at(pull.task.layers[-1])
        else:
            first = last = pull.ended  # a sync pull is usable all at once
        desc = self._local_cache().cache_desc
        blocks = len(pull.spec.local_blocks)
        log.info(
            "hixl: pulled request %s: %d blocks, %.2f MiB in %.2f ms (%s), first layer usable after %.2f ms",
            pull.spec.request_id, blocks, blocks * desc.row_bytes * desc.num_tensors / 2**20,
            ((last or pull.started) - pull.started) * 1e3, self.config.load_mode.value,
            ((first or pull.started) - pull.started) * 1e3,
        )

    def _local_cache(self) -> Cache:
        if self._cache is None:
            raise LLMException("vLLM has not registered its KV cache yet", LLMStatusCode.NOT_INITIALIZED)
        return self._cache

    # -- prefill: releases -------------------------------------------------------------------
    def hold(self, sends: dict[int, str]) -> None:
        """Hold the blocks of newly finished requests under a lease each (see :mod:`._leases`)."""
        if sends:
            assert self.leases is not None, "a send on a worker that does not serve KV"
            self.leases.grant(sends)

    def released(self) -> set[str]:
        """Request ids whose blocks vLLM may free now: pulled, released by decode, or their lease ran out."""
        if self.leases is None:
            return set()
        self.leases.pulled(done.req_id for done in self.datadist.cache_manager.completed_requests() if done.op == "pull")
        return self.leases.due()
