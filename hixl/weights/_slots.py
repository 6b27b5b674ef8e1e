"""The memory of a publisher's snapshot slots: one shared-memory pool allocation per slot.

Pool memory (``hixl.empty(..., shared=True)``) so that peers the ``shm`` transport
serves can read it too. Each slot is registered read-only in the serving engine:
subscribers may read it, never write it. A relay fills its slots by READing into
them through a second engine (its subscriber's), which needs them registered
writable there (``filler``); peers of the serving engine still see them read-only.
A slot grows (a new allocation, the old one deregistered) when a version needs more.
"""

from __future__ import annotations

import numpy as np

from .._exceptions import HixlError
from .._memory import PAGE_SIZE, empty
from .._types import MemDesc, MemHandle
from ..engine import Engine

__all__ = ["SlotBuffers"]


class SlotBuffers:
    """``count`` slots' memory, registered read-only in ``engine`` (and read-write in ``filler``)."""

    def __init__(self, engine: Engine, count: int, filler: Engine | None = None) -> None:
        self._engine = engine
        self._filler = filler
        self._buffers: list[np.ndarray | None] = [None] * count
        self._handles: list[list[tuple[Engine, MemHandle]]] = [[] for _ in range(count)]

    def ensure(self, index: int, nbytes: int) -> np.ndarray:
        """Slot ``index``'s memory, at least ``nbytes`` of it (1-D uint8); reallocated if smaller.

        Only for a slot nobody reads (the ledger says WRITING): a reallocation deregisters the old one.
        """
        buf = self._buffers[index]
        if buf is not None and len(buf) >= nbytes:
            return buf
        self._drop(index)
        buf = empty(max(PAGE_SIZE, -(-nbytes // PAGE_SIZE) * PAGE_SIZE), shared=True)
        self._handles[index].append((self._engine, self._engine.register_mem(buf, access="r")))
        if self._filler is not None:
            self._handles[index].append((self._filler, self._filler.register_mem(buf)))
        self._buffers[index] = buf
        return buf

    def region(self, index: int) -> MemDesc:
        """Where slot ``index`` lies (it must have been :meth:`ensure`\\ d)."""
        buf = self._buffers[index]
        assert buf is not None
        return MemDesc(int(buf.ctypes.data), len(buf))

    def _drop(self, index: int) -> None:
        for engine, handle in self._handles[index]:
            try:
                engine.deregister_mem(handle)
            except HixlError:
                pass  # the engine was finalized first: its registrations are gone
        self._handles[index].clear()
        self._buffers[index] = None

    def close(self) -> None:
        """Deregister every slot (when this returns, no peer reads them) and let them go."""
        for index in range(len(self._buffers)):
            self._drop(index)
