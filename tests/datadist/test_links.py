"""Links between DataDist instances: setup, retry, refusal, unlink, several peers, life cycle."""

from __future__ import annotations

import logging
import signal
import threading
import time

import numpy as np
import pytest

import hixl
from hixl.datadist import (
    BlocksCacheKey,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    TransferDone,
)
from hixl.testing import TargetProcess
from hixl.testing.datadist_peer import DataDistProcess

from .helpers import (
    REMOTE_ID,
    SMALL,
    allocate,
    client_config,
    free_port,
    fresh_id,
    listen_config,
    new_blocks_key,
    pull_all,
)

DESC = SMALL
ALL = list(range(DESC.shape[0]))
SUCCESS, ALREADY_LINK, LINK_FAILED = LLMStatusCode.SUCCESS, LLMStatusCode.ALREADY_LINK, LLMStatusCode.LINK_FAILED


def test_link_twice_is_already_link(remote, local, make_remote):
    assert local.link_clusters([remote.cluster_info()]) == [ALREADY_LINK]
    assert local.linked_clusters() == {REMOTE_ID: remote.ip_info}
    key = new_blocks_key()
    pull_all(local, key, remote, make_remote(DESC, key, seed=1))


def test_nobody_listening_is_link_failed(transport, new_local):
    dd = new_local(config=LLMConfig(transport=transport, link_retry_count=2))
    started = time.monotonic()
    port = free_port()
    assert dd.link_clusters([LLMClusterInfo(5, f"127.0.0.1:{port}")], timeout=2.0) == [LINK_FAILED]
    assert time.monotonic() - started < 2.5
    assert dd.linked_clusters() == {} and dd.engine.connected_engines() == []
    # The status alone cannot say why; link_error does, without a look at the log.
    reason = dd.link_error(5)
    assert reason is not None and f"could not connect to 127.0.0.1:{port} in 3 attempt(s)" in reason, reason
    assert "NotConnected" in reason and "refused" in reason, reason


def test_wrong_cluster_id_behind_the_address(remote, make_remote, new_local):
    dd = new_local()
    assert dd.link_clusters([LLMClusterInfo(REMOTE_ID + 50, remote.ip_info)]) == [LINK_FAILED]
    assert dd.link_error(REMOTE_ID + 50) == f"{remote.ip_info} is cluster {REMOTE_ID}"
    assert dd.linked_clusters() == {} and dd.engine.connected_engines() == []
    # The refused link was torn down, so the right id links at once.
    assert dd.link_clusters([remote.cluster_info()]) == [SUCCESS]
    assert dd.link_error(REMOTE_ID) is None
    key = new_blocks_key()
    pull_all(dd, key, remote, make_remote(DESC, key, seed=2))


def test_plain_engine_is_not_a_datadist_peer(transport, new_local):
    with TargetProcess([4096], {"transport": transport}) as target:
        dd = new_local()
        assert dd.link_clusters([LLMClusterInfo(7, target.engine)]) == [LINK_FAILED]
        assert dd.engine.connected_engines() == []


def test_one_status_per_cluster(transport, remote, new_local):
    dd = new_local(config=LLMConfig(transport=transport, link_timeout=1.0, link_retry_count=1))
    statuses = dd.link_clusters(
        [remote.cluster_info(), LLMClusterInfo(8, "not-an-address:1"), LLMClusterInfo(9, f"127.0.0.1:{free_port()}")]
    )
    assert statuses == [SUCCESS, LLMStatusCode.PARAM_INVALID, LINK_FAILED]
    assert dd.linked_clusters() == {REMOTE_ID: remote.ip_info}


def test_link_to_itself_is_param_invalid(transport, new_local):
    dd = new_local(config=listen_config(transport))
    assert dd.link_clusters([LLMClusterInfo(dd.cluster_id, dd.local_ip_info)]) == [LLMStatusCode.PARAM_INVALID]


def test_link_clusters_takes_cluster_infos(local):
    for bad in ([], ["127.0.0.1:1"], [(1, "127.0.0.1:1")]):
        with pytest.raises(TypeError):
            local.link_clusters(bad)
        with pytest.raises(TypeError):
            local.unlink_clusters(bad)


def test_unlink(remote, make_remote, new_local):
    dd = new_local()
    key = new_blocks_key()
    name = make_remote(DESC, key, seed=3)
    assert dd.link_clusters([remote.cluster_info()]) == [SUCCESS]
    pull_all(dd, key, remote, name)
    assert dd.unlink_clusters([remote.cluster_info()]) == [SUCCESS]
    assert dd.linked_clusters() == {} and dd.engine.connected_engines() == []
    with pytest.raises(LLMException) as info:
        pull_all(dd, key, remote, name)
    assert info.value.status_code is LLMStatusCode.NOT_YET_LINK
    assert dd.unlink_clusters([remote.cluster_info()]) == [LLMStatusCode.NOT_YET_LINK]
    assert dd.link_clusters([remote.cluster_info()]) == [SUCCESS]
    pull_all(dd, key, remote, name)


def test_unlink_fails_transfers_in_flight(transport, remote, make_remote, new_local):
    """A pull whose data is still owed when its link is dropped fails with LINK_FAILED.

    The source is frozen (SIGSTOP) so that the READs are sent but never
    answered: over TCP the target's process produces the data. (Over CMA the
    initiator copies by itself, so a pull can't be held in flight this way.)
    """
    if transport != "tcp":
        pytest.skip("needs a transport whose bytes are produced by the source process (TCP)")
    key = new_blocks_key()
    name = make_remote(DESC, key, seed=10)
    dd = new_local()
    assert dd.link_clusters([remote.cluster_info()]) == [SUCCESS]
    tensors, storage = allocate(DESC)
    cache = dd.cache_manager.register_blocks_cache(DESC, tensors)
    remote.stop(signal.SIGSTOP)
    try:
        task = dd.cache_manager.pull_blocks_async(key, cache, ALL, ALL)
        time.sleep(0.05)
        assert not task.done()
        assert dd.unlink_clusters([remote.cluster_info()]) == [SUCCESS]
        with pytest.raises(LLMException) as info:
            task.synchronize(timeout=5)
        assert info.value.status_code is LINK_FAILED
        assert task.status is LINK_FAILED
    finally:
        remote.stop(signal.SIGCONT)
    assert dd.link_clusters([remote.cluster_info()]) == [SUCCESS]
    dd.cache_manager.pull_blocks(key, cache, ALL, ALL)
    np.testing.assert_array_equal(storage, remote.read(name))


def test_decode_linked_to_two_prefill_clusters(transport, remote, make_remote, new_local):
    """One decode instance pulls from two prefill processes at once, into one cache."""
    with DataDistProcess(LLMRole.PROMPT, 12, listen_config(transport)) as second:
        model = fresh_id()  # the same model id on both clusters: the cluster id tells them apart
        key_1, key_2 = BlocksCacheKey(REMOTE_ID, model), BlocksCacheKey(12, model)
        name_1 = make_remote(DESC, key_1, seed=4)
        name_2 = make_remote(DESC, key_2, seed=5, on=second)
        dd = new_local()
        assert dd.link_clusters([remote.cluster_info(), second.cluster_info()]) == [SUCCESS, SUCCESS]
        assert dd.engine.transport_of(second.ip_info) == transport
        tensors, storage = allocate(DESC)
        cache = dd.cache_manager.register_blocks_cache(DESC, tensors)
        remote.completed_requests(), second.completed_requests()
        tasks = [
            dd.cache_manager.pull_blocks_async(key_1, cache, [0, 1, 2, 3], [0, 1, 2, 3], req_id=71),
            dd.cache_manager.pull_blocks_async(key_2, cache, [0, 1, 2, 3], [4, 5, 6, 7], req_id=72),
        ]
        for task in tasks:
            task.synchronize()
        np.testing.assert_array_equal(storage[:, :4], remote.read(name_1, (slice(None), slice(0, 4))))
        np.testing.assert_array_equal(storage[:, 4:], second.read(name_2, (slice(None), slice(0, 4))))
        assert not np.array_equal(storage[:, :4], storage[:, 4:])
        # Each prefill cluster hears about its own request only.
        assert remote.completed_requests() == [TransferDone(dd.cluster_id, 71, "pull")]
        assert second.completed_requests() == [TransferDone(dd.cluster_id, 72, "pull")]


class _FirstFailedAttempt(logging.Handler):
    """Sets ``event`` once DataDist logs a failed link attempt."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.event = threading.Event()
        self.attempts = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "attempt" in record.getMessage():
            self.attempts += 1
            self.event.set()


def test_link_retries_while_the_prefill_side_is_starting(transport, new_local):
    """Linking starts before the peer listens; the link retries until it comes up.

    The peer is started only once DataDist has logged a failed attempt, so the
    retry path is really taken. (The port is reserved by binding and releasing
    it; another process grabbing it in between would fail the test, not pass it.)
    """
    port = free_port()
    dd = new_local(config=LLMConfig(transport=transport, link_timeout=30.0, link_retry_count=30))
    watcher = _FirstFailedAttempt()
    logger = logging.getLogger("hixl.datadist")
    old_level = logger.level
    logger.addHandler(watcher)
    logger.setLevel(logging.INFO)
    result: list = []
    info = LLMClusterInfo(21, f"127.0.0.1:{port}")
    linker = threading.Thread(target=lambda: result.append(dd.link_clusters([info])), daemon=True)
    try:
        linker.start()
        assert watcher.event.wait(10), "no failed link attempt was logged"
        with DataDistProcess(LLMRole.PROMPT, 21, LLMConfig(listen_ip_info=f"127.0.0.1:{port}", transport=transport)) as late:
            linker.join(40)
            assert result == [[SUCCESS]]
            assert watcher.attempts >= 1
            key = BlocksCacheKey(21, 1)
            late.register_blocks_cache("late", DESC, key, seed=6)
            pull_all(dd, key, late, "late")
    finally:
        logger.removeHandler(watcher)
        logger.setLevel(old_level)


def test_dead_peer_is_link_failed(transport, remote, local, make_remote, new_local):
    with DataDistProcess(LLMRole.PROMPT, 31, listen_config(transport)) as doomed:
        doomed.register_blocks_cache("c", DESC, BlocksCacheKey(31), seed=7)
        dd = new_local()
        assert dd.link_clusters([doomed.cluster_info(), remote.cluster_info()]) == [SUCCESS, SUCCESS]
        pull_all(dd, BlocksCacheKey(31), doomed, "c")
        doomed.kill()
        with pytest.raises(LLMException) as info:
            pull_all(dd, BlocksCacheKey(31), doomed, "c")
        assert info.value.status_code is LINK_FAILED
        # A lost link is still a ConnectionError, with the engine's error kept as the cause.
        assert isinstance(info.value, ConnectionError) and info.value.status is hixl.Status.NOT_CONNECTED
        assert isinstance(info.value.__cause__, hixl.HixlError)
    # The other link is unaffected.
    key = new_blocks_key()
    pull_all(dd, key, remote, make_remote(DESC, key, seed=8))


# -- life cycle --------------------------------------------------------------------------------
def test_context_manager_and_idempotent_finalize(transport, remote, local, make_remote):
    key = new_blocks_key()
    name = make_remote(DESC, key, seed=9)
    with LLMDataDist(LLMRole.DECODER, 41) as dd:
        dd.init(client_config(transport))
        assert dd.link_clusters([remote.cluster_info()]) == [SUCCESS]
        pull_all(dd, key, remote, name)
        engine = dd.engine
    # Leaving the block finalized the instance and its engine.
    assert "uninitialised" in repr(dd)
    for attribute in ("engine", "cache_manager", "local_ip_info"):
        with pytest.raises(LLMException) as info:
            getattr(dd, attribute)
        assert info.value.status_code is LLMStatusCode.NOT_INITIALIZED
    assert engine.connected_engines() == [] and engine.local_mems() == []
    dd.finalize()  # again: a no-op
    dd.finalize()
    # The peer lost a client, nothing else: other links to it still work.
    pull_all(local, key, remote, name)
    # And a finalized instance can be initialised afresh.
    dd.init(client_config(transport))
    try:
        assert dd.linked_clusters() == {}
        assert dd.link_clusters([remote.cluster_info()]) == [SUCCESS]
        pull_all(dd, key, remote, name)
    finally:
        dd.finalize()
