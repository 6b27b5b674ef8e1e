"""The metadata-store contract and the URL that picks an implementation."""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable
from dataclasses import dataclass

from .._exceptions import ParamInvalid, StoreUnavailable

__all__ = ["MetadataStore", "StoreEvent", "StoreEventKind", "StoreUnavailable", "checked_lease_ttl"]


class StoreEventKind(enum.Enum):
    """What happened to a key under a watched prefix."""

    PUT = "PUT"
    DELETE = "DELETE"


@dataclass(frozen=True)
class StoreEvent:
    """A change under a watched prefix: ``value`` is ``None`` for a DELETE."""

    kind: StoreEventKind
    key: str
    value: bytes | None


class MetadataStore(abc.ABC):
    """A key-value store shared by the fleet, with keys that live only as long as their owner.

    Every key this process writes with :meth:`put_owned` or :meth:`create_owned`
    is bound to one lease, refreshed in the background every third of
    ``lease_ttl``; :meth:`close` revokes it (its keys vanish at once), and a
    process that dies stops refreshing it (they vanish within ``lease_ttl``).

    A record is someone's only while a live lease holds it, so readers
    (:meth:`get`, :meth:`get_prefix`, :meth:`watch_prefix`) see only keys bound
    to a lease: hixl never writes any other, and a key written without one (by
    hand, or by a writer that bypasses hixl) is nobody's — to a reader it is
    absent, and a watch reports it deleted. Keys are text: one that is not
    UTF-8 is not hixl's and is left out.

    While this process's lease lives, its keys stay its own: one found
    detached from the lease (deleted, or overwritten out of band) is written
    back within a third of ``lease_ttl`` — for a *claimed* key
    (:meth:`create_owned`), only as far as the claim rule allows.
    """

    url: str
    lease_ttl: float

    @abc.abstractmethod
    def put_owned(self, key: str, value: bytes) -> bool:
        """Write ``key`` (replacing any value), bound to this process's lease; True.

        A key this process claimed with :meth:`create_owned` is written only while
        the claim holds: False if another live lease holds it now (the claim is lost).
        """

    @abc.abstractmethod
    def create_owned(self, key: str, value: bytes) -> bool:
        """Claim ``key``: write it bound to this process's lease unless another live lease holds
        it; whether it is ours now.

        The claim is atomic, and succeeds over an absent key, over one with no
        lease (nobody's: see the class docstring) and over one this process
        already holds. Once claimed, the key is kept while this lease lives
        (see the class docstring): taken back if it is deleted or overwritten
        in place — never from another lease's claim made after it was deleted.
        """

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value of ``key`` if a live lease holds it, else ``None``."""

    @abc.abstractmethod
    def get_prefix(self, prefix: str) -> dict[str, bytes]:
        """Every key under ``prefix`` that a live lease holds, with its value."""

    @abc.abstractmethod
    def delete_owned(self, key: str) -> None:
        """Delete ``key`` (one this process wrote)."""

    @abc.abstractmethod
    def watch_prefix(self, prefix: str, callback: Callable[[StoreEvent], None]) -> Callable[[], None]:
        """Call ``callback`` (on a store thread; quick, non-blocking) for every later change under
        ``prefix``; returns a function that stops the watch. A key that loses its lease (written
        over without one) is reported as a DELETE."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop refreshing, revoke the lease (this process's keys vanish) and stop every watch; idempotent."""


def checked_lease_ttl(value: object) -> float:
    """``value`` as a lease TTL in seconds (2 to 3600: etcd's minimum, and an hour); ParamInvalid if off."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 2 <= value <= 3600:
        raise ParamInvalid(f"lease_ttl must be a number of seconds from 2 to 3600, not {value!r}")
    return float(value)
