"""shm transports configured for tests, for target processes (which name transports by class)."""

from __future__ import annotations

from hixl.transports import ShmTransport

ALLOWED_UID = 4242


class OnlyUid4242(ShmTransport):
    """Shares pool memory only with uid 4242 (``allowed_uids``); nobody in the tests runs as it."""

    def __init__(self) -> None:
        super().__init__(allowed_uids=[ALLOWED_UID])
