"""The worker half of the connector: vLLM's KV cache as a DataDist blocks cache, pulls, and releases.

vLLM's CPU backend hands ``register_kv_caches`` one tensor per layer, shaped
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` — K and V
interleaved inside a block, all layers views into one storage. So a block of
a layer is one contiguous row, and the whole cache is a DataDist blocks cache
of ``num_layers`` tensors, one per layer (``tensor_num_per_layer=1``),
registered with the engine once, as the one span the views cover.

Decode pulls by block id; prefill's worker only watches DataDist's completion
notifications to tell vLLM which finished requests' blocks it may free.
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
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
)
from ._config import ConnectorConfig, LoadMode
from ._params import Endpoint, LoadSpec
from ._stats import HixlKVConnectorStats

__all__ = ["WorkerSide"]

# A child of vLLM's logger: these lines show in vLLM's log, with its format and level.
log = logging.getLogger("vllm.hixl")

_TENSORS_PER_LAYER = 1  # K and V share a tensor (interleaved per head inside a block)


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
        self.datadist.init(
            LLMConfig(
                listen_ip_info=f"{config.host}:{config.port}" if serves_kv else None,
                local_ip=config.host,
                sync_kv_timeout=config.transfer_timeout,
                transport=config.transport,
            )
        )
        self.layers: dict[str, int] = {}
        self._cache: Cache | None = None
        self._pulls: list[_Pull] = []
        self._failed_blocks: set[int] = set()
        # Prefill side: transfer id -> (vLLM request id, release deadline), and ids
        # decode reported pulled before this worker heard of them.
        self._held: dict[int, tuple[str, float]] = {}
        self._early: set[int] = set()
        self._newest_held = 0
        self.stats = HixlKVConnectorStats()  # vLLM takes it after each step (HixlConnector.get_kv_connector_stats)

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
        """Finalize DataDist: links and registrations go."""
        self.datadist.finalize()

    # -- decode: pulls -----------------------------------------------------------------------
    def start(self, specs: Iterable[LoadSpec]) -> None:
        """Issue this step's pulls: layer by layer (returns at once) or whole (returns when landed)."""
        for spec in specs:
            pull = _Pull(spec, time.monotonic())
            self._pulls.append(pull)
            try:
                self._link(spec.remote.endpoint)
                key, cache = BlocksCacheKey(spec.remote.endpoint.cluster_id), self._local_cache()
                args = (key, cache, spec.remote_blocks, spec.local_blocks)
                manager, tid = self.datadist.cache_manager, spec.remote.transfer_id
                if self.config.load_mode is LoadMode.SYNC:
                    manager.pull_blocks(*args, tensor_num_per_layer=_TENSORS_PER_LAYER, req_id=tid)
                    pull.ended = time.monotonic()
                else:
                    pull.task = manager.pull_blocks_async(*args, tensor_num_per_layer=_TENSORS_PER_LAYER, req_id=tid)
            except (HixlError, ValueError, TypeError) as exc:
                pull.error = exc

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
            if pull.error is not None:
                self._failed_blocks.update(pull.spec.local_blocks)
                self.stats.record_failed_pull()
                log.warning("hixl: pull of request %s failed: %s", pull.spec.request_id, pull.error)
            else:
                self._record(pull)
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
        nbytes, seconds = blocks * desc.row_bytes * desc.num_tensors, (last or pull.started) - pull.started
        first_seconds = (first or pull.started) - pull.started
        self.stats.record_pull(nbytes, seconds, first_seconds)
        log.info(
            "hixl: pulled request %s: %d blocks, %.2f MiB in %.2f ms (%s), first layer usable after %.2f ms",
            pull.spec.request_id, blocks, nbytes / 2**20, seconds * 1e3, self.config.load_mode.value, first_seconds * 1e3,
        )

    def _local_cache(self) -> Cache:
        if self._cache is None:
            raise LLMException("vLLM has not registered its KV cache yet", LLMStatusCode.NOT_INITIALIZED)
        return self._cache

    def _link(self, endpoint: Endpoint) -> None:
        linked = self.datadist.linked_clusters().get(endpoint.cluster_id)
        if linked is not None and linked != endpoint.ip_info:  # that id lives elsewhere: a prefill restarted with it
            self.datadist.unlink_clusters([LLMClusterInfo(endpoint.cluster_id, linked)], force=True)
        # Also when linked at this address: DataDist answers ALREADY_LINK for a live link and links
        # anew to a prefill restarted there (a new incarnation), whose old link is dead.
        (status,) = self.datadist.link_clusters([LLMClusterInfo(endpoint.cluster_id, endpoint.ip_info)])
        if status not in (LLMStatusCode.SUCCESS, LLMStatusCode.ALREADY_LINK):
            raise LLMException(f"cannot link to prefill {endpoint.ip_info} (cluster {endpoint.cluster_id})", status)

    # -- prefill: releases -------------------------------------------------------------------
    def hold(self, sends: dict[int, str]) -> None:
        """Hold the blocks of newly finished requests until decode pulled them or the timeout passes."""
        deadline = time.monotonic() + self.config.release_timeout
        for transfer_id, request_id in sends.items():
            self._held[transfer_id] = (request_id, deadline)
            self._newest_held = max(self._newest_held, transfer_id)

    def released(self) -> set[str]:
        """Request ids whose blocks vLLM may free now: pulled by decode, or held past the timeout."""
        if not self.serves_kv:
            return set()
        for done in self.datadist.cache_manager.completed_requests():
            # Ids are issued in order: one not newer than every held id was released already.
            if done.op == "pull" and (done.req_id in self._held or done.req_id > self._newest_held):
                self._early.add(done.req_id)
        out: set[str] = set()
        now = time.monotonic()
        for transfer_id, (request_id, deadline) in list(self._held.items()):
            if transfer_id in self._early:
                self._early.discard(transfer_id)
                log.info("hixl: request %s was pulled by decode; its blocks are released", request_id)
                self.stats.record_release(expired=False)
            elif now >= deadline:
                log.warning(
                    "hixl: request %s was not pulled within %.0f s; releasing its blocks anyway",
                    request_id, self.config.release_timeout,
                )
                self.stats.record_release(expired=True)
            else:
                continue
            del self._held[transfer_id]
            out.add(request_id)
        return out
