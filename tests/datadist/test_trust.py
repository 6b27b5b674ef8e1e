"""DataDist can't be fooled: completions only from the link of their cluster, one live address per
cluster id, a restarted peer linked anew, and the newest catalog published under concurrent changes."""

from __future__ import annotations

import functools
import json
import logging
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

import hixl
from hixl.datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    TransferDone,
)
from hixl.datadist._catalog import CATALOG_KEY, Catalog
from hixl.datadist._state import DONE_NOTIFY, HELLO_NOTIFY
from hixl.testing.datadist_peer import DataDistProcess

from .helpers import (
    LOCAL_ID,
    SMALL,
    allocate,
    free_port,
    fresh_id,
    listen_config,
    new_blocks_key,
    pull_all,
)

SUCCESS = LLMStatusCode.SUCCESS


def _forge(transport: str, target: DataDistProcess, cluster_id: int, req_id: int, *, announce: bool) -> None:
    """From a plain engine, tell ``target`` that ``cluster_id`` finished ``req_id`` (announcing itself first)."""
    with hixl.Engine("127.0.0.1", {"transport": transport}) as engine:
        engine.connect(target.ip_info)
        if announce:
            engine.send_notify(target.ip_info, hixl.NotifyDesc(HELLO_NOTIFY, json.dumps({"cluster_id": cluster_id})))
        done = {"cluster_id": cluster_id, "req_id": req_id, "op": "pull"}
        engine.send_notify(target.ip_info, hixl.NotifyDesc(DONE_NOTIFY, json.dumps(done)))


# -- completions are bound to their link -------------------------------------------------------
def test_only_the_linked_connection_completes_for_its_cluster(transport, remote, local, make_remote, new_local):
    """Forged completions (any engine, any claim) never reach completed_requests(); the real one does."""
    key = new_blocks_key()
    name = make_remote(SMALL, key, seed=1)
    remote.completed_requests()
    forged = [fresh_id() for _ in range(4)]
    _forge(transport, remote, LOCAL_ID, forged[0], announce=False)  # claims the linked cluster
    _forge(transport, remote, LOCAL_ID, forged[1], announce=True)  # ... and says it speaks for it
    _forge(transport, remote, fresh_id(), forged[2], announce=False)  # claims a cluster never linked
    # A whole DataDist instance claiming the linked cluster's id: it may link and read (reads
    # are one-sided), but its completion does not count as the real decode's.
    impostor = new_local(LOCAL_ID)
    assert impostor.link_clusters([remote.cluster_info()]) == [SUCCESS]
    pull_all(impostor, key, remote, name, req_id=forged[3])
    real = fresh_id()
    pull_all(local, key, remote, name, req_id=real)
    assert remote.completed_requests() == [TransferDone(LOCAL_ID, real, "pull")]


def test_a_relinked_decode_completes_from_its_new_connection(transport, remote, make_remote, new_local):
    """Unlinking closes the bound connection; the same cluster linking again (at once) is bound to the new one."""
    key = new_blocks_key()
    name = make_remote(SMALL, key, seed=2)
    dd = new_local()
    info = remote.cluster_info()
    for _ in range(2):
        assert dd.link_clusters([info]) == [SUCCESS]
        req = fresh_id()
        pull_all(dd, key, remote, name, req_id=req)
        assert remote.completed_requests() == [TransferDone(dd.cluster_id, req, "pull")]
        assert dd.unlink_clusters([info]) == [SUCCESS]  # linked again at once, while the target may still see it open


# -- one live address per cluster id -----------------------------------------------------------
def test_a_cluster_id_at_a_second_address_is_refused(transport, new_local, caplog):
    cluster = fresh_id()
    key = BlocksCacheKey(cluster, 1)
    with DataDistProcess(LLMRole.PROMPT, cluster, listen_config(transport)) as first, DataDistProcess(
        LLMRole.PROMPT, cluster, listen_config(transport)
    ) as second:
        first.register_blocks_cache("kv", SMALL, key, seed=3)
        second.register_blocks_cache("kv", SMALL, key, seed=4)
        dd = new_local()
        assert dd.link_clusters([first.cluster_info()]) == [SUCCESS]
        with caplog.at_level(logging.WARNING, logger="hixl.datadist"):
            assert dd.link_clusters([second.cluster_info()]) == [LLMStatusCode.CLUSTER_ID_CONFLICT]
        assert first.ip_info in caplog.text and second.ip_info in caplog.text
        assert dd.linked_clusters() == {cluster: first.ip_info}
        assert dd.link_clusters([first.cluster_info()]) == [LLMStatusCode.ALREADY_LINK]
        pull_all(dd, key, first, "kv")
        # Once the first is gone, the id may move: the link (and its catalog) go to the second.
        first.kill()
        deadline = time.monotonic() + 15
        while (status := dd.link_clusters([second.cluster_info()])) != [SUCCESS]:
            assert status == [LLMStatusCode.CLUSTER_ID_CONFLICT] and time.monotonic() < deadline, status
            time.sleep(0.05)
        assert dd.linked_clusters() == {cluster: second.ip_info}
        pull_all(dd, key, second, "kv")


def test_a_peer_restarted_at_the_same_address_is_linked_anew(transport, new_local):
    """A new incarnation at the old address: relinking replaces the dead link, and pulls get its data."""
    cluster = fresh_id()
    key = BlocksCacheKey(cluster, 1)
    config = LLMConfig(listen_ip_info=f"127.0.0.1:{free_port()}", transport=transport)
    dd = new_local()
    with DataDistProcess(LLMRole.PROMPT, cluster, config) as before:
        before.register_blocks_cache("kv", SMALL, key, seed=5)
        assert dd.link_clusters([before.cluster_info()]) == [SUCCESS]
        pull_all(dd, key, before, "kv")
        before.kill()
    with DataDistProcess(LLMRole.PROMPT, cluster, config) as after:
        after.register_blocks_cache("kv", SMALL, key, seed=6)
        assert dd.link_clusters([after.cluster_info()]) == [SUCCESS]
        assert dd.engine.peer_incarnation(after.ip_info) != ""
        pull_all(dd, key, after, "kv")


# -- one owner for the catalog ------------------------------------------------------------------
def _all_at_once(jobs: list[Callable[[], object]]) -> None:
    """Run ``jobs`` in threads released together, and wait for them all."""
    barrier = threading.Barrier(len(jobs))

    def run(job: Callable[[], object]) -> None:
        barrier.wait(10)
        job()

    workers = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(20)


def _assert_newest_published(reader: hixl.Engine, owner: LLMDataDist, word: np.ndarray) -> None:
    """What ``owner`` publishes names exactly its caches, and its generation word matches that catalog."""
    catalog = Catalog.decode(reader.get_remote_metadata(owner.local_ip_info, CATALOG_KEY))
    reader.transfer_sync(owner.local_ip_info, hixl.Op.READ, [(int(word.ctypes.data), catalog.generation_addr, 8)])
    assert int(word[0]) == catalog.generation
    assert sorted(c.cache_id for c in catalog.caches) == sorted(c.cache_id for c in owner.cache_manager.caches())


def test_concurrent_registrations_leave_the_newest_catalog_published(transport):
    """Threads register and unregister at once; what is published at the end names exactly what is registered.

    A tiny switch interval makes threads interleave between taking the snapshot
    of the caches and publishing it, where an unlocked publish loses the race;
    caches pile up over the rounds, so encoding the catalog (the window) grows.
    """
    cluster = fresh_id()
    small = CacheDesc(2, (2, 8), DataType.DT_FLOAT)
    threads_n, rounds = 16, 12
    owner = LLMDataDist(LLMRole.PROMPT, cluster)
    owner.init(listen_config(transport))
    reader = hixl.Engine("127.0.0.1", {"transport": transport})
    word = hixl.empty(1, np.uint64)
    reader.register_mem(word)
    reader.connect(owner.local_ip_info)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        manager = owner.cache_manager
        for _ in range(rounds):
            tensors = [allocate(small)[0] for _ in range(threads_n)]
            keys = [BlocksCacheKey(cluster, fresh_id()) for _ in range(threads_n)]
            _all_at_once([functools.partial(manager.register_blocks_cache, small, t, k) for t, k in zip(tensors, keys)])
            _assert_newest_published(reader, owner, word)
            gone = manager.caches()[: threads_n // 2]
            _all_at_once([functools.partial(manager.unregister_cache, c.cache_id) for c in gone])
            _assert_newest_published(reader, owner, word)
    finally:
        sys.setswitchinterval(interval)
        reader.finalize()
        owner.finalize()
