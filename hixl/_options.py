"""Engine options: defaults, and the range checks every value passes at ``Engine(...)``."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from typing import Any

from ._exceptions import ParamInvalid, Unsupported
from ._protocol.auth import Secret
from ._protocol.seal import aead_unavailable
from .discovery.store import checked_lease_ttl

__all__ = ["DEFAULT_OPTIONS", "EngineOptions"]

DEFAULT_OPTIONS: dict[str, Any] = {
    "transport": "auto",
    "connect_timeout": 5.0,
    "connect_fail_fast": False,
    "transfer_timeout": 30.0,
    "deregister_timeout": 5.0,
    "heartbeat_interval": 1.0,
    "heartbeat_misses": 5,
    "idle_ping_interval": 10.0,
    "hello_timeout": 1.0,
    "handshake_timeout": 5.0,
    "frame_timeout": 10.0,
    "max_notifies": 4096,
    "max_notify_bytes": 4 << 20,
    "max_notifies_per_connection": 1024,
    "max_notify_bytes_per_connection": 1 << 20,
    "max_registrations": 65536,
    "max_handshakes": 64,
    "max_handshakes_per_source": 8,
    "max_connections": 4096,
    "max_connections_per_peer": 64,
    "serve_threads": 4,
    "max_inflight": 4096,
    "copy_lanes": min(4, os.cpu_count() or 1),
    "busy_poll": 50e-6,
    "auth_secret": None,
    "allow_unauthenticated": False,
    "encrypt": False,
    "allowed_networks": None,
    "metadata_server": None,
    "lease_ttl": 10.0,
}
"""Engine options and their defaults (times in seconds, sizes in bytes).

- ``transport``: ``"auto"`` (best reachable), or a transport name to force it (``"cma"``, ``"tcp"``).
- ``connect_timeout``: how long ``connect`` keeps trying (a refused connection is retried
  until then, unless ``connect_fail_fast``) and waits for the handshake.
- ``transfer_timeout``: default timeout of transfers and notifications.
- ``deregister_timeout``: how long ``deregister_mem``/``finalize`` wait for peers to confirm they
  stopped using the memory (and for requests being served in it) before cutting them off.
- ``heartbeat_interval`` / ``heartbeat_misses``: an idle link is pinged every interval; a peer
  that shows no progress for interval × misses is declared dead.
- ``idle_ping_interval``: a TCP link with nothing waiting on the peer is pinged only after this
  long silent (and declared dead ``heartbeat_interval × heartbeat_misses`` later): idle links cost
  their target a ping per interval each, not one per heartbeat. Links whose copies bypass the
  socket (cma, shm) always ping at the heartbeat's pace.
- ``hello_timeout`` (target): a connection's first frame (HELLO) must be complete within this,
  from accept; at most ``handshake_timeout`` (if left out, it is cut down to it).
- ``handshake_timeout`` (target): a connection must finish its handshake within this, from accept.
- ``frame_timeout`` (target): a frame that has started arriving must complete within this.
- ``max_notifies`` / ``max_notify_bytes`` (target): notifications held for ``get_notifies``
  before senders get RESOURCE_EXHAUSTED.
- ``max_notifies_per_connection`` / ``max_notify_bytes_per_connection`` (target): the share of
  those one connection may hold; past it, only that connection's sender is refused.
- ``max_registrations``: registrations per engine.
- ``max_handshakes`` (target): connections still in the handshake at once; when full, a new one
  evicts the oldest handshake of the source address that holds the most.
- ``max_handshakes_per_source`` (target): connections still in the handshake from one source
  address; more are refused at once with RESOURCE_EXHAUSTED.
- ``max_connections`` / ``max_connections_per_peer`` (target): authenticated connections served at
  once, in all and from one peer address (handshakes do not count); a peer that would exceed them
  is refused with RESOURCE_EXHAUSTED once its handshake passed — unless all ``max_connections`` are
  taken and an address holding two more than the peer's has an idle connection: the one of those
  idle longest, of the address holding the most, is closed to make room (its engine's next transfer
  fails with PeerDisconnected; ``connect`` again reconnects). A listening engine makes sure the
  process may open that many files (raising its soft limit up to the hard one), or refuses to
  start with ResourceExhausted, saying what to raise.
- ``serve_threads`` (target): threads that serve requests moving data (READ replies, WRITE data),
  however many peers; a connection whose request waits for one is served in its turn. Control
  frames, handshakes and heartbeats are served by one I/O thread besides.
- ``max_inflight``: async requests per peer not yet finished; more raise ResourceExhausted.
- ``copy_lanes``: threads (the caller's included) a same-host copy (cma, shm) is split over, window
  by window from 4 MiB, each taking the window's next piece as it frees up (default: the cores, at
  most 4; 1: one thread). The lease and cancel rules hold per window, as with one lane.
- ``busy_poll``: seconds (0 to 0.01; 0: never) that a TCP reply is waited for by trying again
  before sleeping, and that the target's I/O thread polls for its next frame after one came: a
  sleeping thread woken by a reply due in microseconds costs that much more again on a VM whose
  idle CPU halts (~30 µs per wake-up here); a WRITE's ACK longer, by its data at 1 GiB/s (at most
  1 ms more), and a target landing a WRITE tries again as long for more of it. Costs up to that
  much CPU after each request.
- ``auth_secret``: shared secret (str or bytes; default ``$HIXL_AUTH_SECRET``) both ends must know.
- ``allow_unauthenticated``: listen on a non-loopback address without a secret (refused otherwise).
- ``encrypt``: seal every TCP link of this engine, both roles — every frame and every data byte
  encrypted and authenticated (AES-256-GCM, keys derived from each handshake's session key; needs
  ``auth_secret`` and the ``cryptography`` package, ``pip install hixl[encrypt]``). A peer that does
  not encrypt is refused with :class:`~hixl.EncryptionMismatch`, in either role; nothing falls back
  to plaintext. Same-host copies (cma, shm) are not TCP and stay as they are; the socket beside
  them is sealed. Off by default: see docs/engine.md, "Encryption".
- ``allowed_networks`` (target): CIDR strings; connections from elsewhere are refused.
- ``metadata_server``: ``"etcd://host:port"`` (default ``$HIXL_METADATA_SERVER``) to publish this
  engine there and let DataDist resolve clusters through it (see :mod:`hixl.discovery`); ``None``:
  peer to peer only. An unreachable store is an error at ``Engine(...)``, within ``connect_timeout``.
- ``lease_ttl``: seconds (2 to 3600) the records this engine publishes outlive it if it dies.
"""

_POSITIVE_TIMES = (
    "connect_timeout",
    "transfer_timeout",
    "deregister_timeout",
    "heartbeat_interval",
    "idle_ping_interval",
    "hello_timeout",
    "handshake_timeout",
    "frame_timeout",
)
_POSITIVE_COUNTS = (
    "heartbeat_misses",
    "max_notifies",
    "max_notifies_per_connection",
    "max_registrations",
    "max_handshakes",
    "max_handshakes_per_source",
    "max_connections",
    "max_connections_per_peer",
    "serve_threads",
    "max_inflight",
    "copy_lanes",
)
# At least 4096, so that the largest notification (two 1 KiB strings) always fits.
_NOTIFY_BYTES = ("max_notify_bytes", "max_notify_bytes_per_connection")
_FLAGS = ("connect_fail_fast", "allow_unauthenticated", "encrypt")
_MOST_BUSY_POLL = 0.01  # (longer would be a CPU burnt per request, not a wake-up saved)


@dataclass(frozen=True)
class EngineOptions:
    """Validated options; :attr:`public` is what ``Engine.options`` shows (the secret redacted)."""

    values: dict[str, Any]
    secret: Secret | None
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]

    @classmethod
    def parse(cls, options: dict[str, Any] | None) -> EngineOptions:
        """Merge ``options`` over the defaults and check every value; :class:`ParamInvalid` if one is off."""
        if options is not None and not isinstance(options, dict):
            raise ParamInvalid(f"options must be a dict, not {type(options).__name__}")
        unknown = set(options or {}) - set(DEFAULT_OPTIONS)
        if unknown:
            raise ParamInvalid(f"unknown engine option(s) {sorted(unknown)}; known: {sorted(DEFAULT_OPTIONS)}")
        values = {**DEFAULT_OPTIONS, **(options or {})}
        for name in _POSITIVE_TIMES:
            value = values[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e9:
                raise ParamInvalid(f"option {name} must be a positive number of seconds, not {value!r}")
            values[name] = float(value)
        if values["hello_timeout"] > values["handshake_timeout"]:
            # Only a value given explicitly is an error: lowering handshake_timeout alone lowers both.
            if "hello_timeout" in (options or {}):
                raise ParamInvalid(
                    f"option hello_timeout ({values['hello_timeout']}) must not exceed handshake_timeout "
                    f"({values['handshake_timeout']})"
                )
            values["hello_timeout"] = values["handshake_timeout"]
        spin = values["busy_poll"]
        if isinstance(spin, bool) or not isinstance(spin, (int, float)) or not 0 <= spin <= _MOST_BUSY_POLL:
            raise ParamInvalid(f"option busy_poll must be 0 to {_MOST_BUSY_POLL} seconds, not {spin!r}")
        values["busy_poll"] = float(spin)
        for name in _POSITIVE_COUNTS:
            value = values[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParamInvalid(f"option {name} must be a positive integer, not {value!r}")
        for name in _NOTIFY_BYTES:
            value = values[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 4096:
                raise ParamInvalid(f"option {name} must be an integer >= 4096, not {value!r}")
        for name in _FLAGS:
            if not isinstance(values[name], bool):
                raise ParamInvalid(f"option {name} must be True or False, not {values[name]!r}")
        if not isinstance(values["transport"], str):
            raise ParamInvalid(f"option transport must be a string, not {values['transport']!r}")
        try:
            secret = Secret.from_option(values["auth_secret"])
        except TypeError as exc:
            raise ParamInvalid(str(exc)) from None
        values["auth_secret"] = secret
        if values["encrypt"]:
            if secret is None:
                raise ParamInvalid(
                    "option encrypt needs auth_secret (or HIXL_AUTH_SECRET): the keys derive from the handshake's "
                    "session key, which only a shared secret keeps from others"
                )
            missing = aead_unavailable()
            if missing is not None:
                raise Unsupported(missing)
        if values["metadata_server"] is None:
            values["metadata_server"] = os.environ.get("HIXL_METADATA_SERVER") or None
        if values["metadata_server"] is not None and not isinstance(values["metadata_server"], str):
            raise ParamInvalid(f"option metadata_server must be an etcd://host:port URL, not {values['metadata_server']!r}")
        values["lease_ttl"] = checked_lease_ttl(values["lease_ttl"])
        return cls(values, secret, _networks(values["allowed_networks"]))

    @property
    def public(self) -> dict[str, Any]:
        """The options as ``Engine.options`` shows them."""
        return dict(self.values)


def _networks(value: Any) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    if value is None:
        return ()
    if isinstance(value, str) or not hasattr(value, "__iter__"):
        raise ParamInvalid(f"option allowed_networks must be a list of CIDR strings, not {value!r}")
    networks = []
    for item in value:
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except (TypeError, ValueError) as exc:
            raise ParamInvalid(f"allowed_networks: {item!r} is not a network ({exc})") from None
    if not networks:
        raise ParamInvalid("allowed_networks is empty: nobody could connect (use None to allow any)")
    return tuple(networks)


def is_loopback(host: str) -> bool:
    """Whether an engine listening on ``host`` is reachable from this machine only."""
    return ipaddress.ip_address(host).is_loopback
