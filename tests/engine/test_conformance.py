"""The transport conformance suite (:mod:`hixl.testing.conformance`) against every built-in
transport, and against a transport defined outside the package, to show one plugs in without
touching the engine."""

from __future__ import annotations

from typing import Any

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
    transport = "relay"
    transport_class = "tests.engine.thirdparty:RelayTransport"
