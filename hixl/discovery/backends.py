"""Which :class:`~.store.MetadataStore` a URL names: the one place that knows the implementations.

The contract (:mod:`.store`) knows none of them, and each implementation knows
only the contract; a new backend is a module of its own and a scheme here.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from .._exceptions import ParamInvalid
from .store import MetadataStore, checked_lease_ttl

__all__ = ["open_store"]


def open_store(url: str, lease_ttl: float = 10.0, timeout: float = 5.0) -> MetadataStore:
    """Connect to the store at ``url`` (``"etcd://host:port"``) and take a lease of ``lease_ttl`` s.

    Raises :class:`ParamInvalid` for a URL it does not understand and
    :class:`StoreUnavailable` if the store does not answer within ``timeout`` —
    at once, never a hang.
    """
    if not isinstance(url, str):
        raise ParamInvalid(f"metadata_server must be a URL string, not {url!r}")
    parts = urlsplit(url)
    if parts.scheme != "etcd" or not parts.hostname or parts.port is None:
        raise ParamInvalid(f"metadata_server {url!r}: expected etcd://host:port")
    lease_ttl = checked_lease_ttl(lease_ttl)
    from .etcd import EtcdStore  # the optional dependency, only when asked for

    return EtcdStore(url, parts.hostname, parts.port, lease_ttl, float(timeout))
