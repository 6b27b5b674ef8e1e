"""Faults injected into an initiator's links, through the Transport contract.

:class:`FaultyTransport` wraps a transport: an engine given it (``transports=[...]``)
chooses and uses the inner transport exactly as before — same name, same channel —
but every link it opens carries the faults set on the wrapper, for the races a real
network only shows by chance::

    faulty = FaultyTransport(TcpTransport())
    with Engine("127.0.0.1", transports=[faulty]) as eng:
        eng.connect(target.engine)
        faulty.late_regions = 0.1  # from now on, REGIONS updates arrive 0.1 s late

Both faults are off until set, and may be set and cleared while links are open.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .._protocol import RegionsPushed
from .._session.initiator import LinkState
from ..transports.base import Channel, Transport

if TYPE_CHECKING:
    from ..transports.base import LinkSession, ServedSession

__all__ = ["FaultyTransport"]


class FaultyTransport(Transport):
    """``inner`` with faults injected into the links it opens (see the module docstring)."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.capabilities = inner.capabilities
        self.late_regions = 0.0
        """Seconds each REGIONS update from the target (its push of changed registrations) waits on
        arrival before the link applies it; the frames after it on that link wait too, as they
        would behind it on a slow network. 0: none."""
        self.failed_sends_wait = 0.0
        """When a request's send fails, the sending thread waits up to this many seconds for
        another thread (the link's reader) to end the link before it goes on: the reader then
        fails the request while it is still pending. 0: none."""

    def probe(self, link: LinkSession) -> str | None:
        """The inner transport's verdict."""
        return self.inner.probe(link)

    def open(self, link: LinkSession) -> Channel:
        """The inner transport's channel, on a link that now carries this wrapper's faults."""
        link.on_event = self._on_event
        link.on_send_failed = lambda req_id: self._on_send_failed(link)
        return self.inner.open(link)

    def _on_event(self, event: Any) -> None:
        if self.late_regions and isinstance(event, RegionsPushed):
            time.sleep(self.late_regions)

    def _on_send_failed(self, link: LinkSession) -> None:
        # Polled: the link has no event for "ended", and this waits only under a fault.
        deadline = time.monotonic() + self.failed_sends_wait
        while link.state is LinkState.CONNECTED and time.monotonic() < deadline:
            time.sleep(0.001)

    # -- the target half is the inner transport's ---------------------------------------------
    def advertise(self, session: ServedSession) -> dict[str, Any]:
        """The inner transport's facts."""
        return self.inner.advertise(session)

    def serve(self, session: ServedSession, message: Any) -> None:
        """Served by the inner transport."""
        self.inner.serve(session, message)

    def regions_changed(self, generation: int) -> None:
        """Passed on to the inner transport."""
        self.inner.regions_changed(generation)

    def close(self) -> None:
        """Close the inner transport."""
        self.inner.close()

    def __repr__(self) -> str:
        return f"<FaultyTransport {self.inner!r}>"
