"""Who holds a cluster id. In the store: a live lease's claim, which a record written without a
lease, or over it under another lease, cannot take — the owner takes its record back, and a
restarted owner claims its id over a lease-less squatter — while an owner frozen past its lease
never takes an id back from the instance that claimed it since. Between instances: with a store,
an announcement the store disagrees with is refused (CLUSTER_ID_CONFLICT), whoever comes first."""

from __future__ import annotations

import json
import queue
import signal
import time
from typing import Any

import numpy as np
import pytest

import hixl
from hixl.datadist import (
    BlocksCacheKey,
    ClusterEvent,
    ClusterEventKind,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    TransferDone,
)
from hixl.discovery import MetadataStore
from hixl.testing.etcd import EtcdServer

from .helpers import (
    SMALL,
    TTL,
    cluster_key,
    decode_instance,
    eventually,
    fresh_id,
    next_event,
    prefill_process,
)

pytestmark = pytest.mark.timeout(120)

SQUATTER = "127.0.0.1:9"  # where a squatter's record sends its readers


def _squat(cluster_id: int) -> bytes:
    """A well-formed record of ``cluster_id`` that is not the owner's."""
    return json.dumps({"cluster_id": cluster_id, "role": "PROMPT", "address": SQUATTER, "incarnation": "squatter", "caches": []}).encode()


def _held(writer: Any, key: str) -> tuple[str, int] | None:
    """``(address, lease)`` of the record at ``key`` as etcd holds it, lease or not."""
    rows = writer.get(key, metadata=True)
    if not rows:
        return None
    value, meta = rows[0]
    return json.loads(value)["address"], int(meta.get("lease", 0))


def _lease_of(writer: Any, key: str) -> int:
    held = _held(writer, key)
    assert held is not None
    return held[1]


# -- the store: a live lease's claim ---------------------------------------------------------------
@pytest.mark.parametrize("squat", ["without a lease", "under another lease", "deleted"])
def test_a_live_owner_takes_its_record_back(etcd: EtcdServer, writer: Any, store: MetadataStore, squat: str) -> None:
    cluster_id = fresh_id()
    key = cluster_key(cluster_id)
    with prefill_process(etcd, cluster_id) as owner:
        lease = _lease_of(writer, key)
        if squat == "without a lease":
            writer.put(key, _squat(cluster_id))
            record = store.get(key)  # nobody's: a reader never sees it
            assert record is None or json.loads(record)["address"] == owner.ip_info
        elif squat == "under another lease":
            writer.put(key, _squat(cluster_id), lease=writer.lease(ttl=60))
        else:
            writer.delete(key)
        # Within a third of the lease (a refresh), plus the requests.
        assert eventually(lambda: _held(writer, key) == (owner.ip_info, lease), timeout=TTL)
        decode = decode_instance(etcd)
        try:
            assert decode.link_clusters([LLMClusterInfo(cluster_id)]) == [LLMStatusCode.SUCCESS]
            assert decode.linked_clusters() == {cluster_id: owner.ip_info}
        finally:
            decode.finalize()


def test_a_restarted_owner_claims_its_id_over_a_lease_less_record(etcd: EtcdServer, writer: Any, store: MetadataStore) -> None:
    """The audit's case: an etcd writer's record with no lease outlived the real owner, which then
    got CLUSTER_ID_CONFLICT on restart."""
    cluster_id = fresh_id()
    key = cluster_key(cluster_id)
    first = prefill_process(etcd, cluster_id)
    writer.put(key, _squat(cluster_id))
    first.kill()  # before it takes its record back, or after: either way its restart claims the id
    with prefill_process(etcd, cluster_id) as second:
        assert json.loads(store.get(key) or b"{}")["address"] == second.ip_info
    assert store.get(key) is None  # finalized: the record went with its lease


def test_a_lease_less_record_is_nobodys(etcd: EtcdServer, writer: Any, store: MetadataStore) -> None:
    """Never a live owner's: a new instance claims the id at once, and a reader links to nobody."""
    cluster_id = fresh_id()
    key = cluster_key(cluster_id)
    writer.put(key, _squat(cluster_id))
    assert store.get(key) is None
    decode = decode_instance(etcd)
    try:
        started = time.monotonic()
        assert decode.link_clusters([LLMClusterInfo(cluster_id)], timeout=5.0) == [LLMStatusCode.LINK_FAILED]
        assert time.monotonic() - started < 1.0  # told by the store at once, not a connect timeout
        with prefill_process(etcd, cluster_id) as owner:
            assert time.monotonic() - started < TTL  # no wait for a lease that does not exist
            assert _held(writer, key) == (owner.ip_info, _lease_of(writer, key))
            assert _lease_of(writer, key) != 0  # the owner's claim, under its lease
    finally:
        decode.finalize()


def test_an_owner_frozen_past_its_lease_leaves_its_id_to_the_new_claimant(etcd: EtcdServer, store: MetadataStore) -> None:
    cluster_id = fresh_id()
    key = cluster_key(cluster_id)
    with prefill_process(etcd, cluster_id) as first:
        first.stop(signal.SIGSTOP)
        assert eventually(lambda: store.get(key) is None)
        with prefill_process(etcd, cluster_id) as second:
            first.stop(signal.SIGCONT)
            time.sleep(TTL)  # several refreshes of the resumed one
            assert json.loads(store.get(key) or b"{}")["address"] == second.ip_info


def test_a_watch_sees_an_overwritten_record_go_and_come_back(etcd: EtcdServer, writer: Any) -> None:
    """Garbage written over a live record under another lease: the cluster is REMOVED (there is no
    usable record), then ADDED again, same incarnation, once its owner took the record back."""
    cluster_id = fresh_id()
    events: queue.Queue[ClusterEvent] = queue.Queue()
    decode = decode_instance(etcd)
    try:
        watch = decode.watch_clusters(events.put)
        with prefill_process(etcd, cluster_id) as owner:
            added = next_event(events, cluster_id)
            writer.put(cluster_key(cluster_id), b"[" * 100_000, lease=writer.lease(ttl=60))
            removed = next_event(events, cluster_id)
            assert removed.kind is ClusterEventKind.REMOVED and removed.incarnation == added.incarnation
            back = next_event(events, cluster_id, timeout=TTL + 2)
            assert back == ClusterEvent(ClusterEventKind.ADDED, cluster_id, owner.ip_info, added.incarnation)
        watch.cancel()
    finally:
        decode.finalize()


# -- between instances: the store arbitrates announcements ---------------------------------------
def test_with_a_store_a_claim_it_disagrees_with_is_refused(etcd: EtcdServer) -> None:
    """The audit's DataDist squat: whoever announced a cluster id first owned it — the real decoder
    got CLUSTER_ID_CONFLICT and the squatter's forged completions were taken. With a store, the
    prefill checks every announcement against it: the squatter (who cannot claim the id there)
    is refused before the decoder exists and after, and the decoder links and is heard."""
    prefill_id, decoder_id = fresh_id(), fresh_id()
    squatter = LLMDataDist(LLMRole.DECODER, decoder_id)
    squatter.init(LLMConfig())  # no store: it could not claim the id there
    try:
        with prefill_process(etcd, prefill_id) as prefill:
            key = BlocksCacheKey(prefill_id)
            prefill.register_blocks_cache("kv", SMALL, key, seed=5)
            assert squatter.link_clusters([prefill.cluster_info()], timeout=3.0) == [LLMStatusCode.CLUSTER_ID_CONFLICT]
            decoder = decode_instance(etcd, decoder_id)
            try:
                assert squatter.link_clusters([prefill.cluster_info()], timeout=3.0) == [LLMStatusCode.CLUSTER_ID_CONFLICT]
                assert squatter.linked_clusters() == {}
                assert decoder.link_clusters([LLMClusterInfo(prefill_id)]) == [LLMStatusCode.SUCCESS]
                storage = hixl.empty((SMALL.num_tensors, *SMALL.shape), np.float32)
                cache = decoder.cache_manager.register_blocks_cache(SMALL, list(storage))
                blocks = list(range(SMALL.shape[0]))
                decoder.cache_manager.pull_blocks(key, cache, blocks, blocks, req_id=7, timeout=10.0)
                np.testing.assert_array_equal(storage, prefill.read("kv"))
                assert prefill.completed_requests() == [TransferDone(decoder_id, 7, "pull")]
                # The decoder only links out: the store has its claim, but nothing to link to.
                assert prefill.datadist("link_clusters", [LLMClusterInfo(decoder_id)]) == [LLMStatusCode.LINK_FAILED]
            finally:
                decoder.finalize()
    finally:
        squatter.finalize()
