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


def default_transports(copy_lanes: int = 1) -> list[Transport]:
    """Every built-in transport, most preferred first: cma (one kernel copy of any registered memory;
    needs ptrace permission), shm (one copy through the target's pool memory, for same-host peers
    cma cannot reach), tcp (anywhere, any registered memory). A large cma or shm copy is split over
    ``copy_lanes`` threads."""
    return [CmaTransport(copy_lanes), ShmTransport(copy_lanes=copy_lanes), TcpTransport()]
