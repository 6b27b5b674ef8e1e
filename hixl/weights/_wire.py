"""What publishers and subscribers say to each other: metadata keys and notifications.

Everything travels over the engine's public API. A publisher publishes under its
engine's metadata (``set_metadata``):

- :data:`LATEST_KEY`: ``{"version", "slot"}`` of the newest version (version 0: none yet);
- :func:`slot_key` ``(i)``: the manifest of the version slot ``i`` holds (see :mod:`._manifest`);
- :func:`table_key` ``(name)``: the description of a row table (see :mod:`._rows`).

Notifications flow initiator -> target, so a subscriber (the initiator of every read)
sends :data:`SUBSCRIBE`, :data:`ACQUIRE` and :data:`RELEASE` to the publisher, and
the publisher, having connected back to the address the subscriber named,
sends it :func:`version_name` ``(token)`` for every new version. Each message is a
small JSON object, checked field by field on receipt (:func:`decode`).
"""

from __future__ import annotations

import json
from typing import Any

from ._errors import ManifestError
from ._manifest import checked_int

__all__ = [
    "ACQUIRE",
    "LATEST_KEY",
    "RELEASE",
    "SUBSCRIBE",
    "decode",
    "encode",
    "slot_key",
    "table_key",
    "version_name",
]

LATEST_KEY = "hixl.weights.latest"
SUBSCRIBE = "hixl.weights.subscribe"
ACQUIRE = "hixl.weights.acquire"
RELEASE = "hixl.weights.release"
_MAX_TEXT = 256


def slot_key(slot: int) -> str:
    """Where the manifest of what slot ``slot`` holds is published."""
    return f"hixl.weights.slot.{slot}"


def table_key(name: str) -> str:
    """Where the row table ``name`` is described."""
    return f"hixl.weights.table.{name}"


def version_name(token: str) -> str:
    """The notification name one subscriber hears new versions under (its random ``token``)."""
    return f"hixl.weights.version.{token}"


def encode(**fields: Any) -> str:
    """A message's JSON text."""
    return json.dumps(fields, separators=(",", ":"))


def decode(text: str | bytes, **fields: type) -> dict[str, Any]:
    """Parse a peer's message: a JSON object with exactly ``fields``, each of its type (ints non-negative)."""
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"message is not JSON: {exc}") from None
    if not isinstance(doc, dict) or set(doc) != set(fields):
        raise ManifestError(f"message must be an object with exactly the keys {sorted(fields)}")
    for key, kind in fields.items():
        if kind is int:
            checked_int(doc[key], key, 0, (1 << 63) - 1)
        elif not isinstance(doc[key], kind) or (kind is str and len(doc[key]) > _MAX_TEXT):
            raise ManifestError(f"{key} must be a {kind.__name__}")
    return doc
