"""The scheduler half of the connector: which tokens come from a prefill instance, and when blocks may go.

On **decode**, a request whose ``kv_transfer_params`` name a remote prefill
gets every prompt token but the last from there (vLLM must compute at least
one token to sample from, so the last is recomputed — its block is still
pulled whole if it was partial). The load is *synchronous* in vLLM's terms:
the request is scheduled and its blocks are pulled inside the same step —
layer by layer, so attention on layer 0 can start while later layers are
still in flight. From its arrival (``on_new_request``) every worker keeps the
request's leases alive at the prefill ranks holding its blocks and links to
them in the background (see :mod:`._leases`); until the workers report all of
those links up (their reports aggregated: a link counts once every worker has
it), the request is held back (``get_num_new_matched_tokens`` answers None:
vLLM asks again next step and schedules others meanwhile) — as long as its
lease is surely alive without extensions (half a lease from arrival). A
request that finishes at decode before its pull (aborted) has its leases
released.

On **prefill**, a request sent with ``do_remote_decode`` keeps its blocks
after it finishes: ``request_finished`` hands vLLM the ``kv_transfer_params``
for decode and tells the worker (next step's metadata) to hold the blocks
under a lease until decode's completion notification arrives, decode
releases them, or the lease runs out. With TP > 1 the params list every
prefill rank's endpoint (``set_xfer_handshake_metadata`` gives one per rank)
and this instance's :class:`~._params.KvSpec`; every rank's worker holds the
blocks under a lease of its own, under the same (random) transfer id.

Push mode (``mode: "push"``): requests whose params name a push are
:class:`~._push_scheduler.PushScheduler`'s on both roles; others go on as above.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ._config import ConnectorConfig, Mode
from ._leases import new_transfer_id
from ._params import Endpoint, KvSpec, LinkReport, LoadSpec, RemotePrefill, StepMetadata, WatchedLease
from ._push_scheduler import PushScheduler, push_id_of

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]

# A child of vLLM's logger: these lines show in vLLM's log, with its format and level.
log = logging.getLogger("vllm.hixl")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SchedulerSide:
    """Decides loads and deferred frees; see the module docstring."""

    def __init__(self, kv: KvSpec, config: ConnectorConfig) -> None:
        self.kv = kv
        self.block_size = kv.block_size
        self.config = config
        # Prefill only: every TP rank's endpoint, in rank order, once all have told theirs.
        self.endpoints: tuple[Endpoint, ...] = ()
        self._loads: list[LoadSpec] = []
        self._sends: dict[int, str] = {}
        # Decode: requests not pulled yet (with their arrival time), the prefill ranks the workers are
        # linked to, and this step's new leases and drops for the workers.
        self._waiting: dict[str, WatchedLease] = {}
        self._ready: frozenset[Endpoint] = frozenset()
        self._down: frozenset[Endpoint] = frozenset()
        self._watch: list[WatchedLease] = []
        self._drop: list[str] = []
        self.push = PushScheduler(self.block_size, config.push_timeout) if config.mode is Mode.PUSH else None

    # -- decode ------------------------------------------------------------------------------
    def arrived(self, request: Request) -> None:
        """vLLM's ``on_new_request``: a request with a remote prefill starts being kept alive and linked for."""
        if self.push is not None and self.push.arrived(request):
            return
        remote = RemotePrefill.from_params(request.kv_transfer_params)
        if remote is None:
            return
        lease = WatchedLease(request.request_id, remote, time.monotonic())
        self._waiting[request.request_id] = lease
        self._watch.append(lease)

    def worker_report(self, output: KVConnectorOutput) -> None:
        """vLLM's ``update_connector_output``: learn which prefill ranks every worker is linked to (or one finds down)."""
        report = output.kv_connector_worker_meta
        if isinstance(report, LinkReport):
            self._ready, self._down = report.ready, report.down
        if self.push is not None:
            self.push.ended(output.finished_recving or set())
            if isinstance(report, LinkReport):
                self.push.heard(report.granted)

    def loadable_tokens(self, request: Request) -> int:
        """Prompt tokens the remote prefill holds that vLLM may take instead of computing."""
        remote = RemotePrefill.from_params(request.kv_transfer_params)
        if remote is None:
            return 0
        prompt = len(request.prompt_token_ids or ())
        held = min(remote.num_tokens, prompt, len(remote.block_ids) * self.block_size)
        # At least the last prompt token is computed here: its logits give the next token.
        return max(0, min(held, prompt - 1))

    def matched(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens``: (tokens, whether they load asynchronously) — a push is
        asynchronous (the request waits for it in ``WAITING_FOR_REMOTE_KVS``), a pull is not; None while
        the request waits (pull: for links; push, at prefill: for decode's grants)."""
        if self.push is not None:
            pushed = self.push.tokens(request, num_computed_tokens)
            if pushed is not None:
                return pushed, pushed > 0
            if self.push.waits(request):
                return None, False
        return self.num_new_matched_tokens(request, num_computed_tokens), False

    def num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        """vLLM's ``get_num_new_matched_tokens``: loadable tokens beyond the locally cached ones,
        or None (ask again later) while the request waits for its links to prefill."""
        lease = self._waiting.get(request.request_id)
        if lease is not None and self._waits_for_link(lease):
            return None
        return max(0, self.loadable_tokens(request) - num_computed_tokens)

    def _waits_for_link(self, lease: WatchedLease) -> bool:
        """Hold the request back: some prefill rank holding its blocks is not linked yet (by every decode
        worker: the reports are aggregated), none is found down, and its lease is surely alive (half a
        lease from arrival). Past that the load goes ahead and fails (the worker cannot vouch for the
        blocks), so vLLM's ``kv_load_failure_policy`` decides, and nothing hangs."""
        needed = lease.remote.leased
        return (
            not self._ready.issuperset(needed)
            and self._down.isdisjoint(needed)
            and time.monotonic() < lease.arrived + lease.remote.lease_s / 2
        )

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Queue the pull (or, push mode, the grant) of the blocks just allocated for the request's remote tokens."""
        if self.push is not None and self.push.grant(request, blocks, num_external_tokens):
            return
        params = request.kv_transfer_params
        remote = RemotePrefill.from_params(params)
        if remote is None:
            return
        end = self.loadable_tokens(request)
        # Only ever one pull per request: if it is preempted and rescheduled later,
        # prefill may already have freed the blocks, so it recomputes instead.
        assert params is not None
        params["do_remote_prefill"] = False
        lease = self._waiting.pop(request.request_id, None)
        if lease is not None and num_external_tokens <= 0:
            self._drop.append(request.request_id)  # nothing to pull after all: let prefill free it
        if num_external_tokens <= 0:
            return
        # Local prefix-cache hits are whole blocks, so the loaded range starts on one.
        first, last = (end - num_external_tokens) // self.block_size, _cdiv(end, self.block_size)
        local = blocks.get_block_ids()[0]
        headers = dict(request.trace_headers) if request.trace_headers else None
        self._loads.append(
            LoadSpec(
                request.request_id, remote, remote.block_ids[first:last], list(local[first:last]), headers,
                lease.arrived if lease is not None else None,
            )
        )

    # -- prefill -----------------------------------------------------------------------------
    def finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished``: keep a prefilled request's blocks for decode, or free them now;
        on decode, release the lease of a request that finishes unpulled (aborted), or revoke the grant of
        one whose push has not ended (its blocks kept until the workers withdrew it)."""
        from vllm.v1.request import RequestStatus

        if self.push is not None:
            if self.push.decode_finished(request):
                return True, None
            if push_id_of(request.kv_transfer_params) is not None:
                return False, self.push.prefill_finished(request, self.endpoints, self.kv)
        if self._waiting.pop(request.request_id, None) is not None:
            self._drop.append(request.request_id)
            return False, None
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted: decode will never ask for it
        if not block_ids:
            return False, None
        if not self.endpoints:
            log.error("hixl: request %s asks for remote decode, but this instance does not serve KV", request.request_id)
            return False, None
        transfer_id = new_transfer_id()
        self._sends[transfer_id] = request.request_id
        remote = RemotePrefill(
            self.endpoints, self.kv, transfer_id, list(block_ids), request.num_computed_tokens, request.request_id,
            self.config.lease_s, self.config.release_timeout,
        )
        return True, remote.to_params()

    def set_endpoints(self, metadata: dict[int, Endpoint]) -> None:
        """Learn every TP rank's endpoint; all ranks must have told theirs (else none serve KV)."""
        if not metadata:
            return  # a decode-only instance: its workers serve nothing
        ranks = sorted(metadata)
        if ranks != list(range(self.kv.tp_size)):
            log.error("hixl: DataDist endpoints of TP ranks %s, expected ranks 0..%d: this instance serves no KV", ranks, self.kv.tp_size - 1)
            return
        self.endpoints = tuple(metadata[r] for r in ranks)

    # -- every step --------------------------------------------------------------------------
    def build_metadata(self, scheduler_output: SchedulerOutput) -> StepMetadata:
        """This step's orders for the worker; starts collecting the next step's."""
        idle = scheduler_output.total_num_scheduled_tokens == 0
        meta = StepMetadata(self._loads, self._sends, self._watch, self._drop, idle)
        self._loads, self._sends, self._watch, self._drop = [], {}, [], []
        if self.push is not None:
            self.push.orders(meta, scheduler_output)
        return meta
