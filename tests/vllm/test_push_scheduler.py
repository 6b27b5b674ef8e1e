"""Push mode's scheduler half (:mod:`hixl.vllm._push_scheduler`), driven as vLLM's scheduler drives it, no engine.

Real vLLM requests, block lists and scheduler outputs go through
:class:`~hixl.vllm._scheduler.SchedulerSide` in push mode, step by step; prefill's
waits run on a fake clock (their rules are arithmetic). What the workers do with
the orders is :mod:`test_push_worker`'s; the whole path with real engines is
:mod:`test_push_serve`'s.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

# Not just "vllm": where vLLM is missing, this folder itself would import under that name.
pytest.importorskip("vllm.distributed.kv_transfer")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import KVConnectorBlockState, SchedulerOutput  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from hixl.vllm import ConnectorConfig, Mode  # noqa: E402
from hixl.vllm._params import CPU_LAYOUT, Endpoint, KvSpec, LinkReport, PushGrant, PushSource, PushStep, StepMetadata  # noqa: E402
from hixl.vllm._push_scheduler import PushScheduler  # noqa: E402
from hixl.vllm._scheduler import SchedulerSide  # noqa: E402

pytestmark = pytest.mark.timeout(60)

BLOCK = 32
KV = KvSpec("tiny", "float32", 2, 2, 4, BLOCK, CPU_LAYOUT, 1)
PREFILL = (Endpoint("127.0.0.1:7001", 70, (0, 2)),)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def scheduler(push_timeout: float = 5.0) -> tuple[SchedulerSide, Clock]:
    """A push-mode scheduler half whose prefill waits run on the returned clock."""
    side = SchedulerSide(KV, ConnectorConfig(mode=Mode.PUSH, push_timeout=push_timeout))
    clock = Clock()
    side.push = PushScheduler(BLOCK, push_timeout, clock)
    return side, clock


def request(request_id: str, prompt_len: int, params: dict[str, Any]) -> Request:
    sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": dict(params)})
    return Request(request_id, list(range(prompt_len)), sampling, None)


def blocks(*ids: int) -> KVCacheBlocks:
    return KVCacheBlocks((tuple(KVCacheBlock(i) for i in ids),))


def step(side: SchedulerSide, scheduled: dict[str, int] | None = None, tables: dict[str, list[int]] | None = None) -> StepMetadata:
    """One step's metadata, vLLM's scheduler having scheduled ``scheduled`` (request id -> tokens) with these block tables."""
    output = SchedulerOutput.make_empty()
    output.num_scheduled_tokens = dict(scheduled or {})
    output.total_num_scheduled_tokens = sum(output.num_scheduled_tokens.values())
    table = dict(tables or {})
    output.kv_connector_block_state = KVConnectorBlockState(set(output.num_scheduled_tokens), lambda rid: (table[rid],), {})
    meta = side.build_metadata(output)
    assert isinstance(meta, StepMetadata)
    return meta


def report(side: SchedulerSide, *workers: LinkReport, recving: set[str] | None = None) -> None:
    """What vLLM's scheduler hands the connector after a step: the workers' reports aggregated, and finished_recving."""
    meta = functools.reduce(LinkReport.aggregate, workers) if workers else None
    side.worker_report(KVConnectorOutput(finished_recving=recving, kv_connector_worker_meta=meta))


def finish(side: SchedulerSide, req: Request, status: RequestStatus, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
    req.status = status
    return side.finished(req, block_ids)


# -- decode ------------------------------------------------------------------------------------------
def test_decode_grants_the_blocks_past_its_prefix_hits_as_an_async_load() -> None:
    side, _ = scheduler()
    source = PushSource(PREFILL, KV, 12345)
    cold, warm = request("cold", 100, source.to_params()), request("warm", 100, source.to_params())
    for req in (cold, warm):
        side.arrived(req)
    # 100 prompt tokens: all but the last come from prefill, asynchronously; "warm" holds its first block here.
    assert side.matched(cold, 0) == (99, True)
    assert side.matched(warm, BLOCK) == (99 - BLOCK, True)
    side.after_alloc(cold, blocks(10, 11, 12, 13), 99)
    side.after_alloc(warm, blocks(20, 21, 22, 23), 99 - BLOCK)
    meta = step(side)
    assert [(g.request_id, g.local_blocks, g.first_block, g.num_tokens, g.source) for g in meta.grants] == [
        ("cold", [10, 11, 12, 13], 0, 99, source),
        ("warm", [21, 22, 23], 1, 99 - BLOCK, source),
    ]
    assert all(isinstance(g, PushGrant) and g.arrived is not None for g in meta.grants)
    assert not meta.loads and not meta.watch  # no pull, no lease
    # One push per request: asked again (preempted after it landed), it recomputes.
    assert side.matched(cold, 0) == (0, False)
    assert step(side).grants == []


def test_decode_with_the_whole_prompt_cached_grants_nothing() -> None:
    side, _ = scheduler()
    req = request("hit", 33, PushSource(PREFILL, KV, 5).to_params())
    side.arrived(req)
    assert side.matched(req, 32) == (0, False)  # vLLM asserts an async load has tokens
    side.after_alloc(req, blocks(1, 2), 0)
    assert step(side).grants == []


def test_decode_revokes_an_aborted_push_unless_it_ended_first() -> None:
    side, _ = scheduler()
    reqs = {rid: request(rid, 70, PushSource(PREFILL, KV, n).to_params()) for n, rid in enumerate(["aborted", "raced", "landed"], 1)}
    for n, req in enumerate(reqs.values()):
        side.arrived(req)
        side.matched(req, 0)
        side.after_alloc(req, blocks(3 * n, 3 * n + 1, 3 * n + 2), 69)
    assert len(step(side).grants) == 3
    # Aborted while its push is under way: its blocks are kept (True) and its grant revoked next step.
    assert finish(side, reqs["aborted"], RequestStatus.FINISHED_ABORTED, [0, 1, 2]) == (True, None)
    # vLLM fails a request whose load failed before it hands the connector the output listing it received:
    # the revoke must not go out, or the request would be listed twice.
    assert finish(side, reqs["raced"], RequestStatus.FINISHED_ERROR, [3, 4, 5]) == (True, None)
    report(side, recving={"raced", "landed"})
    # Landed, then finished: nothing to revoke, blocks freed at once.
    assert finish(side, reqs["landed"], RequestStatus.FINISHED_LENGTH_CAPPED, [6, 7, 8]) == (False, None)
    assert step(side).revokes == ["aborted"]
    assert step(side).revokes == []  # once


def test_decode_request_aborted_before_it_was_granted_frees_at_once() -> None:
    side, _ = scheduler()
    req = request("queued", 70, PushSource(PREFILL, KV, 9).to_params())
    side.arrived(req)
    assert finish(side, req, RequestStatus.FINISHED_ABORTED, []) == (False, None)
    meta = step(side)
    assert meta.revokes == [] and meta.grants == []


@pytest.mark.parametrize(
    "params",
    [
        {"do_remote_prefill": True, "push_id": 7},  # no ranks
        {"do_remote_prefill": True, "push_id": "7", "remote_ranks": [], "remote_kv": {}},
        {"do_remote_prefill": True, "push_id": True, "remote_ranks": [{"engine": "a", "cluster_id": 1, "heads": [0, 2]}]},
        {"do_remote_prefill": True, "push_id": 0},
        {"do_remote_prefill": True, "push_id": 2**63},
        {"do_remote_prefill": False, **PushSource(PREFILL, KV, 7).to_params(), "do_remote_prefill": False},  # noqa: F601
        {**PushSource(PREFILL, KV, 7).to_params(), "remote_kv": {"model": "tiny"}},
    ],
)
def test_malformed_push_params_are_no_push(params: dict[str, Any]) -> None:
    assert PushSource.from_params(params) is None
    side, _ = scheduler()
    req = request("odd", 70, params)
    side.arrived(req)
    assert side.matched(req, 0) == (0, False)  # computed at decode, nothing waits


def test_pull_requests_go_on_as_in_pull_mode_on_a_push_instance() -> None:
    """The proxy sends an instance's first request in pull mode: a push-mode decode still pulls it."""
    from hixl.vllm._params import RemotePrefill

    side, _ = scheduler()
    remote = RemotePrefill(PREFILL, KV, 77, [4, 5, 6], 70, "p-1", 30.0, 300.0)
    req = request("pulled", 70, remote.to_params())
    side.arrived(req)
    assert side.matched(req, 0) == (None, False)  # waits for its link, as in pull mode
    report(side, LinkReport(frozenset(PREFILL)))
    assert side.matched(req, 0) == (69, False)
    side.after_alloc(req, blocks(1, 2, 3), 69)
    meta = step(side)
    assert [(spec.remote_blocks, spec.local_blocks) for spec in meta.loads] == [([4, 5, 6], [1, 2, 3])] and not meta.grants


# -- prefill -----------------------------------------------------------------------------------------
def prefill_side() -> tuple[SchedulerSide, Clock]:
    side, clock = scheduler(push_timeout=5.0)
    side.set_endpoints({0: PREFILL[0]})
    return side, clock


PUSH = {"do_remote_decode": True, "do_remote_prefill": False}


def test_prefill_waits_for_every_workers_grants_then_pushes_each_chunk() -> None:
    side, clock = prefill_side()
    req = request("chunked", 100, {**PUSH, "push_id": 7})
    assert side.matched(req, 0) == (None, False)
    # Two workers: one holds decode's grants, the other not yet.
    report(side, LinkReport(frozenset(), granted=frozenset({7})), LinkReport(frozenset(), granted=frozenset()))
    clock.now += 4.9
    assert side.matched(req, 0) == (None, False)
    waiting = step(side)
    assert waiting.idle and waiting.awaiting  # the step runs nothing, a request awaits grants: the workers wait for one (see _worker)
    report(side, LinkReport(frozenset(), granted=frozenset({7})), LinkReport(frozenset(), granted=frozenset({7, 8})))
    assert side.matched(req, 0) == (0, False)
    table = {"chunked": [40, 41, 42, 43]}
    first = step(side, {"chunked": 64}, table)
    assert not first.awaiting
    assert first.pushes == [PushStep("chunked", 7, [40, 41, 42, 43], 0, 64, False)]
    req.num_computed_tokens = 64  # (vLLM counts the step's tokens once it is scheduled)
    assert side.matched(req, 64) == (0, False)  # admitted: never waits again
    assert step(side, {"other": 3}, table).pushes == []  # a step that does not schedule it
    assert step(side, {"chunked": 36}, table).pushes == [PushStep("chunked", 7, [40, 41, 42, 43], 64, 100, True)]
    done, params = finish(side, req, RequestStatus.FINISHED_LENGTH_CAPPED, [40, 41, 42, 43])
    assert not done  # its writes ended inside its steps: freed at once
    assert params is not None and params["push_id"] == 7 and params["pushed"] is True
    assert PushSource.from_params({**params, "do_remote_prefill": True}) == PushSource(PREFILL, KV, 7)  # what the proxy learns
    assert not params["do_remote_prefill"]  # never mistaken for a push to take
    assert step(side).cancels == []


def test_prefill_runs_unpushed_after_push_timeout_and_cancels_the_push() -> None:
    side, clock = prefill_side()
    req = request("lonely", 70, {**PUSH, "push_id": 8})
    assert side.matched(req, 0) == (None, False)
    clock.now += 5.0
    assert side.matched(req, 0) == (0, False)
    assert step(side, {"lonely": 70}, {"lonely": [1, 2, 3]}).cancels == [8]  # decode ranks that granted hear now
    assert side.matched(req, 0) == (0, False)  # (asked again, e.g. no blocks free: no second wait)
    _, params = finish(side, req, RequestStatus.FINISHED_LENGTH_CAPPED, [1, 2, 3])
    assert params is not None and params["pushed"] is False
    meta = step(side)
    assert meta.cancels == [] and meta.pushes == []


@pytest.mark.parametrize("when", ["waiting", "mid-push"])
def test_prefill_request_aborted_before_its_last_step_cancels_its_push(when: str) -> None:
    side, _ = prefill_side()
    req = request("gone", 100, {**PUSH, "push_id": 9})
    assert side.matched(req, 0) == (None, False)
    if when == "mid-push":
        report(side, LinkReport(frozenset(), granted=frozenset({9})))
        assert side.matched(req, 0) == (0, False)
        assert step(side, {"gone": 64}, {"gone": [5, 6, 7, 8]}).pushes[0].last is False
    done, _ = finish(side, req, RequestStatus.FINISHED_ABORTED, [5, 6])
    assert not done
    assert step(side).cancels == [9]


def test_pull_mode_ignores_push_ids() -> None:
    """A push id sent to an instance in pull mode: prefill holds the blocks for a pull, waits for nothing."""
    side = SchedulerSide(KV, ConnectorConfig())
    side.set_endpoints({0: PREFILL[0]})
    req = request("pull", 70, {**PUSH, "push_id": 10})
    assert side.matched(req, 0) == (0, False)
    held, params = finish(side, req, RequestStatus.FINISHED_LENGTH_CAPPED, [1, 2, 3])
    assert held and params is not None and "remote_transfer_id" in params
