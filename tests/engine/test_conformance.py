"""The transport conformance suite (:mod:`hixl.testing.conformance`) against every built-in transport."""

from __future__ import annotations

from hixl.testing.conformance import TransportConformance


class TestCma(TransportConformance):
    transport = "cma"


class TestTcp(TransportConformance):
    transport = "tcp"
