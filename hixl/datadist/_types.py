"""DataDist value types: roles, config, cluster info, cache descriptions and keys.

Names follow LLM-DataDist; times are seconds (floats), not milliseconds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "DataType",
    "LLMClusterInfo",
    "LLMConfig",
    "LLMRole",
    "Placement",
    "TransferConfig",
    "TransferDone",
]


class LLMRole(enum.Enum):
    """What an instance does: PROMPT (prefill), DECODER, or MIX (both)."""

    PROMPT = "PROMPT"
    DECODER = "DECODER"
    MIX = "MIX"


class Placement(enum.Enum):
    """Where a cache lives; only HOST memory has a transport here."""

    HOST = "HOST"
    DEVICE = "DEVICE"


class DataType(enum.Enum):
    """Element type of a cache; the value is the dtype's name in numpy/torch."""

    DT_FLOAT16 = "float16"
    DT_BF16 = "bfloat16"
    DT_FLOAT = "float32"
    DT_DOUBLE = "float64"
    DT_INT8 = "int8"
    DT_UINT8 = "uint8"
    DT_INT32 = "int32"
    DT_INT64 = "int64"

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return 2 if self is DataType.DT_BF16 else np.dtype(self.value).itemsize

    @classmethod
    def of(cls, tensor: Any) -> DataType:
        """The DataType of a numpy array or torch tensor; ``TypeError`` if unsupported."""
        name = str(getattr(tensor, "dtype", "")).replace("torch.", "")
        for member in cls:
            if member.value == name:
                return member
        raise TypeError(f"unsupported cache dtype {name or type(tensor).__name__!r}")


@dataclass(frozen=True)
class LLMConfig:
    """Settings for :meth:`LLMDataDist.init`.

    ``listen_ip_info`` is ``"ip:port"`` to accept links (port 0 picks one), or
    ``None`` for an instance that only links out (it then uses ``local_ip``).
    """

    listen_ip_info: str | None = None
    local_ip: str = "127.0.0.1"
    sync_kv_timeout: float = 10.0
    link_timeout: float = 5.0
    link_retry_count: int = 3
    transport: str = "auto"
    engine_options: dict[str, Any] = field(default_factory=dict)
    metadata_server: str | None = None
    """``"etcd://host:port"`` to publish this instance there and link clusters by id alone
    (default: the engine's ``metadata_server`` option, ``$HIXL_METADATA_SERVER``); ``None``: peer to peer."""
    lease_ttl: float | None = None
    """Seconds this instance's record outlives it if it dies (default: the engine's ``lease_ttl``, 10 s)."""
    max_pending_done: int = 65536
    """Most completions of one cluster held until ``completed_requests()`` takes them; more are refused."""


@dataclass(frozen=True)
class LLMClusterInfo:
    """A cluster to link with: its id and its ``"ip:port"`` — or, with a metadata store, its id
    alone (``remote_ip_info=None``: the address is looked up in the store)."""

    remote_cluster_id: int
    remote_ip_info: str | None = None


class ClusterEventKind(enum.Enum):
    """What :meth:`LLMDataDist.watch_clusters` reports about a cluster in the metadata store."""

    ADDED = "ADDED"
    """It has a record now (it started, or its record came back under the same incarnation)."""
    RESTARTED = "RESTARTED"
    """Its id is held by a new incarnation: links to the old one are dead."""
    REMOVED = "REMOVED"
    """Its record is gone: it finalized, or died and its lease ran out (or the record was
    replaced by one that is no live instance's)."""


@dataclass(frozen=True)
class ClusterEvent:
    """A change to a cluster's record: its id, address (None when removed, or for an instance
    that only links out) and incarnation."""

    kind: ClusterEventKind
    cluster_id: int
    address: str | None
    incarnation: str


@dataclass(frozen=True)
class CacheDesc:
    """Shape of a cache: ``num_tensors`` tensors of ``shape`` and ``data_type`` each.

    For a blocks cache ``shape[0]`` is the number of blocks; for a plain cache
    it is the batch size. Tensors are ordered layer by layer (K0, V0, K1, ...).
    """

    num_tensors: int
    shape: tuple[int, ...]
    data_type: DataType
    placement: Placement = Placement.HOST

    def __post_init__(self) -> None:
        if not isinstance(self.num_tensors, int) or self.num_tensors <= 0:
            raise ValueError(f"num_tensors must be a positive int, not {self.num_tensors!r}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if not self.shape or any(d <= 0 for d in self.shape):
            raise ValueError(f"shape must be non-empty with positive dimensions, not {self.shape}")
        if not isinstance(self.data_type, DataType):
            raise TypeError(f"data_type must be a DataType, not {self.data_type!r}")
        if not isinstance(self.placement, Placement):
            raise TypeError(f"placement must be a Placement, not {self.placement!r}")

    @property
    def tensor_bytes(self) -> int:
        """Bytes of one tensor."""
        return int(np.prod(self.shape)) * self.data_type.itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of one block (blocks cache) or one batch entry (plain cache)."""
        return self.tensor_bytes // self.shape[0]


@dataclass(frozen=True)
class CacheKey:
    """Names one batch entry of a plain cache by request."""

    prompt_cluster_id: int
    req_id: int
    model_id: int = 0
    prefix_id: int = -1


@dataclass(frozen=True)
class CacheKeyByIdAndIndex:
    """Names one batch entry of a plain cache by cache id and index."""

    cluster_id: int
    cache_id: int
    batch_index: int = 0


@dataclass(frozen=True)
class BlocksCacheKey:
    """Names a blocks cache: the cluster holding it and the model it belongs to."""

    prompt_cluster_id: int
    model_id: int = 0


@dataclass(frozen=True)
class TransferConfig:
    """Where :meth:`CacheManager.transfer_cache_async` pushes to: a linked cluster's blocks cache."""

    dst_cluster_id: int
    dst_key: BlocksCacheKey
    src_layer_range: range | None = None
    dst_layer_range: range | None = None


@dataclass(frozen=True)
class TransferDone:
    """A completion notification: ``req_id`` was pulled by, or pushed from, ``cluster_id``."""

    cluster_id: int
    req_id: int
    op: str


@dataclass
class Cache:
    """A registered cache (what ``register_cache`` / ``register_blocks_cache`` return)."""

    cache_id: int
    cache_desc: CacheDesc
    tensor_addrs: list[int]
    is_blocks: bool
    keys: list[Any] = field(default_factory=list)
    keepalive: Any = field(default=None, repr=False)
