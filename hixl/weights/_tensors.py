"""What :mod:`hixl.weights` needs to know of a tensor: numpy arrays and torch CPU tensors alike.

torch is never imported here: a tensor is recognised by its type's module, and by
then its caller has imported torch already.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._exceptions import ParamInvalid

__all__ = ["DTYPES", "View", "byte_array", "view_of"]

DTYPES: dict[str, int] = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
}
"""The element types a manifest may name, with their sizes in bytes (the whitelist a peer's manifest
is checked against): numpy's and torch's names, which agree on all of these."""


@dataclass(frozen=True)
class View:
    """Where a tensor's elements lie: its dtype's name, shape, strides in bytes and first element."""

    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    addr: int
    owner: Any
    """The array or tensor itself, kept alive with its view."""

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes of its elements."""
        return math.prod(self.shape) * self.itemsize

    def extent(self) -> tuple[int, int]:
        """The lowest address it touches and one past the highest (``(addr, addr)`` if it is empty)."""
        if self.nbytes == 0:
            return self.addr, self.addr
        low = sum(min(0, (n - 1) * s) for n, s in zip(self.shape, self.strides))
        high = sum(max(0, (n - 1) * s) for n, s in zip(self.shape, self.strides))
        return self.addr + low, self.addr + high + self.itemsize


def _is_torch(obj: Any) -> bool:
    module = type(obj).__module__
    return module == "torch" or module.startswith("torch.")


def view_of(obj: Any) -> View:
    """The :class:`View` of a numpy array or torch CPU tensor; :class:`ParamInvalid` for anything else."""
    if isinstance(obj, np.ndarray):
        dtype = obj.dtype.name
        if dtype not in DTYPES:
            raise ParamInvalid(f"dtype {dtype} is not one of {sorted(DTYPES)}")
        return View(dtype, tuple(obj.shape), tuple(obj.strides), int(obj.ctypes.data), obj)
    if _is_torch(obj) and hasattr(obj, "data_ptr"):
        if obj.device.type != "cpu":
            raise ParamInvalid(f"a tensor on {obj.device} cannot be moved; hixl moves CPU memory")
        dtype = str(obj.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise ParamInvalid(f"dtype {dtype} is not one of {sorted(DTYPES)}")
        size = DTYPES[dtype]
        return View(dtype, tuple(obj.shape), tuple(s * size for s in obj.stride()), int(obj.data_ptr()), obj)
    raise ParamInvalid(f"expected a numpy array or a torch CPU tensor, got {type(obj).__name__}")


def byte_array(obj: Any) -> np.ndarray:
    """A tensor's bytes, in C order, as a 1-D uint8 array: a view where it is contiguous, else a copy."""
    view_of(obj)  # the same checks and messages as everywhere else
    if isinstance(obj, np.ndarray):
        return np.ascontiguousarray(obj).reshape(-1).view(np.uint8)
    import torch  # the caller passed a tensor: torch is loaded already

    return obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy()  # type: ignore[no-any-return]
