"""Turning "these blocks of these layers" into engine descriptors, vectorised.

A cache is ``num_tensors`` tensors, ``tensor_num_per_layer`` per layer, each
``shape[0]`` rows (blocks, or batch entries) of ``row_bytes``. Moving rows
``src_rows`` to ``dst_rows`` for a range of layers is an outer sum of tensor
base addresses and row offsets: one numpy expression, no Python loop over
blocks. A blocks transfer's pairs go in the remote blocks' order; runs that
are contiguous on both sides are merged by the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._types import Op
from ._types import CacheDesc

__all__ = ["in_remote_order", "layer_tensors", "resolve_layers", "row_descs", "rows_array"]


def rows_array(rows: Any, limit: int, what: str) -> np.ndarray:
    """Validate block / batch indices: integers in ``[0, limit)``; ``ValueError`` otherwise."""
    arr = np.asarray(rows)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{what} must be a non-empty 1-D sequence of indices")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers, not {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) >= limit:
        raise ValueError(f"{what} out of range: valid indices are 0..{limit - 1}")
    return arr.astype(np.uint64)


def in_remote_order(local_rows: np.ndarray, remote_rows: np.ndarray, op: Op) -> tuple[np.ndarray, np.ndarray]:
    """The block pairs of a transfer sorted by their remote block, where no destination block repeats
    (``op``: READ lands in the local blocks, WRITE in the remote ones): then the bytes that land are
    the same in any order. Remote blocks adjacent there — in a pool after some churn, about half of
    a prompt's — then follow one another in the descriptors, and a cma copy takes each such run as
    one remote range: the kernel pins remote memory range by range, the page tables locked each
    time (see ``lane_copy`` in ``_native.c``). Pairs are left as given where a destination repeats."""
    landing = local_rows if op is Op.READ else remote_rows
    if len(remote_rows) < 2 or len(np.unique(landing)) != len(landing):
        return local_rows, remote_rows
    order = np.argsort(remote_rows, kind="stable")
    return local_rows[order], remote_rows[order]


def resolve_layers(desc: CacheDesc, layer_range: range | None, tensor_num_per_layer: int, what: str) -> range:
    """Check a layer range against a cache with ``tensor_num_per_layer`` tensors per layer."""
    if not isinstance(tensor_num_per_layer, int) or tensor_num_per_layer <= 0:
        raise ValueError(f"tensor_num_per_layer must be a positive int, not {tensor_num_per_layer!r}")
    if desc.num_tensors % tensor_num_per_layer:
        raise ValueError(f"{desc.num_tensors} tensors do not split into layers of {tensor_num_per_layer}")
    num_layers = desc.num_tensors // tensor_num_per_layer
    if layer_range is None:
        return range(num_layers)
    if not isinstance(layer_range, range) or layer_range.step != 1:
        raise TypeError(f"{what} must be a range with step 1, not {layer_range!r}")
    if len(layer_range) == 0 or layer_range.start < 0 or layer_range.stop > num_layers:
        raise ValueError(f"{what} {layer_range} is outside the cache's {num_layers} layers")
    return layer_range


def layer_tensors(layers: range, tensor_num_per_layer: int) -> np.ndarray:
    """Indices of the tensors making up ``layers`` (K, V, ... of each layer in turn)."""
    return np.arange(layers.start * tensor_num_per_layer, layers.stop * tensor_num_per_layer)


def row_descs(
    local_addrs: Sequence[int],
    remote_addrs: Sequence[int],
    local_rows: np.ndarray,
    remote_rows: np.ndarray,
    row_bytes: int,
) -> np.ndarray:
    """(N, 3) descriptors moving ``row_bytes``-sized rows of each tensor pair.

    ``local_addrs[t]`` and ``remote_addrs[t]`` are the base addresses of the t-th
    tensor moved on each side; row ``local_rows[i]`` pairs with ``remote_rows[i]``.
    """
    size = np.uint64(row_bytes)
    local_base = np.asarray(local_addrs, dtype=np.uint64)[:, None]
    remote_base = np.asarray(remote_addrs, dtype=np.uint64)[:, None]
    descs = np.empty((len(local_base) * len(local_rows), 3), dtype=np.uint64)
    descs[:, 0] = (local_base + local_rows[None, :] * size).ravel()
    descs[:, 1] = (remote_base + remote_rows[None, :] * size).ravel()
    descs[:, 2] = size
    return descs
