"""TCP transport: READ/WRITE served by the target engine's I/O thread.

Works across hosts. The initiator sends READ (descriptors) or WRITE
(descriptors, then the data ``writev``-ed straight from registered memory) on
the connection's socket; the target's I/O thread validates the descriptors
against its registrations and answers with DATA (``writev`` from its registered
memory) or ACK after ``readv``-ing straight into it. No staging buffers, no
serialisation of payloads. The target's application code still takes no
part; only its engine's thread does.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from .. import _protocol as proto
from .._exceptions import HixlError, MemoryRangeError, ProtocolError, TransferTimeout, error_for_status
from .._link import Pending
from .._types import MemType, Op, Status
from .._iov import IovCursor, iovecs
from .base import Capabilities, Channel, Transport

if TYPE_CHECKING:
    from .._link import PeerLink
    from .._request import TransferReq

__all__ = ["TcpTransport"]


class _InFlight(Pending):
    """Completes a :class:`TransferReq` from the reader thread."""

    def __init__(self, req: TransferReq, local: IovCursor) -> None:
        self.req = req
        self.local = local

    def on_data(self, link: PeerLink, nbytes: int) -> None:
        if nbytes != self.local.total:
            raise ProtocolError(f"DATA carries {nbytes} bytes, the READ asked for {self.local.total}")
        link.framed.receive_into(self.local, self.req)
        if not self.req.cancelled:  # else it expired mid-data, and _expire reports TIMEOUT
            self.req.complete()

    def on_reply(self, message: proto.Message) -> None:
        if isinstance(message, proto.Ack):
            self.req.complete()
        elif isinstance(message, proto.Error):
            text = f"peer refused the transfer: {message.message}"
            if message.status == Status.PARAM_INVALID:
                # A target refuses READ/WRITE as PARAM_INVALID only for a range outside its
                # registrations; we checked against our copy of them, which may lag behind
                # a deregistration. Same error as when our own check catches it.
                self.req.fail(MemoryRangeError(text))
            else:
                self.req.fail(error_for_status(message.status, text))
        else:
            self.req.fail(ProtocolError(f"unexpected {type(message).__name__} reply to a transfer"))

    def on_failure(self, error: HixlError) -> None:
        if self.req.deadline is not None and time.monotonic() >= self.req.deadline:
            # Past its deadline the request has timed out, as its status would say. This is
            # also the case where its own send ran out of time mid-frame, killing the link:
            # the reader failing it here must not turn that TIMEOUT into a disconnect.
            error = TransferTimeout(f"{self.req!r} passed its deadline ({error})")
        self.req.fail(error)


class TcpChannel(Channel):
    """Sends transfer requests over the peer's control socket."""

    def __init__(self, link: PeerLink) -> None:
        self.link = link

    def start(self, req: TransferReq, op: Op, descs: np.ndarray) -> None:
        """Send the request (and WRITE data); the link's reader completes ``req``."""
        local = IovCursor(iovecs(descs[:, 0], descs[:, 2]))
        remote = np.ascontiguousarray(descs[:, 1:3])
        req_id = self.link.next_id()
        try:
            self.link.expect(req_id, _InFlight(req, local))
            if op is Op.READ:
                self.link.framed.send(proto.encode(proto.ReadRequest(req_id, remote)), deadline=req.deadline)
            else:
                frame = proto.encode(proto.WriteRequest(req_id, remote, local.total))
                self.link.framed.send(frame, data=local, deadline=req.deadline)
        except HixlError as exc:
            self.link.forget(req_id)
            req.fail(exc)


class TcpTransport(Transport):
    """TCP between any two engines (see module docstring)."""

    capabilities = Capabilities(
        name="tcp",
        same_host_only=False,
        mem_types=frozenset({MemType.HOST}),
        target_cpu_free=False,
        zero_copy=True,
    )

    def probe(self, link: PeerLink) -> str | None:
        """Always reachable: the control connection is itself TCP."""
        return None

    def open(self, link: PeerLink) -> Channel:
        """A channel over ``link``'s socket."""
        return TcpChannel(link)
