"""DataDist errors: :class:`LLMException` with an :class:`LLMStatusCode`, as in LLM-DataDist.

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

__all__ = ["LLMException", "LLMStatusCode", "status_of", "translate_errors"]


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
    FAILED = "FAILED"


class LLMException(HixlError):
    """A DataDist operation failed; ``status_code`` says how."""

    def __init__(self, message: str, status_code: LLMStatusCode) -> None:
        super().__init__(f"{status_code.name}: {message}")
        self._message = message
        self.status_code = status_code

    def __reduce__(self) -> tuple[type[LLMException], tuple[str, LLMStatusCode]]:
        # Exceptions unpickle as ``cls(*self.args)``, and ``args`` holds only the
        # formatted text: without this, an LLMException raised in a worker process
        # (multiprocessing, concurrent.futures) could not be sent back to its parent.
        return type(self), (self._message, self.status_code)

    def __repr__(self) -> str:
        return f"LLMException({str(self)!r}, status_code={self.status_code.name})"


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

