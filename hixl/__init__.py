"""hixl: one-sided, zero-copy, point-to-point data transfer for PD-disaggregated LLM inference.

The :class:`Engine` registers memory, connects to peers named ``"ip:port"`` and
READs or WRITEs their registered memory without their application taking part.
The KV-cache layer on top lives in :mod:`hixl.datadist`.
"""

from ._exceptions import (
    AccessDenied,
    AlreadyConnected,
    AuthenticationFailed,
    EncryptionMismatch,
    HixlError,
    HixlTimeout,
    IntegrityError,
    MemoryRangeError,
    NotConnected,
    ParamInvalid,
    PeerDisconnected,
    ProtocolError,
    ResourceExhausted,
    StoreUnavailable,
    TransferCancelled,
    TransferError,
    TransferTimeout,
    Unsupported,
)
from ._memory import PAGE_SIZE, empty
from ._request import TransferReq
from ._types import CheckedRows, MemDesc, MemHandle, MemType, NotifyDesc, Op, Status, TransferOpDesc, TransferStatus
from ._session.backend import NetworkBackend, TcpBackend
from .engine import DEFAULT_OPTIONS, Engine

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_OPTIONS",
    "PAGE_SIZE",
    "AccessDenied",
    "AlreadyConnected",
    "AuthenticationFailed",
    "CheckedRows",
    "EncryptionMismatch",
    "Engine",
    "HixlError",
    "HixlTimeout",
    "IntegrityError",
    "MemDesc",
    "MemHandle",
    "MemType",
    "MemoryRangeError",
    "NetworkBackend",
    "NotConnected",
    "NotifyDesc",
    "Op",
    "ParamInvalid",
    "PeerDisconnected",
    "ProtocolError",
    "ResourceExhausted",
    "Status",
    "StoreUnavailable",
    "TcpBackend",
    "TransferCancelled",
    "TransferError",
    "TransferOpDesc",
    "TransferReq",
    "TransferStatus",
    "TransferTimeout",
    "Unsupported",
    "__version__",
    "empty",
]
