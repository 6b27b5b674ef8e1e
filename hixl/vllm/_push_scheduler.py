"""Push mode's scheduler half: decode's grants and revokes, prefill's wait for grants and its steps.

**Decode.** A request whose ``kv_transfer_params`` name a push (a
:class:`~._params.PushSource`) is an *async* load in vLLM's terms:
``get_num_new_matched_tokens`` answers ``(tokens, True)``, vLLM allocates
blocks for those tokens and parks the request in ``WAITING_FOR_REMOTE_KVS``;
``update_state_after_alloc`` turns the allocation into a
:class:`~._params.PushGrant` for the workers (the blocks receiving the prompt's
blocks ``first_block`` on), which open write windows over them and tell
prefill (:mod:`._push`). The request waits until a worker lists it in
``finished_recving``: landed, or failed with its blocks in
``get_block_ids_with_load_errors`` (vLLM's ``kv_load_failure_policy`` then
fails or recomputes it). A request that ends at decode before that (aborted)
is *revoked*: ``request_finished`` answers True (vLLM keeps its blocks) and the
next step's metadata tells the workers, which withdraw the windows before
listing it in ``finished_sending`` — only then may vLLM give the blocks to
another request. A revoke goes out only for a push whose end the scheduler has
not heard of: vLLM fails a request whose load failed in the same output that
lists it received, before this half hears of the latter, and a request listed
twice would be freed twice.

**Prefill.** A request sent with ``do_remote_decode`` and a ``push_id`` waits
(``get_num_new_matched_tokens`` answers None: vLLM asks again next step) until
the workers' aggregated :class:`~._params.LinkReport` lists its push id in
``granted`` — every decode rank's grant reached every prefill rank — or
``push_timeout`` has passed since it first asked: then it runs unpushed, and
its push is cancelled, so that decode ranks that did grant hear at once that
nothing will come. Each step that schedules a granted request gets a
:class:`~._params.PushStep` (its blocks, the step's prompt tokens, whether it
computes the prompt's last). Its writes end inside the step, so it is freed at
once when it finishes; one that finishes before its last step (aborted) is
cancelled. Its ``kv_transfer_params`` name this instance's ranks and KV spec,
as pull mode's do, so that the proxy learns where to send the next push.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._params import Endpoint, KvSpec, PushGrant, PushSource, PushStep, StepMetadata, source_params

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["PushScheduler", "push_id_of"]

# A child of vLLM's logger: these lines show in vLLM's log, with its format and level.
log = logging.getLogger("vllm.hixl")


def push_id_of(params: dict[str, Any] | None) -> int | None:
    """Prefill: the push id of a request sent with ``do_remote_decode`` and a valid ``push_id``, else None."""
    if not params or not params.get("do_remote_decode"):
        return None
    push_id = params.get("push_id")
    return push_id if type(push_id) is int and 0 < push_id < 2**63 else None


class PushScheduler:
    """Both roles' push-mode state in vLLM's scheduler (one thread: vLLM's); see the module docstring.

    ``clock``: the time the prefill side's waits are measured on.
    """

    def __init__(self, block_size: int, push_timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.block_size = block_size
        self.push_timeout = push_timeout
        self._clock = clock
        # Decode: arrival times until the grant; granted pushes whose end is not heard of yet (request id ->
        # push id); this step's grants and revokes for the workers.
        self._arrived: dict[str, float] = {}
        self._pending: dict[str, int] = {}
        self._grants: list[PushGrant] = []
        self._revokes: dict[str, None] = {}  # (ordered)
        # Prefill: requests waiting for their grants (request id -> deadline), the push ids every worker holds
        # grants for, admitted requests whose last step is still to come, those whose last step came, and this
        # step's cancels.
        self._waiting: dict[str, float] = {}
        self._granted: frozenset[int] = frozenset()
        self._pushing: dict[str, tuple[Request, int]] = {}
        self._pushed: set[str] = set()
        self._unpushed: set[str] = set()  # waited push_timeout in vain: computed without a push
        self._cancels: list[int] = []

    # -- decode ------------------------------------------------------------------------------
    def arrived(self, request: Request) -> bool:
        """vLLM's ``on_new_request`` at decode: True if the request's KV is pushed (its arrival is noted)."""
        if PushSource.from_params(request.kv_transfer_params) is None:
            return False
        self._arrived[request.request_id] = self._clock()
        return True

    def tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        """Decode: the prompt tokens prefill pushes beyond the locally cached ones (all but the last: vLLM
        computes one to sample from), or None if the request is not pushed (any more)."""
        if PushSource.from_params(request.kv_transfer_params) is None:
            return None
        return max(0, len(request.prompt_token_ids or ()) - 1 - num_computed_tokens)

    def grant(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> bool:
        """vLLM's ``update_state_after_alloc`` at decode: queue the grant of the blocks just allocated for a
        pushed request's tokens; True if the request is pushed (whether or not anything is granted)."""
        params = request.kv_transfer_params
        source = PushSource.from_params(params)
        if source is None:
            return False
        assert params is not None
        # One push per request: one preempted after it landed recomputes what it lost.
        params["do_remote_prefill"] = False
        arrived = self._arrived.pop(request.request_id, None)
        if num_external_tokens <= 0:
            # Decode holds the whole prompt already; prefill's wait for a grant ends at its push_timeout.
            log.info("hixl: request %s: nothing to take from prefill's push %d", request.request_id, source.push_id)
            return True
        end = len(request.prompt_token_ids or ()) - 1
        # Local prefix-cache hits are whole blocks, so the pushed range starts on one.
        first, last = (end - num_external_tokens) // self.block_size, -(-end // self.block_size)
        local = blocks.get_block_ids()[0]
        headers = dict(request.trace_headers) if request.trace_headers else None
        self._grants.append(
            PushGrant(request.request_id, source, list(local[first:last]), first, num_external_tokens, headers, arrived)
        )
        self._pending[request.request_id] = source.push_id
        return True

    def decode_finished(self, request: Request) -> bool:
        """vLLM's ``request_finished`` at decode: True (keep its blocks until a worker lists it) for a request
        whose push was granted and has not ended: it is revoked."""
        self._arrived.pop(request.request_id, None)
        if self._pending.pop(request.request_id, None) is None:
            return False
        self._revokes[request.request_id] = None
        return True

    def ended(self, request_ids: set[str]) -> None:
        """Decode: the workers listed these requests' pushes as ended (``finished_recving``): landed or failed."""
        for request_id in request_ids:
            self._pending.pop(request_id, None)
            self._revokes.pop(request_id, None)  # its blocks are freed by that listing: no second one

    # -- prefill -----------------------------------------------------------------------------
    def waits(self, request: Request) -> bool:
        """vLLM's ``get_num_new_matched_tokens`` at prefill: True while a pushed request waits for its grants."""
        request_id = request.request_id
        push_id = push_id_of(request.kv_transfer_params)
        if push_id is None or request_id in self._pushing or request_id in self._pushed or request_id in self._unpushed:
            return False
        deadline = self._waiting.setdefault(request_id, self._clock() + self.push_timeout)
        if push_id in self._granted:
            del self._waiting[request_id]
            self._pushing[request_id] = (request, push_id)
            return False
        if self._clock() < deadline:
            return True
        del self._waiting[request_id]
        self._unpushed.add(request_id)
        self._cancels.append(push_id)  # decode ranks that did grant hear it now, not at their push_timeout
        log.warning(
            "hixl: request %s: decode's grants for push %d did not come within push_timeout (%.1f s); computing it unpushed",
            request_id, push_id, self.push_timeout,
        )
        return False

    def heard(self, granted: frozenset[int]) -> None:
        """Prefill: the push ids every worker now holds every grant for (their reports aggregated)."""
        self._granted = granted

    def prefill_finished(self, request: Request, endpoints: tuple[Endpoint, ...], kv: KvSpec) -> dict[str, Any] | None:
        """vLLM's ``request_finished`` at prefill for a pushed request (:func:`push_id_of`): its
        ``kv_transfer_params`` (None if this instance serves no KV); one that ends before its last step is
        cancelled. Its blocks may go at once either way."""
        request_id = request.request_id
        push_id = push_id_of(request.kv_transfer_params)
        assert push_id is not None, "not a pushed request"
        pushed = request_id in self._pushed
        self._pushed.discard(request_id)
        self._unpushed.discard(request_id)
        if self._pushing.pop(request_id, None) is not None or self._waiting.pop(request_id, None) is not None:
            self._cancels.append(push_id)
        if not endpoints:
            return None
        return {"do_remote_prefill": False, "do_remote_decode": False, "push_id": push_id, "pushed": pushed, **source_params(endpoints, kv)}

    def _steps(self, scheduler_output: SchedulerOutput) -> list[PushStep]:
        """This step's orders for each admitted request it schedules."""
        steps = []
        state = scheduler_output.kv_connector_block_state
        for request_id, (request, push_id) in list(self._pushing.items()):
            scheduled = scheduler_output.num_scheduled_tokens.get(request_id, 0)
            block_ids = state.get_block_ids(request_id) if state is not None else None
            if not scheduled or block_ids is None:
                continue
            # (Before vLLM counts this step's tokens as computed: where it starts.)
            start = request.num_computed_tokens
            end = start + scheduled
            last = end >= request.num_prompt_tokens
            headers = dict(request.trace_headers) if request.trace_headers else None
            steps.append(PushStep(request_id, push_id, list(block_ids[0]), start, end, last, headers))
            if last:
                del self._pushing[request_id]
                self._pushed.add(request_id)
        return steps

    # -- every step --------------------------------------------------------------------------
    def orders(self, meta: StepMetadata, scheduler_output: SchedulerOutput) -> None:
        """Put this step's push orders into ``meta``; start collecting the next step's."""
        meta.grants, meta.revokes, meta.cancels = self._grants, list(self._revokes), self._cancels
        meta.pushes = self._steps(scheduler_output)
        meta.awaiting = bool(self._waiting)
        self._grants, self._revokes, self._cancels = [], {}, []

    def __repr__(self) -> str:
        return (
            f"<PushScheduler decode: {len(self._pending)} granted, {len(self._revokes)} to revoke; "
            f"prefill: {len(self._waiting)} waiting for grants, {len(self._pushing)} pushing>"
        )
