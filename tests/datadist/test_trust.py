"""DataDist can't be fooled: completions only from the link of their cluster (a refused claim is
forgotten, however the real instance relinks or restarts; no flood of other notifications refuses
one), one live address per cluster id, a restarted peer linked anew, and the newest catalog
published under concurrent changes."""

from __future__ import annotations

import functools
import json
import logging
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

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
from hixl.testing.datadist_peer import CacheRef, DataDistProcess

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


class _Forger:
    """A plain engine connected to ``target`` (``"ip:port"``) that speaks DataDist's notifications with any claim."""

    def __init__(self, transport: str, target: str) -> None:
        self.engine = hixl.Engine("127.0.0.1", {"transport": transport})
        self.target = target
        self.engine.connect(target)

    def hello(self, cluster_id: int) -> type[hixl.HixlError] | None:
        """Announce ``cluster_id``: the error class the target refused it with, None if taken."""
        return self.send(hixl.NotifyDesc(HELLO_NOTIFY, json.dumps({"cluster_id": cluster_id})))

    def done(self, cluster_id: int, req_id: int) -> type[hixl.HixlError] | None:
        """Report that ``cluster_id`` pulled ``req_id``: the refusal's error class, None if taken."""
        done = {"cluster_id": cluster_id, "req_id": req_id, "op": "pull"}
        return self.send(hixl.NotifyDesc(DONE_NOTIFY, json.dumps(done)))

    def send(self, notify: hixl.NotifyDesc) -> type[hixl.HixlError] | None:
        """Send ``notify``: the error class the target refused it with, None if taken."""
        try:
            self.engine.send_notify(self.target, notify)
        except hixl.HixlError as exc:
            return type(exc)
        return None

    def __enter__(self) -> _Forger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.engine.finalize()


REFUSED_CLAIM, REFUSED_DONE = hixl.AlreadyConnected, hixl.AccessDenied


def _pull_in(decoder: DataDistProcess, key: BlocksCacheKey, req_id: int) -> None:
    """The decode child pulls the whole :data:`SMALL` cache ``key`` into its cache "dst", notifying ``req_id``."""
    blocks = list(range(SMALL.shape[0]))
    decoder.cache_manager("pull_blocks", key, CacheRef("dst"), blocks, blocks, req_id=req_id, timeout=10.0)


def _decoder(transport: str, cluster_id: int) -> DataDistProcess:
    """A real decode instance in a child process, with a :data:`SMALL` cache "dst" to pull into."""
    decoder = DataDistProcess(LLMRole.DECODER, cluster_id, listen_config(transport))
    decoder.register_blocks_cache("dst", SMALL, None)
    return decoder


# -- completions are bound to their link -------------------------------------------------------
def test_only_the_linked_connection_completes_for_its_cluster(transport, remote, local, make_remote, new_local, caplog):
    """Forged completions (any engine, any claim) are refused and never reach completed_requests(); the real one does."""
    key = new_blocks_key()
    name = make_remote(SMALL, key, seed=1)
    remote.completed_requests()
    with _Forger(transport, remote.ip_info) as forger:
        assert forger.done(LOCAL_ID, fresh_id()) is REFUSED_DONE  # claims the linked cluster
        assert forger.hello(LOCAL_ID) is REFUSED_CLAIM  # ... says it speaks for it: refused at once
        assert forger.done(LOCAL_ID, fresh_id()) is REFUSED_DONE  # ... and that is not remembered
        assert forger.done(fresh_id(), fresh_id()) is REFUSED_DONE  # claims a cluster never announced
    # A whole DataDist instance claiming the linked cluster's id is refused the same way, and told so.
    impostor = new_local(LOCAL_ID)
    with caplog.at_level(logging.WARNING, logger="hixl.datadist"):
        assert impostor.link_clusters([remote.cluster_info()], timeout=1.0) == [LLMStatusCode.CLUSTER_ID_CONFLICT]
    assert remote.ip_info in caplog.text and f"cluster {LOCAL_ID} is linked from" in caplog.text
    assert impostor.linked_clusters() == {}
    real = fresh_id()
    pull_all(local, key, remote, name, req_id=real)
    assert remote.completed_requests() == [TransferDone(LOCAL_ID, real, "pull")]


def test_a_relinked_decode_completes_from_its_new_connection(transport, remote, make_remote, new_local):
    """Unlinking closes the bound connection; the same cluster linking again at once is bound to the new
    one, every time (it retries while the target has not yet seen the old connection close)."""
    key = new_blocks_key()
    name = make_remote(SMALL, key, seed=2)
    dd = new_local()
    info = remote.cluster_info()
    for _ in range(10):
        assert dd.link_clusters([info]) == [SUCCESS]
        req = fresh_id()
        pull_all(dd, key, remote, name, req_id=req)
        assert remote.completed_requests() == [TransferDone(dd.cluster_id, req, "pull")]
        assert dd.unlink_clusters([info]) == [SUCCESS]  # linked again at once, while the target may still see it open


def test_a_link_waits_out_the_close_of_the_connection_that_held_its_cluster_id(transport, remote, make_remote, new_local):
    """The target still serves a connection that spoke for our cluster id (as our own old one does for a
    moment after an unlink): the link retries its refused announcement and succeeds once that is gone."""
    key = new_blocks_key()
    name = make_remote(SMALL, key, seed=6)
    cluster = fresh_id()
    old = _Forger(transport, remote.ip_info)
    assert old.hello(cluster) is None  # that connection speaks for the cluster now
    closer = threading.Timer(0.5, old.engine.finalize)
    closer.start()
    try:
        dd = new_local(cluster)
        started = time.monotonic()
        assert dd.link_clusters([remote.cluster_info()]) == [SUCCESS]
        assert time.monotonic() - started > 0.3  # refused until the old connection closed
    finally:
        closer.join(10)
    real = fresh_id()
    pull_all(dd, key, remote, name, req_id=real)
    assert remote.completed_requests() == [TransferDone(cluster, real, "pull")]


@pytest.mark.parametrize("pause", [0.0, 0.5], ids=["relinked-at-once", "relinked-after-a-pause"])
def test_a_refused_claim_never_takes_over_at_a_relink(transport, remote, make_remote, pause):
    """An engine claims a linked decode's cluster id: refused, and forgotten. The decode unlinks and
    links again (at once, or once its old connection is surely gone), with the forger sending
    completions all along: only the decode's completions count, before and after."""
    key = new_blocks_key()
    make_remote(SMALL, key, seed=3)
    cluster = fresh_id()
    with _decoder(transport, cluster) as decoder, _Forger(transport, remote.ip_info) as forger:
        assert decoder.datadist("link_clusters", [remote.cluster_info()]) == [SUCCESS]
        refusals = [forger.hello(cluster)]
        remote.completed_requests()  # the prefill looks at its completions while the claim is fresh
        real = []
        for _ in range(2):
            assert decoder.datadist("unlink_clusters", [remote.cluster_info()]) == [SUCCESS]
            time.sleep(pause)
            refusals.append(forger.done(cluster, fresh_id()))  # between the unlink and the link
            assert decoder.datadist("link_clusters", [remote.cluster_info()]) == [SUCCESS]
            real.append(fresh_id())
            _pull_in(decoder, key, real[-1])
            refusals.append(forger.done(cluster, fresh_id()))
        assert remote.completed_requests() == [TransferDone(cluster, r, "pull") for r in real]
        assert refusals == [REFUSED_CLAIM] + [REFUSED_DONE] * 4


def test_a_restarted_decode_is_bound_again_and_a_refused_claim_is_not(transport, remote, make_remote):
    """The decode is SIGKILLed and started again with the same cluster id, while an engine that claimed
    that id (refused) sends completions: the new decode links, and only its completions count."""
    key = new_blocks_key()
    make_remote(SMALL, key, seed=4)
    cluster = fresh_id()
    with _Forger(transport, remote.ip_info) as forger:
        with _decoder(transport, cluster) as before:
            assert before.datadist("link_clusters", [remote.cluster_info()]) == [SUCCESS]
            refusals = [forger.hello(cluster)]
            remote.completed_requests()
            before.kill()
        refusals.append(forger.done(cluster, fresh_id()))  # while no decode is there
        with _decoder(transport, cluster) as after:
            assert after.datadist("link_clusters", [remote.cluster_info()]) == [SUCCESS]
            real = fresh_id()
            _pull_in(after, key, real)
            refusals.append(forger.done(cluster, fresh_id()))
        assert remote.completed_requests() == [TransferDone(cluster, real, "pull")]
        assert refusals == [REFUSED_CLAIM, REFUSED_DONE, REFUSED_DONE]


def test_a_notification_flood_never_refuses_a_completion(transport, remote, make_remote, new_local):
    """Engines fill the prefill's notification queue (each its 1 MiB share, together all 4 MiB): the
    decode's completion is still taken, since DataDist's notifications never enter that queue."""
    key = new_blocks_key()
    name = make_remote(SMALL, key, seed=5)
    dd = new_local()
    assert dd.link_clusters([remote.cluster_info()]) == [SUCCESS]
    remote.completed_requests()
    flood = hixl.NotifyDesc("f" * 1024, "x" * 1024)
    accepted = []
    try:
        for _ in range(5):
            with _Forger(transport, remote.ip_info) as flooder:
                sent = 0
                while sent < 2049 and flooder.send(flood) is None:
                    sent += 1
                accepted.append(sent)
        real = fresh_id()
        pull_all(dd, key, remote, name, req_id=real)
        assert remote.completed_requests() == [TransferDone(dd.cluster_id, real, "pull")]
        assert accepted == [512, 512, 512, 512, 0]  # four shares fill the queue; the fifth gets nothing
    finally:
        remote.datadist("get_notifies")


def test_completions_are_bounded_per_cluster(transport):
    """A cluster whose completions are not taken is refused past its bound, and only it; one connection
    speaks for one cluster, so it cannot spread a flood over made-up cluster ids."""
    prefill = LLMDataDist(LLMRole.PROMPT, fresh_id())
    prefill.init(listen_config(transport, max_pending_done=4))
    try:
        with _Forger(transport, prefill.local_ip_info) as busy, _Forger(transport, prefill.local_ip_info) as quiet:
            first, second, other = fresh_id(), fresh_id(), fresh_id()
            assert busy.hello(first) is None and quiet.hello(other) is None
            assert busy.hello(second) is REFUSED_CLAIM
            assert [busy.done(first, r) for r in range(5)] == [None] * 4 + [hixl.ResourceExhausted]
            assert quiet.done(other, 1) is None
            assert prefill.cache_manager.completed_requests() == [
                *(TransferDone(first, r, "pull") for r in range(4)), TransferDone(other, 1, "pull")
            ]
            assert busy.done(first, 5) is None  # taken: room again
    finally:
        prefill.finalize()


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
