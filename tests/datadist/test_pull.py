"""Pulls (READ): the decode side, in this process, copies KV caches out of a prefill child process.

Every check compares, element by element, what landed here with what the
child holds (read back through its pipe), and checks that what should not
have moved did not.
"""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest

from hixl._memory import merge_adjacent
from hixl.datadist import (
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMException,
    LLMStatusCode,
    TransferDone,
)
from hixl.testing.datadist_peer import pattern

from .helpers import (
    BIG,
    LOCAL_ID,
    assert_numbered,
    fresh_id,
    new_blocks_key,
    new_cache_key,
    numbered_big_caches,
)

LAYERS, BLOCKS = 4, 16
SHAPE = (BLOCKS, 8, 2, 16)  # blocks, block size, heads, head dim
F16 = CacheDesc(2 * LAYERS, SHAPE, DataType.DT_FLOAT16)
F32 = CacheDesc(2 * LAYERS, SHAPE, DataType.DT_FLOAT)


@pytest.mark.parametrize("desc", [F16, F32], ids=["float16", "float32"])
@pytest.mark.parametrize(("remote_layout", "local_layout"), [("shared", "separate"), ("separate", "shared")])
def test_pull_whole_blocks_cache(remote, local, make_remote, make_local, desc, remote_layout, local_layout):
    key = new_blocks_key()
    name = make_remote(desc, key, layout=remote_layout, seed=1)
    mine = make_local(desc, layout=local_layout)
    local.cache_manager.pull_blocks(key, mine.cache, list(range(BLOCKS)), list(range(BLOCKS)))
    held = remote.read(name)
    assert held.dtype == np.dtype(desc.data_type.value)
    np.testing.assert_array_equal(mine.read(), held)
    np.testing.assert_array_equal(held, pattern(desc, 1))  # and the source is unchanged


def test_pull_non_contiguous_out_of_order_blocks(remote, local, make_remote, make_local):
    key = new_blocks_key()
    name = make_remote(F16, key, seed=2)
    mine = make_local(F16, seed=3)
    before = mine.read()
    src, dst = [13, 2, 7, 0, 9], [1, 15, 4, 8, 3]
    local.cache_manager.pull_blocks(key, mine.cache, src, dst)
    got, held = mine.read(), remote.read(name)
    np.testing.assert_array_equal(got[:, dst], held[:, src])
    untouched = [b for b in range(BLOCKS) if b not in dst]
    np.testing.assert_array_equal(got[:, untouched], before[:, untouched])


def test_pull_into_torch_views_of_one_storage(remote, local, make_remote, make_local):
    torch = pytest.importorskip("torch")
    key = new_blocks_key()
    name = make_remote(F16, key, seed=4)
    regions_before = set(local.engine.local_mems())
    mine = make_local(F16, lib="torch", layout="shared")
    assert all(t._base is mine.storage for t in mine.tensors)  # really views of one storage
    # The eight per-layer views are registered as the one storage they share.
    new = set(local.engine.local_mems()) - regions_before
    assert [(m.addr, m.len) for m in new] == [(mine.storage.data_ptr(), mine.storage.nbytes)]
    local.cache_manager.pull_blocks(key, mine.cache, [5, 6, 7], [0, 1, 2])
    assert mine.storage.dtype == torch.float16
    np.testing.assert_array_equal(mine.storage.numpy()[:, :3], remote.read(name, (slice(None), [5, 6, 7])))
    assert not mine.storage[:, 3:].any()


def _record_transfers(engine, monkeypatch):
    """The descriptors of every ``transfer_sync`` the engine makes from now on (a pass-through spy)."""
    seen = []
    real = engine.transfer_sync

    def spy(remote_engine, op, op_descs, timeout=None):
        seen.append(np.array(op_descs, copy=True))
        return real(remote_engine, op, op_descs, timeout)

    monkeypatch.setattr(engine, "transfer_sync", spy)
    return seen


@pytest.mark.parametrize(
    ("src", "dst", "runs_per_tensor"),
    [
        (list(range(BLOCKS)), list(range(BLOCKS)), None),  # everything: one run across all tensors
        (list(range(8)), list(range(8, 16)), 1),
        ([0, 1, 2, 5, 6], [0, 1, 2, 3, 4], 2),
        ([3, 2, 1, 0], [0, 1, 2, 3], 4),  # reversed: nothing may merge
    ],
    ids=["all", "one-run", "two-runs", "reversed"],
)
def test_contiguous_blocks_merge_into_runs(remote, local, make_remote, make_local, monkeypatch, src, dst, runs_per_tensor):
    """What DataDist hands the engine merges into one descriptor per contiguous run.

    A pass-through spy on the public ``Engine.transfer_sync`` records the
    descriptors; the engine merges them with ``merge_adjacent`` before any
    byte moves, so counting its result counts what really goes on the wire.
    """
    key = new_blocks_key()
    name = make_remote(F32, key, seed=5)
    mine = make_local(F32)
    seen = _record_transfers(local.engine, monkeypatch)
    local.cache_manager.pull_blocks(key, mine.cache, src, dst)
    check, descs = seen  # first the 8-byte read of the source's catalog generation, then the data
    assert len(check) == 1 and check[0][2] == 8
    assert len(descs) == F32.num_tensors * len(src)
    expected = 1 if runs_per_tensor is None else F32.num_tensors * runs_per_tensor
    assert len(merge_adjacent(descs)) == expected
    np.testing.assert_array_equal(mine.read()[:, dst], remote.read(name, (slice(None), src)))


@pytest.mark.parametrize(
    ("src", "dst", "sent"),
    [
        ([6, 2, 3, 0], [0, 1, 2, 3], [0, 2, 3, 6]),  # by remote block: 2 and 3 side by side there
        ([6, 2, 3, 0], [1, 3, 3, 0], [6, 2, 3, 0]),  # a destination repeats: the order matters, as given
    ],
    ids=["sorted", "repeated-destination"],
)
def test_blocks_go_in_the_remote_blocks_order(remote, local, make_remote, make_local, monkeypatch, src, dst, sent):
    """DataDist hands the engine a pull's blocks sorted by remote block (a cma copy then takes
    blocks adjacent over there as one remote range) — unless a destination block repeats."""
    key = new_blocks_key()
    name = make_remote(F32, key, seed=6)
    mine = make_local(F32)
    seen = _record_transfers(local.engine, monkeypatch)
    local.cache_manager.pull_blocks(key, mine.cache, src, dst)
    descs = seen[-1].reshape(F32.num_tensors, len(src), 3)
    block = F32.row_bytes
    assert ((descs[0, :, 1] - descs[0, :, 1].min()) // block + min(sent)).tolist() == sent
    if len(set(dst)) == len(dst):
        np.testing.assert_array_equal(mine.read()[:, dst], remote.read(name, (slice(None), src)))


def test_pull_layer_sub_range(remote, local, make_remote, make_local):
    key = new_blocks_key()
    name = make_remote(F16, key, seed=6)
    mine = make_local(F16, seed=7)
    before = mine.read()
    blocks = [4, 5, 11]
    local.cache_manager.pull_blocks(key, mine.cache, blocks, blocks, src_layer_range=range(1, 3), dst_layer_range=range(2, 4))
    got, held = mine.read(), remote.read(name)
    # Remote layers 1-2 (tensors 2..5) landed in local layers 2-3 (tensors 4..7), only in those blocks.
    np.testing.assert_array_equal(got[4:8][:, blocks], held[2:6][:, blocks])
    np.testing.assert_array_equal(got[:4], before[:4])
    others = [b for b in range(BLOCKS) if b not in blocks]
    np.testing.assert_array_equal(got[4:8][:, others], before[4:8][:, others])


def test_pull_between_caches_of_different_depth(remote, local, make_remote, make_local):
    """A 2-layer remote cache fills layers 2-3 of a 4-layer local one; tensor_num_per_layer=1 too."""
    key = new_blocks_key()
    name = make_remote(CacheDesc(4, SHAPE, DataType.DT_FLOAT16), key, seed=8)
    mine = make_local(F16)
    local.cache_manager.pull_blocks(key, mine.cache, [0], [0], dst_layer_range=range(2, 4))
    got, held = mine.read(), remote.read(name)
    np.testing.assert_array_equal(got[4:, 0], held[:, 0])
    assert not got[:4].any()
    # One tensor per layer: remote tensor 3 -> local tensor 0.
    local.cache_manager.pull_blocks(key, mine.cache, [1], [1], src_layer_range=range(3, 4), dst_layer_range=range(1), tensor_num_per_layer=1)
    got = mine.read()
    np.testing.assert_array_equal(got[0, 1], held[3, 1])
    assert not got[1:4].any()


# -- plain caches -----------------------------------------------------------------------------
BATCH_SHAPE = (3, 16, 2, 8)  # batch, sequence, heads, head dim
PLAIN = CacheDesc(4, BATCH_SHAPE, DataType.DT_FLOAT)


def test_pull_cache_by_cache_key(remote, local, make_remote, make_local):
    keys = [new_cache_key() for _ in range(3)]
    name = make_remote(PLAIN, keys, blocks=False, seed=9)
    mine = make_local(CacheDesc(4, (2, *BATCH_SHAPE[1:]), DataType.DT_FLOAT), blocks=False, seed=10)
    before = mine.read()
    local.cache_manager.pull_cache(keys[2], mine.cache, batch_index=1)
    got, held = mine.read(), remote.read(name)
    np.testing.assert_array_equal(got[:, 1], held[:, 2])
    np.testing.assert_array_equal(got[:, 0], before[:, 0])


def test_pull_cache_by_id_and_index_with_size(remote, local, make_remote, make_local):
    name = make_remote(PLAIN, [], blocks=False, seed=11)
    cache_id = remote.cache_manager("caches")[-1].cache_id
    mine = make_local(PLAIN, blocks=False, seed=12)
    before = mine.read()
    local.cache_manager.pull_cache(CacheKeyByIdAndIndex(remote.cluster_id, cache_id, 1), mine.cache, batch_index=2, size=5)
    got, held = mine.read(), remote.read(name)
    # Only the first five positions of entry 1 moved, into entry 2.
    np.testing.assert_array_equal(got[:, 2, :5], held[:, 1, :5])
    np.testing.assert_array_equal(got[:, 2, 5:], before[:, 2, 5:])
    np.testing.assert_array_equal(got[:, :2], before[:, :2])


def test_pull_cache_layer_sub_range(remote, local, make_remote, make_local):
    keys = [new_cache_key() for _ in range(3)]
    name = make_remote(PLAIN, keys, blocks=False, seed=13)
    mine = make_local(PLAIN, blocks=False, seed=14)
    before = mine.read()
    local.cache_manager.pull_cache(keys[0], mine.cache, 0, src_layer_range=range(1, 2), dst_layer_range=range(1))
    got, held = mine.read(), remote.read(name)
    np.testing.assert_array_equal(got[0:2, 0], held[2:4, 0])
    np.testing.assert_array_equal(got[2:], before[2:])
    np.testing.assert_array_equal(got[:2, 1:], before[:2, 1:])


# -- completion notifications -----------------------------------------------------------------
def test_pull_tells_the_source_which_request_is_done(remote, local, make_remote, make_local):
    key = new_blocks_key()
    keys = [CacheKey(remote.cluster_id, 7000 + i) for i in range(3)]
    make_remote(F16, key, seed=15)
    make_remote(PLAIN, keys, blocks=False, seed=16)
    blocks = make_local(F16)
    plain = make_local(PLAIN, blocks=False)
    remote.completed_requests()  # start from an empty queue
    local.cache_manager.pull_blocks(key, blocks.cache, [0], [0], req_id=41)
    # A synchronous pull returns once the notification was delivered.
    assert remote.completed_requests() == [TransferDone(LOCAL_ID, 41, "pull")]
    assert remote.completed_requests() == []  # drained
    local.cache_manager.pull_cache(keys[1], plain.cache, 0, req_id=42)
    assert remote.completed_requests() == [TransferDone(LOCAL_ID, 42, "pull")]
    local.cache_manager.pull_blocks(key, blocks.cache, [1], [1])  # no req_id, no notification
    task = local.cache_manager.pull_blocks_async(key, blocks.cache, [2], [2], req_id=43)
    task.synchronize()  # returns once the source holds the notification
    assert remote.completed_requests() == [TransferDone(LOCAL_ID, 43, "pull")]


# -- layer by layer ---------------------------------------------------------------------------
def test_pull_async_layers_land_in_order(remote, local, make_remote, make_local):
    key = new_blocks_key()
    name = make_remote(F32, key, seed=17)
    mine = make_local(F32)
    held = remote.read(name)
    blocks = [3, 1, 4, 15, 9, 2, 6]
    task = local.cache_manager.pull_blocks_async(key, mine.cache, blocks, blocks)
    assert task.layers == list(range(LAYERS))
    for layer in range(LAYERS):
        task.wait_layer(layer)
        # Layers start in order and complete in order: this one and all before it are here.
        got = mine.read()
        np.testing.assert_array_equal(got[: 2 * layer + 2][:, blocks], held[: 2 * layer + 2][:, blocks])
    task.synchronize()
    assert task.done() and task.status is LLMStatusCode.SUCCESS
    assert f"{LAYERS}/{LAYERS} layers ended, SUCCESS" in repr(task)
    np.testing.assert_array_equal(mine.read()[:, blocks], held[:, blocks])
    with pytest.raises(ValueError, match="not part of this task"):
        task.wait_layer(LAYERS)


def test_pull_async_sub_range_names_local_layers(remote, local, make_remote, make_local):
    key = new_blocks_key()
    name = make_remote(F16, key, seed=18)
    mine = make_local(F16)
    task = local.cache_manager.pull_blocks_async(key, mine.cache, [0, 1], [5, 6], src_layer_range=range(2), dst_layer_range=range(2, 4))
    assert task.layers == [2, 3]
    with pytest.raises(ValueError):
        task.wait_layer(0)
    for layer in reversed(task.layers):  # waiting out of order is fine too
        task.wait_layer(layer)
    got = mine.read()
    np.testing.assert_array_equal(got[4:8, 5:7], remote.read(name, (slice(0, 4), [0, 1])))
    assert not got[:4].any()



def test_first_layer_is_usable_before_the_last_has_landed(transport, remote, local, make_remote, make_local):
    """wait_layer(0) returns while later layers are still in flight (TCP).

    Right after wait_layer(0) returns, the source process is frozen (SIGSTOP),
    so no more data can be produced while layer 0 is checked. Socket buffers
    hold a few MiB at most, far less than the 48 MiB of layers 1-3, so once the
    task is seen unfinished it cannot finish until the source is resumed. On CMA the decode side's own
    thread copies each layer with one syscall, so there is no window to
    observe deterministically; that transport is covered by the ordering test.
    """
    if transport != "tcp":
        pytest.skip("needs a transport whose bytes are produced by the source process (TCP)")
    key, mine = numbered_big_caches(remote, make_remote, make_local)
    blocks = list(range(BIG.shape[0]))
    # The window is ~10 ms wide; a scheduler stall longer than that could close it, so a few
    # attempts are allowed. A wait_layer(0) that waited for the whole task fails every one.
    for _attempt in range(3):
        mine.write(0)
        task = local.cache_manager.pull_blocks_async(key, mine.cache, blocks, blocks)
        try:
            task.wait_layer(0)
            remote.stop(signal.SIGSTOP)
            landed_early = not task.done()
            got = mine.read()
        finally:
            remote.stop(signal.SIGCONT)
        task.synchronize()
        if landed_early:
            break
    assert landed_early, "the whole cache had landed by the time wait_layer(0) returned, every time"
    assert (got[0] == 1).all() and (got[1] == 2).all()  # layer 0 was complete and usable ...
    assert not (got[-1] == BIG.num_tensors).all()  # ... while the last layer was not
    assert task.status is LLMStatusCode.SUCCESS
    assert_numbered(mine)


def test_layer_failure_is_reported_by_wait_layer(transport, remote, local, make_remote, make_local):
    """An async pull that times out (TCP, 0.1 ms for 64 MiB) fails its layers with TIMEOUT."""
    if transport != "tcp":
        pytest.skip("a CMA copy completes inside one syscall; its deadline can't be made to pass mid-transfer")
    key = new_blocks_key()
    make_remote(BIG, key)
    mine = make_local(BIG)
    blocks = list(range(BIG.shape[0]))
    task = local.cache_manager.pull_blocks_async(key, mine.cache, blocks, blocks, timeout=1e-4)
    with pytest.raises(LLMException) as info:
        task.synchronize()
    assert info.value.status_code is LLMStatusCode.TIMEOUT
    assert task.status is LLMStatusCode.TIMEOUT


def test_pull_async_vllm_cpu_layout(remote, local, make_remote, make_local):
    """vLLM's CPU KV cache: one torch tensor per layer ``[blocks, kv heads, block size, 2 * head]``
    (K and V interleaved inside a block), all views of one storage; blocks pulled by id into
    *different* ids, layer by layer, with ``tensor_num_per_layer=1`` — what hixl.vllm does."""
    pytest.importorskip("torch")
    desc = CacheDesc(LAYERS, (BLOCKS, 2, 32, 2 * 16), DataType.DT_FLOAT16)
    key = new_blocks_key()
    name = make_remote(desc, key, seed=31)
    mine = make_local(desc, lib="torch", layout="shared")
    held = remote.read(name)
    src, dst = [4, 9, 2], [0, 11, 7]
    task = local.cache_manager.pull_blocks_async(key, mine.cache, src, dst, tensor_num_per_layer=1, req_id=77)
    for layer in range(LAYERS):
        task.wait_layer(layer)
        np.testing.assert_array_equal(mine.storage.numpy()[layer, dst], held[layer, src])
    task.synchronize()
    untouched = [b for b in range(BLOCKS) if b not in dst]
    assert not mine.storage[:, untouched].any()
    # Prefill may now free its blocks. (Polled: whether the notification is sent as the last
    # layer lands or by synchronize, it travels on its own.)
    import time

    seen: list[TransferDone] = []
    deadline = time.monotonic() + 10
    while TransferDone(LOCAL_ID, 77, "pull") not in seen:
        assert time.monotonic() < deadline, seen
        seen += remote.completed_requests()


def test_cancelled_pull_lands_nothing_after_cancel_returns(transport, remote, local, make_remote, make_local):
    """Cancel with most of 64 MiB still on its way: once cancel() returns the local cache stays still."""
    key, mine = numbered_big_caches(remote, make_remote, make_local)
    blocks = list(range(BIG.shape[0]))
    mine.write(0)
    remote.completed_requests()
    task = local.cache_manager.pull_blocks_async(key, mine.cache, blocks, blocks, req_id=fresh_id())
    task.cancel()
    assert task.done() and task.status is LLMStatusCode.CANCELLED
    frozen = mine.read()
    time.sleep(0.2)  # any late byte of the pull would land in this time
    np.testing.assert_array_equal(mine.read(), frozen)
    with pytest.raises(LLMException) as info:
        task.synchronize()
    assert info.value.status_code is LLMStatusCode.CANCELLED
    assert remote.completed_requests() == []  # the source is not told to free what was not pulled


# -- head slices (tensor-parallel ranks holding different KV heads) -----------------------------
WIDE = CacheDesc(LAYERS, (BLOCKS, 4, 8, 16), DataType.DT_FLOAT16)  # blocks, heads, tokens, head dim
NARROW = CacheDesc(LAYERS, (BLOCKS, 2, 8, 16), DataType.DT_FLOAT16)


@pytest.mark.parametrize("layerwise", [False, True], ids=["sync", "layerwise"])
def test_pull_a_head_slice_of_each_block(remote, local, make_remote, make_local, layerwise):
    """Heads 1..2 of a 4-head source land in heads 0..1 of a 2-head destination; nothing else moves."""
    key = new_blocks_key()
    name = make_remote(WIDE, key, seed=40)
    mine = make_local(NARROW, seed=41)
    before = mine.read()
    src, dst = [3, 9, 4], [0, 7, 1]
    args = (key, mine.cache, src, dst)
    kwargs = dict(tensor_num_per_layer=1, src_heads=range(1, 3), dst_heads=range(0, 2))
    if layerwise:
        task = local.cache_manager.pull_blocks_async(*args, **kwargs)
        for layer in range(LAYERS):
            task.wait_layer(layer)
        task.synchronize()
    else:
        local.cache_manager.pull_blocks(*args, **kwargs)
    got, held = mine.read(), remote.read(name)
    np.testing.assert_array_equal(got[:, dst], held[:, src][:, :, 1:3])
    untouched = [b for b in range(BLOCKS) if b not in dst]
    np.testing.assert_array_equal(got[:, untouched], before[:, untouched])


def test_pull_one_head_into_the_middle_of_a_block(remote, local, make_remote, make_local):
    key = new_blocks_key()
    name = make_remote(NARROW, key, seed=42)
    mine = make_local(WIDE, seed=43)
    before = mine.read()
    local.cache_manager.pull_blocks(key, mine.cache, [5], [2], tensor_num_per_layer=1, src_heads=range(1, 2), dst_heads=range(2, 3))
    got, held = mine.read(), remote.read(name)
    np.testing.assert_array_equal(got[:, 2, 2], held[:, 5, 1])
    for head in (0, 1, 3):  # the block's other heads are as they were
        np.testing.assert_array_equal(got[:, 2, head], before[:, 2, head])


@pytest.mark.parametrize(
    ("src_heads", "dst_heads", "error", "match"),
    [
        (range(0, 2), None, ValueError, "both src_heads and dst_heads"),
        (range(0, 3), range(0, 2), ValueError, "3 source heads but 2 destination heads"),
        (range(3, 5), range(0, 2), ValueError, "outside its 4 heads"),
        (range(0, 2, 2), range(0, 1), TypeError, "step 1"),
    ],
)
def test_head_slice_errors(remote, local, make_remote, make_local, src_heads, dst_heads, error, match):
    key = new_blocks_key()
    make_remote(WIDE, key, seed=44)
    mine = make_local(NARROW)
    with pytest.raises(error, match=match):
        local.cache_manager.pull_blocks(key, mine.cache, [0], [0], tensor_num_per_layer=1, src_heads=src_heads, dst_heads=dst_heads)


def test_head_slice_needs_the_same_per_head_shape(remote, local, make_remote, make_local):
    key = new_blocks_key()
    make_remote(WIDE, key, seed=45)
    mine = make_local(CacheDesc(LAYERS, (BLOCKS, 2, 16, 16), DataType.DT_FLOAT16))  # twice the tokens a block
    with pytest.raises(ValueError, match=r"per-head shape mismatch: local \(16, 16\), remote \(8, 16\)"):
        local.cache_manager.pull_blocks(key, mine.cache, [0], [0], tensor_num_per_layer=1, src_heads=range(2), dst_heads=range(2))


def test_notify_pulled_tells_the_source_without_a_pull(remote, local):
    remote.completed_requests()
    local.cache_manager.notify_pulled(remote.cluster_id, 51)
    assert remote.completed_requests() == [TransferDone(LOCAL_ID, 51, "pull")]
    with pytest.raises(LLMException) as err:
        local.cache_manager.notify_pulled(fresh_id(), 52)
    assert err.value.status_code is LLMStatusCode.NOT_YET_LINK
