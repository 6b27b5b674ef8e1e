"""Fan-out: a subscriber that serves the versions it pulled to further subscribers.

Who pulls from whom: the relay's :class:`~hixl.weights.Subscriber` (on its own
engine) pulls each version from upstream — a publisher or another relay — into
one of the relay's slots; subscribers of the relay connect to the relay's engine
and pull from those slots exactly as from a publisher: the same version numbers,
the same tensors and checksums, leases and header words of the relay's own. So a
fleet can be fed by a tree: the publisher serves a few relays, each relay a few
subscribers (or relays).

The slots are registered read-only in the relay's engine (what downstream
subscribers reach) and writable in the subscriber's (which fills them): hence two
engines. A version is served only once it was pulled whole and checked; the
previous one stays served meanwhile, and after the upstream has gone away.
"""

from __future__ import annotations

import logging
import threading

from .._exceptions import HixlError, HixlTimeout, ParamInvalid, PeerDisconnected
from ..engine import Engine
from ._errors import Superseded
from ._manifest import layout
from ._plan import raw_plan
from ._server import VersionServer
from ._slots import SlotBuffers
from .subscriber import Subscriber

__all__ = ["Relay"]

log = logging.getLogger("hixl.weights")

_FOLLOW_WAIT = 0.5  # seconds between looks at the stop flag while following


class Relay:
    """Serves from ``engine`` (listening, not ``subscriber.engine``) the versions ``subscriber`` pulls.

    ``slots`` and ``lease`` as for :class:`~hixl.weights.Publisher`. With ``follow`` (the default)
    a thread (``hixl-weights-relay``) pulls each new upstream version as it is announced; else
    call :meth:`pull`.
    """

    def __init__(
        self, subscriber: Subscriber, engine: Engine, *, slots: int = 2, lease: float = 30.0, follow: bool = True
    ) -> None:
        if engine is subscriber.engine:
            raise ParamInvalid("a relay serves from an engine of its own: its slots are read-only there, writable in the subscriber's")
        if type(slots) is not int or not 2 <= slots <= 64:
            raise ParamInvalid(f"slots must be an int from 2 to 64, not {slots!r}")
        self.subscriber = subscriber
        self._server = VersionServer(engine, slots, lease)
        self._buffers = SlotBuffers(engine, slots, filler=subscriber.engine)
        self._lock = threading.Lock()
        self.version = 0
        """The version it serves as the newest (0: none yet)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if follow:
            self._thread = threading.Thread(target=self._follow, name="hixl-weights-relay", daemon=True)
            self._thread.start()

    @property
    def engine(self) -> Engine:
        """The engine downstream subscribers read from."""
        return self._server.engine

    def pull(self, *, version: int | None = None, timeout: float | None = None) -> int:
        """Pull ``version`` (None: the newest) from upstream into a free slot and serve it; return it."""
        with self._lock:
            if self._server.closed:
                raise HixlError("this relay is closed")
            upstream = self.subscriber.manifest(version, timeout=timeout)
            if upstream.version == self.version:
                return self.version
            offsets, total = layout([t.nbytes for t in upstream.tensors])
            ledger = self._server.ledger
            slot = ledger.claim(ledger.lease + 1.0)
            try:
                self._server.invalidate(slot)
                buf = self._buffers.ensure(slot, total)
                into = {t.name: buf[o : o + t.nbytes] for t, o in zip(upstream.tensors, offsets)}
                self.subscriber.pull(raw_plan(upstream, into), version=upstream.version, timeout=timeout)
            except BaseException:
                ledger.abandon(slot)
                raise
            self._server.commit(upstream.rebased(slot, self._server.header(slot), self._buffers.region(slot), offsets))
            self.version = upstream.version
            return self.version

    def _follow(self) -> None:
        while not self._stop.is_set():
            try:
                self.subscriber.wait_version(self.version + 1, _FOLLOW_WAIT)
                self.pull()
            except (HixlTimeout, Superseded):
                continue  # nothing new yet / overtaken by a newer version: look again
            except PeerDisconnected as exc:
                log.warning("hixl.weights: relay %s lost its upstream (%s); it goes on serving version %d",
                            self.engine.local_engine, exc, self.version)
                return
            except HixlError as exc:
                if self._stop.is_set():
                    return
                log.warning("hixl.weights: relay %s could not pull: %s", self.engine.local_engine, exc)
                self._stop.wait(_FOLLOW_WAIT)

    def close(self) -> None:
        """Stop following and serving; when this returns no subscriber reads its slots any more."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.subscriber.timeout + _FOLLOW_WAIT)
        with self._lock:
            self._server.close()
            self._buffers.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Relay at {self.engine.local_engine} serving v{self.version} {self._server.ledger!r}>"
