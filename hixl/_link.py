"""The initiator's end of a connection: one TCP control socket per peer.

Theory of operation. ``connect`` opens a socket, sends HELLO and gets WELCOME
(the peer's identity, what its transports advertise, and its registered
regions). From then on a *reader thread* owns the receiving half: it applies
REGIONS updates, hands replies to the :class:`Pending` entry registered under
their ``req_id``, and lets a READ reply's data flow from the socket straight
into local memory. Senders share the sending half (:class:`FramedSocket`).

When the peer dies its socket closes and the reader notices at once; a peer
that hangs is caught by heartbeats. Either way the link turns BROKEN, every
pending request fails with :class:`PeerDisconnected`, and later calls fail
immediately instead of hanging.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from typing import Any

import numpy as np

from . import _protocol as proto
from ._exceptions import HixlError, PeerDisconnected, ProtocolError, TransferTimeout, error_for_status
from ._framed import FramedSocket
from ._memory import RegionTable

log = logging.getLogger("hixl")


class LinkState(enum.Enum):
    """State of a :class:`PeerLink`: CONNECTED until it is CLOSED by us or BROKEN."""

    CONNECTED = "CONNECTED"
    CLOSED = "CLOSED"
    BROKEN = "BROKEN"


class Pending:
    """Something waiting for the reply with a given ``req_id``; subclasses override."""

    def on_reply(self, message: proto.Message) -> None:
        """Called on the reader thread with the reply frame."""

    def on_data(self, link: PeerLink, nbytes: int) -> None:
        """Called on the reader thread when ``nbytes`` of data for this request follow."""
        raise ProtocolError("unexpected DATA frame")

    def on_failure(self, error: HixlError) -> None:
        """Called when the link ends before a reply came."""


class _Call(Pending):
    """A synchronous request/reply (QUERY_REGIONS, NOTIFY)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reply: proto.Message | None = None
        self.error: HixlError | None = None

    def on_reply(self, message: proto.Message) -> None:
        self.reply = message
        self.event.set()

    def on_failure(self, error: HixlError) -> None:
        self.error = error
        self.event.set()


class PeerLink:
    """A live connection to one remote engine (see the module docstring)."""

    def __init__(self, remote_engine: str, framed: FramedSocket, welcome: dict[str, Any]) -> None:
        self.remote_engine = remote_engine
        self.framed = framed
        self.welcome = welcome
        self.state = LinkState.CONNECTED
        self.table = RegionTable(tuple(map(tuple, welcome.get("regions", []))))
        self._ids = itertools.count(1)
        self._pending: dict[int, Pending] = {}
        self._pending_lock = threading.Lock()
        self._closing = False
        self._reader = threading.Thread(target=self._read_loop, name=f"hixl-link-{remote_engine}", daemon=True)
        self._reader.start()

    def next_id(self) -> int:
        """A fresh request id for this link."""
        return next(self._ids)

    def ensure_alive(self) -> None:
        """Raise :class:`PeerDisconnected` unless the link is CONNECTED."""
        if self.state is not LinkState.CONNECTED:
            raise PeerDisconnected(
                f"link to {self.remote_engine} is {self.state.name}: {self.framed.dead_reason or 'closed'}"
            )

    def expect(self, req_id: int, pending: Pending) -> None:
        """Route the reply for ``req_id`` to ``pending``."""
        with self._pending_lock:
            self.ensure_alive()
            self._pending[req_id] = pending

    def forget(self, req_id: int) -> None:
        """Stop waiting for ``req_id`` (a late reply is then ignored, its data drained)."""
        with self._pending_lock:
            self._pending.pop(req_id, None)

    def call(self, message: proto.Message, timeout: float) -> proto.Message:
        """Send a request and wait for its reply; an ERROR reply is raised as its error."""
        pending = _Call()
        req_id = message.req_id
        self.expect(req_id, pending)
        try:
            self.framed.send(proto.encode(message), deadline=time.monotonic() + timeout)
            if not pending.event.wait(timeout):
                raise TransferTimeout(f"{type(message).__name__} to {self.remote_engine}: no reply in {timeout} s")
        finally:
            self.forget(req_id)
        if pending.error is not None:
            raise pending.error
        reply = pending.reply
        if isinstance(reply, proto.Error):
            raise error_for_status(reply.status, reply.message)
        assert reply is not None
        return reply

    def refresh_regions(self, timeout: float) -> None:
        """Ask the peer for its current registrations."""
        reply = self.call(proto.QueryRegions(self.next_id()), timeout)
        if not isinstance(reply, proto.Regions):
            raise ProtocolError(f"expected REGIONS, got {type(reply).__name__}")
        self.table = RegionTable(map(tuple, reply.regions.tolist()))

    def check_remote(self, addrs: np.ndarray, lens: np.ndarray, timeout: float) -> None:
        """Refuse descriptors outside the peer's regions, refreshing a stale view once.

        The refresh makes a registration that the peer made a moment ago usable
        even if its REGIONS update is still on the wire.
        """
        if len(self.table.outside(addrs, lens)):
            self.refresh_regions(timeout)
            self.table.check(addrs, lens, "remote")

    def _read_loop(self) -> None:
        try:
            while self._dispatch(self.framed.recv_frame()):
                pass
        except HixlError as exc:
            self._end(LinkState.CLOSED if self._closing else LinkState.BROKEN, str(exc))
        except Exception as exc:  # a bug must still not strand waiters
            log.exception("hixl link reader crashed")
            self._end(LinkState.BROKEN, f"internal error: {exc!r}")

    def _dispatch(self, message: proto.Message) -> bool:
        if isinstance(message, proto.Regions) and message.req_id == 0:
            self.table = RegionTable(map(tuple, message.regions.tolist()))
            return True
        if isinstance(message, (proto.Ping, proto.Pong)):
            return True
        if isinstance(message, proto.Bye):
            # An orderly goodbye: the link is unusable, but nothing went wrong.
            log.info("hixl: %s closed the link (%s)", self.remote_engine, message.reason or "no reason given")
            self._end(LinkState.BROKEN, f"peer closed the link ({message.reason or 'no reason given'})", quiet=True)
            return False
        if not isinstance(message, (proto.Data, proto.Ack, proto.Error, proto.Regions, proto.Meta)):
            raise ProtocolError(f"unexpected {type(message).__name__} from the target")
        with self._pending_lock:
            pending = self._pending.pop(message.req_id, None)
        if isinstance(message, proto.Data):
            if pending is None:
                self.framed.drain(message.data_len)
            else:
                try:
                    pending.on_data(self, message.data_len)
                except HixlError as exc:
                    # Popped already, so _end() would not reach it: fail it here,
                    # or a link dying mid-data strands its request WAITING.
                    pending.on_failure(exc)
                    raise
        elif pending is not None:
            pending.on_reply(message)
        return True

    def close(self, timeout: float = 1.0) -> None:
        """Say BYE, close the socket and join the reader; idempotent."""
        self._closing = True  # the peer's reaction to BYE is not a failure
        if self.state is LinkState.CONNECTED:
            self.framed.try_send(proto.encode(proto.Bye(0, "disconnect")))
        self._end(LinkState.CLOSED, "disconnected")
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout)
        self.framed.close()

    def _end(self, state: LinkState, reason: str, quiet: bool = False) -> None:
        with self._pending_lock:
            if self.state is not LinkState.CONNECTED:
                return
            self.state = state
            pending, self._pending = self._pending, {}
        self.framed.mark_dead(reason)
        if state is LinkState.BROKEN and not quiet:
            log.warning("hixl: link to %s broken: %s", self.remote_engine, reason)
        error = PeerDisconnected(f"link to {self.remote_engine} {state.name.lower()}: {reason}")
        for entry in pending.values():
            entry.on_failure(error)

    def __repr__(self) -> str:
        return (
            f"<PeerLink {self.remote_engine} {self.state.name} "
            f"regions={len(self.table)} pending={len(self._pending)}>"
        )
