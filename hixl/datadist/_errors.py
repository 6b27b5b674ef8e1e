"""DataDist errors: :class:`LLMException` with an :class:`LLMStatusCode`, as in LLM-DataDist.

They stay in hixl's error tree::

    HixlError (status)
    └── LLMException (status_code; status follows it)
        ├── LLMTimeout (TimeoutError)        TIMEOUT, WAIT_PROCESS_TIMEOUT
        └── LLMLinkError (ConnectionError)   NOT_YET_LINK, LINK_FAILED

``LLMException(message, code)`` builds the subclass its code belongs to, so
``except TimeoutError`` / ``except ConnectionError`` catch a DataDist timeout
or lost link wherever it was raised, and ``status`` (the :class:`~hixl.Status`
inherited from :class:`~hixl.HixlError`) is the one closest to ``status_code``.

Bad arguments raise the builtin ``ValueError`` / ``TypeError`` instead; failures
of the engine underneath are translated by :func:`translate_errors`, with the
original chained as ``__cause__``.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator

from .._exceptions import (
    HixlError,
    HixlTimeout,
    MemoryRangeError,
    NotConnected,
    ParamInvalid,
    PeerDisconnected,
    ResourceExhausted,
)
from .._types import Status

__all__ = ["LLMException", "LLMLinkError", "LLMStatusCode", "LLMTimeout", "status_of", "translate_errors"]


class LLMStatusCode(enum.Enum):
    """Result codes, named as in LLM-DataDist."""

    SUCCESS = "SUCCESS"
    PARAM_INVALID = "PARAM_INVALID"
    NOT_YET_LINK = "NOT_YET_LINK"
    ALREADY_LINK = "ALREADY_LINK"
    LINK_FAILED = "LINK_FAILED"
    UNLINK_FAILED = "UNLINK_FAILED"
    EXIST_LINK = "EXIST_LINK"
    KV_CACHE_NOT_EXIST = "KV_CACHE_NOT_EXIST"
    TIMEOUT = "TIMEOUT"
    WAIT_PROCESS_TIMEOUT = "WAIT_PROCESS_TIMEOUT"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    NOT_INITIALIZED = "NOT_INITIALIZED"
    CLUSTER_ID_CONFLICT = "CLUSTER_ID_CONFLICT"
    """The cluster id is linked at another, live address: two instances claim it."""
    CANCELLED = "CANCELLED"
    """The task was cancelled (:meth:`~hixl.datadist.CacheTask.cancel`)."""
    FAILED = "FAILED"


# The closest engine Status for each code: what ``LLMException.status`` reports.
_STATUS: dict[LLMStatusCode, Status] = {
    LLMStatusCode.SUCCESS: Status.SUCCESS,
    LLMStatusCode.PARAM_INVALID: Status.PARAM_INVALID,
    LLMStatusCode.NOT_YET_LINK: Status.NOT_CONNECTED,
    LLMStatusCode.ALREADY_LINK: Status.ALREADY_CONNECTED,
    LLMStatusCode.LINK_FAILED: Status.NOT_CONNECTED,
    LLMStatusCode.UNLINK_FAILED: Status.FAILED,
    LLMStatusCode.EXIST_LINK: Status.ALREADY_CONNECTED,
    LLMStatusCode.KV_CACHE_NOT_EXIST: Status.PARAM_INVALID,
    LLMStatusCode.TIMEOUT: Status.TIMEOUT,
    LLMStatusCode.WAIT_PROCESS_TIMEOUT: Status.TIMEOUT,
    LLMStatusCode.RESOURCE_EXHAUSTED: Status.RESOURCE_EXHAUSTED,
    LLMStatusCode.NOT_INITIALIZED: Status.FAILED,
    LLMStatusCode.CLUSTER_ID_CONFLICT: Status.ALREADY_CONNECTED,
    LLMStatusCode.CANCELLED: Status.FAILED,
    LLMStatusCode.FAILED: Status.FAILED,
}


class LLMException(HixlError):
    """A DataDist operation failed; ``status_code`` says how, ``status`` is the closest :class:`~hixl.Status`.

    Constructing it with a timeout or link code gives an :class:`LLMTimeout` or
    :class:`LLMLinkError` (see the module docstring).
    """

    def __new__(cls, message: str, status_code: LLMStatusCode) -> LLMException:
        # Chosen here rather than at each raise, so no raise site can forget the mix-in.
        kind = _KIND.get(status_code, cls) if cls is LLMException else cls
        # Only the text goes on: OSError (under TimeoutError, ConnectionError) would read two
        # arguments as (errno, strerror).
        return super(LLMException, kind).__new__(kind, f"{status_code.name}: {message}")

    def __init__(self, message: str, status_code: LLMStatusCode) -> None:
        super().__init__(f"{status_code.name}: {message}", _STATUS[status_code])
        self._message = message
        self.status_code = status_code

    def __reduce__(self) -> tuple[type[LLMException], tuple[str, LLMStatusCode]]:
        # Exceptions unpickle as ``cls(*self.args)``, and ``args`` holds only the
        # formatted text: without this, an LLMException raised in a worker process
        # (multiprocessing, concurrent.futures) could not be sent back to its parent.
        return type(self), (self._message, self.status_code)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r}, status_code={self.status_code.name})"


class LLMTimeout(LLMException, TimeoutError):
    """A DataDist operation ran out of time (TIMEOUT or WAIT_PROCESS_TIMEOUT)."""


class LLMLinkError(LLMException, ConnectionError):
    """The cluster is not linked, or its link failed (NOT_YET_LINK or LINK_FAILED)."""


_KIND: dict[LLMStatusCode, type[LLMException]] = {
    LLMStatusCode.TIMEOUT: LLMTimeout,
    LLMStatusCode.WAIT_PROCESS_TIMEOUT: LLMTimeout,
    LLMStatusCode.NOT_YET_LINK: LLMLinkError,
    LLMStatusCode.LINK_FAILED: LLMLinkError,
}


# Most specific first: TransferTimeout is a HixlTimeout, MemoryRangeError a ParamInvalid.
_CODES: tuple[tuple[type[HixlError], LLMStatusCode], ...] = (
    (HixlTimeout, LLMStatusCode.TIMEOUT),
    (NotConnected, LLMStatusCode.NOT_YET_LINK),
    (PeerDisconnected, LLMStatusCode.LINK_FAILED),
    (MemoryRangeError, LLMStatusCode.KV_CACHE_NOT_EXIST),
    (ParamInvalid, LLMStatusCode.PARAM_INVALID),
    (ResourceExhausted, LLMStatusCode.RESOURCE_EXHAUSTED),
)


def status_of(exc: HixlError) -> LLMStatusCode:
    """The status code an engine (or DataDist) error maps to."""
    if isinstance(exc, LLMException):
        return exc.status_code
    return next((code for kind, code in _CODES if isinstance(exc, kind)), LLMStatusCode.FAILED)


@contextlib.contextmanager
def translate_errors(what: str) -> Iterator[None]:
    """Re-raise engine errors inside the block as :class:`LLMException` (``what`` failed)."""
    try:
        yield
    except LLMException:
        raise
    except HixlError as exc:
        raise LLMException(f"{what}: {exc}", status_of(exc)) from exc



# As hixl's own errors (see hixl._exceptions): named where users import them, hixl.datadist.
for _named in (LLMStatusCode, LLMException, LLMTimeout, LLMLinkError):
    _named.__module__ = "hixl.datadist"
