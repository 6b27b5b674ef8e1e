"""Fuzz targets for hixl.weights' checksum in hixl._accel: ``weights_hash`` of bytes a subscriber
pulled from a peer, and ``copy_hash`` (a publisher's snapshot copy), over ranges of any length and
alignment — what the call reads and writes is exactly the range it is handed (the guards around it,
and the rest of the buffer, are compared too); and ``row_hashes`` of table rows a subscriber
gathered, any width, count, alignment and size of ``out`` (a mismatch refused alike)."""

from __future__ import annotations

import zlib
from types import ModuleType
from typing import Any

from .harness import Memory, outcome

_GUARD = 64
_SIZE = 1 << 19  # (up to twice GIL_FREE_FROM: the GIL-free path too)


class WeightsHash:
    """``weights_hash`` (or, with ``copy``, ``copy_hash``) of the case's bytes laid at ``offset``
    in a range of ``length`` bytes (the pattern after them); ``copy_hash`` lands them at ``to``."""

    name = "weights_hash"

    def __init__(self) -> None:
        self.memory = Memory(src=_SIZE, dst=_SIZE)

    def run(self, impl: ModuleType, case: dict[str, Any]) -> Any:
        room = _SIZE - 2 * _GUARD
        at, to = _GUARD + case["offset"] % room, _GUARD + case["to"] % room
        length = case["length"] % (room - max(at, to) + _GUARD + 1)
        self.memory.reset()
        src, dst = self.memory.buffers["src"], self.memory.buffers["dst"]
        data = bytes.fromhex(case["data"])[:length]
        src[at : at + len(data)] = list(data)
        if case["copy"]:
            answer = outcome(impl.copy_hash, dst[to : to + length], src[at : at + length])
        else:
            answer = outcome(impl.weights_hash, src[at : at + length])
        near = dst[max(0, to - _GUARD) : to + length + _GUARD].tobytes()
        return answer, near, zlib.crc32(dst), zlib.crc32(src)

    def close(self) -> None:
        pass


class RowHashes:
    """``row_hashes`` of ``rows`` rows of ``width`` words (the case's bytes, laid at ``offset``) into
    ``out`` bytes at ``to`` (a wrong size or width refused alike, nothing written)."""

    name = "row_hashes"

    def __init__(self) -> None:
        self.memory = Memory(src=_SIZE, dst=_SIZE)

    def run(self, impl: ModuleType, case: dict[str, Any]) -> Any:
        room = _SIZE - 2 * _GUARD
        at, to = _GUARD + case["offset"] % room, _GUARD + case["to"] % room
        width = case["width"] % 5000 - 4  # (some below 2, some above the 4096 allowed)
        length = min(case["rows"] * max(width, 1) * 8, room - at + _GUARD) if width > 0 else 0
        out = min(case["out"] % (room - to + _GUARD + 1), room - to + _GUARD)
        self.memory.reset()
        src, dst = self.memory.buffers["src"], self.memory.buffers["dst"]
        data = bytes.fromhex(case["data"])[:length]
        src[at : at + len(data)] = list(data)
        answer = outcome(impl.row_hashes, src[at : at + length], width, dst[to : to + out])
        near = dst[max(0, to - _GUARD) : to + out + _GUARD].tobytes()
        return answer, near, zlib.crc32(dst), zlib.crc32(src)

    def close(self) -> None:
        pass


TARGETS = (WeightsHash, RowHashes)
