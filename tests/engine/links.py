"""Helpers shared by the engine tests that break links on purpose."""

from __future__ import annotations

import time

import numpy as np

from hixl import Engine, Op, PeerDisconnected, TransferTimeout


def wait_until_link_dead(eng: Engine, remote: str, local: np.ndarray, remote_addr: int, since: float, limit: float) -> float:
    """Poll ``remote`` with small READs until the link is declared dead; seconds since ``since``.

    Fails the test (``AssertionError``) if that takes ``limit`` seconds or more.
    """
    while time.monotonic() - since < limit:
        try:
            eng.transfer_sync(remote, Op.READ, [(int(local.ctypes.data), remote_addr, 8)], timeout=0.5)
        except PeerDisconnected:
            return time.monotonic() - since
        except TransferTimeout:
            continue
    raise AssertionError(f"the link to {remote} was not declared dead within {limit} s")
