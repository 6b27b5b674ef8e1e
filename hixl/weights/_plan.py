"""Byte plans: which bytes of a published version land where, as one batch of descriptors.

A destination is a whole tensor (``out[name] = array``) or a part of one
(``out[name] = Shard(array, index)``: ``array`` receives ``tensor[index]``, where
``index`` is what numpy's basic indexing takes — ints, slices with any step,
``...``). Each is cut into the longest runs of bytes contiguous on both sides: a
row block of a C-ordered matrix is one run, a column block one run per row, a
strided slice one run per element. The runs of every tensor, together, are one
``transfer_sync`` — a tensor-parallel rank reads exactly the bytes of its shard.

A plan records each run as (local address, region index, offset in region,
length), so it depends only on the manifest's *layout*; it replays unchanged for
every version published with the same tensors, whichever slot holds it
(:meth:`BytePlan.descriptors`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._exceptions import ParamInvalid
from ._manifest import Manifest, TensorSpec
from ._tensors import DTYPES, View, view_of

__all__ = ["BytePlan", "Shard", "make_plan", "raw_plan"]

MAX_RUNS = 1 << 24
"""More runs than this in one plan is refused: an elementwise read of a large tensor is a mistake."""


@dataclass(frozen=True)
class Shard:
    """``out`` receives ``tensor[index]`` of the published tensor (``index``: numpy basic indexing)."""

    out: Any
    index: Any


@dataclass(frozen=True)
class BytePlan:
    """The runs of bytes one pull reads (see the module docstring). Made by :meth:`Subscriber.plan`."""

    layout: tuple[tuple[Any, ...], ...]
    """The layout of the manifest it was made for."""
    runs: np.ndarray
    """``(N, 4)`` int64 rows: local address, region index, offset in the region, length."""
    whole: Mapping[str, Any]
    """The tensors read whole, each with the array or tensor it lands in (their checksums can be checked)."""
    targets: tuple[tuple[int, int, Any], ...]
    """What it writes into: ``(start, end, owner)`` — each destination's byte range and its array or tensor."""
    source: tuple[Mapping[str, Any], tuple[str, ...]]
    """``(out, names)`` it was made from, to make it again for another layout."""

    @property
    def nbytes(self) -> int:
        """How many bytes the plan reads."""
        return int(self.runs[:, 3].sum())

    def descriptors(self, manifest: Manifest) -> np.ndarray:
        """``(N, 3)`` READ descriptors for ``manifest``'s version (which must have this plan's layout)."""
        bases = np.array([r.addr for r in manifest.regions], dtype=np.int64)
        descs = np.empty((len(self.runs), 3), dtype=np.uint64)
        descs[:, 0] = self.runs[:, 0]
        descs[:, 1] = bases[self.runs[:, 1]] + self.runs[:, 2]
        descs[:, 2] = self.runs[:, 3]
        return descs

    def __repr__(self) -> str:
        return f"<BytePlan {len(self.source[1])} tensor(s), {len(self.runs)} run(s), {self.nbytes} bytes>"


def _selection(shape: tuple[int, ...], index: Any) -> list[tuple[int, int, int, bool]]:
    """``(start, step, count, kept)`` per dimension of ``tensor[index]`` (basic indexing only)."""
    items = list(index) if isinstance(index, tuple) else [index]
    if sum(item is Ellipsis for item in items) > 1:
        raise ParamInvalid("an index may hold one ... at most")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at : at + 1] = [slice(None)] * (len(shape) - len(items) + 1)
    if len(items) > len(shape):
        raise ParamInvalid(f"index {index!r} has more entries than the tensor's {len(shape)} dimensions")
    items += [slice(None)] * (len(shape) - len(items))
    dims = []
    for item, n in zip(items, shape):
        if isinstance(item, slice):
            start, stop, step = item.indices(n)
            dims.append((start, step, len(range(start, stop, step)), True))
        elif isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            i = int(item) + n if int(item) < 0 else int(item)
            if not 0 <= i < n:
                raise ParamInvalid(f"index {int(item)} is out of range for a dimension of size {n}")
            dims.append((i, 1, 1, False))
        else:
            raise ParamInvalid(f"only ints, slices and ... can select a shard, not {item!r:.40}")
    return dims


def _runs(spec: TensorSpec, dest: View, index: Any, what: str) -> np.ndarray:
    """The runs that bring ``spec[index]`` (``what``, in messages) into ``dest``."""
    itemsize = DTYPES[spec.dtype]
    if dest.dtype != spec.dtype:
        raise ParamInvalid(f"{what} is {spec.dtype}; its destination is {dest.dtype}")
    src_strides = [itemsize] * len(spec.shape)
    for d in range(len(spec.shape) - 2, -1, -1):
        src_strides[d] = src_strides[d + 1] * spec.shape[d + 1]
    selection = _selection(spec.shape, index)
    shape = tuple(count for _, _, count, kept in selection if kept)
    if shape != dest.shape:
        raise ParamInvalid(f"{what} has shape {shape}; its destination {dest.shape}")
    src = spec.offset + sum(start * stride for (start, _, _, _), stride in zip(selection, src_strides))
    # (count, source stride, destination stride) of each dimension the selection keeps
    dims = [(count, step * stride) for (_, step, count, kept), stride in zip(selection, src_strides) if kept]
    dims3 = [(n, s, t) for (n, s), t in zip(dims, dest.strides) if n != 1]
    if any(n == 0 for n, _, _ in dims3):
        return np.empty((0, 4), dtype=np.int64)
    run = itemsize
    while dims3 and dims3[-1][1] == run and dims3[-1][2] == run:  # contiguous on both sides: one longer run
        run *= dims3.pop()[0]
    count = int(np.prod([n for n, _, _ in dims3], dtype=np.int64))
    if count > MAX_RUNS:
        raise ParamInvalid(f"{spec.name!r}: {count} runs of {run} bytes; at most {MAX_RUNS} per plan")
    local, remote = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
    for n, s, t in dims3:
        steps = np.arange(n, dtype=np.int64)
        local = (local[:, None] + steps * t).ravel()
        remote = (remote[:, None] + steps * s).ravel()
    runs = np.empty((len(local), 4), dtype=np.int64)
    runs[:, 0] = dest.addr + local
    runs[:, 1] = spec.region
    runs[:, 2] = src + remote
    runs[:, 3] = run
    return runs


def make_plan(manifest: Manifest, out: Mapping[str, Any], names: Iterable[str] | None = None) -> BytePlan:
    """The plan that fills ``out`` (name -> tensor or :class:`Shard`) from ``manifest``'s version.

    ``names``: only these entries of ``out`` (default: all of them).
    """
    if not isinstance(out, Mapping):
        raise ParamInvalid(f"out must map tensor names to arrays, tensors or Shards, not {type(out).__name__}")
    chosen = tuple(out) if names is None else tuple(names)
    parts, whole, targets = [], {}, []
    for name in chosen:
        if name not in out:
            raise ParamInvalid(f"{name!r} is in names but not in out")
        if name not in manifest:
            raise ParamInvalid(f"version {manifest.version} has no tensor {name!r}")
        spec, dest = manifest.tensor(name), out[name]
        if isinstance(dest, Shard):
            target, index, what = dest.out, dest.index, f"{name!r}[{dest.index!r}]"
        else:
            target, index, what = dest, (), repr(name)
            whole[name] = target
        view = view_of(target)
        parts.append(_runs(spec, view, index, what))
        start, end = view.extent()
        if end > start:
            targets.append((start, end, target))
    runs = np.concatenate(parts) if parts else np.empty((0, 4), dtype=np.int64)
    return BytePlan(manifest.layout, runs, whole, tuple(targets), (out, chosen))


def raw_plan(manifest: Manifest, into: Mapping[str, np.ndarray]) -> BytePlan:
    """The plan that copies each tensor's bytes, whole, into a 1-D uint8 array of its size (a relay's slot)."""
    runs, targets = [], []
    for spec in manifest.tensors:
        buf = into[spec.name]
        if spec.nbytes:
            runs.append((int(buf.ctypes.data), spec.region, spec.offset, spec.nbytes))
            targets.append((int(buf.ctypes.data), int(buf.ctypes.data) + spec.nbytes, buf))
    table = np.array(runs, dtype=np.int64).reshape(-1, 4)
    whole = {t.name: into[t.name] for t in manifest.tensors if t.nbytes}
    return BytePlan(manifest.layout, table, whole, tuple(targets), (into, tuple(into)))
