"""The errors of :mod:`hixl.weights`, in hixl's error tree::

    HixlError
    ├── TransferError
    │   ├── Superseded                 a pull could not be proven to hold one version
    │   │   └── TornRows               rows kept tearing under the server's updates
    │   └── UpdateFailed               a vLLM update failed: none applied it, or some rank is broken
    └── ProtocolError
        └── ManifestError              what a publisher (or table server) published is malformed

A pull that raises :class:`Superseded` has written an unspecified mix into its
destination (the exception is the mark); nothing it returned is ever mixed.
"""

from __future__ import annotations

from collections.abc import Sequence

from .._exceptions import ProtocolError, TransferError

__all__ = ["ManifestError", "Superseded", "TornRows", "UpdateFailed"]


class Superseded(TransferError):
    """The version being pulled was overwritten (or withdrawn) before the pull could be proven
    consistent. What the pull wrote into its destination is unspecified; pull again."""


class TornRows(Superseded):
    """Some rows were being updated on every one of a row gather's bounded re-reads.

    ``rows`` holds their positions in the ``indices`` asked for. The destination's rows are not to be
    used (on shm the whole ones have landed in it; elsewhere it is untouched)."""

    def __init__(self, message: str, rows: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.rows = list(rows)


class UpdateFailed(TransferError):
    """A weight update of a vLLM instance failed on some rank; ``errors`` holds each failed rank's
    message (rank -> text). If ``broken`` is empty, no rank applied anything: the old weights still
    serve. Otherwise vLLM's own reload raised on the ``broken`` ranks half-way: they cannot serve
    until vLLM is restarted."""

    def __init__(self, message: str, errors: dict[int, str] | None = None, *, broken: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.errors = dict(errors or {})
        self.broken = list(broken)


class ManifestError(ProtocolError):
    """A manifest, table description or notification from a peer failed validation; nothing was read."""
