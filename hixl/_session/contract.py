"""What the target's sessions and a transport's target half ask of each other: the contract, kept here.

The session layer serves every connection and hands the data frames (READ, WRITE) to
the transport that declares it serves them. Both ends of that hand-off are described
here, in the layer below the transports, so that the session layer needs nothing of
:mod:`hixl.transports` to run — it imports downward only, as every layer does:

- :class:`ServedSession` — what a transport's target half sees of one connection: a
  narrow interface, the socket and the protocol state stay here. A served connection
  (:class:`~hixl._session.served._ServedConnection`) is one.
- :class:`TargetHalf` — what the server calls on a transport: its declared
  :class:`ServingCapabilities`, ``advertise`` for the WELCOME, ``serve`` and
  ``serve_small`` for a frame, and ``serves_plainly`` (may the session serve a small READ
  or WRITE itself, as TCP would?). Every :class:`hixl.transports.base.Transport` is one,
  by its shape: nothing here names it, and the type checker holds the two together where
  the engine hands its transports to the server.

:mod:`hixl.transports.base` re-exports :class:`ServedSession`: a transport's author reads
the whole contract from there.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from .._iov import IovCursor
    from .._memory import RemoteRegions
    from .._protocol.frames import FrameType

__all__ = ["ServedSession", "ServingCapabilities", "TargetHalf"]


class ServedSession(Protocol):
    """What a transport's target half sees of one authenticated initiator's connection: a narrow
    interface, not the socket or the protocol state (the session layer keeps those)."""

    keepalive: list[Any]
    """Objects to keep alive as long as the connection lasts."""

    @property
    def peer(self) -> str:
        """The peer's address, ``"ip:port"`` (for logs)."""

    def binding(self, label: str) -> bytes:
        """16 bytes only the two ends of this authenticated connection can compute, for ``label``:
        what a side channel of the transport's own proves it belongs to this connection with."""

    def regions(self) -> RemoteRegions:
        """This engine's registrations, with access rights, as of now."""

    def hold(self, descs: np.ndarray) -> AbstractContextManager[None]:
        """Hold ``descs`` ((N, 2): addr, len) of this engine's memory while a request uses them:
        deregistering them waits (see ``Engine.deregister_mem``). Take it before checking them."""

    def expired(self, deadline_us: int) -> bool:
        """Whether a deadline carried in a request (our clock, microseconds) has passed."""

    def local_deadline(self, deadline_us: int) -> float:
        """A carried deadline as ``time.monotonic()`` seconds, capped by this engine's limit."""

    def mark_one_sided(self) -> None:
        """The peer reaches this engine's memory one-sidedly from now on (it was handed a way to:
        shm's memory files), whatever it said at the handshake: it confirms deregistrations."""

    # For a transport served on the I/O loop (``Capabilities.serve_blocks`` False): calls that
    # queue and return at once; the loop moves the bytes as the socket allows.
    def reply(self, message: Any) -> None:
        """Send ``message`` (an ACK, an ERROR) after whatever is queued already."""

    def acknowledge(self, req_id: int) -> None:
        """:meth:`reply` with the ACK of ``req_id`` (the latency path: its frame made directly)."""

    def take_hold(self, descs: np.ndarray | list[tuple[int, int]]) -> Callable[[], None]:
        """:meth:`hold`, released by calling the function returned (once; later calls do nothing),
        or passing it to :meth:`send_data` / :meth:`land_data`."""

    def send_data(self, message: Any, ranges: np.ndarray, release: Callable[[], None]) -> None:
        """Send ``message`` (a DATA), then the bytes of ``ranges`` ((N, 2): addr, len of this
        engine's memory) straight from there; ``release()`` once sent, or the connection ended."""

    def send_small(self, req_id: int, pairs: list[tuple[int, int]], release: Callable[[], None]) -> None:
        """:meth:`send_data` of the DATA answering ``req_id`` with the bytes of a few (addr, len)
        ``pairs``: frame and bytes in one ``sendmsg`` when nothing is queued before them."""

    def land_small(
        self, pairs: list[tuple[int, int]], deadline: float, landed: Callable[[bool], None], release: Callable[[], None]
    ) -> None:
        """:meth:`land_data` into a few (addr, len) ``pairs``: copied at once if the data all came
        with its frame (a small WRITE), else landed as it arrives, exactly as :meth:`land_data`."""

    def land_data(
        self, cursor: IovCursor | None, deadline: float, landed: Callable[[bool], None], release: Callable[[], None]
    ) -> None:
        """Land the bulk data after the current frame into ``cursor``'s memory as it arrives,
        none of it past ``deadline`` (dropped then, as all of it is for ``cursor`` None); then
        ``release()`` and ``landed(all_of_it)`` — or only ``release()`` if the connection ends."""

    def is_open(self) -> bool:
        """Whether the connection is still open. A transport that serves on a channel of its own
        serves a request only while it is, and looks again between chunks: this engine ends a
        connection whose request outlasts a deregistration, and that must stop the request."""


class ServingCapabilities(Protocol):
    """The part of a transport's declared capabilities (:class:`hixl.transports.base.Capabilities`)
    that the target reads: what it is called, which frames it answers, and where it answers them."""

    @property
    def name(self) -> str:
        """The transport's short name: its advertised facts go in the WELCOME under it."""

    @property
    def serves(self) -> frozenset[FrameType]:
        """Frame types its target half answers (:meth:`TargetHalf.serve`)."""

    @property
    def serve_blocks(self) -> bool:
        """Whether :meth:`TargetHalf.serve` may block: it then runs on a worker, else on the I/O loop."""


class TargetHalf(Protocol):
    """What the target needs of a transport: its target half (see the module docstring)."""

    @property
    def capabilities(self) -> ServingCapabilities:
        """What the transport declares it serves, and how."""

    def advertise(self, session: ServedSession) -> dict[str, Any]:
        """JSON-able facts for ``session``'s WELCOME (sent under the transport's name)."""

    def serve(self, session: ServedSession, message: Any) -> None:
        """Answer one frame of a type in :attr:`ServingCapabilities.serves`."""

    def serve_small(
        self, session: ServedSession, write: bool, req_id: int, deadline: int, pairs: list[tuple[int, int]], data_len: int
    ) -> None:
        """:meth:`serve` for a small READ or WRITE read straight off the socket, given by its fields
        (on the I/O loop: ``serve_blocks`` False)."""

    def serves_plainly(self) -> bool:
        """Whether it serves a small READ or WRITE exactly as TCP does, so that the session may serve
        one itself, in the C call that read it (see ``Transport.serves_plainly``)."""
