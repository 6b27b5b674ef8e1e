"""The transport conformance suite (:mod:`hixl.testing.conformance`) against every built-in
transport, and against a transport defined outside the package, to show one plugs in without
touching the engine."""

from __future__ import annotations

from hixl.testing.conformance import TransportConformance


class TestCma(TransportConformance):
    transport = "cma"
    transport_class = "hixl.transports.cma:CmaTransport"


class TestTcp(TransportConformance):
    transport = "tcp"
    transport_class = "hixl.transports.tcp:TcpTransport"


class TestThirdParty(TransportConformance):
    transport = "relay"
    transport_class = "tests.engine.thirdparty:RelayTransport"
