"""Registering KV caches and moving them — whole, by block, layer by layer.

Every transfer is planned the same way: resolve the peer's cache from its
published catalog, check shapes, dtypes, block indices and layer ranges, then
build all descriptors in one vectorised step (:mod:`._layout`). A synchronous
call sends them as one engine transfer (runs of contiguous blocks merge into
single descriptors); an async one sends one engine request per layer, in
layer order, so :meth:`CacheTask.wait_layer` can return as soon as its layer
has landed.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .._exceptions import HixlError
from .._memory import buffer_range
from .._request import TransferReq
from .._types import Op
from ._catalog import Catalog, RemoteCache
from ._errors import LLMException, LLMStatusCode, translate_errors
from ._layout import in_remote_order, layer_tensors, resolve_layers, row_descs, rows_array
from ._state import DataDistState
from ._task import CacheTask, TaskControl
from ._types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    Placement,
    TransferConfig,
    TransferDone,
)

__all__ = ["CacheManager", "CacheTask", "LayerSynchronizer"]


class LayerSynchronizer(Protocol):
    """Told by the pushing side when prefill has finished computing a layer."""

    def synchronize_layer(self, layer_index: int, timeout: float | None) -> bool:
        """Block until layer ``layer_index`` is computed; False (or raising) aborts the push."""
        ...


@dataclass(frozen=True)
class _Plan:
    """Validated descriptors of one transfer, grouped by layer."""

    remote_engine: str
    op: Op
    layers: list[int]  # local layer indices, in order
    descs: np.ndarray  # (layers * tensors_per_layer * rows, 3), layer-major
    catalog: Catalog  # the remote catalog the descriptors were built from

    def layer_slice(self, position: int) -> np.ndarray:
        per_layer = len(self.descs) // len(self.layers)
        return self.descs[position * per_layer : (position + 1) * per_layer]


class CacheManager:
    """Cache registration and transfers of one :class:`LLMDataDist` (``datadist.cache_manager``)."""

    def __init__(self, state: DataDistState) -> None:
        # Caches, links and catalogs live in the state this manager shares with its LLMDataDist.
        self._state = state

    # -- registration --------------------------------------------------------------------
    def register_cache(
        self, cache_desc: CacheDesc, tensors_or_addrs: Sequence[Any], cache_keys: Sequence[CacheKey] = ()
    ) -> Cache:
        """Register a plain cache (``shape[0]`` = batch size); ``cache_keys[i]`` names batch entry i."""
        keys = list(cache_keys)
        if any(not isinstance(k, CacheKey) for k in keys):
            raise TypeError("cache_keys must be CacheKey instances")
        if len(keys) > cache_desc.shape[0]:
            raise ValueError(f"{len(keys)} cache keys for a batch of {cache_desc.shape[0]}")
        return self._register(cache_desc, tensors_or_addrs, keys, is_blocks=False)

    def register_blocks_cache(
        self,
        cache_desc: CacheDesc,
        tensors_or_addrs: Sequence[Any],
        blocks_cache_key: BlocksCacheKey | None = None,
        *,
        access: str = "rw",
    ) -> Cache:
        """Register a paged cache (``shape[0]`` = number of blocks) under ``blocks_cache_key``.

        ``access="r"``: peers may pull from it but never push into it (a WRITE is
        refused with :class:`~hixl.AccessDenied`, on every transport) except where
        the owner registers a writable window over part of it with the engine
        (``engine.register_mem(MemDesc(addr, len), access="rw")``).
        """
        if blocks_cache_key is not None and not isinstance(blocks_cache_key, BlocksCacheKey):
            raise TypeError("blocks_cache_key must be a BlocksCacheKey")
        return self._register(cache_desc, tensors_or_addrs, [blocks_cache_key] if blocks_cache_key else [], True, access)

    def _register(self, desc: CacheDesc, tensors: Sequence[Any], keys: list[Any], is_blocks: bool, access: str = "rw") -> Cache:
        if not isinstance(desc, CacheDesc):
            raise TypeError(f"cache_desc must be a CacheDesc, not {type(desc).__name__}")
        if desc.placement is not Placement.HOST:
            raise LLMException("only HOST placement has a transport here", LLMStatusCode.PARAM_INVALID)
        if isinstance(tensors, (str, bytes)) or len(tensors) != desc.num_tensors:
            raise ValueError(f"expected {desc.num_tensors} tensors or addresses, got {len(tensors)}")
        addrs = [_tensor_addr(t, desc, i) for i, t in enumerate(tensors)]
        return self._state.add_cache(desc, addrs, keys, is_blocks, tensors, access)

    def unregister_cache(self, cache_id: int) -> None:
        """Forget a cache; peers can no longer reach it."""
        self._state.remove_cache(cache_id)

    def caches(self) -> list[Cache]:
        """Every registered cache."""
        return self._state.caches()

    # -- pulls (READ) --------------------------------------------------------------------
    def pull_blocks(
        self,
        src_key: BlocksCacheKey,
        dst_cache: Cache,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        tensor_num_per_layer: int = 2,
        *,
        req_id: int | None = None,
        timeout: float | None = None,
        src_heads: range | None = None,
        dst_heads: range | None = None,
    ) -> None:
        """Copy blocks ``src_blocks`` of the remote cache ``src_key`` into ``dst_blocks`` of ``dst_cache``.

        With ``req_id``, the source is told (:meth:`completed_requests`) once the
        data has landed, so it may free those blocks.

        ``src_heads`` / ``dst_heads`` (both or neither) move only that range of
        each block's second axis (``shape[1]``: the KV heads in a
        ``[blocks, heads, tokens, ...]`` layout) into that range of the
        destination's — e.g. between tensor-parallel ranks that hold different
        heads. The two caches then need equal ``shape[2:]`` and dtype, not equal
        ``shape[1]``; each block of each tensor moves as one descriptor.
        """
        timeout = self._timeout(timeout)
        plan = self._blocks_plan(Op.READ, src_key, dst_cache, src_blocks, dst_blocks, src_layer_range, dst_layer_range, tensor_num_per_layer, timeout=timeout, remote_heads=src_heads, local_heads=dst_heads)
        self._run(plan, req_id, timeout, "pull_blocks")

    def pull_blocks_async(
        self,
        src_key: BlocksCacheKey,
        dst_cache: Cache,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        tensor_num_per_layer: int = 2,
        *,
        req_id: int | None = None,
        timeout: float | None = None,
        src_heads: range | None = None,
        dst_heads: range | None = None,
    ) -> CacheTask:
        """:meth:`pull_blocks` layer by layer: returns at once; ``task.wait_layer(i)`` waits for layer i.

        With ``req_id``, ``task.synchronize()`` (or ``await task``) sends the
        completion notification before it returns; a task nobody synchronizes
        sends none. ``src_heads`` / ``dst_heads`` as in :meth:`pull_blocks`.
        """
        timeout = self._timeout(timeout)
        plan = self._blocks_plan(Op.READ, src_key, dst_cache, src_blocks, dst_blocks, src_layer_range, dst_layer_range, tensor_num_per_layer, timeout=timeout, verify=False, remote_heads=src_heads, local_heads=dst_heads)
        return self._run_async(plan, req_id, timeout)

    def pull_cache(
        self,
        cache_key: CacheKey | CacheKeyByIdAndIndex,
        cache: Cache,
        batch_index: int = 0,
        size: int = -1,
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        tensor_num_per_layer: int = 2,
        *,
        req_id: int | None = None,
        timeout: float | None = None,
    ) -> None:
        """Copy the remote batch entry named by ``cache_key`` into entry ``batch_index`` of ``cache``.

        ``size`` > 0 copies only the first ``size`` positions along ``shape[1]``
        (e.g. the prompt's tokens); -1 copies the whole entry.
        """
        timeout = self._timeout(timeout)
        plan = self._cache_plan(Op.READ, cache_key, cache, batch_index, size, src_layer_range, dst_layer_range, tensor_num_per_layer, timeout=timeout)
        self._run(plan, req_id, timeout, "pull_cache")

    # -- pushes (WRITE) --------------------------------------------------------------------
    def push_blocks(
        self,
        dst_key: BlocksCacheKey,
        src_cache: Cache,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        tensor_num_per_layer: int = 2,
        *,
        req_id: int | None = None,
        timeout: float | None = None,
        src_heads: range | None = None,
        dst_heads: range | None = None,
    ) -> None:
        """Write blocks of the local ``src_cache`` into the remote blocks cache ``dst_key``.

        ``src_heads`` / ``dst_heads`` (both or neither): only that range of each
        block's KV heads, into that range of the destination's, as in :meth:`pull_blocks`.
        """
        timeout = self._timeout(timeout)
        plan = self._blocks_plan(Op.WRITE, dst_key, src_cache, dst_blocks, src_blocks, dst_layer_range, src_layer_range, tensor_num_per_layer, timeout=timeout, remote_heads=dst_heads, local_heads=src_heads)
        self._run(plan, req_id, timeout, "push_blocks")

    def push_blocks_async(
        self,
        dst_key: BlocksCacheKey,
        src_cache: Cache,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        tensor_num_per_layer: int = 2,
        *,
        timeout: float | None = None,
        src_heads: range | None = None,
        dst_heads: range | None = None,
    ) -> CacheTask:
        """:meth:`push_blocks` layer by layer: returns at once, every layer of the ranges on its way.

        For a pusher that computes its layers one at a time: push each one as it
        is computed (a one-layer range) and wait for the task later. Before it
        returns, the destination's catalog generation is read (one small round
        trip, as :meth:`push_blocks` does): a write must never start into caches
        the destination re-registered since, so this check cannot ride behind
        the data as a pull's does.
        """
        timeout = self._timeout(timeout)
        plan = self._blocks_plan(Op.WRITE, dst_key, src_cache, dst_blocks, src_blocks, dst_layer_range, src_layer_range, tensor_num_per_layer, timeout=timeout, remote_heads=dst_heads, local_heads=src_heads)
        return self._run_async(plan, None, timeout)

    def push_cache(
        self,
        dst_key: CacheKey | CacheKeyByIdAndIndex,
        src_cache: Cache,
        batch_index: int = 0,
        size: int = -1,
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        tensor_num_per_layer: int = 2,
        *,
        req_id: int | None = None,
        timeout: float | None = None,
    ) -> None:
        """Write entry ``batch_index`` of the local ``src_cache`` into the remote entry ``dst_key``."""
        timeout = self._timeout(timeout)
        plan = self._cache_plan(Op.WRITE, dst_key, src_cache, batch_index, size, dst_layer_range, src_layer_range, tensor_num_per_layer, timeout=timeout)
        self._run(plan, req_id, timeout, "push_cache")

    def transfer_cache_async(
        self,
        src_cache: Cache,
        layer_synchronizer: LayerSynchronizer,
        transfer_configs: Sequence[TransferConfig],
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        tensor_num_per_layer: int = 2,
        *,
        req_id: int | None = None,
        timeout: float | None = None,
    ) -> CacheTask:
        """Push ``src_cache`` layer by layer while prefill is still computing.

        A helper thread calls ``layer_synchronizer.synchronize_layer(i, timeout)``
        for each layer and, as soon as it returns True, starts writing layer i
        to every destination in ``transfer_configs`` — so the transfer of layer
        i overlaps the compute of layer i+1. ``task.synchronize()`` waits for all
        and then, with ``req_id``, notifies every destination before it returns.
        """
        timeout = self._timeout(timeout)
        if not transfer_configs:
            raise ValueError("transfer_configs is empty")
        plans = [
            self._blocks_plan(Op.WRITE, cfg.dst_key, src_cache, dst_blocks, src_blocks, cfg.dst_layer_range, cfg.src_layer_range, tensor_num_per_layer, cfg.dst_cluster_id, timeout=timeout)
            for cfg in transfer_configs
        ]
        if len({tuple(p.layers) for p in plans}) != 1:
            raise ValueError("every transfer config must cover the same source layers")
        control = TaskControl(plans[0].layers, timeout)
        state = self._state

        def start_layer(position: int, layer: int) -> list[TransferReq]:
            # Every destination's generation is read again right before its layer is
            # written: one that re-registered its caches since the plan (or since the
            # last layer) must not get this layer written into whatever is there now.
            for plan in plans:
                if not state.is_current(plan.remote_engine, plan.catalog, timeout):
                    raise LLMException(
                        f"{plan.remote_engine} changed its caches during the push; layer {layer} and later not written",
                        LLMStatusCode.KV_CACHE_NOT_EXIST,
                    )
            with translate_errors(f"push layer {layer}"):
                return [state.engine.transfer_async(p.remote_engine, p.op, p.layer_slice(position), timeout) for p in plans]

        def push() -> None:
            for position, layer in enumerate(control.task.layers):
                try:
                    ready = layer_synchronizer.synchronize_layer(layer, timeout)
                except Exception as exc:
                    control.fail_from(position, LLMException(f"synchronize_layer({layer}) raised {exc!r}", LLMStatusCode.FAILED))
                    return
                if not ready:
                    control.fail_from(position, LLMException(f"layer {layer} was not computed in time", LLMStatusCode.TIMEOUT))
                    return
                if not control.start(position, functools.partial(start_layer, position, layer)):
                    return

        threading.Thread(target=push, name="hixl-datadist-push", daemon=True).start()
        if req_id is not None:

            def notify_every_destination() -> None:
                for plan in plans:
                    self._notify_done(plan, req_id, "push")

            control.on_success(notify_every_destination)
        return control.task

    # -- completion notifications -----------------------------------------------------------
    def completed_requests(self) -> list[TransferDone]:
        """Requests peers finished with since the last call: pulled from us, or pushed to us."""
        return self._state.take_done()

    def notify_pulled(self, cluster_id: int, req_id: int) -> None:
        """Tell the linked cluster ``cluster_id`` that ``req_id`` was pulled, as a pull with ``req_id`` would.

        For a pull split between several pullers (tensor-parallel ranks, each
        pulling its part without ``req_id``): one of them speaks for all once
        every part has landed, so the source hears exactly once.
        """
        link = self._state.link(cluster_id)
        if link is None:
            raise LLMException(f"cluster {cluster_id} is not linked", LLMStatusCode.NOT_YET_LINK)
        self._state.send_done(link.name, req_id, "pull")

    def _notify_done(self, plan: _Plan, req_id: int, op: str) -> None:
        self._state.send_done(plan.remote_engine, req_id, op)

    # -- planning ----------------------------------------------------------------------------
    def _timeout(self, timeout: float | None) -> float:
        return self._state.config.sync_kv_timeout if timeout is None else float(timeout)

    def _local(self, cache: Cache) -> Cache:
        if not isinstance(cache, Cache):
            raise TypeError(f"expected a Cache from register_*, got {type(cache).__name__}")
        if not self._state.registered(cache):
            raise LLMException(f"cache {cache.cache_id} is not registered here", LLMStatusCode.KV_CACHE_NOT_EXIST)
        return cache

    def _blocks_plan(
        self,
        op: Op,
        remote_key: BlocksCacheKey,
        local_cache: Cache,
        remote_blocks: Sequence[int],
        local_blocks: Sequence[int],
        remote_layer_range: range | None,
        local_layer_range: range | None,
        tensor_num_per_layer: int,
        cluster_id: int | None = None,
        *,
        timeout: float,
        verify: bool = True,
        remote_heads: range | None = None,
        local_heads: range | None = None,
    ) -> _Plan:
        if not isinstance(remote_key, BlocksCacheKey):
            raise TypeError(f"a blocks transfer names its remote cache by BlocksCacheKey, not {type(remote_key).__name__}")
        local = self._local(local_cache)
        if not local.is_blocks:
            raise TypeError("the local cache is not a blocks cache (use register_blocks_cache)")
        cluster = remote_key.prompt_cluster_id if cluster_id is None else cluster_id
        remote_engine, remote, catalog = self._state.remote_cache(
            cluster, lambda cat: cat.blocks_cache(remote_key), remote_key, timeout, verify
        )
        local_rows = rows_array(local_blocks, local.cache_desc.shape[0], "local block indices")
        remote_rows = rows_array(remote_blocks, remote.cache_desc.shape[0], "remote block indices")
        if len(local_rows) != len(remote_rows):
            raise ValueError(f"{len(remote_rows)} source blocks but {len(local_rows)} destination blocks")
        local_rows, remote_rows = in_remote_order(local_rows, remote_rows, op)
        if remote_heads is None and local_heads is None:
            _check_compatible(local.cache_desc, remote.cache_desc)
            return self._plan(op, remote_engine, local, remote, local_rows, remote_rows, local_layer_range, remote_layer_range, tensor_num_per_layer, local.cache_desc.row_bytes, catalog)
        local_start, remote_start, nbytes = _head_slices(local.cache_desc, remote.cache_desc, local_heads, remote_heads)
        # Byte offsets, as _cache_plan does: each block's slice starts ``*_start`` bytes into its row.
        local_offsets = local_rows * np.uint64(local.cache_desc.row_bytes) + np.uint64(local_start)
        remote_offsets = remote_rows * np.uint64(remote.cache_desc.row_bytes) + np.uint64(remote_start)
        plan = self._plan(op, remote_engine, local, remote, local_offsets, remote_offsets, local_layer_range, remote_layer_range, tensor_num_per_layer, 1, catalog)
        plan.descs[:, 2] = nbytes
        return plan

    def _cache_plan(
        self,
        op: Op,
        remote_key: CacheKey | CacheKeyByIdAndIndex,
        local_cache: Cache,
        batch_index: int,
        size: int,
        remote_layer_range: range | None,
        local_layer_range: range | None,
        tensor_num_per_layer: int,
        *,
        timeout: float,
    ) -> _Plan:
        local = self._local(local_cache)
        if local.is_blocks:
            raise TypeError("the local cache is a blocks cache (use pull_blocks/push_blocks)")
        if isinstance(remote_key, CacheKey):
            cluster = remote_key.prompt_cluster_id
            found: Any = lambda cat: cat.by_cache_key(remote_key)
        elif isinstance(remote_key, CacheKeyByIdAndIndex):
            cluster = remote_key.cluster_id

            def found(cat: Any) -> Any:
                cache = cat.by_id(remote_key.cache_id)
                return None if cache is None or cache.is_blocks else (cache, remote_key.batch_index)

        else:
            raise TypeError(f"cache key must be CacheKey or CacheKeyByIdAndIndex, not {type(remote_key).__name__}")
        remote_engine, (remote, remote_index), catalog = self._state.remote_cache(cluster, found, remote_key, timeout)
        _check_compatible(local.cache_desc, remote.cache_desc)
        shape = local.cache_desc.shape
        if size != -1:
            if len(shape) < 2 or not 0 < size <= shape[1]:
                raise ValueError(f"size {size} must be -1 or within 1..{shape[1] if len(shape) > 1 else 1}")
            nbytes = size * (local.cache_desc.row_bytes // shape[1])
        else:
            nbytes = local.cache_desc.row_bytes
        local_rows = rows_array([batch_index], shape[0], "batch_index")
        remote_rows = rows_array([remote_index], remote.cache_desc.shape[0], "remote batch index")
        # Rows are ``row_bytes`` apart; only their first ``nbytes`` move.
        plan = self._plan(op, remote_engine, local, remote, local_rows * np.uint64(local.cache_desc.row_bytes), remote_rows * np.uint64(local.cache_desc.row_bytes), local_layer_range, remote_layer_range, tensor_num_per_layer, 1, catalog)
        plan.descs[:, 2] = nbytes
        return plan

    def _plan(
        self,
        op: Op,
        remote_engine: str,
        local: Cache,
        remote: RemoteCache,
        local_rows: np.ndarray,
        remote_rows: np.ndarray,
        local_layer_range: range | None,
        remote_layer_range: range | None,
        tensor_num_per_layer: int,
        row_bytes: int,
        catalog: Catalog,
    ) -> _Plan:
        local_layers = resolve_layers(local.cache_desc, local_layer_range, tensor_num_per_layer, "local layer range")
        remote_layers = resolve_layers(remote.cache_desc, remote_layer_range, tensor_num_per_layer, "remote layer range")
        if len(local_layers) != len(remote_layers):
            raise ValueError(f"layer ranges differ in length: {len(remote_layers)} source vs {len(local_layers)} destination")
        local_addrs = np.asarray(local.tensor_addrs, dtype=np.uint64)[layer_tensors(local_layers, tensor_num_per_layer)]
        remote_addrs = np.asarray(remote.tensor_addrs, dtype=np.uint64)[layer_tensors(remote_layers, tensor_num_per_layer)]
        descs = row_descs(local_addrs, remote_addrs, local_rows, remote_rows, row_bytes)
        return _Plan(remote_engine, op, list(local_layers), descs, catalog)

    # -- execution ---------------------------------------------------------------------------
    def _run(self, plan: _Plan, req_id: int | None, timeout: float, what: str) -> None:
        with translate_errors(what):
            self._state.engine.transfer_sync(plan.remote_engine, plan.op, plan.descs, timeout)
        if req_id is not None:
            self._notify_done(plan, req_id, "pull" if plan.op is Op.READ else "push")

    def _run_async(self, plan: _Plan, req_id: int | None, timeout: float) -> CacheTask:
        control = TaskControl(plan.layers, timeout)
        engine = self._state.engine
        per_layer = len(plan.descs) // len(plan.layers)
        what = "pull" if plan.op is Op.READ else "push"
        if plan.op is Op.READ:
            # The catalog check rides in the same ordered queue just ahead of layer 0,
            # rather than costing a round trip before the first layer may start.
            guard, current = self._state.generation_read(plan.catalog)
            head = np.concatenate([np.array([guard], dtype=np.uint64), plan.layer_slice(0)])
            # Two engine calls: layer 0 is queued (and starts copying) while the rest
            # are still being validated; each call validates its layers in one pass.
            with translate_errors(what):
                guard_req, first = engine.transfer_async_split(plan.remote_engine, plan.op, head, [1, per_layer], timeout)
            control.guard(guard_req, current)
        else:  # a write's plan was verified before it was made (see push_blocks_async)
            with translate_errors(what):
                (first,) = engine.transfer_async_split(plan.remote_engine, plan.op, plan.layer_slice(0), [per_layer], timeout)
        control.submit(plan.layers[0], [first])
        if len(plan.layers) > 1:
            try:
                with translate_errors(what):
                    rest = engine.transfer_async_split(
                        plan.remote_engine, plan.op, plan.descs[per_layer:], [per_layer] * (len(plan.layers) - 1), timeout
                    )
            except LLMException as exc:
                control.fail_from(1, exc)
            else:
                for layer, req in zip(plan.layers[1:], rest):
                    control.submit(layer, [req])
        if req_id is not None:
            control.on_success(lambda: self._notify_done(plan, req_id, "pull"))
        return control.task


def _tensor_addr(tensor: Any, desc: CacheDesc, index: int) -> int:
    """Address of tensor ``index``, after checking it matches ``desc``."""
    if isinstance(tensor, (int, np.integer)):
        if int(tensor) <= 0:
            raise ValueError(f"address {index} must be positive, not {tensor}")
        return int(tensor)
    shape = tuple(int(d) for d in getattr(tensor, "shape", ()))
    if shape != desc.shape:
        raise ValueError(f"tensor {index} has shape {shape}, the CacheDesc says {desc.shape}")
    if DataType.of(tensor) is not desc.data_type:
        raise TypeError(f"tensor {index} is {DataType.of(tensor).name}, the CacheDesc says {desc.data_type.name}")
    try:
        addr, _, _ = buffer_range(tensor)
    except HixlError as exc:
        raise ValueError(f"tensor {index}: {exc}") from exc
    return addr


def _check_compatible(local: CacheDesc, remote: CacheDesc) -> None:
    if local.data_type is not remote.data_type:
        raise TypeError(f"dtype mismatch: local {local.data_type.name}, remote {remote.data_type.name}")
    if local.shape[1:] != remote.shape[1:]:
        raise ValueError(f"block/entry shape mismatch: local {local.shape[1:]}, remote {remote.shape[1:]}")


def _head_slices(local: CacheDesc, remote: CacheDesc, local_heads: range | None, remote_heads: range | None) -> tuple[int, int, int]:
    """Byte offsets of the head ranges within a block on each side, and their length."""
    if local_heads is None or remote_heads is None:
        raise ValueError("a head-sliced transfer needs both src_heads and dst_heads")
    if local.data_type is not remote.data_type:
        raise TypeError(f"dtype mismatch: local {local.data_type.name}, remote {remote.data_type.name}")
    if len(local.shape) < 2 or local.shape[2:] != remote.shape[2:]:
        raise ValueError(f"per-head shape mismatch: local {local.shape[2:]}, remote {remote.shape[2:]}")
    for heads, desc, side in ((local_heads, local, "destination"), (remote_heads, remote, "source")):
        if not isinstance(heads, range) or heads.step != 1:
            raise TypeError(f"{side} heads must be a range with step 1, not {heads!r}")
        if len(heads) == 0 or heads.start < 0 or heads.stop > desc.shape[1]:
            raise ValueError(f"{side} heads {heads} are outside its {desc.shape[1]} heads")
    if len(local_heads) != len(remote_heads):
        raise ValueError(f"{len(remote_heads)} source heads but {len(local_heads)} destination heads")
    head_bytes = local.row_bytes // local.shape[1]
    return local_heads.start * head_bytes, remote_heads.start * head_bytes, len(local_heads) * head_bytes
