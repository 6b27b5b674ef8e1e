"""The shared-secret proofs of the handshake: nonces, HMACs, the session key. Pure functions.

Each side sends a fresh random nonce; each proves it knows the secret with
``HMAC(secret, role | my nonce | your nonce | version)``. The role label stops a
proof from being reflected back as the other side's; the nonces stop replays.
Both proofs are compared with :func:`hmac.compare_digest`. A session key derived
from the secret and both nonces then authenticates what the target says about
itself (the WELCOME) and binds the same-host probe to this one connection.

Without a secret the same exchange runs with an empty key: it proves nothing
about the peer (anyone can compute it), but a recorded handshake still cannot be
replayed, since every connection's nonces are new.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

__all__ = ["NONCE_HEX", "Secret", "fresh_nonce", "mac", "proof", "session_key", "verify"]

NONCE_HEX = 64
"""A nonce is 32 random bytes, sent as 64 hex digits."""
ENV_VAR = "HIXL_AUTH_SECRET"


class Secret:
    """A shared secret that never shows itself in a repr, a log line or an error message."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        self._key = key

    @classmethod
    def from_option(cls, value: object) -> Secret | None:
        """The secret from an ``auth_secret`` option (str or bytes), else from ``$HIXL_AUTH_SECRET``.

        ``None`` means no secret (both unset or empty). Anything else raises ``TypeError``.
        """
        if value is None:
            value = os.environ.get(ENV_VAR) or None
        if value is None or isinstance(value, Secret):
            return value
        if isinstance(value, str):
            value = value.encode()
        if not isinstance(value, (bytes, bytearray)):
            raise TypeError(f"auth_secret must be str or bytes, not {type(value).__name__}")
        return cls(bytes(value)) if value else None

    @property
    def key(self) -> bytes:
        """The raw key bytes (for the HMACs only)."""
        return self._key

    def __repr__(self) -> str:
        return "<Secret ***>"

    __str__ = __repr__


def fresh_nonce() -> str:
    """32 random bytes as hex."""
    return secrets.token_hex(NONCE_HEX // 2)


def _hmac(key: bytes, *parts: object) -> str:
    return hmac.new(key, "|".join(map(str, parts)).encode(), hashlib.sha256).hexdigest()


def proof(key: bytes, role: str, mine: str, theirs: str, version: int) -> str:
    """What the side called ``role`` sends to prove it knows ``key``."""
    return _hmac(key, "hixl-proof", role, mine, theirs, version)


def session_key(key: bytes, initiator_nonce: str, target_nonce: str, version: int) -> bytes:
    """A key for this connection only, known to both sides once the proofs passed."""
    return bytes.fromhex(_hmac(key, "hixl-session", initiator_nonce, target_nonce, version))


def mac(key: bytes, label: str, data: bytes) -> str:
    """An HMAC of ``data`` under ``key``, domain-separated by ``label``."""
    return hmac.new(key, label.encode() + b"|" + data, hashlib.sha256).hexdigest()


def verify(expected: str, got: object) -> bool:
    """Constant-time comparison of a proof or MAC received from a peer."""
    return isinstance(got, str) and hmac.compare_digest(expected.encode(), got.encode("utf-8", "replace"))
