"""Many initiator engines in one child process, all connected to one target: the fleet's far side.

A :class:`PeerGroup` starts ``python -m hixl.bench._fleet_peers_main`` and
asks it to open engines (each one an authenticated TCP peer of the target,
with a registered buffer of its own), to time an 8-byte ``transfer_sync``
READ from one of them, or to have several of them READ at once for a while
and say how many bytes each moved. The engines stay connected and idle in
between, which is what a target serving a fleet sees most of the time.
"""

from __future__ import annotations

import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from .._tools.child import ChildProcess, CommandChild, serve_commands

__all__ = ["PeerGroup"]

_BUFFER = 1 << 20


class _Peers:
    """The child's engines (see the module docstring)."""

    def __init__(self, target: str, options: dict[str, Any]) -> None:
        self.target, self.options = target, options
        self.engines: list[Any] = []
        self.buffers: list[Any] = []

    def open(self, count: int) -> int:
        from .. import Engine, empty  # in the child only

        for _ in range(count):
            engine = Engine("127.0.0.1", self.options)
            buf = empty(_BUFFER)
            engine.register_mem(buf)
            engine.connect(self.target)
            self.engines.append(engine)
            self.buffers.append(buf)
        return len(self.engines)

    def latency(self, remote_addr: int, iterations: int) -> list[float]:
        """Seconds per 8-byte READ from the first engine, ``iterations`` times."""
        from .. import Op

        engine, local = self.engines[0], int(self.buffers[0].ctypes.data)
        descs = [(local, remote_addr, 8)]
        samples = []
        for _ in range(iterations):
            start = time.perf_counter()
            engine.transfer_sync(self.target, Op.READ, descs)
            samples.append(time.perf_counter() - start)
        return samples

    def read_for(self, count: int, remote_addr: int, nbytes: int, seconds: float) -> list[int]:
        """Bytes each of the first ``count`` engines READ (``nbytes`` at a time, one thread each)
        in ``seconds``, all starting together."""
        from .. import Op

        moved = [0] * count
        start = threading.Barrier(count + 1)
        stop_at: list[float] = []

        def reader(index: int) -> None:
            engine, local = self.engines[index], int(self.buffers[index].ctypes.data)
            descs = [(local, remote_addr, nbytes)]
            start.wait()
            while time.perf_counter() < stop_at[0]:
                engine.transfer_sync(self.target, Op.READ, descs)
                moved[index] += nbytes

        threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(count)]
        for thread in threads:
            thread.start()
        stop_at.append(time.perf_counter() + seconds)
        start.wait()
        for thread in threads:
            thread.join(seconds + 60)
        return moved

    def close(self) -> None:
        for engine in self.engines:
            engine.finalize()


def _serve(conn: Connection) -> None:
    target, options = conn.recv()
    peers = _Peers(target, options)
    conn.send("ready")
    try:
        serve_commands(conn, lambda command, args: getattr(peers, command)(*args))
    finally:
        peers.close()


class PeerGroup(CommandChild):
    """A child process of initiator engines connected to ``target`` (see the module docstring)."""

    who = "fleet peer process"

    def __init__(self, target: str, options: dict[str, Any], timeout: float = 300.0) -> None:
        self._child = ChildProcess("hixl.bench._fleet_peers_main", timeout)
        self._child.request((target, options))
        self.pid = self._child.pid
        self._reading = 0.0

    def open(self, count: int) -> int:
        """Open ``count`` more connected engines; how many the group has now."""
        return int(self._do("open", count))

    def latency(self, remote_addr: int, iterations: int) -> list[float]:
        """Seconds per 8-byte ``transfer_sync`` READ of ``remote_addr`` from the group's first engine."""
        return list(self._do("latency", remote_addr, iterations))

    def start_reading(self, count: int, remote_addr: int, nbytes: int, seconds: float) -> None:
        """Have ``count`` engines read ``nbytes`` at a time for ``seconds``, without waiting: several
        groups then read at once. :meth:`bytes_read` collects what each moved."""
        self._child.send(("read_for", (count, remote_addr, nbytes, seconds)))
        self._reading = seconds

    def bytes_read(self) -> list[int]:
        """What each engine of the last :meth:`start_reading` moved (waits for it to end)."""
        return list(self._child.answer("read_for", self.who, self._reading + 120))
