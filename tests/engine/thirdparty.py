"""A transport defined outside hixl, for the conformance suite: it has its own name and target
half, and reaches the engine only through the Transport contract (``transports=[...]``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from hixl.transports.tcp import TcpTransport


class RelayTransport(TcpTransport):
    """TCP's two halves under another name, counting the frames its target half serves."""

    capabilities = dataclasses.replace(TcpTransport.capabilities, name="relay")

    def __init__(self) -> None:
        self.served = 0

    def serve(self, session: Any, message: Any) -> None:
        """Count, then serve as TCP does."""
        self.served += 1
        super().serve(session, message)

