"""etcd as hixl's metadata store, through ``etcd3gw`` (etcd's v3 JSON gateway; ``pip install 'hixl[etcd]'``).

One lease per store, granted at open and refreshed by one background thread
every third of its TTL. If a refresh finds the lease gone (this process was
frozen past the TTL, or etcd lost it), a new one is granted and every key this
store owns is written again under it, so a live owner's records come back.
Requests carry the store's timeout: an etcd that stops answering is a
:class:`~hixl.discovery.StoreUnavailable`, never a hang. Each watch gets its own
client (its own HTTP session and thread), stopped by the function it returns.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

from .store import MetadataStore, StoreEvent, StoreEventKind, StoreUnavailable

__all__ = ["EtcdStore"]

log = logging.getLogger("hixl.discovery")


def _client_module() -> Any:
    try:
        import etcd3gw
    except ImportError as exc:  # the optional extra is missing
        raise StoreUnavailable("etcd needs the etcd3gw client: pip install 'hixl[etcd]'") from exc
    return etcd3gw


class EtcdStore(MetadataStore):
    """A :class:`MetadataStore` on one etcd endpoint (see the module docstring)."""

    def __init__(self, url: str, host: str, port: int, lease_ttl: float, timeout: float) -> None:
        self.url = url
        self.lease_ttl = lease_ttl
        self._host, self._port, self._timeout = host, port, timeout
        self._etcd = _client_module()
        self._client = self._etcd.client(host=host, port=port, timeout=timeout)
        self._lock = threading.Lock()  # the client's session and the owned keys
        self._owned: dict[str, bytes] = {}
        self._watches: list[Callable[[], None]] = []
        self._closed = threading.Event()
        self._lease = self._call("grant a lease", lambda: self._client.lease(ttl=max(2, round(lease_ttl))))
        self._refresher = threading.Thread(target=self._refresh_loop, name=f"hixl-etcd-lease-{host}:{port}", daemon=True)
        self._refresher.start()

    def _call(self, what: str, request: Callable[[], Any]) -> Any:
        """Run one request to etcd; its failures as :class:`StoreUnavailable`."""
        try:
            with self._lock:
                return request()
        except self._etcd.exceptions.Etcd3Exception as exc:
            raise StoreUnavailable(f"metadata server {self.url}: cannot {what}: {exc.detail_text or exc}") from exc
        except OSError as exc:
            raise StoreUnavailable(f"metadata server {self.url}: cannot {what}: {exc}") from exc

    # -- keys this process owns ---------------------------------------------------------------
    def put_owned(self, key: str, value: bytes) -> None:
        """Write ``key`` under this store's lease."""
        self._call(f"write {key}", lambda: self._client.put(key, value, lease=self._lease))
        with self._lock:
            self._owned[key] = value

    def create_owned(self, key: str, value: bytes) -> bool:
        """Write ``key`` under this store's lease if it does not exist yet."""
        created = bool(self._call(f"create {key}", lambda: self._client.create(key, value, lease=self._lease)))
        if created:
            with self._lock:
                self._owned[key] = value
        return created

    def delete_owned(self, key: str) -> None:
        """Delete ``key``, one this store wrote."""
        with self._lock:
            self._owned.pop(key, None)
        self._call(f"delete {key}", lambda: self._client.delete(key))

    # -- reading --------------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        """The value of ``key`` or ``None``."""
        values = self._call(f"read {key}", lambda: self._client.get(key))
        return bytes(values[0]) if values else None

    def get_prefix(self, prefix: str) -> dict[str, bytes]:
        """Every key under ``prefix``."""
        rows = self._call(f"read {prefix}*", lambda: self._client.get_prefix(prefix))
        return {_text(meta["key"]): bytes(value) for value, meta in rows}

    def watch_prefix(self, prefix: str, callback: Callable[[StoreEvent], None]) -> Callable[[], None]:
        """Call ``callback`` for each change under ``prefix`` (on this watch's own thread)."""
        client = self._etcd.client(host=self._host, port=self._port, timeout=self._timeout)
        try:
            events, cancel = client.watch_prefix(prefix)
        except (self._etcd.exceptions.Etcd3Exception, OSError) as exc:
            raise StoreUnavailable(f"metadata server {self.url}: cannot watch {prefix}*: {exc}") from exc

        def deliver() -> None:
            try:
                for event in events:
                    kv = event["kv"]
                    kind = StoreEventKind.DELETE if event.get("type") == "DELETE" else StoreEventKind.PUT
                    value = bytes(kv["value"]) if kind is StoreEventKind.PUT else None
                    try:
                        callback(StoreEvent(kind, _text(kv["key"]), value))
                    except Exception:  # a subscriber's bug must not end the watch
                        log.exception("hixl: a watch callback on %s raised", prefix)
            except Exception as exc:  # the stream broke: etcd went away, or the watch was stopped
                if not self._closed.is_set():
                    log.warning("hixl: watch on %s%s ended: %s", self.url, prefix, exc)

        thread = threading.Thread(target=deliver, name=f"hixl-etcd-watch-{prefix}", daemon=True)
        thread.start()

        def stop() -> None:
            cancel()
            thread.join(2.0)

        with self._lock:
            self._watches.append(stop)
        return stop

    # -- the lease ------------------------------------------------------------------------------
    def _refresh_loop(self) -> None:
        while not self._closed.wait(self.lease_ttl / 3):
            try:
                ttl = self._call("refresh the lease", self._lease.refresh)
                if ttl <= 0:
                    self._renew()
            except StoreUnavailable as exc:
                log.warning("hixl: %s (the records of this process vanish if this lasts %.0f s)", exc, self.lease_ttl)

    def _renew(self) -> None:
        """The lease expired while we lived: take a new one and write our keys again under it."""
        log.warning("hixl: the lease on %s had expired; publishing again", self.url)
        self._lease = self._call("grant a lease", lambda: self._client.lease(ttl=max(2, round(self.lease_ttl))))
        with self._lock:
            owned = dict(self._owned)
        for key, value in owned.items():
            self._call(f"write {key}", functools.partial(self._client.put, key, value, lease=self._lease))

    def close(self) -> None:
        """Stop refreshing and watching, and revoke the lease: this process's keys vanish now."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._refresher.join(self._timeout + 1)
        with self._lock:
            watches, self._watches = self._watches, []
        for stop in watches:
            stop()
        try:
            self._call("revoke the lease", self._lease.revoke)
        except StoreUnavailable as exc:
            log.warning("hixl: %s (the records vanish at lease expiry instead)", exc)

    def __repr__(self) -> str:
        return f"<EtcdStore {self.url} lease_ttl={self.lease_ttl:g}s owned={sorted(self._owned)}>"


def _text(key: Any) -> str:
    return key.decode() if isinstance(key, bytes) else str(key)
