"""DataDist across hosts: prefill and decode on different hosts (network and PID namespaces of
their own, so every byte crosses the bridge over TCP) — pulls, pushes, and both layer by layer;
with this process as one side, and with both sides on other hosts.

Hosts: 0 and 1 each a network namespace with its own PID namespace; 2 this process's namespace.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

import hixl
from hixl.datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    TransferConfig,
    TransferDone,
)
from hixl.testing.datadist_peer import CacheRef, DataDistProcess, pattern
from hixl.testing.hosts import Hosts, hosts_fixture

pytestmark = pytest.mark.timeout(90)

PREFILL, DECODE, LOCAL = 1, 2, 3
LAYERS, BLOCKS = 4, 16
DESC = CacheDesc(2 * LAYERS, (BLOCKS, 16, 4, 64), DataType.DT_FLOAT16)  # 128 KiB per tensor
OPTIONS = {"auth_secret": "datadist across hosts"}

hosts = hosts_fixture(2, here=True, pid_namespaces=[0, 1])


def _listen(host_ip: str) -> LLMConfig:
    return LLMConfig(listen_ip_info=f"{host_ip}:0", engine_options=OPTIONS)


@pytest.fixture(scope="module")
def prefill(hosts: Hosts) -> Iterator[DataDistProcess]:
    """Prefill on host 0, its cache filled with pattern(DESC, 1) under BlocksCacheKey(PREFILL, 0)."""
    with hosts[0].datadist(LLMRole.PROMPT, PREFILL, _listen(hosts[0].ip)) as child:
        child.register_blocks_cache("kv", DESC, BlocksCacheKey(PREFILL, 0), seed=1)
        yield child


@pytest.fixture(scope="module")
def decode(hosts: Hosts) -> Iterator[DataDistProcess]:
    """Decode on host 1, listening: the destination of pushes, and a puller of its own."""
    with hosts[1].datadist(LLMRole.DECODER, DECODE, _listen(hosts[1].ip)) as child:
        child.register_blocks_cache("kv", DESC, BlocksCacheKey(DECODE, 0))
        yield child


@pytest.fixture
def here(hosts: Hosts) -> Iterator[LLMDataDist]:
    """A client-only DataDist in this process, on host 2."""
    dd = LLMDataDist(LLMRole.DECODER, LOCAL)
    dd.init(LLMConfig(local_ip=hosts[2].ip, engine_options=OPTIONS))
    try:
        yield dd
    finally:
        dd.finalize()


def _cache(dd: LLMDataDist) -> tuple[np.ndarray, object]:
    storage = hixl.empty((DESC.num_tensors, *DESC.shape), np.float16)
    storage[...] = 0
    return storage, dd.cache_manager.register_blocks_cache(DESC, list(storage))


def _link(dd: LLMDataDist, child: DataDistProcess) -> None:
    assert dd.link_clusters([child.cluster_info()]) == [LLMStatusCode.SUCCESS]
    assert dd.engine.transport_of(child.ip_info) == "tcp"  # another PID namespace: no cma


def test_decode_here_pulls_from_prefill_on_another_host(here, prefill) -> None:
    _link(here, prefill)
    storage, cache = _cache(here)
    src, dst = [13, 2, 7, 0, 9], [1, 15, 4, 8, 3]
    prefill.completed_requests()
    here.cache_manager.pull_blocks(BlocksCacheKey(PREFILL, 0), cache, src, dst, req_id=7)
    np.testing.assert_array_equal(storage[:, dst], pattern(DESC, 1)[:, src])
    assert not storage[:, [b for b in range(BLOCKS) if b not in dst]].any()
    assert prefill.completed_requests() == [TransferDone(LOCAL, 7, "pull")]


def test_a_layer_wise_pull_lands_layer_by_layer_across_hosts(here, prefill) -> None:
    _link(here, prefill)
    storage, cache = _cache(here)
    blocks = list(range(BLOCKS))
    task = here.cache_manager.pull_blocks_async(BlocksCacheKey(PREFILL, 0), cache, blocks, blocks)
    held = pattern(DESC, 1)
    for layer in range(LAYERS):
        task.wait_layer(layer)
        np.testing.assert_array_equal(storage[: 2 * layer + 2], held[: 2 * layer + 2])
    task.synchronize()
    assert task.status is LLMStatusCode.SUCCESS


class _Steps:
    """A LayerSynchronizer: layer i is "computed" once ``done[i]`` is set."""

    def __init__(self) -> None:
        self.done = [threading.Event() for _ in range(LAYERS)]

    def synchronize_layer(self, layer_index: int, timeout: float | None) -> bool:
        return self.done[layer_index].wait(timeout)


def test_prefill_here_pushes_layer_by_layer_to_decode_on_another_host(hosts, decode) -> None:
    dd = LLMDataDist(LLMRole.PROMPT, LOCAL)
    dd.init(LLMConfig(local_ip=hosts[2].ip, engine_options=OPTIONS))
    try:
        _link(dd, decode)
        storage, cache = _cache(dd)
        storage[...] = pattern(DESC, 2)
        decode.write("kv", 0)
        decode.completed_requests()
        steps = _Steps()
        src, dst = [2, 3, 4, 10], [7, 8, 9, 0]
        config = TransferConfig(DECODE, BlocksCacheKey(DECODE, 0))
        task = dd.cache_manager.transfer_cache_async(cache, steps, [config], src, dst, req_id=9, timeout=10.0)
        for layer in range(LAYERS):
            steps.done[layer].set()
            task.wait_layer(layer)
            held = decode.read("kv")
            np.testing.assert_array_equal(held[2 * layer : 2 * layer + 2][:, dst], storage[2 * layer : 2 * layer + 2][:, src])
            assert not held[2 * layer + 2 :].any()  # later layers are not computed yet: not sent
        task.synchronize()
        assert task.status is LLMStatusCode.SUCCESS
        assert decode.completed_requests() == [TransferDone(LOCAL, 9, "push")]
        dd.cache_manager.push_blocks(config.dst_key, cache, [5], [5])  # and a whole push in one call
        np.testing.assert_array_equal(decode.read("kv", (slice(None), 5)), storage[:, 5])
    finally:
        dd.finalize()


def test_decode_and_prefill_both_on_other_hosts(prefill, decode) -> None:
    """Neither side in this process: decode on host 1 links to prefill on host 0 and pulls."""
    decode.write("kv", 0)
    assert decode.datadist("link_clusters", [LLMClusterInfo(PREFILL, prefill.ip_info)]) == [LLMStatusCode.SUCCESS]
    try:
        decode.cache_manager("pull_blocks", BlocksCacheKey(PREFILL, 0), CacheRef("kv"), [0, 1, 2], [3, 4, 5])
        np.testing.assert_array_equal(decode.read("kv", (slice(None), [3, 4, 5])), pattern(DESC, 1)[:, [0, 1, 2]])
    finally:
        decode.datadist("unlink_clusters", [LLMClusterInfo(PREFILL, prefill.ip_info)])
