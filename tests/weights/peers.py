"""The parent's handle on a :mod:`tests.weights.peer_main` child: a publisher, subscriber or relay."""

from __future__ import annotations

import signal
import time
from typing import Any

import numpy as np

import hixl
from hixl._tools.child import ChildProcess, CommandChild

from .peer_main import UNCHECKED


class Peer(CommandChild):
    """One side of hixl.weights in a child process. ``role``: ``"publisher"``, ``"subscriber"`` or
    ``"relay"``; ``settings``: ``transport``, ``slots``, ``lease``, ``mode``, ``upstream``, ``verify``.
    ``unchecked``: the child's consistency checks are off (the test hook of peer_main).
    Commands run in the child: ``peer.do("publish_pattern", {"w": 8})``; see peer_main.Side.
    """

    def __init__(self, role: str, settings: dict[str, Any], *, unchecked: bool = False, timeout: float = 120.0) -> None:
        self.who = f"the {role}"
        self._child = ChildProcess("tests.weights.peer_main", timeout, env={UNCHECKED: "1" if unchecked else "0"})
        try:
            self.address, self.pid = self._child.request((role, settings), 30.0)
        except BaseException:
            self._child.kill()
            raise

    def wait_stopped(self, timeout: float = 10.0) -> None:
        """Wait until the child has stopped itself (SIGSTOP, peer_main's StallingEngine)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(f"/proc/{self.pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "T":
                    return
            time.sleep(0.01)
        raise TimeoutError(f"{self.who} did not stop within {timeout} s")

    def signal(self, signum: int) -> None:
        """Send ``signum`` (SIGCONT, SIGKILL, ...) to the child."""
        self._child.signal(signum)

    def kill(self) -> None:
        """SIGKILL the child and reap it."""
        self._child.kill()

    def close(self) -> None:
        """End the child (resumed first, if it was stopped)."""
        if self._child.process.poll() is None:
            self._child.signal(signal.SIGCONT)
        super().close()


class CountingEngine(hixl.Engine):
    """An engine that records the bytes of every transfer it is asked for (then makes it as usual)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.moved: list[int] = []

    def __enter__(self) -> CountingEngine:
        return self

    def transfer_sync(self, remote_engine: str, op: hixl.Op, op_descs: Any, timeout: float | None = None) -> None:
        descs = np.asarray([tuple(d) for d in op_descs] if isinstance(op_descs, list) else op_descs)
        self.moved.append(int(descs[:, 2].sum()))
        super().transfer_sync(remote_engine, op, op_descs, timeout)
