"""Pushes (WRITE): the prefill side, in this process, writes KV caches into a decode child process.

Includes the layer-wise push, ``transfer_cache_async``, driven by a
LayerSynchronizer the test controls one layer at a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from hixl.datadist import (
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    LLMException,
    LLMRole,
    LLMStatusCode,
    TransferConfig,
    TransferDone,
)
from hixl.testing.datadist_peer import DataDistProcess

from .helpers import (
    LOCAL_ID,
    REMOTE_ID,
    fresh_id,
    listen_config,
    new_blocks_key,
    new_cache_key,
)

LAYERS, BLOCKS = 4, 16
SHAPE = (BLOCKS, 4, 2, 16)
F16 = CacheDesc(2 * LAYERS, SHAPE, DataType.DT_FLOAT16)
F32 = CacheDesc(2 * LAYERS, SHAPE, DataType.DT_FLOAT)


@pytest.fixture(scope="module")
def remote(transport: str) -> Iterator[DataDistProcess]:
    """Here the child is the decode side: it listens, and the prefill side pushes to it."""
    with DataDistProcess(LLMRole.DECODER, REMOTE_ID, listen_config(transport)) as child:
        yield child


@pytest.mark.parametrize("desc", [F16, F32], ids=["float16", "float32"])
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_push_whole_blocks_cache(remote, local, make_remote, make_local, desc, lib):
    if lib == "torch":
        pytest.importorskip("torch")
    key = new_blocks_key()
    name = make_remote(desc, key, layout="separate", seed=1)
    mine = make_local(desc, lib=lib, seed=2)
    local.cache_manager.push_blocks(key, mine.cache, list(range(BLOCKS)), list(range(BLOCKS)))
    np.testing.assert_array_equal(remote.read(name), mine.read())


def test_push_non_contiguous_out_of_order_blocks(remote, local, make_remote, make_local):
    key = new_blocks_key()
    name = make_remote(F16, key, seed=3)
    before = remote.read(name)
    mine = make_local(F16, seed=4)
    src, dst = [0, 9, 4, 15], [12, 3, 5, 0]
    local.cache_manager.push_blocks(key, mine.cache, src, dst)
    held = remote.read(name)
    np.testing.assert_array_equal(held[:, dst], mine.read()[:, src])
    untouched = [b for b in range(BLOCKS) if b not in dst]
    np.testing.assert_array_equal(held[:, untouched], before[:, untouched])


def test_push_layer_sub_range(remote, local, make_remote, make_local):
    key = new_blocks_key()
    name = make_remote(F32, key, seed=5)
    before = remote.read(name)
    mine = make_local(F32, seed=6)
    local.cache_manager.push_blocks(key, mine.cache, [1, 2], [1, 2], src_layer_range=range(3, 4), dst_layer_range=range(1))
    held = remote.read(name)
    np.testing.assert_array_equal(held[0:2, 1:3], mine.read()[6:8, 1:3])
    np.testing.assert_array_equal(held[2:], before[2:])
    np.testing.assert_array_equal(held[0:2, 3:], before[0:2, 3:])


PLAIN = CacheDesc(4, (2, 16, 2, 8), DataType.DT_FLOAT16)


def test_push_cache_by_key_and_by_id(remote, local, make_remote, make_local):
    keys = [new_cache_key(), new_cache_key()]
    name = make_remote(PLAIN, keys, blocks=False, seed=7)
    cache_id = remote.cache_manager("caches")[-1].cache_id
    before = remote.read(name)
    mine = make_local(PLAIN, blocks=False, seed=8)
    local.cache_manager.push_cache(keys[1], mine.cache, batch_index=0, size=3)
    held = remote.read(name)
    np.testing.assert_array_equal(held[:, 1, :3], mine.read()[:, 0, :3])
    np.testing.assert_array_equal(held[:, 1, 3:], before[:, 1, 3:])
    np.testing.assert_array_equal(held[:, 0], before[:, 0])
    local.cache_manager.push_cache(CacheKeyByIdAndIndex(REMOTE_ID, cache_id, 0), mine.cache, batch_index=1)
    np.testing.assert_array_equal(remote.read(name)[:, 0], mine.read()[:, 1])


def test_push_tells_the_destination(remote, local, make_remote, make_local):
    key = new_blocks_key()
    keys = [new_cache_key(), new_cache_key()]
    make_remote(F16, key)
    make_remote(PLAIN, keys, blocks=False)
    blocks = make_local(F16, seed=9)
    plain = make_local(PLAIN, blocks=False, seed=10)
    remote.completed_requests()
    local.cache_manager.push_blocks(key, blocks.cache, [0], [0], req_id=51)
    assert remote.completed_requests() == [TransferDone(LOCAL_ID, 51, "push")]
    local.cache_manager.push_cache(keys[0], plain.cache, 0, req_id=52)
    assert remote.completed_requests() == [TransferDone(LOCAL_ID, 52, "push")]
    assert remote.completed_requests() == []


# -- transfer_cache_async ---------------------------------------------------------------------
class StepSynchronizer:
    """A LayerSynchronizer the test drives: layer i is "computed" once ``release(i)`` is called.

    ``outcomes`` overrides what ``synchronize_layer`` returns (or raises) for a layer.
    """

    def __init__(self, outcomes: dict[int, object] | None = None) -> None:
        self.outcomes = outcomes or {}
        self.called = {layer: threading.Event() for layer in range(64)}
        self.released = {layer: threading.Event() for layer in range(64)}
        self.returned: dict[int, bool] = {}
        self.timeouts: list[float | None] = []

    def synchronize_layer(self, layer_index: int, timeout: float | None) -> bool:
        self.timeouts.append(timeout)
        self.called[layer_index].set()
        ready = self.released[layer_index].wait(timeout)
        outcome = self.outcomes.get(layer_index, True)
        if isinstance(outcome, BaseException):
            raise outcome
        self.returned[layer_index] = bool(ready and outcome)
        return self.returned[layer_index]

    def wait_called(self, layer: int) -> None:
        assert self.called[layer].wait(10), f"synchronize_layer({layer}) was never called"
        # Give a push that ignored the synchronizer time to show up before checking for it.
        time.sleep(0.02)

    def release(self, layer: int) -> None:
        self.released[layer].set()


def _layer(held: np.ndarray, layer: int) -> np.ndarray:
    return held[2 * layer : 2 * layer + 2]


def test_push_layer_by_layer_as_layers_are_computed(remote, local, make_remote, make_local):
    key = new_blocks_key()
    name = make_remote(F32, key, seed=11)
    before = remote.read(name)
    mine = make_local(F32, seed=12)
    src, dst = [2, 3, 4, 10], [7, 8, 9, 0]
    sync = StepSynchronizer()
    remote.completed_requests()
    task = local.cache_manager.transfer_cache_async(mine.cache, sync, [TransferConfig(REMOTE_ID, key)], src, dst, req_id=61, timeout=5.0)
    assert task.layers == list(range(LAYERS))
    for layer in range(LAYERS):
        sync.wait_called(layer)
        held = remote.read(name)
        # Not computed yet, so not written: this layer and every later one are as they were.
        np.testing.assert_array_equal(held[2 * layer :], before[2 * layer :])
        assert not task.done() and task.status is LLMStatusCode.WAIT_PROCESS_TIMEOUT
        sync.release(layer)
        task.wait_layer(layer)
        assert sync.returned[layer] is True
        held = remote.read(name)
        np.testing.assert_array_equal(_layer(held, layer)[:, dst], _layer(mine.read(), layer)[:, src])
    task.synchronize()
    assert task.done() and task.status is LLMStatusCode.SUCCESS
    assert sync.timeouts == [5.0] * LAYERS
    held = remote.read(name)
    np.testing.assert_array_equal(held[:, dst], mine.read()[:, src])
    untouched = [b for b in range(BLOCKS) if b not in dst]
    np.testing.assert_array_equal(held[:, untouched], before[:, untouched])
    assert remote.completed_requests() == [TransferDone(LOCAL_ID, 61, "push")]  # sent by synchronize


@pytest.mark.parametrize(
    ("outcome", "status"),
    [(False, LLMStatusCode.TIMEOUT), (RuntimeError("prefill crashed"), LLMStatusCode.FAILED)],
    ids=["returns-false", "raises"],
)
def test_a_layer_that_is_never_computed_fails_the_push(remote, local, make_remote, make_local, outcome, status):
    key = new_blocks_key()
    name = make_remote(F16, key, seed=13)
    before = remote.read(name)
    mine = make_local(F16, seed=14)
    blocks = [0, 1, 2]
    sync = StepSynchronizer({2: outcome})
    remote.completed_requests()
    task = local.cache_manager.transfer_cache_async(mine.cache, sync, [TransferConfig(REMOTE_ID, key)], blocks, blocks, req_id=62)
    for layer in range(LAYERS - 1):
        sync.release(layer)
    for layer in (0, 1):
        task.wait_layer(layer)
    for layer in (2, 3):
        with pytest.raises(LLMException) as info:
            task.wait_layer(layer)
        assert info.value.status_code is status
    with pytest.raises(LLMException) as info:
        task.synchronize()
    assert info.value.status_code is status
    assert task.status is status and task.done()
    assert not sync.called[3].is_set()  # the push stopped at the failed layer
    time.sleep(0.05)  # let a wrongly continuing push show itself
    held = remote.read(name)
    np.testing.assert_array_equal(held[:4, blocks], mine.read()[:4, blocks])  # layers 0-1 moved
    np.testing.assert_array_equal(held[4:], before[4:])  # layers 2-3 never did
    time.sleep(0.1)
    assert TransferDone(LOCAL_ID, 62, "push") not in remote.completed_requests()


def test_synchronize_times_out_while_a_layer_is_not_computed(remote, local, make_remote, make_local):
    key = new_blocks_key()
    name = make_remote(F16, key)
    mine = make_local(F16, seed=15)
    sync = StepSynchronizer()
    task = local.cache_manager.transfer_cache_async(mine.cache, sync, [TransferConfig(REMOTE_ID, key)], [5], [6])
    sync.release(0)
    started = time.monotonic()
    with pytest.raises(LLMException) as info:
        task.synchronize(timeout=0.2)
    assert info.value.status_code is LLMStatusCode.TIMEOUT
    assert 0.15 < time.monotonic() - started < 5
    # Timing out the wait does not cancel the task: it finishes once the layers are computed.
    assert task.status is LLMStatusCode.WAIT_PROCESS_TIMEOUT and not task.done()
    for layer in range(1, LAYERS):
        sync.release(layer)
    task.synchronize()
    np.testing.assert_array_equal(remote.read(name, (slice(None), 6)), mine.read()[:, 5])


def test_push_to_two_caches_at_once(remote, local, make_remote, make_local):
    """Several TransferConfigs: every layer goes to each destination, with its own layer range."""
    key_a, key_b = new_blocks_key(), new_blocks_key()
    name_a = make_remote(F16, key_a)
    name_b = make_remote(CacheDesc(4 * LAYERS, SHAPE, DataType.DT_FLOAT16), key_b)
    mine = make_local(F16, seed=16)
    sync = StepSynchronizer()
    for layer in range(LAYERS):
        sync.release(layer)
    configs = [TransferConfig(REMOTE_ID, key_a), TransferConfig(REMOTE_ID, key_b, dst_layer_range=range(LAYERS, 2 * LAYERS))]
    task = local.cache_manager.transfer_cache_async(mine.cache, sync, configs, [1, 2], [3, 4])
    task.synchronize()
    expected = mine.read()[:, [1, 2]]
    np.testing.assert_array_equal(remote.read(name_a, (slice(None), [3, 4])), expected)
    held_b = remote.read(name_b)
    np.testing.assert_array_equal(held_b[2 * LAYERS :, [3, 4]], expected)
    assert not held_b[: 2 * LAYERS].any()


def test_transfer_configs_are_checked_up_front(remote, local, make_remote, make_local):
    key = new_blocks_key()
    make_remote(F16, key)
    mine = make_local(F16)
    sync = StepSynchronizer()
    with pytest.raises(ValueError, match="empty"):
        local.cache_manager.transfer_cache_async(mine.cache, sync, [], [0], [0])
    configs = [TransferConfig(REMOTE_ID, key), TransferConfig(REMOTE_ID, key, src_layer_range=range(1), dst_layer_range=range(1))]
    with pytest.raises(ValueError, match="same source layers"):
        local.cache_manager.transfer_cache_async(mine.cache, sync, configs, [0], [0])
    with pytest.raises(LLMException) as info:
        local.cache_manager.transfer_cache_async(mine.cache, sync, [TransferConfig(99, key)], [0], [0])
    assert info.value.status_code is LLMStatusCode.NOT_YET_LINK
    with pytest.raises(ValueError, match="out of range"):
        local.cache_manager.transfer_cache_async(mine.cache, sync, [TransferConfig(REMOTE_ID, key)], [0], [BLOCKS])
    assert sync.timeouts == []  # nothing was started


def _push_past_layer_0(remote, local, make_remote, make_local, desc, seed):
    """Start pushing every block of a fresh cache; return once layer 0 landed and layer 1 is being computed.

    Returns the remote cache's name, its contents before the push, the local cache, the synchronizer, the task.
    """
    key = new_blocks_key()
    name = make_remote(desc, key, seed=seed)
    before = remote.read(name)
    mine = make_local(desc, seed=seed + 1)
    blocks = list(range(BLOCKS))
    sync = StepSynchronizer()
    remote.completed_requests()
    task = local.cache_manager.transfer_cache_async(mine.cache, sync, [TransferConfig(REMOTE_ID, key)], blocks, blocks, req_id=fresh_id(), timeout=5.0)
    sync.release(0)
    task.wait_layer(0)
    sync.wait_called(1)
    return key, name, before, mine, sync, task


def test_push_checks_the_destination_before_every_layer(remote, local, make_remote, make_local):
    """The destination re-registers its cache (same key, same memory) between layers: the rest is not written."""
    key, first, _, _, sync, task = _push_past_layer_0(remote, local, make_remote, make_local, F32, 15)
    # The destination lets the cache go and registers another one under the same key in the
    # very same memory: the addresses the push planned with are valid again, for other data.
    remote.unregister(first, keep_memory=True)
    second = f"{first}-again"
    remote.register_blocks_cache(second, F32, key, layout=f"reuse:{first}", seed=17)
    try:
        before = remote.read(second)
        for layer in range(1, LAYERS):
            sync.release(layer)
        with pytest.raises(LLMException) as info:
            task.synchronize()
        assert info.value.status_code is LLMStatusCode.KV_CACHE_NOT_EXIST
        assert task.status is LLMStatusCode.KV_CACHE_NOT_EXIST
        for layer in range(1, LAYERS):
            with pytest.raises(LLMException):
                task.wait_layer(layer)
        np.testing.assert_array_equal(remote.read(second), before)
        assert remote.completed_requests() == []
    finally:
        remote.unregister(second)


# -- cancel ------------------------------------------------------------------------------------
def test_cancelled_push_writes_no_further_layer(remote, local, make_remote, make_local):
    _, name, before, mine, sync, task = _push_past_layer_0(remote, local, make_remote, make_local, F16, 18)
    task.cancel()
    assert task.done() and task.status is LLMStatusCode.CANCELLED
    for layer in range(1, LAYERS):
        sync.release(layer)  # prefill computes on; the push must not follow
    time.sleep(0.2)
    held = remote.read(name)
    np.testing.assert_array_equal(_layer(held, 0), _layer(mine.read(), 0))  # landed before the cancel
    np.testing.assert_array_equal(held[2:], before[2:])
    for layer in task.layers:
        with pytest.raises(LLMException) as info:
            task.wait_layer(layer)
        assert info.value.status_code is LLMStatusCode.CANCELLED
    with pytest.raises(LLMException):
        task.synchronize()
    assert remote.completed_requests() == []  # a cancelled task tells nobody it finished
