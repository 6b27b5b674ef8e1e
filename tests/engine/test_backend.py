"""The network backend is where an engine gets its sockets, both ways: one given to the Engine is
used for every connect and for listening — so a test can inject faults there, through the front door."""

from __future__ import annotations

import socket

import numpy as np
import pytest

import hixl
from hixl import Engine, NetworkBackend, NotConnected, Op, TcpBackend


class Counting(TcpBackend):
    """Plain TCP, counting what it opened; refuses every connect while ``down``."""

    def __init__(self) -> None:
        self.connects: list[tuple[str, int]] = []
        self.listens: list[tuple[str, int]] = []
        self.down = False

    def connect(self, host: str, port: int, timeout: float) -> socket.socket:
        if self.down:
            raise ConnectionRefusedError(111, "refused by the test's backend")
        self.connects.append((host, port))
        return super().connect(host, port, timeout)

    def listen(self, host: str, port: int, backlog: int) -> socket.socket:
        self.listens.append((host, port))
        return super().listen(host, port, backlog)


def test_the_engine_connects_and_listens_through_its_backend() -> None:
    backend = Counting()
    with Engine("127.0.0.1:0", network_backend=backend) as target, Engine("127.0.0.1", network_backend=backend) as eng:
        assert backend.listens == [("127.0.0.1", 0)]
        there, here = hixl.empty(64), hixl.empty(64)
        there[:] = 5
        target.register_mem(there)
        eng.register_mem(here)
        eng.connect(target.local_engine)
        host, port = target.local_engine.split(":")
        assert backend.connects == [(host, int(port))]
        eng.transfer_sync(target.local_engine, Op.READ, np.array([[here.ctypes.data, there.ctypes.data, 64]], np.uint64))
        assert (here == 5).all()
        eng.disconnect(target.local_engine)
        backend.down = True  # a fault injected below the engine: its connect says why
        with pytest.raises(NotConnected, match="refused by the test's backend"):
            eng.connect(target.local_engine, timeout=0.5)


def test_the_base_backend_must_be_subclassed() -> None:
    with pytest.raises(NotImplementedError):
        NetworkBackend().connect("127.0.0.1", 1, 1.0)
    with pytest.raises(NotImplementedError):
        NetworkBackend().listen("127.0.0.1", 0, 1)
