"""DataDist: KV-cache transfer for prefill/decode disaggregation, on top of :class:`hixl.Engine`.

Names follow Huawei's LLM-DataDist: :class:`LLMDataDist`, ``cache_manager``
with ``register_blocks_cache`` / ``pull_blocks`` / ``push_blocks`` /
``transfer_cache_async``, :class:`LLMException` with :class:`LLMStatusCode`.
"""

from ._errors import LLMException, LLMLinkError, LLMStatusCode, LLMTimeout
from ._task import CacheTask
from ._types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    ClusterEvent,
    ClusterEventKind,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMRole,
    Placement,
    TransferConfig,
    TransferDone,
)
from .cache_manager import CacheManager, LayerSynchronizer
from .llm_datadist import LLMDataDist

__all__ = [
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "CacheManager",
    "CacheTask",
    "ClusterEvent",
    "ClusterEventKind",
    "DataType",
    "LLMClusterInfo",
    "LLMConfig",
    "LLMDataDist",
    "LLMException",
    "LLMLinkError",
    "LLMRole",
    "LLMStatusCode",
    "LLMTimeout",
    "LayerSynchronizer",
    "Placement",
    "TransferConfig",
    "TransferDone",
]
