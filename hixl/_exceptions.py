"""The hixl error tree. Every error hixl raises derives from :class:`HixlError`::

    HixlError (status)
    ├── ParamInvalid (ValueError)             PARAM_INVALID
    │   └── MemoryRangeError                   a range outside registered memory
    ├── HixlTimeout (TimeoutError)            TIMEOUT
    │   └── TransferTimeout (+TransferError)   a transfer ran past its deadline
    ├── NotConnected (ConnectionError)        NOT_CONNECTED
    │   └── StoreUnavailable                   the metadata server (etcd) does not answer
    ├── AlreadyConnected                      ALREADY_CONNECTED
    ├── Unsupported                           UNSUPPORTED
    ├── ResourceExhausted                     RESOURCE_EXHAUSTED
    ├── AuthenticationFailed (PermissionError) AUTH_FAILED, a peer failed the shared-secret proof
    ├── AccessDenied (PermissionError)        ACCESS_DENIED, e.g. a WRITE into a read-only region
    ├── TransferError                         FAILED
    │   ├── PeerDisconnected (ConnectionError) the peer died or closed the link
    │   │   └── IntegrityError                 an encrypted link's bytes failed authentication
    │   └── TransferCancelled                  TransferReq.cancel() stopped it
    └── ProtocolError                         FAILED, a malformed or unexpected frame

Builtin mix-ins let callers catch by meaning (``except TimeoutError``) without
importing hixl; ``status`` carries the code the real HIXL would have returned.
"""

from __future__ import annotations

from ._types import Status

__all__ = [
    "AccessDenied",
    "AlreadyConnected",
    "AuthenticationFailed",
    "EncryptionMismatch",
    "HixlError",
    "HixlTimeout",
    "IntegrityError",
    "MemoryRangeError",
    "NotConnected",
    "ParamInvalid",
    "PeerDisconnected",
    "ProtocolError",
    "ResourceExhausted",
    "StoreUnavailable",
    "TransferCancelled",
    "TransferError",
    "TransferTimeout",
    "Unsupported",
    "error_for_status",
]


class HixlError(Exception):
    """Base of every hixl error; ``status`` is a :class:`~hixl.Status`."""

    status: Status = Status.FAILED

    def __init__(self, message: str, status: Status | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r}, status={self.status.name})"


class ParamInvalid(HixlError, ValueError):
    """An argument is malformed or out of range."""

    status = Status.PARAM_INVALID


class MemoryRangeError(ParamInvalid):
    """A transfer descriptor points outside registered memory; no byte was moved."""


class HixlTimeout(HixlError, TimeoutError):
    """An operation did not finish within its timeout."""

    status = Status.TIMEOUT


class NotConnected(HixlError, ConnectionError):
    """No (live) connection to the named peer."""

    status = Status.NOT_CONNECTED


class StoreUnavailable(NotConnected):
    """The metadata server (``metadata_server``, etcd) cannot be reached, or stopped answering."""


class AlreadyConnected(HixlError):
    """``connect`` to a peer this engine is already connected to."""

    status = Status.ALREADY_CONNECTED


class Unsupported(HixlError):
    """The request needs a capability no available transport has."""

    status = Status.UNSUPPORTED


class EncryptionMismatch(Unsupported):
    """One end of a connection encrypts its links (``encrypt=True``) and the other does not: the
    connection is refused by both, never made in plaintext."""


class ResourceExhausted(HixlError):
    """A bounded resource (pending notifications, registrations, ...) is full."""

    status = Status.RESOURCE_EXHAUSTED


class AuthenticationFailed(HixlError, PermissionError):
    """The peer (or this engine) failed the shared-secret proof of the handshake."""

    status = Status.AUTH_FAILED


class AccessDenied(HixlError, PermissionError):
    """The operation is not allowed on that memory (a WRITE into a region registered read-only)."""

    status = Status.ACCESS_DENIED


class TransferError(HixlError):
    """A transfer failed after it was accepted."""

    status = Status.FAILED


class TransferTimeout(HixlTimeout, TransferError):
    """A transfer did not complete before its deadline."""

    status = Status.TIMEOUT


class PeerDisconnected(TransferError, ConnectionError):
    """The peer closed the connection, died, or stopped answering heartbeats.

    Its message ends with what to do about it: ``connect`` to the peer again, which replaces the
    broken link (the peer's new process, if it restarted)."""

    HINT = " (connect() to it again replaces the broken link)"

    def __init__(self, message: str, status: Status | None = None) -> None:
        super().__init__(message if message.endswith(self.HINT) else message + self.HINT, status)


class IntegrityError(PeerDisconnected):
    """Bytes received on an encrypted link failed authentication: altered (or corrupted) on the
    way. None of them landed; the link is closed, and every request pending on it fails."""


class TransferCancelled(TransferError):
    """The request was stopped by :meth:`~hixl.TransferReq.cancel`."""


class ProtocolError(HixlError):
    """A frame on the wire was malformed or unexpected."""


_BY_STATUS: dict[Status, type[HixlError]] = {
    Status.PARAM_INVALID: ParamInvalid,
    Status.TIMEOUT: HixlTimeout,
    Status.NOT_CONNECTED: NotConnected,
    Status.ALREADY_CONNECTED: AlreadyConnected,
    Status.UNSUPPORTED: Unsupported,
    Status.RESOURCE_EXHAUSTED: ResourceExhausted,
    Status.AUTH_FAILED: AuthenticationFailed,
    Status.ACCESS_DENIED: AccessDenied,
    Status.FAILED: TransferError,
}


def error_for_status(status: int, message: str) -> HixlError:
    """Rebuild the most specific error for a status code received from a peer."""
    try:
        code = Status(status)
    except ValueError:
        return ProtocolError(f"peer sent unknown status {status}: {message}")
    if code is Status.SUCCESS:  # an error whose status says SUCCESS would contradict itself
        return ProtocolError(f"peer reported an error with status SUCCESS: {message}")
    return _BY_STATUS.get(code, TransferError)(message, code)


# Users write hixl.NotConnected (the package exports every error): tracebacks, reprs and pickles
# name them so, not by this private module.
for _error in [value for value in globals().values() if isinstance(value, type) and issubclass(value, HixlError)]:
    _error.__module__ = "hixl"
