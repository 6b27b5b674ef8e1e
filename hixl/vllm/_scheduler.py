"""The scheduler half of the connector: which tokens come from a prefill instance, and when blocks may go.

On **decode**, a request whose ``kv_transfer_params`` name a remote prefill
gets every prompt token but the last from there (vLLM must compute at least
one token to sample from, so the last is recomputed — its block is still
pulled whole if it was partial). The load is *synchronous* in vLLM's terms:
the request is scheduled at once and its blocks are pulled inside the same
step — layer by layer, so attention on layer 0 can start while later layers
are still in flight.

On **prefill**, a request sent with ``do_remote_decode`` keeps its blocks
after it finishes: ``request_finished`` hands vLLM the ``kv_transfer_params``
for decode and tells the worker (next step's metadata) to report the request
as sent once decode's completion notification arrives. With TP > 1 the
params list every prefill rank's endpoint (``set_xfer_handshake_metadata``
gives one per rank) and this instance's :class:`~._params.KvSpec`.
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING, Any

from ._params import Endpoint, KvSpec, LoadSpec, RemotePrefill, StepMetadata

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]

# A child of vLLM's logger: these lines show in vLLM's log, with its format and level.
log = logging.getLogger("vllm.hixl")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SchedulerSide:
    """Decides loads and deferred frees; see the module docstring."""

    def __init__(self, kv: KvSpec) -> None:
        self.kv = kv
        self.block_size = kv.block_size
        # Prefill only: every TP rank's endpoint, in rank order, once all have told theirs.
        self.endpoints: tuple[Endpoint, ...] = ()
        self._transfer_ids = itertools.count(1)
        self._loads: list[LoadSpec] = []
        self._sends: dict[int, str] = {}

    # -- decode ------------------------------------------------------------------------------
    def loadable_tokens(self, request: Request) -> int:
        """Prompt tokens the remote prefill holds that vLLM may take instead of computing."""
        remote = RemotePrefill.from_params(request.kv_transfer_params)
        if remote is None:
            return 0
        prompt = len(request.prompt_token_ids or ())
        held = min(remote.num_tokens, prompt, len(remote.block_ids) * self.block_size)
        # At least the last prompt token is computed here: its logits give the next token.
        return max(0, min(held, prompt - 1))

    def num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """vLLM's ``get_num_new_matched_tokens``: loadable tokens beyond the locally cached ones."""
        return max(0, self.loadable_tokens(request) - num_computed_tokens)

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Queue the pull of the blocks just allocated for the request's remote tokens."""
        params = request.kv_transfer_params
        remote = RemotePrefill.from_params(params)
        if remote is None:
            return
        end = self.loadable_tokens(request)
        # Only ever one pull per request: if it is preempted and rescheduled later,
        # prefill may already have freed the blocks, so it recomputes instead.
        assert params is not None
        params["do_remote_prefill"] = False
        if num_external_tokens <= 0:
            return
        # Local prefix-cache hits are whole blocks, so the loaded range starts on one.
        first, last = (end - num_external_tokens) // self.block_size, _cdiv(end, self.block_size)
        local = blocks.get_block_ids()[0]
        self._loads.append(
            LoadSpec(request.request_id, remote, remote.block_ids[first:last], list(local[first:last]))
        )

    # -- prefill -----------------------------------------------------------------------------
    def finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished``: keep a prefilled request's blocks for decode, or free them now."""
        from vllm.v1.request import RequestStatus

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
        transfer_id = next(self._transfer_ids)
        self._sends[transfer_id] = request.request_id
        remote = RemotePrefill(self.endpoints, self.kv, transfer_id, list(block_ids), request.num_computed_tokens, request.request_id)
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
    def build_metadata(self) -> StepMetadata:
        """This step's orders for the worker; starts collecting the next step's."""
        meta = StepMetadata(self._loads, self._sends)
        self._loads, self._sends = [], {}
        return meta
