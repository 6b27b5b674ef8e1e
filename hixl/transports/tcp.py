"""TCP transport, both halves: READ/WRITE over the connection's own socket.

Works across hosts. *Initiator half* (:class:`TcpChannel`): sends READ
(descriptors) or WRITE (descriptors, then the data ``writev``-ed straight from
registered memory); a READ's DATA reply is ``readv``-ed straight into local
memory. Requests with more descriptors than a frame carries are split into
several frames and complete together. *Target half* (:meth:`TcpTransport.serve`):
the target engine's I/O thread checks the descriptors against its registrations
(and their access rights), then answers with DATA (``writev`` from registered
memory) or lands the WRITE's data (``readv`` into it) and ACKs. No staging
buffers, no serialisation of payloads; the target's application code takes no
part, only its engine's thread does.

Deadlines travel in the request, converted to the target's clock (never later
than the initiator's): the target lands no byte of a WRITE past it, and refuses
a READ that arrives after it, so once the initiator reports TIMEOUT no byte of
that request lands on either side.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _protocol as proto
from .._exceptions import (
    HixlError,
    MemoryRangeError,
    ProtocolError,
    TransferTimeout,
    error_for_status,
)
from .._iov import IovCursor, iovecs
from .._session.initiator import Pending
from .._types import MemType, Op, Status
from .base import Capabilities, Channel, Transport

if TYPE_CHECKING:
    from .._memory import RemoteRegions
    from .._request import TransferReq
    from .base import LinkSession, ServedSession

__all__ = ["TcpChannel", "TcpTransport"]


def _refusal_error(message: proto.Message) -> HixlError:
    """The error a non-ACK reply to a READ/WRITE stands for."""
    if not isinstance(message, proto.Error):
        return ProtocolError(f"unexpected {type(message).__name__} reply to a transfer")
    text = f"peer refused the transfer: {message.message}"
    if message.status == Status.PARAM_INVALID:
        # A target refuses READ/WRITE as PARAM_INVALID only for a range outside its
        # registrations; we checked against our copy of them, which may lag behind
        # a deregistration. Same error as when our own check catches it.
        return MemoryRangeError(text)
    if message.status == Status.TIMEOUT:
        return TransferTimeout(text)
    return error_for_status(message.status, text)


class _Parts:
    """Completes one :class:`TransferReq` once every frame it was split into is answered."""

    def __init__(self, req: TransferReq, count: int) -> None:
        self.req = req
        self.left = count
        self._lock = threading.Lock()

    def one_done(self) -> None:
        with self._lock:
            self.left -= 1
            last = self.left == 0
        if last and not self.req.cancelled:  # cancelled: it expired, and its status says TIMEOUT
            self.req.complete()


class _InFlight(Pending):
    """One frame of a transfer; its reply arrives on whichever thread reads the socket."""

    def __init__(self, parts: _Parts, local: IovCursor) -> None:
        self.parts = parts
        self.local = local

    def on_data(self, link: LinkSession, nbytes: int) -> None:
        # (nbytes is what the READ asked for: the connection refuses any other DATA.)
        req = self.parts.req
        if link.receive_into(self.local, req):
            self.parts.one_done()
        self.done = True

    def on_reply(self, message: proto.Message) -> None:
        self.done = True
        if isinstance(message, proto.Ack):
            self.parts.one_done()
        else:
            self.parts.req.fail(_refusal_error(message))

    def on_failure(self, error: HixlError) -> None:
        self.done = True
        req = self.parts.req
        if req.deadline is not None and time.monotonic() >= req.deadline:
            # Past its deadline the request has timed out, as its status would say. This is
            # also the case where its own send ran out of time mid-frame, killing the link:
            # the reader failing it here must not turn that TIMEOUT into a disconnect.
            error = TransferTimeout(f"{req!r} passed its deadline ({error})")
        req.fail(error)


class _Small(Pending):
    """The reply to a latency-path request: a READ's data is scattered straight into ``descs``."""

    def __init__(self, descs: list[tuple[int, int, int]], deadline: float, size: int) -> None:
        self.descs = descs
        self.deadline = deadline
        self.size = size
        """Bytes of DATA the reply brings (0: a WRITE's, answered by an ACK)."""
        self.ok = False
        self.error: HixlError | None = None

    def on_landed(self, nbytes: int) -> None:
        self.done = True
        self.ok = nbytes == self.size
        if not self.ok:
            self.error = TransferTimeout(f"the reply to a READ of {self.size} B stalled past its deadline")

    def on_data(self, link: LinkSession, nbytes: int) -> None:
        self.done = True
        data = link.take_data(nbytes)
        if len(data) == nbytes:  # (the connection refuses DATA of another length than the READ's)
            offset = 0
            for addr, _, length in self.descs:  # a few memmoves beat building an iovec cursor
                ctypes.memmove(addr, data[offset : offset + length], length)
                offset += length
            self.ok = True
            return
        local = IovCursor(iovecs(np.array([d[0] for d in self.descs], np.uint64), np.array([d[2] for d in self.descs], np.uint64)))
        local.copy_in(data)
        self.ok = link.receive_into(local, abandon_at=self.deadline)
        if not self.ok:
            self.error = TransferTimeout(f"the reply to a READ of {nbytes} B stalled past its deadline")

    def on_reply(self, message: proto.Message) -> None:
        self.done = True
        self.ok = isinstance(message, proto.Ack)
        if not self.ok:
            self.error = _refusal_error(message)

    def on_failure(self, error: HixlError) -> None:
        self.done = True
        self.error = error


class TcpChannel(Channel):
    """Sends transfer requests over the peer's authenticated socket."""

    def __init__(self, link: LinkSession) -> None:
        self.link = link
        self._compiled = link.compiled_exchange()

    def start(self, req: TransferReq, op: Op, descs: np.ndarray) -> None:
        """Send the request's frames (and WRITE data); replies complete ``req`` on the reading thread."""
        self._send(req, op, descs, read_reply=False)

    def run(self, req: TransferReq, op: Op, descs: np.ndarray) -> None:
        """As :meth:`start`, and read the reply on this thread if nobody else is reading."""
        self._send(req, op, descs, read_reply=True)

    def run_small(
        self, op: Op, descs: list[tuple[int, int, int]], nbytes: int, timeout: float, checked: RemoteRegions
    ) -> bool:
        """The latency path: one frame packed from the tuples, the WRITE's data sent from
        registered memory in the same ``sendmsg``, and the reply read on this thread —
        only when nothing else is being read (else the general path queues behind it)."""
        link = self.link
        deadline = time.monotonic() + timeout
        write = op is Op.WRITE
        # In C where it can be (hixl._accel.TcpSmall); where that stops short, the link goes on from there.
        stopped = self._compiled.run(write, descs, deadline) if self._compiled is not None else None
        if stopped is True:
            return True
        pending = _Small(descs, deadline, 0 if write else nbytes)
        try:
            if stopped is not None:
                link.resume(stopped, write, descs, nbytes, pending, deadline)
            elif not link.exchange(write, descs, nbytes, pending, deadline):
                return False  # someone else is reading: queue behind them on the general path
        except HixlError as exc:
            if pending.error is None:
                pending.error = exc
        if pending.error is not None:
            raise pending.error
        if not pending.done:
            raise TransferTimeout(f"{op.name} of {nbytes} B from {link.remote_engine} timed out after {timeout} s")
        return pending.ok

    def _send(self, req: TransferReq, op: Op, descs: np.ndarray, read_reply: bool) -> None:
        groups = [descs[i : i + proto.frames.MAX_DESCS] for i in range(0, len(descs), proto.frames.MAX_DESCS)]
        parts = _Parts(req, len(groups))
        req.lands_remotely = op is Op.WRITE
        for group in groups:
            local = IovCursor(iovecs(group[:, 0], group[:, 2]))
            remote = np.ascontiguousarray(group[:, 1:3])
            req_id = self.link.next_id()
            deadline = self.link.peer_deadline(req.deadline)
            if op is Op.READ:
                message: proto.Message = proto.ReadRequest(req_id, remote, deadline)
                data = None
            else:
                message, data = proto.WriteRequest(req_id, remote, local.total, deadline), local
            try:
                pending = _InFlight(parts, local)
                self.link.submit(message, pending, data, req.deadline, read_reply=read_reply and len(groups) == 1)
            except HixlError as exc:
                req.fail(exc)
                return


class TcpTransport(Transport):
    """TCP between any two engines (see module docstring)."""

    capabilities = Capabilities(
        name="tcp",
        same_host_only=False,
        mem_types=frozenset({MemType.HOST}),
        serves=frozenset({proto.FrameType.READ, proto.FrameType.WRITE}),
        serve_blocks=False,
        one_sided=False,
    )

    def probe(self, link: LinkSession) -> str | None:
        """Always reachable: the connection is itself TCP."""
        return None

    def open(self, link: LinkSession) -> Channel:
        """A channel over ``link``'s socket."""
        return TcpChannel(link)

    # -- target half ----------------------------------------------------------------------------
    def serve(self, session: ServedSession, message: Any) -> None:
        """Answer one READ or WRITE, on the target's I/O loop, without blocking: the reply and its
        data are queued, a WRITE's data is landed as it arrives (see :class:`ServedSession`).

        The request holds its ranges from before the check until its last byte moved,
        so a deregistration of them waits for it (or cuts it off).
        """
        write = isinstance(message, proto.WriteRequest)
        if len(message.descs) <= proto.frames.SMALL_DESCS:
            pairs = [(a, n) for a, n in message.descs.tolist()]
            self.serve_small(session, write, message.req_id, message.deadline, pairs, message.data_len if write else 0)
            return
        release = session.take_hold(message.descs)
        try:
            if write:
                self._serve_write(session, message, release)
            else:
                self._serve_read(session, message, release)
        except BaseException:
            release()
            raise

    def serve_small(
        self, session: ServedSession, write: bool, req_id: int, deadline: int, pairs: list[tuple[int, int]], data_len: int
    ) -> None:
        """The latency path of :meth:`serve`, from the request's fields: a few ranges checked with
        bisect (numpy costs more than it saves), a READ's DATA and bytes in one ``sendmsg``, a
        small WRITE's data copied from what came with its frame — the same rules, in fewer steps."""
        release = session.take_hold(pairs)
        try:
            table = session.regions()
            if not write and self._late(session, req_id, deadline, release):
                return
            if not all(table.contains(a, n, write) for a, n in pairs):
                refusal = self._refusal(session, req_id, np.array(pairs, dtype=np.uint64).reshape(-1, 2), write)
                if refusal is not None:  # (the check that explains is the one that decides)
                    self._refuse(session, write, refusal, release)
                    return
            if write:
                session.land_small(pairs, session.local_deadline(deadline), self._landed(session, req_id), release)
            else:
                session.send_small(req_id, pairs, release)
        except BaseException:
            release()
            raise

    def serves_plainly(self) -> bool:
        """True: :meth:`serve_small` is those rules. Not for a subclass that serves its own way
        (overrides :meth:`serve` or :meth:`serve_small`, say to count what it serves)."""
        return self._serves_as(TcpTransport)

    @staticmethod
    def _refusal(session: ServedSession, req_id: int, descs: np.ndarray, write: bool) -> proto.Error | None:
        try:
            session.regions().check(descs[:, 0], descs[:, 1], write, "requested")
        except HixlError as exc:
            return proto.Error(req_id, int(exc.status), str(exc))
        return None

    @staticmethod
    def _refuse(session: ServedSession, write: bool, refusal: proto.Error, release: Callable[[], None]) -> None:
        if write:
            session.land_data(None, 0.0, lambda _: session.reply(refusal), release)  # dropped: the stream stays in step
        else:
            release()
            session.reply(refusal)

    @staticmethod
    def _landed(session: ServedSession, req_id: int) -> Callable[[bool], None]:
        def landed(complete: bool) -> None:
            if complete:
                session.acknowledge(req_id)
            else:
                session.reply(proto.Error(req_id, Status.TIMEOUT, "the WRITE passed its deadline; the rest was dropped"))

        return landed

    @staticmethod
    def _late(session: ServedSession, req_id: int, deadline: int, release: Callable[[], None]) -> bool:
        """Refuse a READ that arrived after its deadline (True), moving nothing."""
        if not session.expired(deadline):
            return False
        release()
        session.reply(proto.Error(req_id, Status.TIMEOUT, "the READ arrived after its deadline"))
        return True

    def _serve_read(self, session: ServedSession, message: proto.ReadRequest, release: Callable[[], None]) -> None:
        if self._late(session, message.req_id, message.deadline, release):
            return
        refusal = self._refusal(session, message.req_id, message.descs, write=False)
        if refusal is not None:
            self._refuse(session, False, refusal, release)
            return
        session.send_data(proto.Data(message.req_id, int(message.descs[:, 1].sum())), message.descs, release)

    def _serve_write(self, session: ServedSession, message: proto.WriteRequest, release: Callable[[], None]) -> None:
        refusal = self._refusal(session, message.req_id, message.descs, write=True)
        if refusal is not None:
            self._refuse(session, True, refusal, release)
            return
        cursor = IovCursor(iovecs(message.descs[:, 0], message.descs[:, 1]))
        session.land_data(cursor, session.local_deadline(message.deadline), self._landed(session, message.req_id), release)
