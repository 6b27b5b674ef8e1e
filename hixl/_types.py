"""Enums and small value types shared by every layer of hixl.

The names follow the real HIXL engine (``Op``, ``MemType``, ``TransferStatus``,
``MemDesc``, ``TransferOpDesc``, ``NotifyDesc``) so code written against it reads
the same here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = [
    "CheckedRows",
    "IdentityEnum",
    "MemDesc",
    "MemHandle",
    "MemType",
    "NotifyDesc",
    "Op",
    "Status",
    "TransferOpDesc",
    "TransferStatus",
]


class IdentityEnum(enum.Enum):
    """An Enum hashed by identity, as its members compare. Enum's own ``__hash__`` is Python code
    (the hash of the member's name): ~50 ns more on every dict or set lookup, and the protocol
    looks its states up several times per frame."""

    __hash__ = object.__hash__


class Status(enum.IntEnum):
    """Status codes carried by every :class:`~hixl.HixlError` (and on the wire)."""

    SUCCESS = 0
    PARAM_INVALID = 1
    TIMEOUT = 2
    NOT_CONNECTED = 3
    ALREADY_CONNECTED = 4
    UNSUPPORTED = 5
    RESOURCE_EXHAUSTED = 6
    FAILED = 7
    AUTH_FAILED = 8
    ACCESS_DENIED = 9


class Op(enum.IntEnum):
    """Direction of a one-sided transfer, seen from the initiator."""

    READ = 0
    """remote -> local"""
    WRITE = 1
    """local -> remote"""


class MemType(enum.IntEnum):
    """Kind of memory a registration describes."""

    HOST = 0
    DEVICE = 1


class TransferStatus(IdentityEnum):
    """Life cycle of a :class:`~hixl.TransferReq`: WAITING, then exactly one final state."""

    WAITING = "WAITING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"

    @property
    def is_final(self) -> bool:
        """True once the request can no longer change."""
        return self is not TransferStatus.WAITING


class MemDesc(NamedTuple):
    """A raw memory range: ``len`` bytes starting at virtual address ``addr``."""

    addr: int
    len: int


class TransferOpDesc(NamedTuple):
    """One piece of a batched transfer: ``len`` bytes between a local and a remote address."""

    local_addr: int
    remote_addr: int
    len: int


@dataclass(frozen=True)
class NotifyDesc:
    """A small notification: ``name`` and ``msg`` are each at most 1 KiB once UTF-8 encoded.

    ``sender`` is filled in on receipt: it names the authenticated connection the
    notification came on — the same for every notification on that connection,
    different for any other (another peer, or the same peer connected again). It is
    neither compared nor shown: ``NotifyDesc("a", "b")`` equals what arrives for it.
    """

    name: str
    msg: str
    sender: str = field(default="", compare=False, repr=False)


class CheckedRows(NamedTuple):
    """:meth:`Engine.read_rows` of rows that say whether they were read whole, checked and handed over.

    Each row of the peer's table is ``[seq | a word the reader ignores | payload...]``: ``seq``
    (native uint64) odd while its writer rewrites the row, and the writer stores it odd, then
    the row, then even (:class:`hixl.weights.Table` does). Row numbers must be in ``[0,
    limit)``: the table's rows. Where a transport can read each row between two loads of its
    ``seq`` on a machine that keeps loads in order (shm, x86-64), it copies each row's first
    ``row_bytes`` payload bytes straight into ``out`` and ``seq // 2`` into ``versions`` (the
    slots are not written), lists the positions of rows whose two loads differ or are odd —
    *torn*, their ``out`` and version not to be used — in ``torn``, and ``read_rows`` returns
    their count. Elsewhere it returns -1: the rows are in the slots as read, ``out`` untouched,
    for the caller to check its own way (hixl.weights: each row's hash). ``out``: a writable
    C-contiguous buffer of ``row_bytes`` a row; ``versions``, ``torn``: writable int64 arrays of
    one a row; ``check=False`` takes every row as it came (tests only).
    """

    limit: int
    row_bytes: int
    out: Any
    versions: Any
    torn: Any
    check: bool = True


@dataclass(frozen=True)
class MemHandle:
    """What :meth:`Engine.register_mem` returns; pass it back to ``deregister_mem``."""

    id: int
    addr: int
    len: int
    mem_type: MemType = MemType.HOST
    access: str = "rw"
    """``"rw"``: peers may READ and WRITE it; ``"r"``: peers may only READ it."""
