"""The ``kv`` scenario's KV-cache layout, its check pattern, and its prefill process.

A :class:`KvShape` is a Llama-style paged KV cache: ``layers`` layers, a K and
a V tensor each, every tensor a pool of blocks of ``block_size`` tokens
(``kv_heads x head_dim`` fp16 values per token). Both sides keep their pool in
one page-aligned storage ``(layers, 2, pool_tokens, kv_heads, head_dim)``; a
block size is a *view* of it, so one storage serves every block size (the
tensors of a view are ``storage[layer, k_or_v]`` reshaped to
``(pool_tokens // block_size, block_size, kv_heads, head_dim)``).

With ``fused_kv`` it is vLLM's CPU layout instead: one tensor per layer,
``(pool_blocks, kv_heads, block_size, 2 * head_dim)`` — K and V interleaved
inside a block — so a block of a layer is one row twice as long, and the
storage is ``(layers, 1, pool_tokens, kv_heads, 2 * head_dim)``.

The prefill instance runs in a child process (``python -m
hixl.bench._kv_prefill_main``, started through :class:`hixl._child.ChildProcess`
like the engine scenario's target): an :class:`~hixl.datadist.LLMDataDist`
PROMPT instance that registers one blocks cache per block size under
``BlocksCacheKey(PREFILL_CLUSTER, model_id=block_size)`` — all views of the
same storage — plus one contiguous buffer of the prompt's size for the
engine's own single-descriptor baseline. Then it only waits: pulls are
one-sided.

Every 8-byte word of the prefill storage holds :func:`pattern` of its index,
so the decode side can check any pulled block byte for byte without asking
the child (a block from the wrong layer, tensor, pool slot or offset reads
differently).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np

from .._tools.child import ChildProcess
from .._memory import empty
from ..datadist import BlocksCacheKey, CacheDesc, DataType, LLMConfig, LLMDataDist, LLMRole

__all__ = [
    "CONTIGUOUS_SALT",
    "POOL_SALT",
    "PREFILL_CLUSTER",
    "KvShape",
    "PrefillProcess",
    "fill_pattern",
    "pattern",
]

PREFILL_CLUSTER = 1
POOL_SALT = 0x5EED_0001
CONTIGUOUS_SALT = 0x5EED_0002
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # an odd multiplier: distinct indices give distinct words
_FILL_CHUNK = 1 << 23  # words per fill step (64 MiB): bounds the temporary index array


@dataclass(frozen=True)
class KvShape:
    """A paged KV cache for one prompt; see the module docstring.

    ``pool_factor`` is how many times the prompt's blocks each side's pool
    holds: the prompt occupies a shuffled subset of it, as with a real paged
    allocator after some churn.
    """

    layers: int = 80
    tokens: int = 4096
    kv_heads: int = 8
    head_dim: int = 128
    block_sizes: tuple[int, ...] = (16, 32, 128)
    pool_factor: int = 2
    fused_kv: bool = False

    itemsize = 2  # fp16

    def __post_init__(self) -> None:
        for name in ("layers", "tokens", "kv_heads", "head_dim", "pool_factor"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)}")
        if not self.block_sizes:
            raise ValueError("at least one block size is needed")
        for bs in self.block_sizes:
            if bs < 1 or self.tokens % bs:
                raise ValueError(f"block size {bs} does not divide the prompt's {self.tokens} tokens")

    @property
    def tensors_per_layer(self) -> int:
        """2 (K, V), or 1 with ``fused_kv``."""
        return 1 if self.fused_kv else 2

    @property
    def head_values(self) -> int:
        """Values of one token and one head in one tensor: ``head_dim``, doubled with ``fused_kv``."""
        return 2 * self.head_dim if self.fused_kv else self.head_dim

    @property
    def token_bytes(self) -> int:
        """Bytes of one token in one tensor (all heads)."""
        return self.kv_heads * self.head_values * self.itemsize

    @property
    def pool_tokens(self) -> int:
        """Tokens each tensor's pool holds."""
        return self.tokens * self.pool_factor

    @property
    def storage_shape(self) -> tuple[int, ...]:
        """Shape of one side's whole pool, fp16."""
        return (self.layers, self.tensors_per_layer, self.pool_tokens, self.kv_heads, self.head_values)

    @property
    def prompt_bytes(self) -> int:
        """Bytes of the prompt's KV: what one pull moves."""
        return self.layers * self.tensors_per_layer * self.tokens * self.token_bytes

    def prompt_blocks(self, block_size: int) -> int:
        """Blocks the prompt occupies."""
        return self.tokens // block_size

    def pool_blocks(self, block_size: int) -> int:
        """Blocks in each tensor's pool."""
        return self.pool_tokens // block_size

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block of one tensor (one descriptor, unless merged)."""
        return block_size * self.token_bytes

    def tensor_shape(self, block_size: int) -> tuple[int, int, int, int]:
        """Shape of each tensor at this block size (vLLM's CPU shape with ``fused_kv``)."""
        if self.fused_kv:
            return (self.pool_blocks(block_size), self.kv_heads, block_size, self.head_values)
        return (self.pool_blocks(block_size), block_size, self.kv_heads, self.head_dim)

    def tensors(self, storage: np.ndarray, block_size: int) -> list[np.ndarray]:
        """The cache's tensors (K0, V0, K1, ... or one per layer) as views of ``storage`` at this block size."""
        per_layer = self.tensors_per_layer
        blocks = storage.reshape(self.layers, per_layer, *self.tensor_shape(block_size))
        return [blocks[layer, kv] for layer in range(self.layers) for kv in range(per_layer)]

    def block_word(self, layer: int, kv: int, block: int, block_size: int) -> int:
        """Index of the first 8-byte word of a block in the storage (``kv`` is 0 with ``fused_kv``)."""
        tensor_words = self.pool_tokens * self.token_bytes // 8
        return (layer * self.tensors_per_layer + kv) * tensor_words + block * self.block_bytes(block_size) // 8


def pattern(start: int, count: int, salt: int) -> np.ndarray:
    """The words at indices ``start .. start+count-1`` of a buffer filled with ``salt``."""
    words = np.arange(start, start + count, dtype=np.uint64)
    words *= _GOLDEN
    words += np.uint64(salt)
    return words


def fill_pattern(buf: np.ndarray, salt: int) -> None:
    """Fill ``buf`` (a multiple of 8 bytes) with :func:`pattern`, touching every page now."""
    words = buf.reshape(-1).view(np.uint64)
    for start in range(0, len(words), _FILL_CHUNK):
        stop = min(start + _FILL_CHUNK, len(words))
        words[start:stop] = pattern(start, stop - start, salt)


# -- the child -------------------------------------------------------------------------------
def _serve(conn: Connection) -> None:
    """The prefill child: build and register the cache, report where it is, wait for ``exit``."""
    shape: KvShape
    shape, shared = conn.recv()
    storage = empty(shape.storage_shape, np.float16, shared=shared)
    fill_pattern(storage, POOL_SALT)
    contiguous = empty(shape.prompt_bytes, shared=shared)
    fill_pattern(contiguous, CONTIGUOUS_SALT)
    with LLMDataDist(LLMRole.PROMPT, PREFILL_CLUSTER) as datadist:
        datadist.init(LLMConfig(listen_ip_info="127.0.0.1:0"))
        for bs in shape.block_sizes:
            desc = CacheDesc(shape.tensors_per_layer * shape.layers, shape.tensor_shape(bs), DataType.DT_FLOAT16)
            datadist.cache_manager.register_blocks_cache(
                desc, shape.tensors(storage, bs), BlocksCacheKey(PREFILL_CLUSTER, model_id=bs)
            )
        datadist.engine.register_mem(contiguous)
        conn.send(
            {
                "ip_info": datadist.local_ip_info,
                "pid": os.getpid(),
                "storage": int(storage.ctypes.data),
                "contiguous": int(contiguous.ctypes.data),
            }
        )
        try:
            while conn.recv() != "exit":
                pass
        except (EOFError, KeyboardInterrupt):
            pass


# -- the parent's handle ---------------------------------------------------------------------
class PrefillProcess:
    """Start the prefill child for ``shape``; a context manager.

    Attributes: ``ip_info`` (its DataDist ``"ip:port"``), ``pid``, and the
    addresses of its ``storage`` and ``contiguous`` buffers in its memory.
    """

    def __init__(self, shape: KvShape, timeout: float = 120.0, shared: bool = False) -> None:
        self._child = ChildProcess("hixl.bench._kv_prefill_main", timeout)
        try:
            self._child.send((shape, shared))
            info = self._child.receive()
        except BaseException:
            self._child.kill()
            raise
        self.ip_info: str = info["ip_info"]
        self.pid: int = info["pid"]
        self.storage: int = info["storage"]
        self.contiguous: int = info["contiguous"]

    def close(self) -> None:
        """Ask the child to finalize and exit; kill it if it doesn't."""
        self._child.close(goodbye="exit")

    def __enter__(self) -> PrefillProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
