"""Row tables: how a row is stored so that a one-sided read of it can be checked, and what describes a table.

Each row is ``[seq | hash | payload, padded to 8 bytes]`` (``seq`` and ``hash``
little-endian u64). ``seq`` is ``2 * u`` once update ``u`` (the table's u-th
:meth:`~hixl.weights.Table.update`) has written the row, and ``2 * u - 1`` while it
does; ``hash`` is :func:`row_hashes` of ``seq`` and the payload. A reader copies
whole rows in one READ — in no particular order, byte by byte for all it knows —
and accepts a row only if its ``seq`` is even and its hash matches: a row whose
copy mixed two updates fails that (but for a chance of about 2**-64 per torn row),
and is read again. Where the reader's own code copies the row from memory mapped
in its process on a machine that keeps loads in order (shm, x86-64), it needs no
hash: it loads ``seq`` before and after copying the payload, and a row whose two
loads differ or are odd is torn (:class:`hixl.CheckedRows`) — the update stores
``seq`` odd, then the row, then ``seq`` even, and those stores are seen in that order.

The hash is computed for whole batches (:func:`hixl._accel.row_hashes`, in C, and
its numpy twin): each 8-byte word is xor-ed with a key for its position, passed
through the SplitMix64 finalizer (a bijection that spreads every input bit over
the output) and the results are summed. A reader checks a gathered batch and hands
it over in one call (:func:`accept`: :func:`hixl._accel.accept_rows`): a batch of
1024 rows of 256 bytes takes the C one ~0.05 ms here (~0.035 of it the hashes,
four sums at a time), numpy's ~0.3 ms.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._accel import accept_rows
from .._accel import row_hashes as row_hashes_into
from .._exceptions import ParamInvalid
from .._types import MemDesc
from . import _checks
from ._errors import ManifestError
from ._manifest import FORMAT, MAX_DIMS, MAX_NAME, checked_int, within
from ._tensors import DTYPES

__all__ = ["HEAD_WORDS", "TableInfo", "accept", "check_name", "row_hashes", "stride_of"]

HEAD_WORDS = 2  # seq, hash


def stride_of(row_bytes: int) -> int:
    """Bytes from one stored row to the next: the head words and the payload, padded to 8 bytes."""
    return 8 * (HEAD_WORDS + -(-row_bytes // 8))


def row_hashes(rows: np.ndarray) -> np.ndarray:
    """The hash of each row of an ``(n, HEAD_WORDS + w)`` uint64 array (its hash word left out)."""
    out = np.empty(len(rows), dtype=np.uint64)
    row_hashes_into(np.ascontiguousarray(rows), rows.shape[1], out)
    return out


def accept(words: np.ndarray, width: int, row_bytes: int, out: np.ndarray, versions: np.ndarray, torn: np.ndarray) -> int:
    """Check a read of ``len(torn)`` rows of ``width`` words (``words``: uint64) and hand them over if
    every row is whole: see :func:`hixl._accel.accept_rows` (0: payloads in ``out``, versions in
    ``versions``; else how many rows cannot be accepted — mid-update or mixed — listed in ``torn``)."""
    if not _checks.ENABLED:  # (tests only: every row taken as it came)
        rows = words.reshape(len(torn), width)
        out.reshape(len(torn), row_bytes)[:] = rows.view(np.uint8)[:, 8 * HEAD_WORDS : 8 * HEAD_WORDS + row_bytes]
        versions[:] = (rows[:, 0] >> np.uint64(1)).astype(np.int64)
        return 0
    return accept_rows(words, width, row_bytes, out, versions, torn)


@dataclass(frozen=True)
class TableInfo:
    """What a table server publishes about one table: its shape, dtype and where its rows are."""

    name: str
    rows: int
    row_shape: tuple[int, ...]
    dtype: str
    region: MemDesc

    @property
    def row_bytes(self) -> int:
        """Bytes of one row's payload."""
        return math.prod(self.row_shape) * DTYPES[self.dtype]

    @property
    def stride(self) -> int:
        """Bytes from one stored row to the next: the head words and the payload, padded to 8 bytes."""
        return stride_of(self.row_bytes)

    def encode(self) -> bytes:
        """The JSON a table server publishes."""
        doc = {
            "format": FORMAT,
            "name": self.name,
            "rows": self.rows,
            "row_shape": list(self.row_shape),
            "dtype": self.dtype,
            "region": [self.region.addr, self.region.len],
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes, name: str, registered: Sequence[MemDesc]) -> TableInfo:
        """Parse and check a peer's table description (it must describe ``name``, in registered memory)."""
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ManifestError(f"table description is not JSON: {exc}") from None
        keys = {"format", "name", "rows", "row_shape", "dtype", "region"}
        if not isinstance(doc, dict) or set(doc) != keys or doc["format"] != FORMAT or doc["name"] != name:
            raise ManifestError(f"table {name!r}: the description must be format {FORMAT} with exactly {sorted(keys)}")
        if doc["dtype"] not in DTYPES:
            raise ManifestError(f"table {name!r}: dtype {doc['dtype']!r:.30} is not one of {sorted(DTYPES)}")
        shape = doc["row_shape"]
        if not isinstance(shape, list) or len(shape) > MAX_DIMS:
            raise ManifestError(f"table {name!r}: row_shape must be a list of at most {MAX_DIMS} sizes")
        region = doc["region"]
        if not isinstance(region, list) or len(region) != 2:
            raise ManifestError(f"table {name!r}: region must be [addr, len]")
        info = cls(
            name,
            checked_int(doc["rows"], "rows", 1),
            tuple(checked_int(n, "row_shape", 1, 1 << 32) for n in shape),
            doc["dtype"],
            MemDesc(checked_int(region[0], "region addr"), checked_int(region[1], "region len", 1)),
        )
        if info.rows * info.stride != info.region.len or not within(info.region.addr, info.region.len, registered):
            raise ManifestError(f"table {name!r}: its {info.rows} rows are not its registered region")
        return info


def check_name(name: object) -> str:
    """A table's name: a non-empty string of at most 1 KiB."""
    if not isinstance(name, str) or not name or len(name.encode()) > MAX_NAME:
        raise ParamInvalid(f"a table name is a non-empty string of at most {MAX_NAME} bytes, not {name!r:.40}")
    return name
