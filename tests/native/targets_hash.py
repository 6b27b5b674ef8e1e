"""Fuzz targets for hixl.weights' checksum in hixl._accel: ``weights_hash`` of bytes a subscriber
pulled from a peer, and ``copy_hash`` (a publisher's snapshot copy), over ranges of any length and
alignment — what the call reads and writes is exactly the range it is handed (the guards around it,
and the rest of the buffer, are compared too); and ``row_hashes`` of table rows a subscriber
gathered, any width, count, alignment and size of ``out`` (a mismatch refused alike); ``gather_rows``
(a batch of a table's rows by number, from memory mapped here) and ``accept_rows`` (such a batch
checked, and handed over only if every row is whole), any stride, width and mix of torn rows; and
``gather_checked_rows`` (a batch straight into the caller's array, each row's sequence word loaded
around its copy), any stride, alignment, limit and mix of rows caught mid-update."""

from __future__ import annotations

import zlib
from types import ModuleType
from typing import Any

import numpy as np

from hixl._accel import pure

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


class GatherRows:
    """``gather_rows`` of the case's row numbers (each taken into the table, but for the negative
    ones, which must be refused) of a table of ``stride`` bytes a row at ``src`` into ``dst``; a
    stride below 1 or row numbers not int64 refused alike, nothing copied."""

    name = "gather_rows"

    def __init__(self) -> None:
        self.memory = Memory(table=_SIZE, slots=_SIZE)

    def run(self, impl: ModuleType, case: dict[str, Any]) -> Any:
        stride = case["stride"] % 1100 - 20  # (some below 1: refused)
        at, to = case["src"] % 4096, case["dst"] % 4096
        table_rows = (_SIZE - at) // max(stride, 1)
        numbers = [-1 - (-r % 5) if r < 0 else r % table_rows for r in case["rows"]][: (_SIZE - to) // max(stride, 1)]
        rows = np.array(numbers, dtype=np.int64 if case["int64"] else np.int32)
        self.memory.reset()
        answer = outcome(impl.gather_rows, self.memory.addr("slots", to), self.memory.addr("table", at), stride, rows)
        return answer, zlib.crc32(self.memory.buffers["slots"]), zlib.crc32(self.memory.buffers["table"])

    def close(self) -> None:
        pass


class AcceptRows:
    """``accept_rows`` of ``rows`` rows of ``width`` words made whole from the case's bytes (an even
    sequence word, the right hash), then torn where the case says (a sequence word made odd, a word
    changed), handed ``row_bytes`` of payload a row and an ``out`` ``extra`` bytes off its size (a
    wrong size or width refused alike, nothing written)."""

    name = "accept_rows"

    def run(self, impl: ModuleType, case: dict[str, Any]) -> Any:
        width = case["width"] % 80 - 2  # (some below 2: refused)
        n = case["rows"] % 300
        row_bytes = case["row_bytes"] % (8 * max(width - 2, 0) + 3)  # (some past the payload: refused)
        data = bytes.fromhex(case["data"]) or b"\0"
        words = np.frombuffer((data * (8 * max(width, 1) * n // len(data) + 1))[: 8 * max(width, 1) * n], np.uint64)
        words = words.copy().reshape(n, max(width, 1))
        if width >= 2 and n:
            words[:, 0] &= ~np.uint64(1)
            hashes = np.empty(n, np.uint64)
            pure.row_hashes(words, width, hashes)
            words[:, 1] = hashes
            for row, word, flip in case["tear"]:
                words[row % n, word % width] ^= np.uint64(flip % (1 << 64))
        extra, short = max(-2, min(2, case["extra"])), max(-2, min(2, case["short"]))
        out = np.full(max(n * row_bytes + extra, 0), 0xA5, np.uint8)
        versions, torn = np.full(n, -7, np.int64), np.full(max(n + short, 0), -9, np.int64)
        answer = outcome(impl.accept_rows, words, width, row_bytes, out, versions, torn)
        return answer, out.tobytes(), versions.tobytes(), torn.tobytes()

    def close(self) -> None:
        pass


class GatherCheckedRows:
    """``gather_checked_rows`` of the case's row numbers (some past ``limit`` or negative: refused,
    nothing written) of a table of ``stride`` bytes a row at ``src`` made of the case's bytes, the
    sequence words the case names made odd (rows mid-update: torn), into an ``out`` ``extra`` bytes
    off its size; a stride that is not a multiple of 8 or below 16, a payload past the row, a table
    address that is not a multiple of 8 or row numbers not int64, refused alike."""

    name = "gather_checked_rows"

    def __init__(self) -> None:
        self.memory = Memory(table=_SIZE)

    def run(self, impl: ModuleType, case: dict[str, Any]) -> Any:
        stride = case["stride"] % 1100 - 20  # (some below 16, some not a multiple of 8: refused)
        at = case["src"] % 4096  # (some not a multiple of 8: refused)
        table_rows = (_SIZE - at) // max(stride, 8)
        limit = max(1, min(table_rows, case["limit"] % (table_rows + 1)))
        numbers = [-1 - (-r % 5) if r < 0 else r % (limit + 2) for r in case["rows"]]  # (some past limit: refused)
        rows = np.array(numbers, dtype=np.int64 if case["int64"] else np.int32)
        row_bytes = case["row_bytes"] % (max(stride, 16) - 16 + 3)  # (some past the payload: refused)
        self.memory.reset()
        table = self.memory.buffers["table"]
        data = bytes.fromhex(case["data"]) or b"\0"
        table[at : at + limit * max(stride, 8)] = list((data * (limit * max(stride, 8) // len(data) + 1))[: limit * max(stride, 8)])
        if stride >= 16 and not stride % 8:
            for r in range(limit):
                seq = at + r * stride
                table[seq] &= 0xFE  # an even sequence word: whole
            for r in case["odd"]:
                table[at + (r % limit) * stride] |= 1
        n, extra = len(numbers), max(-2, min(2, case["extra"]))
        out = np.full(max(n * row_bytes + extra, 0), 0xA5, np.uint8)
        versions, torn = np.full(n, -7, np.int64), np.full(n, -9, np.int64)
        answer = outcome(
            impl.gather_checked_rows, self.memory.addr("table", at), stride, rows, limit, row_bytes, out, versions, torn,
            case["check"],
        )
        return answer, out.tobytes(), versions.tobytes(), torn.tobytes(), zlib.crc32(table)

    def close(self) -> None:
        pass


TARGETS = (WeightsHash, RowHashes, GatherRows, AcceptRows, GatherCheckedRows)
