"""Enums and small value types shared by every layer of hixl.

The names follow the real HIXL engine (``Op``, ``MemType``, ``TransferStatus``,
``MemDesc``, ``TransferOpDesc``, ``NotifyDesc``) so code written against it reads
the same here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = [
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


@dataclass(frozen=True)
class MemHandle:
    """What :meth:`Engine.register_mem` returns; pass it back to ``deregister_mem``."""

    id: int
    addr: int
    len: int
    mem_type: MemType = MemType.HOST
    access: str = "rw"
    """``"rw"``: peers may READ and WRITE it; ``"r"``: peers may only READ it."""
