"""Discovery through a real etcd: engines and DataDist instances publish themselves under a lease,
clusters are linked by id alone, a watch sees them come, go and come back, and a dead one's
record vanishes with its lease — while without a store everything works peer to peer."""

from __future__ import annotations

import json
import queue
import signal
import socket
import time

import numpy as np
import pytest

import hixl
from hixl import Engine, ParamInvalid
from hixl.datadist import (
    BlocksCacheKey,
    ClusterEvent,
    ClusterEventKind,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
)
from hixl.discovery import MetadataStore, StoreUnavailable
from hixl.engine import ENGINES_PREFIX
from hixl.testing.etcd import EtcdServer

from .helpers import (
    SMALL,
    TTL,
    decode_instance,
    eventually,
    fresh_id,
    next_event,
    prefill_process,
)

pytestmark = pytest.mark.timeout(120)

def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the engine ------------------------------------------------------------------------------------
def test_an_engine_publishes_itself_while_it_lives(etcd: EtcdServer, store: MetadataStore) -> None:
    with Engine("127.0.0.1:0", {"metadata_server": etcd.url}) as engine:
        record = json.loads(store.get(ENGINES_PREFIX + engine.local_engine) or b"{}")
        assert record["address"] == engine.local_engine and record["incarnation"] == engine.incarnation
    assert store.get(ENGINES_PREFIX + engine.local_engine) is None  # finalize revokes the lease at once


def test_the_store_can_come_from_the_environment(etcd: EtcdServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HIXL_METADATA_SERVER", etcd.url)
    with Engine("127.0.0.1:0") as engine:
        assert engine.metadata_store is not None and engine.metadata_store.url == etcd.url


def test_without_a_store_engines_work_peer_to_peer() -> None:
    with Engine("127.0.0.1:0") as target, Engine("127.0.0.1") as initiator:
        assert target.metadata_store is None
        buf = hixl.empty(4096)
        target.register_mem(buf)
        initiator.connect(target.local_engine)
        assert initiator.remote_mems(target.local_engine)


def test_an_unreachable_store_is_a_clear_error_at_once() -> None:
    url = f"etcd://127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="metadata server"):
        Engine("127.0.0.1:0", {"metadata_server": url, "connect_timeout": 2.0})
    dd = LLMDataDist(LLMRole.DECODER, fresh_id())
    with pytest.raises(LLMException) as info:
        dd.init(LLMConfig(metadata_server=url, engine_options={"connect_timeout": 2.0}))
    assert "metadata server" in str(info.value)
    assert time.monotonic() - started < 5.0


@pytest.mark.parametrize("url", ["http://127.0.0.1:2379", "etcd://127.0.0.1", "etcd://:2379", 2379])
def test_a_malformed_store_url_is_refused(url: object) -> None:
    with pytest.raises(ParamInvalid):
        Engine("127.0.0.1", {"metadata_server": url})


# -- DataDist ------------------------------------------------------------------------------------
def test_a_cluster_is_linked_by_id_alone_and_pulled_from(etcd: EtcdServer) -> None:
    cluster_id = fresh_id()
    key = BlocksCacheKey(cluster_id, fresh_id())
    with prefill_process(etcd, cluster_id) as prefill:
        name = "kv"
        prefill.register_blocks_cache(name, SMALL, key, seed=7)
        decode = decode_instance(etcd)
        try:
            assert decode.link_clusters([LLMClusterInfo(cluster_id)]) == [LLMStatusCode.SUCCESS]
            assert decode.linked_clusters() == {cluster_id: prefill.ip_info}
            storage = hixl.empty((SMALL.num_tensors, *SMALL.shape), np.float32)
            cache = decode.cache_manager.register_blocks_cache(SMALL, list(storage))
            blocks = list(range(SMALL.shape[0]))
            decode.cache_manager.pull_blocks(key, cache, blocks, blocks, timeout=10.0)
            np.testing.assert_array_equal(storage, prefill.read(name))
        finally:
            decode.finalize()


def test_the_record_names_role_and_caches(etcd: EtcdServer, store: MetadataStore) -> None:
    cluster_id = fresh_id()
    with prefill_process(etcd, cluster_id) as prefill:
        prefill.register_blocks_cache("kv", SMALL, BlocksCacheKey(0, fresh_id()))
        record = json.loads(store.get(f"/hixl/clusters/{cluster_id}") or b"{}")
        assert record["address"] == prefill.ip_info and record["role"] == "PROMPT"
        assert [c["shape"] for c in record["caches"]] == [list(SMALL.shape)]


def test_a_second_live_instance_cannot_take_a_cluster_id(etcd: EtcdServer) -> None:
    cluster_id = fresh_id()
    with prefill_process(etcd, cluster_id):
        impostor = LLMDataDist(LLMRole.PROMPT, cluster_id)
        started = time.monotonic()
        with pytest.raises(LLMException) as info:
            impostor.init(LLMConfig(listen_ip_info="127.0.0.1:0", metadata_server=etcd.url, lease_ttl=TTL))
        assert info.value.status_code is LLMStatusCode.CLUSTER_ID_CONFLICT
        assert time.monotonic() - started < TTL + 4  # it waited out one lease, no longer


def test_a_killed_instance_vanishes_within_its_lease_and_comes_back_as_a_new_incarnation(etcd: EtcdServer) -> None:
    """SIGKILL: no goodbye. The watch reports it gone within the lease; a link to it then fails
    at once (the store says nobody holds the id); restarted, it is found under its new incarnation."""
    cluster_id = fresh_id()
    events: queue.Queue[ClusterEvent] = queue.Queue()
    decode = decode_instance(etcd)
    try:
        watch = decode.watch_clusters(events.put)
        first = prefill_process(etcd, cluster_id)
        added = next_event(events, cluster_id)
        assert added.kind is ClusterEventKind.ADDED and added.address == first.ip_info
        assert decode.link_clusters([LLMClusterInfo(cluster_id)]) == [LLMStatusCode.SUCCESS]

        killed_at = time.monotonic()
        first.kill()
        removed = next_event(events, cluster_id, timeout=TTL + 5)
        assert removed.kind is ClusterEventKind.REMOVED and removed.incarnation == added.incarnation
        assert time.monotonic() - killed_at < TTL + 3
        decode.unlink_clusters([LLMClusterInfo(cluster_id)], force=True)
        started = time.monotonic()
        assert decode.link_clusters([LLMClusterInfo(cluster_id)], timeout=5.0) == [LLMStatusCode.LINK_FAILED]
        assert time.monotonic() - started < 0.5  # not a connect timeout

        with prefill_process(etcd, cluster_id) as second:
            back = next_event(events, cluster_id)
            assert back.kind is ClusterEventKind.RESTARTED and back.address == second.ip_info
            assert back.incarnation != added.incarnation
            assert decode.link_clusters([LLMClusterInfo(cluster_id)]) == [LLMStatusCode.SUCCESS]
        assert next_event(events, cluster_id).kind is ClusterEventKind.REMOVED  # finalized: at once
        watch.cancel()
    finally:
        decode.finalize()


def test_a_frozen_instance_past_its_lease_publishes_again_when_it_resumes(etcd: EtcdServer, store: MetadataStore) -> None:
    cluster_id = fresh_id()
    key = f"/hixl/clusters/{cluster_id}"
    with prefill_process(etcd, cluster_id) as prefill:
        prefill.stop(signal.SIGSTOP)
        assert eventually(lambda: store.get(key) is None)
        prefill.stop(signal.SIGCONT)
        assert eventually(lambda: store.get(key) is not None)
        assert json.loads(store.get(key) or b"{}")["address"] == prefill.ip_info


def test_linking_by_id_needs_a_store() -> None:
    dd = LLMDataDist(LLMRole.DECODER, fresh_id())
    dd.init(LLMConfig())
    try:
        assert dd.link_clusters([LLMClusterInfo(fresh_id())]) == [LLMStatusCode.PARAM_INVALID]
        with pytest.raises(LLMException):
            dd.watch_clusters(lambda event: None)
    finally:
        dd.finalize()
