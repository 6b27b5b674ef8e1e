"""A staging area: where a serving process pulls the parts of a version it needs before using them.

A pull can fail half-way (the publisher dies, the version is superseded, the time
runs out) and then leaves an unspecified mix in what it wrote into; the weights a
server computes with must never be that mix. So a :class:`Staging` pulls into
buffers of its own — one registered buffer, the size of the parts it needs (for a
tensor-parallel rank, its share of the model: that is the memory it costs) — and
only a pull that returned, proven to be one version, is handed on
(:meth:`Staging.tensors`). Planned once per layout, the pull replays the same
:class:`~hixl.weights.BytePlan` for every version.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from .._exceptions import ParamInvalid
from .._memory import empty
from .._types import MemHandle
from ._manifest import Manifest
from ._plan import BytePlan, Shard
from .subscriber import Subscriber
from .vllm_layout import Cut

__all__ = ["Staging"]

_ALIGN = 64


class Staging:
    """Pulls ``tensor[cut]`` of each named tensor (name -> :class:`~hixl.weights.vllm_layout.Cut`)
    from ``subscriber``'s publisher into buffers registered once with its engine. Needs torch."""

    def __init__(self, subscriber: Subscriber, cuts: Mapping[str, Cut]) -> None:
        self.subscriber = subscriber
        self.cuts = dict(cuts)
        self.version: int | None = None
        """The version the staging holds, proven whole; None after a failed (or before any) pull."""
        self._layout: tuple[Any, ...] | None = None
        self._manifest: Manifest | None = None
        self._parts: dict[str, Any] = {}  # name -> the torch view its part lands in
        self._plan: BytePlan | None = None
        self._buffer: Any = None
        self._handle: MemHandle | None = None

    @property
    def nbytes(self) -> int:
        """Bytes one pull reads (0 before the first pull)."""
        return self._plan.nbytes if self._plan is not None else 0

    def pull(self, version: int | None, timeout: float) -> int:
        """Pull ``version`` (None: the newest) into the staging buffers; return the version now staged.

        On any error :attr:`version` is None and the error propagates (the buffers hold a mix).
        """
        self.version = None
        manifest = self.subscriber.manifest(version, timeout=timeout)
        if manifest.layout != self._layout:
            self._allocate(manifest)
        assert self._plan is not None
        # A newer version with another layout is planned again by the pull itself, into the same
        # parts: their shapes are checked there, so what is staged always fits the model.
        pulled = self.subscriber.pull(self._plan, version=version, timeout=timeout)
        self.version = pulled
        return pulled

    def _allocate(self, manifest: Manifest) -> None:
        """Lay the parts out in one buffer, register it, and plan the pull (once per layout)."""
        import torch

        specs: dict[str, tuple[Any, tuple[int, ...]]] = {}
        for name, cut in self.cuts.items():
            if name not in manifest:
                raise ParamInvalid(f"version {manifest.version} has no tensor {name!r}, which this model needs")
            spec = manifest.tensor(name)
            dims = list(spec.shape)
            if cut.dim is not None:
                if cut.dim >= len(dims) or cut.start + cut.size > dims[cut.dim]:
                    raise ParamInvalid(f"{name!r} has shape {spec.shape}: this model needs {cut} of it")
                dims[cut.dim] = cut.size
            specs[name] = (spec, tuple(dims))
        offsets, total = {}, 0
        for name, (spec, shape) in specs.items():
            offsets[name] = total
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=getattr(torch, spec.dtype)).element_size()
            total += -(-nbytes // _ALIGN) * _ALIGN
        self._release()
        self._buffer = empty(max(total, 1), shared=True)
        self._handle = self.subscriber.engine.register_mem(self._buffer)
        raw = torch.from_numpy(self._buffer)
        out: dict[str, Any] = {}
        self._parts = {}
        for name, (spec, shape) in specs.items():
            dtype = getattr(torch, spec.dtype)
            count = torch.Size(shape).numel()
            size = torch.empty((), dtype=dtype).element_size()
            part = raw[offsets[name] : offsets[name] + count * size].view(dtype).view(shape)
            self._parts[name] = part
            whole = tuple(shape) == tuple(spec.shape)  # read whole: the pull checks its checksum too
            out[name] = part if whole else Shard(part, self.cuts[name].index(len(shape)))
        self._plan = self.subscriber.plan(out, version=manifest.version)
        self._layout, self._manifest = manifest.layout, manifest

    def tensors(self) -> Iterator[tuple[str, Any]]:
        """Each staged tensor as its loader takes it: ``(name, tensor)``, full-sized, with the staged
        part in its place. What lies outside the part is never read by this rank's loader (the rule
        table of :mod:`~hixl.weights.vllm_layout`); its pages are allocated on demand only if touched.
        """
        import torch

        if self.version is None or self._manifest is None:
            raise ParamInvalid("nothing is staged: pull first")
        for name, part in self._parts.items():
            spec = self._manifest.tensor(name)
            if tuple(part.shape) == tuple(spec.shape):
                yield name, part
                continue
            full = torch.empty(spec.shape, dtype=part.dtype)
            full[self.cuts[name].index(len(spec.shape))] = part
            yield name, full

    def _release(self) -> None:
        if self._handle is not None:
            self.subscriber.engine.deregister_mem(self._handle)
            self._handle = None
        self._buffer = None

    def close(self) -> None:
        """Deregister the buffer and close the subscriber."""
        self._release()
        self.subscriber.close()

    def __repr__(self) -> str:
        return f"<Staging {len(self.cuts)} tensor(s), {self.nbytes} bytes, staged v{self.version}>"
