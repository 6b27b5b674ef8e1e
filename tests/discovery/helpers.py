"""Helpers shared by the discovery tests (the fixtures are in conftest.py)."""

from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Callable

from hixl.datadist import (
    CacheDesc,
    ClusterEvent,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMRole,
)
from hixl.testing.datadist_peer import DataDistProcess
from hixl.testing.etcd import EtcdServer

TTL = 2.0  # etcd's shortest lease: a dead instance's record is gone within ~2 s
SMALL = CacheDesc(4, (8, 4, 2, 8), DataType.DT_FLOAT)
_ids = itertools.count(int(time.time()) % 100_000 * 100)


def fresh_id() -> int:
    """A cluster id or model id no other test (nor an earlier run against the same etcd) uses."""
    return next(_ids)


def cluster_key(cluster_id: int) -> str:
    """Where DataDist keeps the record of ``cluster_id``."""
    return f"/hixl/clusters/{cluster_id}"


def prefill_process(etcd: EtcdServer, cluster_id: int) -> DataDistProcess:
    """A listening instance in a child process, with the store."""
    return DataDistProcess(LLMRole.PROMPT, cluster_id, LLMConfig(listen_ip_info="127.0.0.1:0", metadata_server=etcd.url, lease_ttl=TTL))


def decode_instance(etcd: EtcdServer, cluster_id: int | None = None) -> LLMDataDist:
    """A client-only instance in this process, with the store (under a fresh id unless given)."""
    dd = LLMDataDist(LLMRole.DECODER, fresh_id() if cluster_id is None else cluster_id)
    dd.init(LLMConfig(metadata_server=etcd.url, lease_ttl=TTL))
    return dd


def eventually(condition: Callable[[], bool], timeout: float = TTL + 5) -> bool:
    """Whether ``condition()`` holds within ``timeout`` (polled every 0.1 s)."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)
    return condition()


def next_event(events: queue.Queue[ClusterEvent], cluster_id: int, timeout: float = 15.0) -> ClusterEvent:
    """The next event about ``cluster_id`` (others' events are skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        event = events.get(timeout=max(0.01, deadline - time.monotonic()))
        if event.cluster_id == cluster_id:
            return event
