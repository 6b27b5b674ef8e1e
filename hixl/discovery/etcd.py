"""etcd as hixl's metadata store, through ``etcd3gw`` (etcd's v3 JSON gateway; ``pip install 'hixl[etcd]'``).

One lease per store, granted at open and refreshed by one background thread
every third of its TTL. If a refresh finds the lease gone (this process was
frozen past the TTL, or etcd lost it), a new one is granted and every key this
store owns is restored under it (below), so a live owner's records come back.
Requests carry the store's timeout: an etcd that stops answering is a
:class:`~hixl.discovery.StoreUnavailable`, never a hang. Each watch gets its own
client (its own HTTP session and thread), stopped by the function it returns.

Claims (:meth:`EtcdStore.create_owned`) are one transaction: put the key under
our lease if its lease is 0 — etcd reads an absent key's lease as 0, so that is
"absent, or written without a lease", never a live owner's. Writes to a claimed
key are transactions guarded by "its lease is still ours". Each refresh also
lists the keys bound to our lease; an owned key missing from it was detached
out of band, and is restored (:meth:`EtcdStore._restore`):

- absent or lease-less: claimed again, by the same transaction;
- under another lease but created no later than our last write to it: it was
  overwritten in place (a put keeps a key's create revision, and nobody could
  claim a key that was never deleted), so it is taken back, guarded by that
  lease and create revision;
- under another lease and created after our last write: it was deleted and
  then claimed by the rules, by a live lease: ours is lost (logged). Taking it
  back would have two claimants overwrite each other for ever.

After a lapse of our lease (a new one is granted first) every key goes through
the same restoration, so a process frozen past its TTL never overwrites the
instance that claimed its id meanwhile.
"""

from __future__ import annotations

import base64
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
        # One write of our own keys at a time, so a restore and an update of a key never interleave.
        self._writes = threading.Lock()
        self._owned: dict[str, bytes] = {}
        self._claimed: set[str] = set()  # owned keys taken with create_owned
        self._written: dict[str, int] = {}  # claimed key -> the etcd revision of our last write to it (under _writes)
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

    def _put_if(self, what: str, key: str, value: bytes, **expect: int) -> tuple[bool, dict[str, Any] | None]:
        """Put ``key`` under our lease if it has each of ``expect`` now (``lease=``,
        ``create_revision=``), in one transaction: whether it did, and if not, the key as it
        is (None if absent)."""
        encoded = _b64(key.encode())
        txn = {
            "compare": [{"key": encoded, "result": "EQUAL", "target": _TARGETS[name], name: n} for name, n in expect.items()],
            "success": [{"request_put": {"key": encoded, "value": _b64(value), "lease": self._lease.id}}],
            "failure": [{"request_range": {"key": encoded}}],
        }
        reply = self._call(what, lambda: self._client.transaction(txn))
        if reply.get("succeeded"):
            self._written[key] = int(reply["header"]["revision"])
            return True, None
        kvs = reply["responses"][0]["response_range"].get("kvs") or [None]
        return False, kvs[0]

    # -- keys this process owns ---------------------------------------------------------------
    def put_owned(self, key: str, value: bytes) -> bool:
        """Write ``key`` under this store's lease (a claimed key only while the claim holds)."""
        with self._writes:
            with self._lock:
                claimed = key in self._claimed
                if claimed:
                    self._owned[key] = value  # the newest value, for a restore too
            if not claimed:
                self._call(f"write {key}", lambda: self._client.put(key, value, lease=self._lease))
                with self._lock:
                    self._owned[key] = value
                return True
            return self._put_if(f"write {key}", key, value, lease=self._lease.id)[0] or self._restore(key)

    def create_owned(self, key: str, value: bytes) -> bool:
        """Claim ``key`` under this store's lease (see the module docstring)."""
        with self._writes:
            taken, holder = self._put_if(f"claim {key}", key, value, lease=0)
            if not taken and holder is not None and _lease_of(holder) == self._lease.id:
                taken = self._put_if(f"claim {key}", key, value, lease=self._lease.id)[0]
            if taken:
                with self._lock:
                    self._owned[key] = value
                    self._claimed.add(key)
            return taken

    def delete_owned(self, key: str) -> None:
        """Delete ``key``, one this store wrote — if our lease still holds it."""
        with self._writes:
            with self._lock:
                self._owned.pop(key, None)
                self._claimed.discard(key)
                self._written.pop(key, None)
            encoded = _b64(key.encode())
            txn = {
                "compare": [{"key": encoded, "result": "EQUAL", "target": "LEASE", "lease": self._lease.id}],
                "success": [{"request_delete_range": {"key": encoded}}],
                "failure": [],
            }
            self._call(f"delete {key}", lambda: self._client.transaction(txn))

    def _restore(self, key: str) -> bool:
        """Bring ``key`` back under our lease after it was detached from it out of band (the rules
        are in the module docstring); whether it is ours again. The caller holds ``_writes``."""
        with self._lock:
            value = self._owned.get(key)
            claimed = key in self._claimed
        if value is None:
            return False  # deleted by this process meanwhile
        if not claimed:
            self._call(f"write {key}", lambda: self._client.put(key, value, lease=self._lease))
            return True
        taken, holder = self._put_if(f"claim {key} again", key, value, lease=0)
        if taken or holder is None:
            return taken
        lease, created = _lease_of(holder), int(holder.get("create_revision", 0))
        if lease == self._lease.id:  # restored meanwhile: write the newest value
            return self._put_if(f"write {key}", key, value, lease=lease)[0]
        if created <= self._written.get(key, 0):
            log.warning("hixl: %s in %s was overwritten under another lease; taking it back", key, self.url)
            return self._put_if(f"take {key} back", key, value, lease=lease, create_revision=created)[0]
        log.error("hixl: %s in %s was deleted out of band and claimed anew by a live lease: it is not ours any more", key, self.url)
        with self._lock:
            self._owned.pop(key, None)
            self._claimed.discard(key)
            self._written.pop(key, None)
        return False

    # -- reading --------------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        """The value of ``key`` if a live lease holds it, else ``None``."""
        rows = self._call(f"read {key}", lambda: self._client.get(key, metadata=True))
        return next((bytes(value) for value, meta in rows if _lease_of(meta)), None)

    def get_prefix(self, prefix: str) -> dict[str, bytes]:
        """Every key under ``prefix`` that a live lease holds (and that is text)."""
        rows = self._call(f"read {prefix}*", lambda: self._client.get_prefix(prefix))
        found = {}
        for value, meta in rows:
            key = _key_text(meta.get("key"))
            if key is not None and _lease_of(meta):
                found[key] = bytes(value)
        return found

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
                    change = _change_of(event)
                    if change is None:
                        continue
                    try:
                        callback(change)
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
                else:
                    self._keep_owned()
            except StoreUnavailable as exc:
                log.warning("hixl: %s (the records of this process vanish if this lasts %.0f s)", exc, self.lease_ttl)

    def _keep_owned(self) -> None:
        """Restore every owned key no longer bound to our lease (one request when none is)."""
        bound = {_key_text(key) for key in self._call("list the lease's keys", self._lease.keys)}
        with self._lock:
            detached = [key for key in self._owned if key not in bound]
        with self._writes:
            for key in detached:
                self._restore(key)

    def _renew(self) -> None:
        """The lease expired while we lived: take a new one and restore our keys under it."""
        log.warning("hixl: the lease on %s had expired; publishing again", self.url)
        self._lease = self._call("grant a lease", lambda: self._client.lease(ttl=max(2, round(self.lease_ttl))))
        with self._lock:
            owned = list(self._owned)
        with self._writes:
            for key in owned:
                self._restore(key)

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


_TARGETS = {"lease": "LEASE", "create_revision": "CREATE"}  # what _put_if may compare


def _b64(data: bytes) -> str:
    """``data`` as etcd's JSON gateway carries bytes."""
    return base64.b64encode(data).decode()


def _lease_of(kv: dict[str, Any]) -> int:
    """The lease a key is bound to (0: none; etcd's JSON leaves a zero out)."""
    return int(kv.get("lease", 0))


def _key_text(key: Any) -> str | None:
    """A key as text; None if it is not UTF-8 (so not one of hixl's)."""
    try:
        return key.decode() if isinstance(key, bytes) else str(key)
    except UnicodeDecodeError:
        return None


def _change_of(event: dict[str, Any]) -> StoreEvent | None:
    """A watch event as a reader sees it (see :class:`MetadataStore`): a key written without a
    lease is nobody's, so a DELETE; None for a key that is not text."""
    kv = event.get("kv") or {}
    key = _key_text(kv.get("key", b""))
    if not key:
        return None
    if event.get("type") == "DELETE" or not _lease_of(kv):
        return StoreEvent(StoreEventKind.DELETE, key, None)
    return StoreEvent(StoreEventKind.PUT, key, bytes(kv.get("value", b"")))
