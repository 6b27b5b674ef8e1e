"""Every way a transfer is refused or fails — and that the link still works afterwards.

Argument errors are the builtin ValueError / TypeError, raised before any
byte moves; failures are LLMException with a status code. After each one,
a good pull over the same link must still succeed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

import hixl
from hixl.datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMException,
    LLMStatusCode,
)

from .helpers import REMOTE_ID, LocalCache, new_blocks_key, new_cache_key

LAYERS, BLOCKS = 2, 8
SHAPE = (BLOCKS, 4, 2, 8)
DESC = CacheDesc(2 * LAYERS, SHAPE, DataType.DT_FLOAT16)
PLAIN = CacheDesc(2 * LAYERS, (2, 4, 2, 8), DataType.DT_FLOAT16)


@dataclass
class Pair:
    """A remote blocks cache under ``key``, a local one (``mine``), and a good pull between them."""

    key: BlocksCacheKey
    mine: LocalCache
    good_pull: Callable[[], None]


@pytest.fixture
def pair(remote, local, make_remote, make_local) -> Pair:
    key = new_blocks_key()
    name = make_remote(DESC, key, seed=1)
    mine = make_local(DESC)

    def good_pull() -> None:
        """Pull three blocks over the same link and check them: the link still works."""
        mine.write(0)
        local.cache_manager.pull_blocks(key, mine.cache, [6, 7, 1], [0, 1, 2])
        np.testing.assert_array_equal(mine.read()[:, :3], remote.read(name, (slice(None), [6, 7, 1])))

    return Pair(key, mine, good_pull)


def _status(info: pytest.ExceptionInfo) -> LLMStatusCode:
    return info.value.status_code  # type: ignore[no-any-return]


# -- LLMException ------------------------------------------------------------------------------
def test_not_yet_linked(local, pair):
    manager = local.cache_manager
    for call in (
        lambda: manager.pull_blocks(BlocksCacheKey(99), pair.mine.cache, [0], [0]),
        lambda: manager.pull_blocks_async(BlocksCacheKey(99), pair.mine.cache, [0], [0]),
        lambda: manager.push_blocks(BlocksCacheKey(99), pair.mine.cache, [0], [0]),
    ):
        with pytest.raises(LLMException) as info:
            call()
        assert _status(info) is LLMStatusCode.NOT_YET_LINK
    pair.good_pull()


def test_unknown_caches(remote, local, make_remote, make_local, pair):
    plain = make_local(PLAIN, blocks=False)
    blocks_id = remote.cache_manager("caches")[-1].cache_id
    manager = local.cache_manager
    for call in (
        lambda: manager.pull_blocks(BlocksCacheKey(REMOTE_ID, 987654), pair.mine.cache, [0], [0]),
        lambda: manager.push_blocks(BlocksCacheKey(REMOTE_ID, 987654), pair.mine.cache, [0], [0]),
        lambda: manager.pull_cache(CacheKey(REMOTE_ID, 987654), plain.cache),
        lambda: manager.pull_cache(CacheKeyByIdAndIndex(REMOTE_ID, 987654), plain.cache),
        # An id that names a blocks cache is not a plain cache.
        lambda: manager.pull_cache(CacheKeyByIdAndIndex(REMOTE_ID, blocks_id), plain.cache),
    ):
        with pytest.raises(LLMException) as info:
            call()
        assert _status(info) is LLMStatusCode.KV_CACHE_NOT_EXIST
    pair.good_pull()


def test_local_cache_must_be_registered_here(local, make_local, pair):
    gone = make_local(DESC)
    local.cache_manager.unregister_cache(gone.cache.cache_id)
    with pytest.raises(LLMException) as info:
        local.cache_manager.pull_blocks(pair.key, gone.cache, [0], [0])
    assert _status(info) is LLMStatusCode.KV_CACHE_NOT_EXIST
    with pytest.raises(LLMException) as info:
        local.cache_manager.unregister_cache(gone.cache.cache_id)
    assert _status(info) is LLMStatusCode.KV_CACHE_NOT_EXIST
    with pytest.raises(TypeError):
        local.cache_manager.pull_blocks(pair.key, "not a cache", [0], [0])
    pair.good_pull()


@pytest.mark.parametrize("timeout", [0, -1.0])
def test_bad_timeout_is_param_invalid(local, pair, timeout):
    with pytest.raises(LLMException) as info:
        local.cache_manager.pull_blocks(pair.key, pair.mine.cache, [0], [0], timeout=timeout)
    assert _status(info) is LLMStatusCode.PARAM_INVALID
    # The async form may refuse at the call or fail its task; either way with PARAM_INVALID.
    with pytest.raises(LLMException) as info:
        local.cache_manager.pull_blocks_async(pair.key, pair.mine.cache, [0], [0], timeout=timeout).synchronize()
    assert _status(info) is LLMStatusCode.PARAM_INVALID
    pair.good_pull()


# -- argument errors ---------------------------------------------------------------------------
def _remote_variant(make_remote, desc: CacheDesc) -> BlocksCacheKey:
    key = new_blocks_key()
    make_remote(desc, key)
    return key


@pytest.mark.parametrize(
    ("case", "error", "match"),
    [
        ("src block out of range", ValueError, "remote block indices out of range"),
        ("dst block out of range", ValueError, "local block indices out of range"),
        ("negative block", ValueError, "out of range"),
        ("float blocks", TypeError, "integers"),
        ("empty blocks", ValueError, "non-empty"),
        ("2-D blocks", ValueError, "1-D"),
        ("block lists differ in length", ValueError, "3 source blocks but 2 destination"),
        ("layer ranges differ in length", ValueError, "layer ranges differ in length"),
        ("layer range outside the cache", ValueError, "outside the cache"),
        ("empty layer range", ValueError, "outside the cache"),
        ("layer range with a step", TypeError, "step 1"),
        ("layer range not a range", TypeError, "range"),
        ("tensor_num_per_layer 0", ValueError, "positive int"),
        ("tensor_num_per_layer not int", ValueError, "positive int"),
        ("tensor_num_per_layer does not divide", ValueError, "do not split"),
        ("block shape mismatch", ValueError, "shape mismatch"),
        ("dtype mismatch", TypeError, "dtype mismatch"),
        ("tensor count mismatch", ValueError, "layer ranges differ in length"),
        ("key of the wrong type", TypeError, "BlocksCacheKey"),
        ("plain cache in a blocks transfer", TypeError, "not a blocks cache"),
    ],
)
def test_bad_blocks_arguments(local, make_remote, make_local, pair, case, error, match):
    manager = local.cache_manager
    args: dict = {"src_key": pair.key, "dst_cache": pair.mine.cache, "src_blocks": [0, 1], "dst_blocks": [0, 1]}
    if case == "src block out of range":
        args["src_blocks"] = [0, BLOCKS]
    elif case == "dst block out of range":
        args["dst_blocks"] = [BLOCKS + 5, 0]
    elif case == "negative block":
        args["src_blocks"] = [-1, 0]
    elif case == "float blocks":
        args["src_blocks"] = [0.0, 1.0]
    elif case == "empty blocks":
        args["src_blocks"] = args["dst_blocks"] = []
    elif case == "2-D blocks":
        args["src_blocks"] = args["dst_blocks"] = [[0, 1]]
    elif case == "block lists differ in length":
        args["src_blocks"] = [0, 1, 2]
    elif case == "layer ranges differ in length":
        args.update(src_layer_range=range(2), dst_layer_range=range(1, 2))
    elif case == "layer range outside the cache":
        args.update(src_layer_range=range(1, 3), dst_layer_range=range(2))
    elif case == "empty layer range":
        args.update(src_layer_range=range(1, 1), dst_layer_range=range(1, 1))
    elif case == "layer range with a step":
        args.update(src_layer_range=range(0, 2, 2), dst_layer_range=range(1))
    elif case == "layer range not a range":
        args.update(src_layer_range=[0], dst_layer_range=[0])
    elif case == "tensor_num_per_layer 0":
        args["tensor_num_per_layer"] = 0
    elif case == "tensor_num_per_layer not int":
        args["tensor_num_per_layer"] = 2.0
    elif case == "tensor_num_per_layer does not divide":
        args["tensor_num_per_layer"] = 3
    elif case == "block shape mismatch":
        args["src_key"] = _remote_variant(make_remote, CacheDesc(DESC.num_tensors, (BLOCKS, 4, 2, 4), DataType.DT_FLOAT16))
    elif case == "dtype mismatch":
        args["src_key"] = _remote_variant(make_remote, CacheDesc(DESC.num_tensors, SHAPE, DataType.DT_FLOAT))
    elif case == "tensor count mismatch":
        args["src_key"] = _remote_variant(make_remote, CacheDesc(DESC.num_tensors + 2, SHAPE, DataType.DT_FLOAT16))
    elif case == "key of the wrong type":
        args["src_key"] = CacheKey(REMOTE_ID, 1)
    elif case == "plain cache in a blocks transfer":
        args["dst_cache"] = make_local(PLAIN, blocks=False).cache
    before = pair.mine.read()
    for method in (manager.pull_blocks, manager.pull_blocks_async, manager.push_blocks):
        kwargs = dict(args)
        if method == manager.push_blocks:  # same checks, mirrored names
            kwargs = {
                "dst_key": args["src_key"],
                "src_cache": args["dst_cache"],
                "src_blocks": args["dst_blocks"],
                "dst_blocks": args["src_blocks"],
                **{k: v for k, v in args.items() if k == "tensor_num_per_layer"},
            }
            if "src_layer_range" in args:
                kwargs.update(src_layer_range=args["dst_layer_range"], dst_layer_range=args["src_layer_range"])
        with pytest.raises(error, match=match):
            method(**kwargs)
    np.testing.assert_array_equal(pair.mine.read(), before)  # nothing moved
    pair.good_pull()


def test_bad_cache_arguments(remote, local, make_remote, make_local, pair):
    keys = [new_cache_key(), new_cache_key()]
    make_remote(PLAIN, keys, blocks=False, seed=2)
    plain = make_local(PLAIN, blocks=False)
    manager = local.cache_manager
    with pytest.raises(ValueError, match="size"):
        manager.pull_cache(keys[0], plain.cache, size=PLAIN.shape[1] + 1)
    with pytest.raises(ValueError, match="size"):
        manager.pull_cache(keys[0], plain.cache, size=0)
    with pytest.raises(ValueError, match="batch_index"):
        manager.pull_cache(keys[0], plain.cache, batch_index=PLAIN.shape[0])
    with pytest.raises(ValueError, match="remote batch index"):
        manager.pull_cache(CacheKeyByIdAndIndex(REMOTE_ID, remote.cache_manager("caches")[-1].cache_id, 5), plain.cache)
    with pytest.raises(TypeError, match="CacheKey"):
        manager.pull_cache(pair.key, plain.cache)
    with pytest.raises(TypeError, match="blocks cache"):
        manager.pull_cache(keys[0], pair.mine.cache)
    with pytest.raises(TypeError, match="blocks cache"):
        manager.push_cache(keys[0], pair.mine.cache)
    assert not plain.read().any()
    manager.pull_cache(keys[1], plain.cache, 0, size=2)  # and a good one still works
    pair.good_pull()


# -- the catalog -------------------------------------------------------------------------------
def test_cache_registered_after_the_link_is_found(remote, local, make_remote, make_local, pair):
    """The remote catalog is refetched on a miss, so late registrations are usable."""
    pair.good_pull()  # the catalog is cached now
    late_key = new_blocks_key()
    name = make_remote(DESC, late_key, seed=3)
    late_keys = [new_cache_key()]
    plain_name = make_remote(PLAIN, late_keys, blocks=False, seed=4)
    local.cache_manager.pull_blocks(late_key, pair.mine.cache, [2], [5])
    np.testing.assert_array_equal(pair.mine.read()[:, 5], remote.read(name, (slice(None), 2)))
    plain = make_local(PLAIN, blocks=False)
    local.cache_manager.pull_cache(late_keys[0], plain.cache, 1)
    np.testing.assert_array_equal(plain.read()[:, 1], remote.read(plain_name, (slice(None), 0)))


def test_unregistered_remote_cache_is_gone(remote, local, make_remote, make_local, pair):
    gone_key = new_blocks_key()
    name = make_remote(DESC, gone_key, seed=5)
    local.cache_manager.pull_blocks(gone_key, pair.mine.cache, [0], [0])  # known to the local catalog now
    remote.unregister(name)
    for _ in range(2):
        with pytest.raises(LLMException) as info:
            local.cache_manager.pull_blocks(gone_key, pair.mine.cache, [0], [0])
        assert _status(info) is LLMStatusCode.KV_CACHE_NOT_EXIST
    pair.good_pull()


def test_key_registered_again_elsewhere_is_followed(remote, local, make_remote, make_local, pair):
    moved_key = new_blocks_key()
    old = make_remote(DESC, moved_key, seed=6)
    local.cache_manager.pull_blocks(moved_key, pair.mine.cache, [0], [0])  # cache the catalog entry
    remote.unregister(old, keep_memory=True)
    make_remote(DESC, new_blocks_key(), layout=f"reuse:{old}")  # another cache in the old memory
    new = make_remote(DESC, moved_key, seed=7)  # the key, in new memory
    pair.mine.write(0)
    local.cache_manager.pull_blocks(moved_key, pair.mine.cache, list(range(BLOCKS)), list(range(BLOCKS)))
    np.testing.assert_array_equal(pair.mine.read(), remote.read(new))


# -- timeouts ----------------------------------------------------------------------------------
BIG = CacheDesc(4, (16, 64, 1024), DataType.DT_FLOAT)  # 4 x 4 MiB: far more than moves in 0.1 ms


def test_timed_out_pull_leaves_the_link_usable(transport, remote, local, make_remote, make_local, pair):
    if transport != "tcp":
        pytest.skip("a CMA copy completes inside one syscall; its deadline can't be made to pass mid-transfer")
    big_key = new_blocks_key()
    name = make_remote(BIG, big_key)
    # Distinct values per tensor and block (cheaper to make than random data of this size).
    remote.write(name, np.arange(BIG.num_tensors * BIG.shape[0], dtype=np.float32).reshape(BIG.num_tensors, BIG.shape[0], 1, 1))
    held = remote.read(name)
    big = make_local(BIG)
    blocks = list(range(BIG.shape[0]))
    for _ in range(2):
        with pytest.raises(LLMException) as info:
            local.cache_manager.pull_blocks(big_key, big.cache, blocks, blocks, timeout=1e-4)
        assert _status(info) is LLMStatusCode.TIMEOUT
        # Still a timeout to callers that catch by meaning, with the engine's error kept as the cause.
        assert isinstance(info.value, TimeoutError) and info.value.status is hixl.Status.TIMEOUT
        assert isinstance(info.value.__cause__, hixl.TransferTimeout)
        # The late data of the timed-out pull is still on its way; the next pull must not be confused by it.
        big.write(-1)
        local.cache_manager.pull_blocks(big_key, big.cache, blocks, blocks)
        np.testing.assert_array_equal(big.read(), held)
    pair.good_pull()
