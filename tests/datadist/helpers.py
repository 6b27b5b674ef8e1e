"""Helpers shared by the DataDist tests (the fixtures are in conftest.py)."""

from __future__ import annotations

import itertools
import socket
from dataclasses import dataclass
from typing import Any

import numpy as np

import hixl
from hixl.datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMStatusCode,
)
from hixl.testing.datadist_peer import DataDistProcess, pattern

TRANSPORTS = ["cma", "tcp"]
REMOTE_ID = 1
LOCAL_ID = 2

_ids = itertools.count(1000)


def fresh_id() -> int:
    """A number no other test in this session uses (for model ids, req ids, cache names)."""
    return next(_ids)


# A cache big enough that later layers are still on the wire when the first has landed: 4 layers
# of 16 MiB. The TCP target sends each layer's data in request order; the decode side's reader
# thread completes layer 0 about 48 MiB before the last one.
BIG = CacheDesc(8, (32, 64, 1024), DataType.DT_FLOAT)


def numbered_big_caches(remote: DataDistProcess, make_remote: Any, make_local: Any) -> tuple[BlocksCacheKey, LocalCache]:
    """:data:`BIG` registered on both sides, under a fresh key; the remote's tensor t holds t + 1."""
    key = new_blocks_key()
    name = make_remote(BIG, key)
    remote.write(name, np.arange(1, BIG.num_tensors + 1, dtype=np.float32).reshape(-1, 1, 1, 1))
    return key, make_local(BIG)


def assert_numbered(cache: LocalCache) -> None:
    """Every tensor t of a :data:`BIG` cache holds t + 1: the whole numbered cache landed."""
    got = cache.read()
    for t in range(BIG.num_tensors):
        assert (got[t] == t + 1).all(), f"tensor {t}"


# A small blocks cache, pulled whole by the link tests.
SMALL = CacheDesc(4, (8, 4, 2, 8), DataType.DT_FLOAT)


def pull_all(dd: LLMDataDist, key: BlocksCacheKey, source: DataDistProcess, name: str, req_id: int | None = None) -> None:
    """Pull the whole :data:`SMALL` cache ``name`` of ``source`` into a fresh local cache and compare."""
    tensors, storage = allocate(SMALL)
    cache = dd.cache_manager.register_blocks_cache(SMALL, tensors)
    blocks = list(range(SMALL.shape[0]))
    try:
        dd.cache_manager.pull_blocks(key, cache, blocks, blocks, req_id=req_id, timeout=10.0)
        np.testing.assert_array_equal(storage, source.read(name))
    finally:
        dd.cache_manager.unregister_cache(cache.cache_id)


def new_blocks_key(cluster: int = REMOTE_ID) -> BlocksCacheKey:
    """A BlocksCacheKey no other test uses."""
    return BlocksCacheKey(cluster, fresh_id())


def new_cache_key(cluster: int = REMOTE_ID) -> CacheKey:
    """A CacheKey no other test uses."""
    return CacheKey(cluster, fresh_id())


def listen_config(transport: str, **kwargs: Any) -> LLMConfig:
    return LLMConfig(listen_ip_info="127.0.0.1:0", transport=transport, **kwargs)


def client_config(transport: str, **kwargs: Any) -> LLMConfig:
    return LLMConfig(transport=transport, **kwargs)


def free_port() -> int:
    """A port nobody listens on right now (bound and released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def link(local: LLMDataDist, *remotes: DataDistProcess) -> None:
    statuses = local.link_clusters([r.cluster_info() for r in remotes])
    assert statuses == [LLMStatusCode.SUCCESS] * len(remotes), statuses


@dataclass
class LocalCache:
    """A cache registered in the test process, with the tensors behind it."""

    cache: Cache
    tensors: list[Any]
    storage: Any  # the one allocation behind the tensors, or None if each has its own
    owner: LLMDataDist

    def read(self) -> np.ndarray:
        """Every tensor, stacked to ``(num_tensors, *shape)`` (a copy)."""
        return np.stack([_as_numpy(t) for t in self.tensors])

    def write(self, values: Any) -> None:
        values = np.broadcast_to(np.asarray(values), (len(self.tensors), *self.cache.cache_desc.shape))
        for tensor, v in zip(self.tensors, values):
            _as_numpy(tensor)[...] = v


def _as_numpy(tensor: Any) -> np.ndarray:
    return tensor if isinstance(tensor, np.ndarray) else tensor.numpy()


def allocate(desc: CacheDesc, layout: str = "shared", lib: str = "numpy", seed: int | None = None) -> tuple[list[Any], Any]:
    """Tensors for ``desc``: views into one storage (``"shared"``) or one allocation each."""
    if lib == "torch":
        import torch

        dtype = getattr(torch, desc.data_type.value)
        if layout == "shared":
            storage = torch.zeros((desc.num_tensors, *desc.shape), dtype=dtype)
            tensors = list(storage.unbind(0))
        else:
            storage, tensors = None, [torch.zeros(desc.shape, dtype=dtype) for _ in range(desc.num_tensors)]
    else:
        dtype = np.dtype(desc.data_type.value)
        if layout == "shared":
            storage = hixl.empty((desc.num_tensors, *desc.shape), dtype)
            tensors = list(storage)
        else:
            storage, tensors = None, [hixl.empty(desc.shape, dtype) for _ in range(desc.num_tensors)]
    if seed is not None:
        for tensor, values in zip(tensors, pattern(desc, seed)):
            _as_numpy(tensor)[...] = values
    return tensors, storage
