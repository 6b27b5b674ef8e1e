"""Parsing engine names: ``"ip:port"``, ``"ip"``, ``"[v6]:port"``, ``"[v6]"``."""

from __future__ import annotations

import ipaddress

from .._exceptions import ParamInvalid

__all__ = ["boot_id", "format_address", "parse_address"]


def _instead(host: str, name: str) -> str:
    """What to write instead of a host name (no lookup: a resolver may stall for seconds)."""
    if host == "localhost":
        return f"engines take addresses, not host names: write {name.replace(host, '127.0.0.1', 1)!r}"
    if host.replace(".", "").isdigit():  # a resolver would take "1.2.3" for 1.2.0.3: say what is wrong
        return "an IPv4 address is four numbers from 0 to 255 joined by dots, e.g. '10.0.0.7:5000'"
    return f"engines take addresses, not host names: resolve {host!r} first (socket.gethostbyname) and pass 'ip:port'"


def parse_address(name: str, require_port: bool = False) -> tuple[str, int | None]:
    """Split an engine name into ``(host, port)``; ``port`` is ``None`` for ``"ip"`` alone.

    The host must be a literal IP address: engines bind exactly the address
    they are given, and a name that resolves to several would be ambiguous.
    """
    if not isinstance(name, str) or not name:
        raise ParamInvalid(f"engine address must be a non-empty string, not {name!r}")
    if name.startswith("["):
        host, sep, rest = name[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ParamInvalid(f"malformed IPv6 engine address {name!r}")
        port_text = rest[1:] if rest else None
    elif name.count(":") == 1:
        host, port_text = name.split(":")
    elif ":" in name:
        raise ParamInvalid(f"IPv6 engine addresses need brackets: {name!r} -> '[addr]:port'")
    else:
        host, port_text = name, None
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ParamInvalid(f"{host!r} in {name!r} is not an IP address: {_instead(host, name)}") from None
    port: int | None = None
    if port_text is not None:
        if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
            raise ParamInvalid(f"invalid port {port_text!r} in {name!r}")
        port = int(port_text)
    if require_port and port is None:
        raise ParamInvalid(f"{name!r} names no port; a remote engine is 'ip:port'")
    return host, port


def format_address(host: str, port: int) -> str:
    """The canonical ``"ip:port"`` (bracketed for IPv6)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def boot_id() -> str:
    """This kernel's boot id: two engines that report the same one share a host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
