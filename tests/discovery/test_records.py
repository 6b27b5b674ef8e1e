"""Whatever anyone writes to etcd, a reader gets a status: a malformed record of a cluster id is no
record — ``link_clusters`` answers LINK_FAILED, a watch passes over it — never an exception, and
never stops a watch from seeing the good records that come after it."""

from __future__ import annotations

import json
import logging
import queue
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from hixl.datadist import (
    ClusterEvent,
    ClusterEventKind,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
)
from hixl.testing.etcd import EtcdServer

from .helpers import TTL, cluster_key, decode_instance, fresh_id, next_event

pytestmark = pytest.mark.timeout(120)

_DEEP = 100_000  # far past the JSON parser's recursion limit


def _json(doc: Any) -> bytes:
    return json.dumps(doc).encode()


# Each: the bytes an etcd writer puts at the key of cluster id ``cid``.
MALFORMED: dict[str, Callable[[int], bytes]] = {
    "deeply nested": lambda cid: b'{"cluster_id": %d, "address": ' % cid + b"[" * _DEEP + b"]" * _DEEP + b"}",
    "wrong types": lambda cid: _json({"cluster_id": str(cid), "address": 5, "incarnation": None}),
    "nested types": lambda cid: _json({"cluster_id": cid, "address": ["127.0.0.1", 1], "incarnation": {"id": "x"}}),
    "huge": lambda cid: _json({"cluster_id": cid, "address": "127.0.0.1:" + "1" * 1_000_000, "incarnation": "x"}),
    "invalid UTF-8": lambda cid: b'{"cluster_id": %d, "address": "127.0.0.1:1", "incarnation": "\xff\xfe"}' % cid,
    "not JSON": lambda cid: b"\x00\x01 not json",
    "a JSON list": lambda cid: _json([cid, "127.0.0.1:1", "x"]),
    "another cluster's id": lambda cid: _json({"cluster_id": cid + 1, "address": "127.0.0.1:1", "incarnation": "x"}),
}


@pytest.fixture(scope="module")
def decode(etcd: EtcdServer) -> Iterator[LLMDataDist]:
    dd = decode_instance(etcd)
    yield dd
    dd.finalize()


@pytest.fixture
def lease(writer: Any) -> Iterator[Any]:
    """A live lease of the raw writer's: its records pass the lease rule, so only parsing stands
    between them and a reader."""
    granted = writer.lease(ttl=60)
    yield granted
    granted.revoke()


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_a_malformed_record_is_link_failed_never_an_exception(decode: LLMDataDist, writer: Any, lease: Any, kind: str) -> None:
    cluster_id = fresh_id()
    writer.put(cluster_key(cluster_id), MALFORMED[kind](cluster_id), lease=lease)
    started = time.monotonic()
    assert decode.link_clusters([LLMClusterInfo(cluster_id)], timeout=2.0) == [LLMStatusCode.LINK_FAILED]
    assert time.monotonic() - started < 1.0  # told at once: nobody usable holds it
    assert decode.linked_clusters() == {}


def test_malformed_records_neither_break_nor_stop_a_watch(
    etcd: EtcdServer, decode: LLMDataDist, writer: Any, lease: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Bad records before the watch starts (its snapshot) and while it runs — every kind, a key
    that is not UTF-8, keys that spell a cluster id another way — and then a real instance: the
    watch reports it, and nothing about the bad ones, and nothing raised anywhere."""
    caplog.set_level(logging.WARNING)
    bad_ids = {fresh_id() for _ in MALFORMED}
    early = fresh_id()
    bad_ids.add(early)
    writer.put(cluster_key(early), MALFORMED["deeply nested"](early), lease=lease)
    events: queue.Queue[ClusterEvent] = queue.Queue()
    seen: list[ClusterEvent] = []

    def on_event(event: ClusterEvent) -> None:
        seen.append(event)
        events.put(event)

    watch = decode.watch_clusters(on_event)
    try:
        for cluster_id, make in zip(sorted(bad_ids - {early}), MALFORMED.values()):
            writer.put(cluster_key(cluster_id), make(cluster_id), lease=lease)
        writer.put(cluster_key(early).encode() + b"\xff", b"{}", lease=lease)
        alias = fresh_id()
        bad_ids.add(alias)
        for spelling in (f"0{alias}", f"+{alias}", f" {alias}", f"{alias}.0"):
            writer.put(f"/hixl/clusters/{spelling}", _json({"cluster_id": alias, "address": "127.0.0.1:1", "incarnation": "x"}), lease=lease)

        good = LLMDataDist(LLMRole.PROMPT, fresh_id())
        good.init(LLMConfig(listen_ip_info="127.0.0.1:0", metadata_server=etcd.url, lease_ttl=TTL))
        try:
            added = next_event(events, good.cluster_id)
            assert added.kind is ClusterEventKind.ADDED and added.address == good.local_ip_info
        finally:
            good.finalize()
        assert next_event(events, good.cluster_id).kind is ClusterEventKind.REMOVED
        assert not [event for event in seen if event.cluster_id in bad_ids]
    finally:
        watch.cancel()
    raised = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not raised, [r.getMessage() for r in raised]
