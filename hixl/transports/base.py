"""The transport contract: what a transport declares and what it must do.

A :class:`Transport` has two faces. On the *target* side it may ``advertise``
facts the initiator needs (sent in WELCOME). On the *initiator* side it
``probe``\\s a fresh :class:`~hixl._link.PeerLink` — can I reach this peer? —
and, if so, ``open``\\s a :class:`Channel` bound to it. The engine walks its
transports in order of preference and takes the first whose probe passes, so
new transports (shared memory, RDMA, GPU) plug in without touching the engine.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .._types import MemType, Op

if TYPE_CHECKING:
    from .._link import PeerLink
    from .._request import TransferReq

__all__ = ["Capabilities", "Channel", "Transport"]


@dataclass(frozen=True)
class Capabilities:
    """What a transport can do, declared up front rather than discovered by trial."""

    name: str
    """Short name, also the value of the engine's ``"transport"`` option."""
    same_host_only: bool
    """Only works when both engines share a kernel (and pid namespace)."""
    mem_types: frozenset[MemType]
    """Memory kinds it can move."""
    target_cpu_free: bool
    """The target's CPU takes no part in moving the bytes (true one-sidedness)."""
    zero_copy: bool
    """Bytes go straight between the two registered buffers (no staging copy)."""


class Channel(abc.ABC):
    """A transport bound to one connected peer."""

    link: PeerLink
    """The connection to the peer."""

    @abc.abstractmethod
    def start(self, req: TransferReq, op: Op, descs: np.ndarray) -> None:
        """Begin moving the bytes of validated ``descs`` ((N, 3): local, remote, len).

        Must eventually ``complete()`` or ``fail()`` ``req``; may do the whole
        job before returning. Must check ``req.cancelled`` under ``req.io_lock``
        before each chunk it writes into local memory.
        """

    def run_small(self, op: Op, descs: list[tuple[int, int, int]], nbytes: int) -> bool:
        """Try to move a few small, validated descriptors synchronously, right now.

        The latency path of ``transfer_sync``: a transport that can beat the
        general path for a handful of descriptors overrides it. Returns True if
        every byte moved; False sends the caller down the general path, which
        also reports any error. The default has no fast path.
        """
        return False

    def check_remote(self, addrs: np.ndarray, lens: np.ndarray, timeout: float) -> None:
        """Raise :class:`~hixl.MemoryRangeError` unless every range is inside the peer's regions.

        Called before any byte moves. The default checks the link's copy of the
        peer's regions; a transport whose target can't refuse a request itself
        (CMA) makes sure that copy is current first.
        """
        self.link.check_remote(addrs, lens, timeout)

    def close(self) -> None:
        """Release per-peer resources (the link itself is closed by the engine)."""


class Transport(abc.ABC):
    """A way of moving bytes between engines; see the module docstring."""

    capabilities: Capabilities

    def advertise(self) -> dict[str, Any]:
        """Target side: JSON-able facts for WELCOME (keyed by nothing; merged under the name)."""
        return {}

    @abc.abstractmethod
    def probe(self, link: PeerLink) -> str | None:
        """Initiator side: ``None`` if this peer is reachable this way, else the reason not."""

    @abc.abstractmethod
    def open(self, link: PeerLink) -> Channel:
        """Initiator side: a channel to a peer whose probe passed."""

    def regions_changed(self) -> None:
        """Target side: this engine's registrations changed (called before the change returns)."""

    def close(self) -> None:
        """Release what ``advertise`` set up."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.capabilities.name}>"
