"""Transports: how bytes move between engines. See :mod:`hixl.transports.base`."""

from .base import Capabilities, Channel, Transport
from .cma import CmaTransport
from .shm import ShmTransport
from .tcp import TcpTransport

__all__ = [
    "Capabilities",
    "Channel",
    "CmaTransport",
    "ShmTransport",
    "TcpTransport",
    "Transport",
    "default_transports",
]


def default_transports() -> list[Transport]:
    """Every built-in transport, most preferred first: cma (no copy the target takes part in, but
    needs ptrace permission), shm (one copy through the target's pool memory, for peers cma cannot
    reach), tcp (anywhere, and every region)."""
    return [CmaTransport(), ShmTransport(), TcpTransport()]
