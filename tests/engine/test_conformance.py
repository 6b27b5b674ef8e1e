"""The transport conformance suite (:mod:`hixl.testing.conformance`) against every built-in
transport, and against a transport defined outside the package, to show one plugs in without
touching the engine."""

from __future__ import annotations

import socket
from typing import Any

from hixl import Engine
from hixl.testing import TargetProcess
from hixl.testing.conformance import TransportConformance


class TestCma(TransportConformance):
    transport = "cma"
    transport_class = "hixl.transports.cma:CmaTransport"


class TestShm(TransportConformance):
    """shm against a target whose buffers are pool memory (what it moves; the rest goes over TCP)."""

    transport = "shm"
    transport_class = "hixl.transports.shm:ShmTransport"

    @classmethod
    def make_target(cls, sizes: list[int], options: dict[str, Any] | None = None) -> TargetProcess:
        return TargetProcess(sizes, options, transports=[cls.transport_class], shared=True)


class TestTcp(TransportConformance):
    transport = "tcp"
    transport_class = "hixl.transports.tcp:TcpTransport"


class TestThirdParty(TransportConformance):
    """A transport with its own socket and framing (tests/engine/thirdparty.py)."""

    transport = "sidecar"
    transport_class = "tests.engine.thirdparty:SidecarTransport"

    def test_a_client_that_proves_nothing_is_hung_up_on(self, engine: Engine, target: TargetProcess) -> None:
        """The sidecar socket serves only the holder of an open connection's binding."""
        with open("/proc/net/unix") as table:  # abstract names, as "@name"; the target listens already
            (name,) = {line.split()[-1][1:] for line in table if f"@hixl-sidecar-{target.pid}-" in line}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect("\0" + name)
            sock.sendall(bytes(16))  # no connection's binding
            assert sock.recv(64) == b""  # hung up on, told nothing
