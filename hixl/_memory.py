"""Local memory: turning user buffers into registered regions, and descriptor arrays.

Descriptors are kept as ``(N, 3)`` ``uint64`` numpy arrays — columns local address,
remote address, length — so that a batch of 10^5 blocks costs three array columns,
not 10^5 Python objects. Every check here is vectorised.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from . import _shm_pool
from ._exceptions import AccessDenied, MemoryRangeError, ParamInvalid, ProtocolError, ResourceExhausted
from ._types import MemDesc, MemHandle, MemType, TransferOpDesc

__all__ = [
    "PAGE_SIZE",
    "Region",
    "RegionTable",
    "RegionUpdate",
    "Registry",
    "RemoteRegions",
    "as_desc_array",
    "buffer_range",
    "empty",
    "merge_adjacent",
    "memory_view",
]

PAGE_SIZE = mmap.PAGESIZE
# A range registered "rw" is writable by every connected peer (one-sided WRITE); writing
# into an immutable object (bytes, a read-only array) would corrupt the process.
_READ_ONLY = (
    "cannot register a read-only buffer for writing: peers may WRITE into memory registered "
    "with access='rw'; register it with access='r'"
)
ACCESS_MODES = ("rw", "r")
_U64_MAX = (1 << 64) - 1
_WRITABLE = np.uint64(1)
# What a newcomer passing a buffer where an address belongs needs to read.
ADDRESS_HINT = "an address is an int: buf.ctypes.data for a numpy array, tensor.data_ptr() for a torch tensor"


def empty(shape: int | Sequence[int], dtype: Any = np.uint8, *, shared: bool = False) -> np.ndarray:
    """A new, page-aligned, zero-filled numpy array backed by an anonymous mapping.

    Copies between buffers whose page offsets differ run several times slower on
    common CPUs (the ``rep movsb`` fast path needs matching alignment), so the
    easy way to get a buffer is also the fast one. ``shape`` may be a byte count
    (with the default ``uint8`` dtype) or any numpy shape.

    The mapping is private and asks for transparent huge pages (``MADV_HUGEPAGE``,
    as numpy does for its own large arrays; the kernel grants them where
    ``/sys/kernel/mm/transparent_hugepage/enabled`` says ``madvise`` or
    ``always``): the kernel pins a huge page for a peer's ``process_vm_*`` far
    faster than 512 small ones (docs/engine.md, "Memory"). Like any private
    memory, a forked child gets a copy of it, not the same pages.

    ``shared=True`` takes the memory from hixl's shared-memory pool instead (a
    memfd, its pages allocated up front): registered, it can be moved by the
    ``shm`` transport, which peers on this host use when cross-memory attach is
    refused (another user, another pid namespace). A torch tensor on it:
    ``torch.from_numpy(hixl.empty(shape, np.float16, shared=True))`` (for dtypes
    numpy lacks, a byte array ``.view(torch.bfloat16)``). Raises
    :class:`MemoryError` if the pages cannot be had.
    """
    dt = np.dtype(dtype)
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = int(np.prod(dims, dtype=np.int64)) * dt.itemsize
    if nbytes < 0:
        raise ParamInvalid(f"negative size {shape!r}")
    mapping = _shm_pool.allocate(nbytes) if shared else _private_mapping(max(nbytes, 1))
    return np.frombuffer(mapping, dtype=np.uint8, count=nbytes).view(dt).reshape(dims)


def _private_mapping(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping of ``nbytes``, on transparent huge pages where the kernel has them.

    Asked for at every size: the kernel only puts a huge page on a whole aligned 2 MiB inside the
    mapping, so a small buffer stays on small pages; and the mark keeps the kernel from merging the
    mapping with plain anonymous memory beside it (Python's own arenas).
    """
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel built without transparent huge pages: small pages
            pass
    return mapping


def buffer_range(buf: Any, mem_type: MemType = MemType.HOST, writable: bool = True) -> tuple[int, int, Any]:
    """Return ``(address, nbytes, keepalive)`` for anything hixl can register.

    Accepts numpy arrays, torch tensors (duck-typed, so torch stays optional),
    objects with the buffer protocol (bytearray, memoryview, mmap) and
    :class:`MemDesc`. ``keepalive`` must be held while the range is registered.
    With ``writable``, read-only buffers are refused.
    """
    if isinstance(buf, MemDesc):
        if not (_is_int(buf.addr) and _is_int(buf.len)):
            raise ParamInvalid(f"MemDesc(addr, len) takes two ints, not {_type_names(buf)} ({ADDRESS_HINT})")
        addr, nbytes = int(buf.addr), int(buf.len)
        if addr <= 0 or nbytes <= 0 or addr + nbytes > _U64_MAX:
            raise ParamInvalid(f"invalid MemDesc {buf!r}")
        return addr, nbytes, None
    if hasattr(buf, "data_ptr") and hasattr(buf, "element_size"):
        return _tensor_range(buf, mem_type)
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ParamInvalid("numpy array must be C-contiguous to be registered")
        if buf.nbytes == 0:
            raise ParamInvalid("cannot register an empty array")
        if writable and not buf.flags.writeable:
            raise ParamInvalid(_READ_ONLY)
        return int(buf.ctypes.data), int(buf.nbytes), buf
    try:
        view = np.frombuffer(buf, dtype=np.uint8)
    except (TypeError, ValueError, BufferError) as exc:
        raise ParamInvalid(f"cannot register object of type {type(buf).__name__}: {exc}") from exc
    if view.size == 0:
        raise ParamInvalid("cannot register an empty buffer")
    if writable and not view.flags.writeable:
        raise ParamInvalid(_READ_ONLY)
    return int(view.ctypes.data), int(view.nbytes), view


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _type_names(values: Iterable[Any]) -> str:
    return "(" + ", ".join(type(v).__name__ for v in values) + ")"


def _tensor_range(tensor: Any, mem_type: MemType) -> tuple[int, int, Any]:
    device = getattr(getattr(tensor, "device", None), "type", "cpu")
    if mem_type is MemType.HOST and device != "cpu":
        raise ParamInvalid(f"a {device} tensor is not HOST memory")
    if not tensor.is_contiguous():
        raise ParamInvalid("tensor must be contiguous to be registered")
    nbytes = int(tensor.numel()) * int(tensor.element_size())
    if nbytes == 0:
        raise ParamInvalid("cannot register an empty tensor")
    return int(tensor.data_ptr()), nbytes, tensor


def memory_view(addr: int, nbytes: int) -> memoryview:
    """A writable byte view of raw memory, for socket I/O straight into registered buffers."""
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


class Region(MemDesc):
    """A registered range (same fields as :class:`MemDesc`)."""


_BULK_FROM = 64
"""Batches of this many ranges are first checked against one region at once (see :meth:`RegionTable.outside`)."""


class RegionTable:
    """An immutable set of address ranges answering "is every descriptor inside?" in bulk.

    Overlapping or touching registrations are merged first, so a descriptor that
    spans two adjacent registrations is accepted: the memory behind it is valid.
    """

    __slots__ = ("_ends", "_starts", "intervals", "regions")

    def __init__(self, regions: Iterable[tuple[int, int]]) -> None:
        self.regions: tuple[MemDesc, ...] = tuple(MemDesc(int(a), int(n)) for a, n in regions)
        starts: list[int] = []
        ends: list[int] = []
        for addr, nbytes in sorted(self.regions):
            if ends and addr <= ends[-1]:
                ends[-1] = max(ends[-1], addr + nbytes)
            else:
                starts.append(addr)
                ends.append(addr + nbytes)
        self._starts = np.array(starts, dtype=np.uint64)
        self._ends = np.array(ends, dtype=np.uint64)
        self.intervals = (starts, ends)
        """The merged regions' starts and ends as plain lists: for a handful of descriptors, bisect
        (or :func:`hixl._accel.check_small`) beats numpy's call overhead."""

    def __len__(self) -> int:
        return len(self.regions)

    def contains(self, addr: int, nbytes: int) -> bool:
        """Whether ``[addr, addr+nbytes)`` lies inside one merged region (scalar fast path)."""
        starts, ends = self.intervals
        slot = bisect.bisect_right(starts, addr) - 1
        return slot >= 0 and addr + nbytes <= ends[slot]

    def outside(self, addrs: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """Indices of the ranges ``[addrs[i], addrs[i]+lens[i])`` not inside one merged region."""
        if len(self._starts) == 0 or len(addrs) == 0:
            return np.arange(len(addrs))
        if len(addrs) == 1 and self.contains(int(addrs[0]), int(lens[0])):
            return np.arange(0)  # (one range, inside: a bisect, without numpy's per-call costs)
        if len(self._starts) > 1 and len(addrs) < _BULK_FROM:
            return np.flatnonzero(self._search(addrs, lens))
        # One region, or a large batch, which mostly lies in one (a KV cache's blocks, and a word
        # elsewhere): every range is tested against that region at once — the only one, or the
        # middle range's — and only those not in it are searched for (40 960 blocks among a few
        # regions: ~0.07 ms, against ~0.6 ms searching for each).
        bulk = max(0, bisect.bisect_right(self.intervals[0], int(addrs[len(addrs) // 2])) - 1)
        elsewhere = np.flatnonzero(~((addrs >= self._starts[bulk]) & (addrs + lens <= self._ends[bulk])))
        return elsewhere[self._search(addrs[elsewhere], lens[elsewhere])]

    def _search(self, addrs: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """Per range: True where it lies inside no merged region (a search for each)."""
        slot = np.searchsorted(self._starts, addrs, side="right").astype(np.int64) - 1
        inside = slot >= 0
        ends = self._ends[np.maximum(slot, 0)]
        inside &= addrs + lens <= ends
        return ~inside

    def check(self, addrs: np.ndarray, lens: np.ndarray, what: str, hint: str = "") -> None:
        """Raise :class:`MemoryRangeError` naming the first range outside the table (and ``hint``)."""
        bad = self.outside(addrs, lens)
        if len(bad):
            i = int(bad[0])
            raise MemoryRangeError(
                f"{what} range [{int(addrs[i]):#x}, +{int(lens[i])}) of descriptor {i} is "
                f"outside registered memory ({len(bad)} descriptor(s) affected); {self._nearest(int(addrs[i]))}"
                + (f": {hint}" if hint else "")
            )

    def _nearest(self, addr: int) -> str:
        """What is registered near ``addr``: the merged region at or below it (else the first)."""
        if not len(self._starts):
            return "nothing is registered there"
        slot = max(int(np.searchsorted(self._starts, np.uint64(addr), side="right")) - 1, 0)
        start, end = int(self._starts[slot]), int(self._ends[slot])
        return f"{len(self._starts)} range(s) registered there, the nearest [{start:#x}, +{end - start})"


class RemoteRegions:
    """Registered ranges with their access rights: which may be read, which also written.

    Used for a peer's regions (as its REGIONS frames list them) and for this
    engine's own. ``rows`` is the ``(N, 3)`` uint64 array ``(addr, len, flags)``.
    """

    __slots__ = ("readable", "rows", "writable")

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows
        self.readable = RegionTable(rows[:, :2].tolist())
        self.writable = RegionTable(rows[rows[:, 2] & _WRITABLE != 0][:, :2].tolist())

    @classmethod
    def from_rows(cls, rows: Any) -> RemoteRegions:
        """From an ``(N, 3)`` array or a list of ``[addr, len, flags]`` (as in WELCOME)."""
        try:
            array = np.array(rows, dtype=np.uint64).reshape(-1, 3)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ProtocolError(f"malformed region list: {exc}") from None
        return cls(array)

    @property
    def regions(self) -> tuple[MemDesc, ...]:
        """Every region, in the order the owner listed them."""
        return self.readable.regions

    def changed(self, added: np.ndarray, removed: np.ndarray) -> RemoteRegions:
        """These regions less ``removed``, plus ``added`` (both ``(N, 3)`` rows): a new table."""
        rows = self.rows
        if len(removed):
            rows = rows[~np.isin(_row_keys(rows), _row_keys(removed))]
        if len(added):
            rows = np.concatenate([rows, np.asarray(added, dtype=np.uint64).reshape(-1, 3)])
        return RemoteRegions(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def contains(self, addr: int, nbytes: int, write: bool) -> bool:
        """Whether ``[addr, addr+nbytes)`` may be read (or, with ``write``, written)."""
        return (self.writable if write else self.readable).contains(addr, nbytes)

    def outside(self, addrs: np.ndarray, lens: np.ndarray, write: bool = False) -> np.ndarray:
        """Indices of ranges that may not be read (or, with ``write``, written)."""
        return (self.writable if write else self.readable).outside(addrs, lens)

    def check(
        self, addrs: np.ndarray, lens: np.ndarray, write: bool = False, what: str = "remote", hint: str = ""
    ) -> None:
        """Raise :class:`MemoryRangeError` for a range outside every region (ending with ``hint``), and
        :class:`AccessDenied` for one that would write into a read-only region."""
        self.readable.check(addrs, lens, what, hint)
        if write:
            bad = self.writable.outside(addrs, lens)
            if len(bad):
                i = int(bad[0])
                raise AccessDenied(
                    f"{what} range [{int(addrs[i]):#x}, +{int(lens[i])}) of descriptor {i} lies in memory "
                    f"registered read-only (access='r'); it may be read, not written"
                )


def _row_keys(rows: np.ndarray) -> np.ndarray:
    """Each ``(addr, len, flags)`` row as one opaque 24-byte value, for set operations on rows."""
    return np.ascontiguousarray(rows, dtype=np.uint64).reshape(-1, 3).view(np.dtype((np.void, 24))).ravel()


_NO_ROWS = np.empty((0, 3), dtype=np.uint64)
CHANGE_LOG = 256
"""Registration changes a :class:`Registry` remembers, to tell a peer what changed since it last heard."""


class RegionUpdate(NamedTuple):
    """What a peer that knows the registrations of generation ``base`` needs to know those of
    ``generation``: ``added`` and ``removed`` rows, or (``base`` None) the whole table in ``added``."""

    generation: int
    base: int | None
    added: np.ndarray
    removed: np.ndarray


class _Snapshot(NamedTuple):
    generation: int
    table: RemoteRegions


class OwnView:
    """This engine's own view of its registrations (:attr:`Registry.own`): where its transfers may read
    from (every registration) and land (those registered ``rw``, and those registered ``r`` whose
    buffer is itself writable: ``r`` keeps *peers* from writing, not this engine from reading into
    its own memory). ``table`` is replaced, never mutated, on each change."""

    __slots__ = ("table",)

    def __init__(self) -> None:
        self.table = RemoteRegions(_NO_ROWS)


class Registry:
    """This engine's registrations; thread-safe, notifies listeners on every change.

    Each change bumps the *generation* and is remembered (the last
    :data:`CHANGE_LOG` of them), so a peer that was told generation ``g`` can be
    sent only what changed since (:meth:`update_since`) rather than every region.
    """

    def __init__(self, max_registrations: int = 65536) -> None:
        self._lock = threading.Lock()
        self._by_range: dict[tuple[int, int, MemType], MemHandle] = {}
        self._keepalive: dict[int, Any] = {}
        self._next_id = 1
        self._max = max_registrations
        self._snapshot = _Snapshot(0, RemoteRegions(_NO_ROWS))
        self._landable: set[int] = set()  # ids of "r" registrations whose buffers are writable
        self.own = OwnView()
        # (generation, added rows, removed rows) of the latest changes, oldest first.
        self._log: deque[tuple[int, list[tuple[int, int, int]], list[tuple[int, int, int]]]] = deque(maxlen=CHANGE_LOG)
        self.listeners: list[Any] = []

    @property
    def table(self) -> RemoteRegions:
        """Every registration with its access; replaced (never mutated) on each change."""
        return self._snapshot.table

    @property
    def generation(self) -> int:
        """Counts the changes: :attr:`table` is at least as new as this generation."""
        return self._snapshot.generation

    def current(self) -> tuple[int, RemoteRegions]:
        """The generation and its table, read together (one is never newer than the other)."""
        return self._snapshot

    def update_since(self, base: int) -> RegionUpdate:
        """What changed since generation ``base``: a delta if the log reaches back that far and
        it is smaller than the table, else the whole table (``base`` None)."""
        with self._lock:
            generation, table = self._snapshot
            if base == generation:
                return RegionUpdate(generation, base, _NO_ROWS, _NO_ROWS)
            oldest = self._log[0][0] if self._log else generation + 1
            if base < oldest - 1 or base > generation:
                return RegionUpdate(generation, None, table.rows, _NO_ROWS)
            net: dict[tuple[int, int, int], int] = {}
            for changed_at, added, removed in self._log:
                if changed_at > base:
                    for row in added:
                        net[row] = net.get(row, 0) + 1
                    for row in removed:
                        net[row] = net.get(row, 0) - 1
        plus = [row for row, n in net.items() if n > 0]
        minus = [row for row, n in net.items() if n < 0]
        if len(plus) + len(minus) >= len(table):
            return RegionUpdate(generation, None, table.rows, _NO_ROWS)
        return RegionUpdate(generation, base, _rows(plus), _rows(minus))

    def register(self, buf: Any, mem_type: MemType = MemType.HOST, access: str = "rw") -> MemHandle:
        """Register ``buf``; the same range, type and access give back the same handle."""
        if not isinstance(mem_type, MemType):
            raise ParamInvalid(f"mem_type must be a MemType, not {mem_type!r}")
        if mem_type is not MemType.HOST:
            raise ParamInvalid(f"{mem_type.name} memory needs a device transport; none is installed")
        if access not in ACCESS_MODES:
            raise ParamInvalid(f"access must be 'rw' (peers may read and write) or 'r' (read only), not {access!r}")
        addr, nbytes, keepalive = buffer_range(buf, mem_type, writable=access == "rw")
        landable = access == "rw" or _writable_buffer(buf, mem_type)
        key = (addr, nbytes, mem_type)
        with self._lock:
            handle = self._by_range.get(key)
            if handle is not None and handle.access != access:
                raise ParamInvalid(f"{handle!r} is registered already with access={handle.access!r}")
            if handle is None:
                if len(self._by_range) >= self._max:
                    raise ResourceExhausted(f"at most {self._max} registrations per engine")
                handle = MemHandle(self._next_id, addr, nbytes, mem_type, access)
                self._next_id += 1
                self._by_range[key] = handle
                self._keepalive[handle.id] = keepalive
                if landable:
                    self._landable.add(handle.id)
                self._rebuild([_row_of(handle)], [])
        return handle

    def deregister(self, handle: MemHandle) -> None:
        """Forget a registration; an unknown handle is a :class:`ParamInvalid`."""
        self.deregister_many([handle])

    def deregister_many(self, handles: Sequence[MemHandle]) -> None:
        """Forget several registrations as one change (one generation); if any handle is unknown (or
        named twice), :class:`ParamInvalid` and none is forgotten."""
        with self._lock:
            keys = [(h.addr, h.len, h.mem_type) for h in handles]
            for handle, key in zip(handles, keys):
                if self._by_range.get(key) != handle:
                    raise ParamInvalid(f"{handle!r} is not registered")
            if len(set(keys)) != len(keys):
                raise ParamInvalid("a handle is named twice")
            for handle, key in zip(handles, keys):
                del self._by_range[key]
                del self._keepalive[handle.id]
                self._landable.discard(handle.id)
            self._rebuild([], [_row_of(h) for h in handles])

    def clear(self) -> None:
        """Drop every registration (used by ``finalize``)."""
        with self._lock:
            removed = self.regions()
            self._by_range.clear()
            self._keepalive.clear()
            self._landable.clear()
            self._rebuild([], removed)

    def regions(self) -> list[tuple[int, int, int]]:
        """Every registered ``(addr, len, flags)`` (flags: :data:`~hixl._protocol.REGION_WRITABLE`)."""
        return [_row_of(h) for h in self._by_range.values()]

    def _rebuild(self, added: list[tuple[int, int, int]], removed: list[tuple[int, int, int]]) -> None:
        generation = self._snapshot.generation + 1
        self._log.append((generation, added, removed))
        self._snapshot = _Snapshot(generation, RemoteRegions(_rows(self.regions())))
        self.own.table = RemoteRegions(
            _rows([(h.addr, h.len, int(h.id in self._landable)) for h in self._by_range.values()])
        )
        for listener in list(self.listeners):
            listener(self._snapshot.table, generation)


def _writable_buffer(buf: Any, mem_type: MemType) -> bool:
    """Whether this engine may land bytes in ``buf`` (a raw :class:`MemDesc` is the caller's word that it may)."""
    try:
        buffer_range(buf, mem_type, writable=True)
    except ParamInvalid:
        return False
    return True


def _row_of(handle: MemHandle) -> tuple[int, int, int]:
    return (handle.addr, handle.len, int(handle.access == "rw"))


def _rows(rows: list[tuple[int, int, int]]) -> np.ndarray:
    return np.array(rows, dtype=np.uint64).reshape(-1, 3)


def as_desc_array(op_descs: Any) -> np.ndarray:
    """Normalise ``op_descs`` to a C-contiguous ``(N, 3)`` uint64 array, checking its shape.

    Accepts a list of :class:`TransferOpDesc` (or 3-tuples) or an integer
    ``(N, 3)`` numpy array, which is used without a per-descriptor Python step.
    """
    if isinstance(op_descs, np.ndarray):
        if op_descs.ndim != 2 or op_descs.shape[1] != 3:
            raise ParamInvalid(f"op_descs array must have shape (N, 3), not {op_descs.shape}")
        if op_descs.dtype.kind not in "iu":
            raise ParamInvalid(f"op_descs array must be integer, not {op_descs.dtype}")
        if op_descs.dtype.kind == "i" and len(op_descs) and int(op_descs.min()) < 0:
            raise ParamInvalid("op_descs contains negative values")
        descs = np.ascontiguousarray(op_descs, dtype=np.uint64)
    else:
        if isinstance(op_descs, TransferOpDesc):
            raise ParamInvalid("op_descs must be a list of TransferOpDesc, not a single one")
        try:
            items = list(op_descs)
        except TypeError:
            raise ParamInvalid(f"op_descs must be a list of {_DESC_FORM}, not {type(op_descs).__name__}") from None
        try:
            descs = np.array(items, dtype=np.uint64).reshape(-1, 3)
        except (TypeError, ValueError, OverflowError) as exc:
            # numpy's own message ("inhomogeneous shape", ...) does not say which field is wrong.
            raise ParamInvalid(_first_bad_desc(items) or f"op_descs must be {_DESC_FORM} items: {exc}") from exc
    if len(descs) == 0:
        raise ParamInvalid("op_descs is empty")
    lens = descs[:, 2]
    if not lens.all():
        raise ParamInvalid(f"descriptor {int(np.flatnonzero(lens == 0)[0])} has length 0")
    # A range that wraps past 2**64 would pass the bounds check modulo 2**64.
    limit = np.uint64(_U64_MAX)
    if (descs[:, 0] > limit - lens).any() or (descs[:, 1] > limit - lens).any():
        raise ParamInvalid("a descriptor's range wraps around the address space")
    return descs


_DESC_FORM = "TransferOpDesc(local_addr, remote_addr, len)"


def _first_bad_desc(items: Sequence[Any]) -> str | None:
    """What is wrong with the first malformed descriptor of ``items``, in words (None if none is)."""
    for i, desc in enumerate(items):
        try:
            fields = tuple(desc)
        except TypeError:
            fields = ()
        if len(fields) != 3:
            return f"descriptor {i} ({type(desc).__name__} {desc!r:.40}) is not a {_DESC_FORM}"
        for name, value in zip(TransferOpDesc._fields, fields):
            if not _is_int(value):
                return f"descriptor {i}: {name} is of type {type(value).__name__}, not int ({ADDRESS_HINT})"
            if not 0 <= int(value) <= _U64_MAX:
                return f"descriptor {i}: {name} = {int(value)} is outside 0 .. 2**64-1"
    return None


def merge_adjacent(descs: np.ndarray) -> np.ndarray:
    """Merge runs of descriptors contiguous on both sides into single descriptors.

    A paged KV cache moved block by block is mostly such runs; merging turns
    10^4 descriptors into a handful of iovecs before any syscall or frame.
    """
    if len(descs) < 2:
        return descs
    local, remote, lens = descs[:, 0], descs[:, 1], descs[:, 2]
    follows = (local[:-1] + lens[:-1] == local[1:]) & (remote[:-1] + lens[:-1] == remote[1:])
    if not follows.any():
        return descs
    starts = np.concatenate(([0], np.flatnonzero(~follows) + 1))
    merged = descs[starts].copy()
    merged[:, 2] = np.add.reduceat(lens, starts)
    return merged
