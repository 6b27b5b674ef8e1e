"""The cache catalog: what a DataDist instance publishes about its registered caches.

It travels as engine metadata (``Engine.set_metadata``), so a peer learns
tensor addresses, shapes and keys straight from the owner — no addresses
passed out of band, and a cache registered after the link is found by
refetching the catalog.

A catalog goes stale when the owner unregisters a cache and registers the
same key elsewhere — the old addresses may by then belong to another cache,
and a transfer to them would succeed with the wrong data. So the owner keeps
a *generation* counter in a small registered word, bumped whenever its
catalog changes; a peer reads that word (8 bytes, one transfer) before each
transfer it plans and refetches the catalog when it moved.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ._types import BlocksCacheKey, Cache, CacheDesc, CacheKey, DataType, Placement

CATALOG_KEY = "hixl.datadist/catalog/v1"


@dataclass(frozen=True)
class RemoteCache:
    """A cache as a peer sees it in the owner's catalog."""

    cache_id: int
    cache_desc: CacheDesc
    tensor_addrs: list[int]
    is_blocks: bool
    keys: list[Any]


def _key_json(key: Any) -> list[int]:
    if isinstance(key, BlocksCacheKey):
        return [key.prompt_cluster_id, key.model_id]
    return [key.prompt_cluster_id, key.req_id, key.model_id, key.prefix_id]


def encode_catalog(cluster_id: int, role: str, caches: list[Cache], generation: int, generation_addr: int) -> bytes:
    """Serialise this instance's identity, caches, and where its generation word lives."""
    entries = [
        {
            "cache_id": c.cache_id,
            "num_tensors": c.cache_desc.num_tensors,
            "shape": list(c.cache_desc.shape),
            "dtype": c.cache_desc.data_type.name,
            "addrs": c.tensor_addrs,
            "blocks": c.is_blocks,
            "keys": [_key_json(k) for k in c.keys],
        }
        for c in caches
    ]
    doc = {
        "cluster_id": cluster_id,
        "role": role,
        "generation": generation,
        "generation_addr": generation_addr,
        "caches": entries,
    }
    return json.dumps(doc).encode()


@dataclass(frozen=True)
class Catalog:
    """A decoded catalog with lookups by key."""

    cluster_id: int
    role: str
    generation: int
    generation_addr: int
    caches: list[RemoteCache]

    @classmethod
    def decode(cls, raw: bytes) -> Catalog:
        """Parse what :func:`encode_catalog` produced; ``ValueError`` if it is malformed."""
        try:
            doc = json.loads(raw)
            caches = []
            for e in doc["caches"]:
                desc = CacheDesc(int(e["num_tensors"]), tuple(e["shape"]), DataType[e["dtype"]], Placement.HOST)
                if e["blocks"]:
                    keys: list[Any] = [BlocksCacheKey(*k) for k in e["keys"]]
                else:
                    keys = [CacheKey(*k) for k in e["keys"]]
                caches.append(RemoteCache(int(e["cache_id"]), desc, [int(a) for a in e["addrs"]], bool(e["blocks"]), keys))
            return cls(
                int(doc["cluster_id"]), str(doc["role"]), int(doc["generation"]), int(doc["generation_addr"]), caches
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed DataDist catalog: {exc!r}") from exc

    def blocks_cache(self, key: BlocksCacheKey) -> RemoteCache | None:
        """The blocks cache registered under ``key``."""
        return next((c for c in self.caches if c.is_blocks and key in c.keys), None)

    def by_cache_key(self, key: CacheKey) -> tuple[RemoteCache, int] | None:
        """The plain cache holding ``key`` and the key's batch index in it."""
        for cache in self.caches:
            if not cache.is_blocks and key in cache.keys:
                return cache, cache.keys.index(key)
        return None

    def by_id(self, cache_id: int) -> RemoteCache | None:
        """The cache with ``cache_id``."""
        return next((c for c in self.caches if c.cache_id == cache_id), None)
