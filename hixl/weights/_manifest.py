"""The manifest of one published version: which tensor lies where, and its checksum.

A publisher lays a version's tensors out in a slot (:func:`layout`) and publishes
the manifest, JSON, under its engine's metadata. Subscribers read it from a peer,
so :meth:`Manifest.decode` trusts nothing: every field is type- and range-checked,
dtypes come from a whitelist, counts are bounded, and every range a manifest names
must lie inside memory the publisher registered (what ``remote_mems`` says), so a
malformed manifest is refused whole with :class:`ManifestError` before any byte is read.
It names its checksum (``"checksum": "mlh64"``, :data:`~hixl.weights._checks.CHECKSUM`), or
``"none"`` (:data:`~hixl.weights._checks.NO_CHECKSUM`, every tensor's checksum 0) from a publisher
made with ``checksums=False``; one named otherwise is refused too, as a subscriber could not check
its tensors.

The layout (names, dtypes, shapes, where each tensor sits relative to its region)
is what a byte plan depends on; it is the same for every version published with
the same tensors, so a plan made once replays for every later version.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .._memory import PAGE_SIZE
from .._types import MemDesc
from ._checks import CHECKSUM, NO_CHECKSUM
from ._errors import ManifestError
from ._tensors import DTYPES

__all__ = ["FORMAT", "Manifest", "TensorSpec", "checked_int", "layout", "within"]

FORMAT = 1
MAX_TENSORS = 1 << 16
MAX_DIMS = 16
MAX_NAME = 1024
_U64 = (1 << 64) - 1
_SMALL_ALIGN = 64  # a cache line: small tensors packed densely; big ones start on a page (fast copies)


def checked_int(value: Any, what: str, low: int = 0, high: int = _U64) -> int:
    """``value`` if it is an int (not a bool) in ``[low, high]``, else :class:`ManifestError`."""
    if type(value) is not int or not low <= value <= high:
        raise ManifestError(f"{what} must be an integer in [{low}, {high}], not {value!r:.60}")
    return value


def within(addr: int, nbytes: int, registered: Sequence[MemDesc]) -> bool:
    """Whether ``[addr, addr + nbytes)`` lies inside one of the ``registered`` regions."""
    return any(r.addr <= addr and addr + nbytes <= r.addr + r.len for r in registered)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a version: its name, dtype, shape, where it lies and the checksum of its bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    region: int
    """Index into :attr:`Manifest.regions`."""
    offset: int
    """Bytes from the start of its region."""
    checksum: int
    """:data:`~hixl.weights._checks.CHECKSUM` of its bytes (64-bit); 0 in a manifest without checksums."""

    @property
    def nbytes(self) -> int:
        """Size of its elements in bytes."""
        return math.prod(self.shape) * DTYPES[self.dtype]


@dataclass(frozen=True)
class Manifest:
    """What one version is: its number, slot, header word, regions and tensors (see the module docstring)."""

    version: int
    slot: int
    header: int
    """Address of the slot's header word on the publisher: it holds ``version`` while the slot does."""
    regions: tuple[MemDesc, ...]
    tensors: tuple[TensorSpec, ...]
    checksum: str = CHECKSUM
    """Which checksum its tensors carry: :data:`~hixl.weights._checks.CHECKSUM`, or
    :data:`~hixl.weights._checks.NO_CHECKSUM` (none: leases and the header word prove a pull)."""
    _by_name: dict[str, TensorSpec] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {t.name: t for t in self.tensors})

    def tensor(self, name: str) -> TensorSpec:
        """The tensor called ``name``; :class:`KeyError` if this version has none."""
        return self._by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    @property
    def checksummed(self) -> bool:
        """Whether its tensors carry checksums a subscriber can check."""
        return self.checksum == CHECKSUM

    @property
    def layout(self) -> tuple[tuple[Any, ...], ...]:
        """Everything a byte plan depends on (equal layouts: a plan for one replays for the other)."""
        return tuple((t.name, t.dtype, t.shape, t.region, t.offset) for t in self.tensors)

    @property
    def nbytes(self) -> int:
        """Bytes of all its tensors."""
        return sum(t.nbytes for t in self.tensors)

    def encode(self) -> bytes:
        """The JSON a publisher publishes."""
        return json.dumps(
            {
                "format": FORMAT,
                "checksum": self.checksum,
                "version": self.version,
                "slot": self.slot,
                "header": self.header,
                "regions": [[r.addr, r.len] for r in self.regions],
                "tensors": [[t.name, t.dtype, list(t.shape), t.region, t.offset, t.checksum] for t in self.tensors],
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, data: bytes, registered: Sequence[MemDesc]) -> Manifest:
        """Parse and check a peer's manifest against the regions it registered (see the module docstring)."""
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ManifestError(f"manifest is not JSON: {exc}") from None
        keys = {"format", "checksum", "version", "slot", "header", "regions", "tensors"}
        if not isinstance(doc, dict) or set(doc) != keys:
            raise ManifestError(f"manifest must be an object with exactly the keys {sorted(keys)}")
        if doc["format"] != FORMAT:
            raise ManifestError(f"manifest format {doc['format']!r:.20} is not {FORMAT}")
        if doc["checksum"] not in (CHECKSUM, NO_CHECKSUM):
            raise ManifestError(f"manifest checksum {doc['checksum']!r:.20} is not {CHECKSUM!r} or {NO_CHECKSUM!r}")
        version = checked_int(doc["version"], "version", 1, (1 << 63) - 1)
        slot = checked_int(doc["slot"], "slot", 0, MAX_TENSORS)
        header = checked_int(doc["header"], "header")
        if header % 8 or not within(header, 8, registered):
            raise ManifestError(f"header word at {header:#x} is not an aligned word of registered memory")
        regions = _regions(doc["regions"], registered)
        tensors = _tensors(doc["tensors"], regions)
        if doc["checksum"] == NO_CHECKSUM and any(t.checksum for t in tensors):
            raise ManifestError(f"a manifest without checksums ({NO_CHECKSUM!r}) gives its tensors checksum 0")
        return cls(version, slot, header, regions, tensors, doc["checksum"])

    def rebased(self, slot: int, header: int, region: MemDesc, offsets: Sequence[int]) -> Manifest:
        """The same version and tensors (checksums included), laid out at ``offsets`` in one other region."""
        tensors = tuple(
            TensorSpec(t.name, t.dtype, t.shape, 0, offset, t.checksum) for t, offset in zip(self.tensors, offsets)
        )
        return Manifest(self.version, slot, header, (region,), tensors, self.checksum)


def _regions(value: Any, registered: Sequence[MemDesc]) -> tuple[MemDesc, ...]:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_TENSORS:
        raise ManifestError(f"regions must be a list of 1 to {MAX_TENSORS} [addr, len] pairs")
    regions = []
    for i, pair in enumerate(value):
        if not isinstance(pair, list) or len(pair) != 2:
            raise ManifestError(f"region {i} must be [addr, len]")
        addr, nbytes = checked_int(pair[0], f"region {i} addr"), checked_int(pair[1], f"region {i} len", 1)
        if not within(addr, nbytes, registered):
            raise ManifestError(f"region {i} ({nbytes} bytes at {addr:#x}) is not inside the publisher's registered memory")
        regions.append(MemDesc(addr, nbytes))
    return tuple(regions)


def _tensors(value: Any, regions: tuple[MemDesc, ...]) -> tuple[TensorSpec, ...]:
    if not isinstance(value, list) or len(value) > MAX_TENSORS:
        raise ManifestError(f"tensors must be a list of at most {MAX_TENSORS} entries")
    tensors, names = [], set()
    for i, entry in enumerate(value):
        if not isinstance(entry, list) or len(entry) != 6:
            raise ManifestError(f"tensor {i} must be [name, dtype, shape, region, offset, checksum]")
        name, dtype, shape = entry[0], entry[1], entry[2]
        if not isinstance(name, str) or not name or len(name.encode()) > MAX_NAME or name in names:
            raise ManifestError(f"tensor {i}: name must be a unique non-empty string of at most {MAX_NAME} bytes")
        names.add(name)
        if dtype not in DTYPES:
            raise ManifestError(f"tensor {name!r}: dtype {dtype!r:.30} is not one of {sorted(DTYPES)}")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS:
            raise ManifestError(f"tensor {name!r}: shape must be a list of at most {MAX_DIMS} sizes")
        dims = tuple(checked_int(n, f"tensor {name!r} shape") for n in shape)
        region = checked_int(entry[3], f"tensor {name!r} region", 0, len(regions) - 1)
        offset = checked_int(entry[4], f"tensor {name!r} offset")
        checksum = checked_int(entry[5], f"tensor {name!r} checksum")
        nbytes = math.prod(dims) * DTYPES[dtype]  # Python ints: no overflow on the way to the bound check
        if offset + nbytes > regions[region].len:
            raise ManifestError(f"tensor {name!r} ({nbytes} bytes at offset {offset}) overruns its region")
        tensors.append(TensorSpec(name, dtype, dims, region, offset, checksum))
    return tuple(tensors)


def layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets for tensors of ``sizes`` bytes packed in order into one slot, and the slot size needed."""
    offsets, end = [], 0
    for nbytes in sizes:
        align = PAGE_SIZE if nbytes >= PAGE_SIZE else _SMALL_ALIGN
        end = -(-end // align) * align
        offsets.append(end)
        end += nbytes
    return offsets, end
