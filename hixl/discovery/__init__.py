"""Discovery through a metadata store the fleet already runs (etcd), as an option.

Without a store, engines and DataDist instances find each other peer to peer
by the addresses they are given (the embedded default). With one
(``metadata_server="etcd://host:port"``, or ``$HIXL_METADATA_SERVER``), each
publishes a small record of itself under a *lease* that it refreshes while it
lives: a process that dies (even SIGKILL) stops refreshing, and its records
vanish within ``lease_ttl``. Others read and watch those records to resolve a
cluster id to an address and incarnation, and to hear when a peer appears,
restarts or goes away. A record is someone's only while a live lease holds it:
readers pass over keys written without one, and a claim is never taken from a
live lease (:class:`MetadataStore` has the rules).

:class:`MetadataStore` is what the rest of hixl uses; :func:`open_store` picks
the implementation from the URL's scheme (``etcd://``: :mod:`.etcd`, through
the maintained ``etcd3gw`` client of etcd's v3 JSON gateway, the optional
extra ``hixl[etcd]``).
"""

from __future__ import annotations

from .backends import open_store
from .store import MetadataStore, StoreEvent, StoreEventKind, StoreUnavailable

__all__ = ["MetadataStore", "StoreEvent", "StoreEventKind", "StoreUnavailable", "open_store"]
