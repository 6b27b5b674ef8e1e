"""Leases on prefilled blocks (:mod:`hixl.vllm._leases`): the message, prefill's table, decode's keeper.

The table runs on a fake clock (its rules are arithmetic); the keeper runs
against a real prefill-side DataDist on 127.0.0.1 whose engine hands lease
notifications to a real table, as the connector's workers do.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

# Not just "vllm": where vLLM is missing, this folder itself would import under that name.
pytest.importorskip("vllm.distributed.kv_transfer")

from hixl import AccessDenied, HixlError, ParamInvalid  # noqa: E402
from hixl._types import NotifyDesc  # noqa: E402
from hixl.datadist import LLMConfig, LLMDataDist, LLMRole  # noqa: E402
from hixl.vllm._affinity import unpinned  # noqa: E402
from hixl.vllm._leases import LEASE_NOTIFY, Ending, LeaseKeeper, LeaseMessage, LeaseOp, LeaseTable, new_transfer_id  # noqa: E402
from hixl.vllm._params import CPU_LAYOUT, Endpoint, KvSpec, LinkReport, RemotePrefill, WatchedLease  # noqa: E402

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def notify(op: str, transfer_id: int) -> NotifyDesc:
    return NotifyDesc(LEASE_NOTIFY, LeaseMessage(LeaseOp(op), transfer_id).encode())


# -- the message --------------------------------------------------------------------------------------
def test_message_round_trips_and_ids_are_random() -> None:
    for op in LeaseOp:
        message = LeaseMessage(op, new_transfer_id())
        assert LeaseMessage.decode(message.encode()) == message
    ids = {new_transfer_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(1 <= i < 2**63 for i in ids)


@pytest.mark.parametrize(
    "msg",
    [
        "", "{", "[]", "null", '"extend"', '{"op": "extend"}', '{"transfer_id": 5}',
        '{"op": "extend", "transfer_id": 5, "more": 1}', '{"op": "grab", "transfer_id": 5}',
        '{"op": "extend", "transfer_id": "5"}', '{"op": "extend", "transfer_id": 5.0}',
        '{"op": "extend", "transfer_id": true}', '{"op": "extend", "transfer_id": 0}',
        '{"op": "extend", "transfer_id": -3}', f'{{"op": "extend", "transfer_id": {2**63}}}',
        '{"op": ["extend"], "transfer_id": 5}', "[" * 5000 + "]" * 5000,
    ],
)
def test_malformed_messages_are_refused(msg: str) -> None:
    table = LeaseTable(5.0, 50.0, Clock())
    table.grant({5: "r"})
    with pytest.raises(ParamInvalid):
        table.on_notify(NotifyDesc(LEASE_NOTIFY, msg))
    assert len(table) == 1  # nothing changed


# -- prefill's table ----------------------------------------------------------------------------------
def test_a_lease_runs_out_unless_extended_and_never_past_the_cap() -> None:
    clock = Clock()
    table = LeaseTable(10.0, 25.0, clock)
    table.grant({1: "a", 2: "b"})
    clock.now += 6
    table.on_notify(notify("extend", 1))  # a: expires at +16
    clock.now += 5  # +11: b ran out at +10
    assert table.due() == {"b": Ending.EXPIRED}
    clock.now += 4  # +15
    assert table.due().keys() == set()
    table.on_notify(notify("extend", 1))  # would be +25: the cap
    clock.now += 9.9  # +24.9
    table.on_notify(notify("extend", 1))  # still capped at +25
    assert table.due().keys() == set()
    clock.now += 0.1
    assert table.due() == {"a": Ending.CAPPED} and len(table) == 0
    with pytest.raises(AccessDenied):  # gone: an extension does not bring it back
        table.on_notify(notify("extend", 1))


def test_pulled_and_released_end_a_lease_at_once_and_unknown_ids_change_nothing() -> None:
    clock = Clock()
    table = LeaseTable(10.0, 100.0, clock)
    table.grant({1: "a", 2: "b", 3: "c"})
    table.pulled([1])
    table.on_notify(notify("release", 2))
    with pytest.raises(AccessDenied):
        table.on_notify(notify("extend", 99))  # never granted
    table.on_notify(notify("release", 98))  # remembered as early, harms nobody
    assert table.due() == {"a": Ending.PULLED, "b": Ending.RELEASED}
    assert len(table) == 1


def test_ends_heard_before_the_grant_apply_to_it_and_are_bounded() -> None:
    clock = Clock()
    table = LeaseTable(10.0, 100.0, clock)
    table.pulled([7])
    table.on_notify(notify("release", 8))
    table.grant({7: "a", 8: "b", 9: "c"})
    assert table.due() == {"a": Ending.PULLED, "b": Ending.RELEASED} and len(table) == 1
    for i in range(10_000):  # a peer making up ids: memory stays bounded
        table.on_notify(notify("release", 1000 + i))
    assert len(table._early) <= 4096
    clock.now += 61  # and old ones go
    table.on_notify(notify("release", 5))
    assert len(table._early) == 1


def test_lease_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        LeaseTable(10.0, 5.0)
    with pytest.raises(ValueError):
        LeaseTable(0.0, 5.0)


def test_link_reports_aggregate_to_what_every_worker_has() -> None:
    a, b, c = (Endpoint(f"127.0.0.1:{i}", i, (0, 1)) for i in (1, 2, 3))
    both = LinkReport(frozenset({a, b}), frozenset()).aggregate(LinkReport(frozenset({b, c}), frozenset({a})))
    assert both == LinkReport(frozenset({b}), frozenset({a}))


def test_decode_scheduler_waits_until_every_decode_worker_links_every_prefill_rank_holding_the_blocks() -> None:
    """Prefill TP 4 with 2 KV heads: ranks 0 and 2 hold the blocks (1 and 3 hold unread replicas)."""
    from vllm import SamplingParams
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from hixl.vllm import ConnectorConfig
    from hixl.vllm._scheduler import SchedulerSide

    kv = KvSpec("tiny", "float32", 2, 2, 4, 32, CPU_LAYOUT, 4)
    ranks = tuple(Endpoint(f"127.0.0.1:{10 + r}", 10 + r, (r // 2, r // 2 + 1)) for r in range(4))
    remote = RemotePrefill(ranks, kv, new_transfer_id(), [1, 3], 40, "p-1", 30.0, 300.0)
    request = Request("d-1", list(range(40)), SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": remote.to_params()}), None)
    scheduler = SchedulerSide(replace(kv, tp_size=2), ConnectorConfig())
    scheduler.arrived(request)

    def reported(*workers: LinkReport) -> int | None:
        scheduler.worker_report(KVConnectorOutput(kv_connector_worker_meta=functools.reduce(LinkReport.aggregate, workers)))
        return scheduler.num_new_matched_tokens(request, 0)

    r0, r1, r2, r3 = ranks
    assert reported(LinkReport(frozenset())) is None
    assert reported(LinkReport(frozenset({r0, r2})), LinkReport(frozenset({r0}))) is None  # one decode worker lacks r2
    assert reported(LinkReport(frozenset({r0, r2})), LinkReport(frozenset({r0, r2, r3}))) == 39  # r1, r3: not needed
    assert reported(LinkReport(frozenset({r0})), LinkReport(frozenset(), frozenset({r2}))) == 39  # r2 down: wait no more


# -- decode's keeper against a real prefill ------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prefill:
    """A prefill-side DataDist listening on 127.0.0.1 whose engine feeds lease messages to a table."""

    def __init__(self, cluster_id: int, port: int, lease_s: float) -> None:
        self.table = LeaseTable(lease_s, 100 * lease_s)
        self.datadist = LLMDataDist(LLMRole.PROMPT, cluster_id)
        self.datadist.init(LLMConfig(listen_ip_info=f"127.0.0.1:{port}"))
        self.datadist.engine.handle_notifies(LEASE_NOTIFY, self.table.on_notify)
        self.endpoint = Endpoint(self.datadist.local_ip_info, cluster_id, (0, 1))


@pytest.fixture
def decode() -> Iterator[tuple[LLMDataDist, LeaseKeeper]]:
    datadist = LLMDataDist(LLMRole.DECODER, 4242)
    datadist.init(LLMConfig(local_ip="127.0.0.1"))
    keeper = LeaseKeeper(datadist)
    try:
        yield datadist, keeper
    finally:
        keeper.close()
        datadist.finalize()


KV = KvSpec("tiny", "float32", 2, 1, 4, 32, CPU_LAYOUT, 1)  # one KV head, one prefill rank


def lease(request_id: str, endpoint: Endpoint, transfer_id: int, lease_s: float, arrived: float | None = None) -> WatchedLease:
    remote = RemotePrefill((endpoint,), KV, transfer_id, [0], 32, request_id, lease_s, 100 * lease_s)
    return WatchedLease(request_id, remote, time.monotonic() if arrived is None else arrived)


def wait_until(check, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_keeper_links_in_the_background_extends_and_releases(decode: tuple[LLMDataDist, LeaseKeeper]) -> None:
    _, keeper = decode
    prefill = Prefill(77, 0, lease_s=0.8)
    try:
        prefill.table.grant({11: "kept", 12: "dropped"})
        keeper.watch([lease("r-kept", prefill.endpoint, 11, 0.8), lease("r-dropped", prefill.endpoint, 12, 0.8)])
        wait_until(lambda: keeper.ready() == {prefill.endpoint})
        assert keeper.linked(prefill.endpoint)
        time.sleep(2.0)  # 2.5 leases: alive only because the keeper extends them
        assert prefill.table.due().keys() == set() and len(prefill.table) == 2
        assert keeper.usable("r-kept")
        released_at = time.monotonic()
        keeper.drop(["r-dropped"], release=True)
        wait_until(lambda: len(prefill.table) == 1)
        assert time.monotonic() - released_at < 0.5
        assert prefill.table.due().keys() == {"dropped"}
        assert not keeper.usable("r-dropped")
        keeper.drop(["r-kept"], release=False)  # pulled: stop extending, and the lease runs out
        wait_until(lambda: prefill.table.due().keys() == {"kept"}, timeout=3.0)
    finally:
        prefill.datadist.finalize()


def test_a_release_that_fails_is_sent_again(decode: tuple[LLMDataDist, LeaseKeeper]) -> None:
    """The first release is lost (the prefill's handler refuses it, as a link that broke under it
    would lose it); the keeper links again and sends it again, long before the lease runs out."""
    _, keeper = decode
    prefill = Prefill(81, 0, lease_s=5.0)
    lost: list[float] = []

    def losing_the_first_release(notify: NotifyDesc) -> None:
        if LeaseMessage.decode(notify.msg).op is LeaseOp.RELEASE and not lost:
            lost.append(time.monotonic())
            raise HixlError("injected: this release is lost")
        prefill.table.on_notify(notify)

    prefill.datadist.engine.handle_notifies(LEASE_NOTIFY, losing_the_first_release)
    try:
        prefill.table.grant({41: "dropped"})
        keeper.watch([lease("r-dropped", prefill.endpoint, 41, 5.0)])
        wait_until(lambda: keeper.ready() == {prefill.endpoint})
        keeper.drop(["r-dropped"], release=True)
        wait_until(lambda: len(prefill.table) == 0, timeout=4.0)  # (its lease: 5 s)
        assert len(lost) == 1 and prefill.table.due() == {"dropped": Ending.RELEASED}
        wait_until(lambda: "leases=0" in repr(keeper))
    finally:
        prefill.datadist.finalize()


def test_a_release_nobody_can_take_is_given_up_when_the_lease_would_have_run_out(
    decode: tuple[LLMDataDist, LeaseKeeper],
) -> None:
    """Nobody listens at the prefill: the release is tried for as long as it could matter, then
    forgotten, and so is the link to that prefill (nothing wants it any more)."""
    _, keeper = decode
    endpoint = Endpoint(f"127.0.0.1:{free_port()}", 82, (0, 1))
    keeper.watch([lease("r", endpoint, 51, 1.0, arrived=time.monotonic() - 0.5)])
    keeper.drop(["r"], release=True)
    assert "leases=1" in repr(keeper)  # (still to be released: half a lease left)
    wait_until(lambda: repr(keeper) == "<LeaseKeeper leases=0 links={}>", timeout=3.0)


def test_a_lease_is_usable_only_while_prefill_surely_holds_it(decode: tuple[LLMDataDist, LeaseKeeper]) -> None:
    _, keeper = decode
    prefill = Prefill(78, 0, lease_s=1.0)
    try:
        # Arrived 0.4 s ago and never granted at prefill: extensions are refused, so only the
        # arrival vouches for it, for half a lease.
        keeper.watch([lease("r", prefill.endpoint, 21, 1.0, arrived=time.monotonic() - 0.4)])
        assert keeper.usable("r")
        wait_until(lambda: not keeper.usable("r"), timeout=2.0)
        assert not keeper.usable("never-watched")
    finally:
        prefill.datadist.finalize()


def test_keeper_retries_a_link_until_the_prefill_is_up(decode: tuple[LLMDataDist, LeaseKeeper]) -> None:
    _, keeper = decode
    port = free_port()
    endpoint = Endpoint(f"127.0.0.1:{port}", 79, (0, 1))
    keeper.watch([lease("r", endpoint, 31, 30.0)])
    wait_until(lambda: keeper.down() == {endpoint}, timeout=5.0)  # a few attempts were refused: nobody listens yet
    assert keeper.ready() == frozenset()
    started: list[Prefill] = []
    threading.Thread(target=lambda: started.append(Prefill(79, port, lease_s=30.0))).start()
    try:
        wait_until(lambda: keeper.ready() == {endpoint}, timeout=10.0)
        assert keeper.down() == frozenset()
        wait_until(lambda: bool(started))
        started[0].table.grant({31: "r"})
        before = time.monotonic()
        wait_until(lambda: started[0].table._held[31].extended is not None, timeout=10.0)  # the first extension lands
        assert time.monotonic() - before < 9.0
    finally:
        wait_until(lambda: bool(started))
        started[0].datadist.finalize()


def test_a_hostile_peer_cannot_touch_leases_it_was_not_given() -> None:
    prefill = Prefill(80, 0, lease_s=5.0)
    peer = LLMDataDist(LLMRole.DECODER, 4343)
    peer.init(LLMConfig(local_ip="127.0.0.1"))
    try:
        held = new_transfer_id()
        prefill.table.grant({held: "victim"})
        peer.engine.connect(prefill.endpoint.ip_info, timeout=5)
        send = lambda msg: peer.engine.send_notify(prefill.endpoint.ip_info, NotifyDesc(LEASE_NOTIFY, msg), 5)  # noqa: E731
        for msg in ['{"op": "release"}', "x" * 900, json.dumps({"op": "extend", "transfer_id": held + 1})]:
            with pytest.raises((ParamInvalid, AccessDenied)):
                send(msg)
        send(json.dumps({"op": "release", "transfer_id": held ^ 1}))  # accepted (perhaps early), names no held lease
        assert len(prefill.table) == 1 and prefill.table.due().keys() == set()
    finally:
        peer.finalize()
        prefill.datadist.finalize()


def test_a_release_wakes_a_prefill_pacing_its_idle_steps() -> None:
    table = LeaseTable(10.0, 100.0)
    started = time.monotonic()
    table.wait_for_end(0.2)  # nothing held: no pacing at all
    assert time.monotonic() - started < 0.1
    table.grant({1: "a"})
    threading.Timer(0.1, table.on_notify, [notify("release", 1)]).start()
    started = time.monotonic()
    table.wait_for_end(5.0)
    assert 0.05 < time.monotonic() - started < 2.0
    assert table.due().keys() == {"a"}


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2, reason="needs 2 CPUs and affinity")
def test_threads_started_unpinned_may_use_every_cpu_and_the_caller_stays_pinned() -> None:
    seen: list[set[int]] = []
    everything = os.sched_getaffinity(0)

    def pinned_caller() -> None:
        os.sched_setaffinity(0, {min(everything)})  # as vLLM binds its main thread
        with unpinned():
            thread = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
            thread.start()
            thread.join()
        seen.append(os.sched_getaffinity(0))

    caller = threading.Thread(target=pinned_caller)
    caller.start()
    caller.join()
    assert seen == [everything, {min(everything)}]
