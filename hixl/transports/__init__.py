"""Transports: how bytes move between engines. See :mod:`hixl.transports.base`."""

from .base import Capabilities, Channel, Transport
from .cma import CmaTransport
from .tcp import TcpTransport

__all__ = ["Capabilities", "Channel", "CmaTransport", "TcpTransport", "Transport", "default_transports"]


def default_transports() -> list[Transport]:
    """Every built-in transport, most preferred first."""
    return [CmaTransport(), TcpTransport()]
