"""``HixlConnector``: vLLM's KV-connector interface (v1, as in vLLM 0.32), on hixl's DataDist.

vLLM builds one connector in its scheduler and one in each worker (one per
TP rank), with a role; each half delegates to :class:`~._scheduler.SchedulerSide`
or :class:`~._worker.WorkerSide`. The scheduler half learns every worker's
DataDist address and KV heads through vLLM's handshake metadata
(``get_handshake_metadata`` -> ``set_xfer_handshake_metadata``), so no port
has to be configured. Prefill and decode may run different TP sizes. In push
mode (``mode: "push"``) prefill's workers write each layer as vLLM computes it
(``save_kv_layer``) into blocks decode granted, and decode takes pushed
requests as asynchronous loads (docs/vllm.md, "Push mode").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from ._config import ConnectorConfig, Mode
from ._follow import Spans
from ._params import Endpoint, KvSpec, StepMetadata
from ._scheduler import SchedulerSide
from ._stats import HixlKVConnectorStats, HixlPromMetrics
from ._worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats, PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["HixlConnector"]


class HixlConnector(KVConnectorBase_V1):
    """Prefill/decode KV transfer over hixl; load it with ``kv_connector_module_path="hixl.vllm"``.

    Settings come from ``kv_connector_extra_config`` (see
    :class:`~hixl.vllm.ConnectorConfig`); none are required.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise ValueError(
                f"the hixl connector does not support pipeline parallelism "
                f"(pipeline_parallel_size={vllm_config.parallel_config.pipeline_parallel_size}); use PP=1"
            )
        self.config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config)
        kv = KvSpec.of(vllm_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role is KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(kv, self.config)
        else:
            from vllm.distributed.parallel_state import get_tp_group

            tp = get_tp_group()
            self._worker = WorkerSide(
                self.config,
                # Push mode: decode's workers listen too (prefill connects to them to write).
                transfer.is_kv_producer or self.config.mode is Mode.PUSH,
                transfer.is_kv_consumer,
                kv_cache_config.num_blocks,
                kv,
                tp.rank_in_group,
                tp.barrier if tp.world_size > 1 else None,
                # (a push-mode prefill traces its pushes)
                Spans.open(vllm_config, "decode" if transfer.is_kv_consumer else "prefill")
                if transfer.is_kv_consumer or self.config.mode is Mode.PUSH
                else None,
            )

    @property
    def scheduler(self) -> SchedulerSide:
        """The scheduler half (only in the scheduler's connector)."""
        assert self._scheduler is not None, "not the scheduler's connector"
        return self._scheduler

    @property
    def worker(self) -> WorkerSide:
        """The worker half (only in a worker's connector)."""
        assert self._worker is not None, "not a worker's connector"
        return self._worker

    # -- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register vLLM's KV tensors with DataDist, once."""
        self.worker.register(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """This worker's DataDist endpoint and KV heads, for its scheduler (None if it only pulls)."""
        return self.worker.endpoint()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Keep this step's orders; take its push orders now, before the forward computes any layer (vLLM may
        call :meth:`start_load_kv` only after it)."""
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, StepMetadata)
        self.worker.take_push_orders(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Take this step's orders: hold finished requests' blocks, keep leases, start pulls."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, StepMetadata)
        self.worker.take_orders(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Return once this layer's KV has landed (at once for a sync load)."""
        self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Push mode, prefill: the layer is computed; start writing it into decode's blocks (returns at once).
        Pull mode: nothing (decode pulls)."""
        if self.config.mode is Mode.PUSH:
            self.worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        """End of the step: settle its pulls, and (push mode) wait for its writes."""
        self.worker.end_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(Requests whose blocks may be freed: prefill's released ones, decode's revoked pushes withdrawn;
        decode's pushes that landed or failed.) Pulls finish within their step: nothing to report for them."""
        sending = self.worker.released()
        recving: set[str] = set()
        if self.config.mode is Mode.PUSH:
            revoked, recving = self.worker.finished_pushes()
            sending |= revoked
        return sending or None, recving or None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Tell the scheduler which prefill ranks this worker is linked to (it holds requests back for links)."""
        return self.worker.link_report()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose pull failed this step: vLLM fails or recomputes their requests."""
        return self.worker.take_failed_blocks()

    def loading_block_ids(self) -> list[int]:
        """Local block ids this step's pulls write into."""
        return self.worker.loading_blocks()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This worker's pulls and releases since the last step (None in the scheduler: it records none)."""
        return self._worker.stats.take() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        """Rebuild the stats from the dict the front end receives (empty stats if ``data`` is None)."""
        return HixlKVConnectorStats(data=data) if data is not None else HixlKVConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> HixlPromMetrics:
        """The ``vllm:hixl_*`` series on vLLM's ``/metrics``."""
        return HixlPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Finalize the worker's DataDist."""
        if self._worker is not None:
            self._worker.close()

    # -- scheduler side ----------------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Learn every worker's DataDist endpoint (one per TP rank)."""
        self.scheduler.set_endpoints({rank: m for rank, m in metadata.items() if isinstance(m, Endpoint)})

    def on_new_request(self, request: Request) -> None:
        """Decode: start keeping the request's leases at prefill (every rank holding its blocks) alive, and
        linking to those ranks."""
        self.scheduler.arrived(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Learn from the workers (their reports aggregated) which prefill ranks they are linked to."""
        self.scheduler.worker_report(connector_output)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Prompt tokens decode takes from prefill: pulled within the step, or (push mode) pushed, async; None
        while the request waits — for its links to prefill, or at a pushing prefill for decode's grants (vLLM
        asks again next step)."""
        return self.scheduler.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Queue the pull into (or, push mode, the grant of) the blocks vLLM just allocated."""
        self.scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's orders for the worker."""
        return self.scheduler.build_metadata(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Keep a prefilled request's blocks for decode and return where to find them; on decode,
        release the lease of a request that finished before its pull, or revoke the grant of one that
        finished before its push landed (its blocks freed once the workers withdrew it)."""
        return self.scheduler.finished(request, block_ids)
