"""The transport contract: what a transport declares and what it must do.

A :class:`Transport` is one thing with two halves. Its *target* half may
``advertise`` facts the initiator needs (sent in the WELCOME of each
authenticated connection), and ``serve``\\s the frame types it declares in
:attr:`Capabilities.serves` on the target engine's I/O thread. Its *initiator*
half ``probe``\\s a fresh link to a peer — can I reach it? — and, if so,
``open``\\s a :class:`Channel` bound to it. Each half sees a narrow session,
not the socket or the protocol state: :class:`ServedSession` on the target,
:class:`LinkSession` on the initiator. (:class:`ServedSession` is defined a layer below, in
:mod:`hixl._session.contract`, and re-exported here: with what the target calls on a
transport, :class:`~hixl._session.contract.TargetHalf` — which every :class:`Transport`
is — it lets the session layer serve without importing this module.) The engine reads
the declared capabilities (a same-host-only transport is not even probed for a
peer on another host; memory kinds must match), walks its transports in order
of preference and takes the first whose probe passes, so new transports (shared
memory, RDMA, GPU) plug in without touching the engine.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .._memory import merge_adjacent
from .._protocol.frames import FrameType, ReadRequest, WriteRequest
from .._session.contract import ServedSession
from .._types import CheckedRows, MemType, Op

if TYPE_CHECKING:
    import socket

    from .. import _protocol as proto
    from .._iov import IovCursor
    from .._memory import OwnView, RemoteRegions
    from .._request import TransferReq
    from .._session.initiator import LinkState, Pending
    from .._session.peer_regions import PeerRegions

__all__ = ["Capabilities", "Channel", "LinkSession", "ServedSession", "Transport", "row_descs"]


def row_descs(local_addr: int, remote_addr: int, stride: int, rows: np.ndarray) -> np.ndarray:
    """The ``(N, 3)`` uint64 descriptors a gather of rows ``rows`` stands for (see
    :meth:`hixl.Engine.read_rows`): row ``rows[i]`` of ``stride`` bytes into slot ``i``."""
    descs = np.empty((len(rows), 3), dtype=np.uint64)
    descs[:, 0] = np.arange(len(rows), dtype=np.uint64) * np.uint64(stride) + np.uint64(local_addr)
    descs[:, 1] = rows.astype(np.uint64) * np.uint64(stride) + np.uint64(remote_addr)
    descs[:, 2] = stride
    return descs


class LinkSession(Protocol):
    """What a transport's initiator half sees of its link to one peer (a
    :class:`~hixl._session.initiator.PeerLink`): requests and their replies, the peer's
    regions, and the connection's bindings — not the socket's locks or the protocol state."""

    remote_engine: str
    """The peer's address, ``"ip:port"``."""
    welcome: dict[str, Any]
    """What the peer's WELCOME said (its transports' advertised facts under ``"transports"``)."""
    regions: PeerRegions
    """The peer's registrations, their generation, and the lease same-host copies hold."""
    state: LinkState
    """CONNECTED until the link is CLOSED or BROKEN."""
    connect_deadline: float | None
    """When the ``connect`` that made this link gives up (``time.monotonic()``): a probe ends by
    then. None: no such deadline."""
    on_event: Callable[[Any], None] | None
    """Fault injection (:class:`hixl.testing.faults.FaultyTransport`): called with each event read."""
    on_send_failed: Callable[[int], None] | None
    """Fault injection: called with the id of a request whose send failed, before it is forgotten."""

    @property
    def socket(self) -> socket.socket:
        """The authenticated connection's socket: for proving who holds its far end, not for I/O."""

    def ensure_alive(self) -> None:
        """Raise :class:`~hixl.PeerDisconnected` unless the link is CONNECTED."""

    def next_id(self) -> int:
        """A fresh request id."""

    def submit(
        self, message: proto.Message, pending: Pending, data: Any = None, deadline: float | None = None, read_reply: bool = False
    ) -> None:
        """Send a request (and its bulk ``data``) whose reply goes to ``pending``."""

    def exchange(
        self, write: bool, descs: list[tuple[int, int, int]], nbytes: int, pending: Pending, deadline: float
    ) -> bool:
        """The latency path: one READ or WRITE frame for ``descs`` ((local, remote, len), ``nbytes``
        in all) and a WRITE's data in one send, the reply read on this thread (a DATA's bytes
        straight into local memory)."""

    def compiled_exchange(self) -> Any:
        """The latency path in C (:class:`hixl._accel.TcpSmall`), or None without the extension."""

    def resume(
        self, stopped: tuple[Any, ...], write: bool, descs: list[tuple[int, int, int]], nbytes: int, pending: Pending, deadline: float
    ) -> None:
        """Go on from where the compiled latency path stopped short (as :meth:`exchange` from there)."""

    def call(self, message: proto.Message, timeout: float) -> proto.Message:
        """Send a request and wait for its reply."""

    def check_remote(self, addrs: np.ndarray, lens: np.ndarray, timeout: float, write: bool = False) -> None:
        """Refuse ranges outside the peer's regions (refreshed once on a miss)."""

    def refresh_regions(self, timeout: float) -> None:
        """Ask the peer for its current registrations."""

    def poll_input(self) -> None:
        """Handle what already arrived for the link, if nobody else reads (for a copying loop)."""

    def binding(self, label: str) -> bytes:
        """16 bytes only the two ends of this connection can compute, for ``label``."""

    def peer_deadline(self, deadline: float | None) -> int:
        """Our monotonic ``deadline`` in the peer's clock, microseconds (0: none)."""

    def take_data(self, nbytes: int) -> bytes:
        """Up to ``nbytes`` of the current reply's data that arrived with its frame (a ``Pending``'s ``on_data``)."""

    def receive_into(self, cursor: IovCursor, owner: object | None = None, abandon_at: float | None = None) -> bool:
        """Land the current reply's data into ``cursor`` (a ``Pending``'s ``on_data``); False if
        ``owner`` was cancelled or ``abandon_at`` passed (the rest is drained)."""


@dataclass(frozen=True)
class Capabilities:
    """What a transport can do, declared up front rather than discovered by trial."""

    name: str
    """Short name, also the value of the engine's ``"transport"`` option."""
    same_host_only: bool
    """Only works when both engines share a kernel (the engine skips it for a peer whose boot id differs)."""
    mem_types: frozenset[MemType]
    """Memory kinds it can move."""
    serves: frozenset[FrameType] = field(default_factory=frozenset)
    """Frame types its target half answers (:meth:`Transport.serve`); none for one-sided ones."""
    serve_blocks: bool = True
    """Whether :meth:`Transport.serve` may block (wait on a socket, say): it then runs on one of the
    target's few worker threads, and the connection is not read meanwhile. A transport that answers
    through the session's queueing calls (``reply``, ``send_data``, ``land_data``: TCP) declares
    False and is served on the target's I/O loop itself, at no thread hand-off."""
    one_sided: bool = True
    """Whether its initiator half may touch the target's memory without the target serving the
    request (cma, shm). A target waits for such peers to confirm a deregistration (REVOKE); a peer
    whose every transport declares False (TCP: the target checks and serves each request itself)
    says so at the handshake and is only told of the change."""


class Channel(abc.ABC):
    """A transport bound to one connected peer."""

    link: LinkSession
    """The connection to the peer."""

    @abc.abstractmethod
    def start(self, req: TransferReq, op: Op, descs: np.ndarray) -> None:
        """Begin moving the bytes of validated ``descs`` ((N, 3): local, remote, len).

        Must eventually ``complete()`` or ``fail()`` ``req``; may do the whole
        job before returning. Must check ``req.cancelled`` under ``req.io_lock``
        before each chunk it writes into local memory.
        """

    def run(self, req: TransferReq, op: Op, descs: np.ndarray) -> None:
        """Like :meth:`start`, for a caller that waits for ``req`` right after (``transfer_sync``).

        A transport may use the calling thread to finish the job; the default starts it.
        """
        self.start(req, op, descs)

    def run_small(
        self, op: Op, descs: list[tuple[int, int, int]], nbytes: int, timeout: float, checked: RemoteRegions
    ) -> bool:
        """Try to move a few small, validated descriptors synchronously, right now.

        The latency path of ``transfer_sync``: a transport that can beat the
        general path for a handful of descriptors overrides it. Returns True if
        every byte moved within ``timeout`` seconds; False sends the caller down
        the general path, which also reports any error (so moving bytes twice
        must be harmless). ``checked`` is the table of the peer's regions the
        engine checked ``descs`` against: a transport whose copies bypass the
        peer copies only while it is still the current one (under its lease).
        The default has no fast path.
        """
        return False

    def read_rows(
        self, req: TransferReq, local_addr: int, remote_addr: int, stride: int, rows: np.ndarray, span: tuple[int, int],
        checked: CheckedRows | None = None,
    ) -> int:
        """Move a gather the engine checked (:meth:`hixl.Engine.read_rows`), for a caller that waits for ``req``;
        how many rows are torn, or -1 where it did not check them (see :class:`~hixl.CheckedRows`).

        ``rows``: int64; ``span``: the peer's ``(start, length)`` they all lie in, found inside its
        regions — without ``checked``, each row is >= 0 and inside it; with, the span is the whole
        table and the rows are not checked yet (ValueError, nothing moved, for one outside). The
        slots here are registered. The default moves the descriptors it stands for through
        :meth:`run`; a transport that can gather in one step overrides it, under the same rules
        as :meth:`start`.
        """
        if checked is not None and len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= checked.limit):
            raise ValueError(f"rows must be in [0, {checked.limit})")
        self.run(req, Op.READ, merge_adjacent(row_descs(local_addr, remote_addr, stride, rows)))
        return -1

    def latency_path(self, registry: OwnView) -> Callable[[Op, object], bool] | None:
        """``transfer_sync``'s whole latency path to this peer in one call, or None (the default).

        A transport whose small copy is one system call offers a callable taking ``(op,
        op_descs)`` as the application passed them, which checks both sides' ranges itself (the
        local ones against ``registry``, this engine's registrations) and moves the bytes at
        once: True if every byte moved; False sends the caller down the general path, which
        checks again and reports any error (so moving bytes twice must be harmless). The engine
        then calls it instead of its own checks and :meth:`run_small`.
        """
        return None

    def check_remote(self, addrs: np.ndarray, lens: np.ndarray, timeout: float, write: bool) -> None:
        """Raise :class:`~hixl.MemoryRangeError` unless every range is inside the peer's regions
        (and :class:`~hixl.AccessDenied` if ``write`` and one is read-only).

        Called before any byte moves. The default checks the link's copy of the
        peer's regions; a transport whose target can't refuse a request itself
        (CMA) makes sure that copy is current first.
        """
        self.link.check_remote(addrs, lens, timeout, write)

    def close(self) -> None:
        """Release per-peer resources (the link itself is closed by the engine)."""


class Transport(abc.ABC):
    """A way of moving bytes between engines; see the module docstring."""

    capabilities: Capabilities

    def advertise(self, session: ServedSession) -> dict[str, Any]:
        """Target side: JSON-able facts for this connection's WELCOME (sent under the name)."""
        return {}

    def serve(self, session: ServedSession, message: Any) -> None:
        """Target side: answer one frame of a type in :attr:`Capabilities.serves`."""
        raise NotImplementedError(f"{self.capabilities.name} serves no frames")

    def serve_small(
        self, session: ServedSession, write: bool, req_id: int, deadline: int, pairs: list[tuple[int, int]], data_len: int
    ) -> None:
        """Target side, on the I/O loop (``serve_blocks`` False): :meth:`serve` for a small READ or
        WRITE read straight off the socket, given by its fields (``pairs``: (addr, len); the
        connection has accounted for the frame already). By default the message is built and
        served; a transport may answer from the fields alone (TCP's latency path) — and one that
        overrides :meth:`serve` to watch what it serves then overrides this one too."""
        descs = np.array(pairs, dtype=np.uint64).reshape(-1, 2)
        message = WriteRequest(req_id, descs, data_len, deadline) if write else ReadRequest(req_id, descs, deadline)
        self.serve(session, message)

    def serves_plainly(self) -> bool:
        """Whether this transport's target half serves a small READ or WRITE exactly as TCP does —
        its ranges checked against this engine's registrations readable (READ) or writable (WRITE),
        one past its deadline refused, a READ's DATA and bytes sent from where they lie, a WRITE's
        data copied in and an ACK sent — so that the session may serve one that arrived whole
        itself, in the C call that read it (:func:`hixl._accel.tcp_request`), without calling
        :meth:`serve_small`. False unless the transport says so."""
        return False

    def _serves_as(self, cls: type[Transport]) -> bool:
        """Whether this transport serves with ``cls``'s own :meth:`serve` and :meth:`serve_small`
        (not a subclass's that serves its own way, say to count what it serves)."""
        return type(self).serve is cls.serve and type(self).serve_small is cls.serve_small

    @abc.abstractmethod
    def probe(self, link: LinkSession) -> str | None:
        """Initiator side: ``None`` if this peer is reachable this way, else the reason not."""

    @abc.abstractmethod
    def open(self, link: LinkSession) -> Channel:
        """Initiator side: a channel to a peer whose probe passed."""

    def regions_changed(self, generation: int) -> None:
        """Target side: this engine's registrations changed, to ``generation`` (called before the
        change returns, and before any peer is told)."""

    def close(self) -> None:
        """Release what ``advertise`` set up."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.capabilities.name}>"
