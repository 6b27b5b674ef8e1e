"""shm transports configured for tests, for target processes (which name transports by class)."""

from __future__ import annotations

from typing import Any

from hixl.transports import ShmTransport
from hixl.transports.base import ServedSession

ALLOWED_UID = 4242


class OnlyUid4242(ShmTransport):
    """Shares pool memory only with uid 4242 (``allowed_uids``); nobody in the tests runs as it."""

    def __init__(self) -> None:
        super().__init__(allowed_uids=[ALLOWED_UID])


class CountingShm(ShmTransport):
    """shm counting the READ and WRITE frames its target half serves: what went over TCP."""

    def __init__(self) -> None:
        super().__init__()
        self._served = 0

    def serve(self, session: ServedSession, message: Any) -> None:
        """Count, then serve as shm does."""
        self._served += 1
        super().serve(session, message)

    def serve_small(
        self, session: ServedSession, write: bool, req_id: int, deadline: int, pairs: list[tuple[int, int]], data_len: int
    ) -> None:
        """Count, then serve as shm does (a small READ or WRITE the target read straight off the socket)."""
        self._served += 1
        super().serve_small(session, write, req_id, deadline, pairs, data_len)

    def served(self) -> int:
        """Frames served so far (read with ``TargetProcess.transport_call("shm", "served")``)."""
        return self._served
