"""Push mode's bookkeeping in the proxy: where each prefill instance's KV lives, and what each side is sent.

In push mode (``--kv-mode push``) a request goes to decode and prefill at
once, both naming it by one random push id: decode must be told where
prefill's KV lives — every TP rank's DataDist endpoint and heads
(``remote_ranks``) and its KV spec (``remote_kv``) — before prefill has
answered. The proxy learns that from the instance's own answers: pull mode's
``kv_transfer_params`` carry both, and so do a pushing prefill's. So the
first request to a prefill the proxy knows nothing of goes in pull mode;
every answer refreshes what it knows; and a request whose push fails makes
the proxy forget it (a prefill restarted with new endpoints), so the next
request to that prefill goes in pull mode again and teaches the proxy anew.
No I/O here.
"""

from __future__ import annotations

import secrets
from collections.abc import Hashable
from typing import Any

__all__ = ["KvSources", "decode_params", "new_push_id", "prefill_params"]

#: What prefill is asked to do with a request in pull mode: compute the prompt's KV, keep it for decode.
PULL_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}


def new_push_id() -> int:
    """A fresh push id: random, 63 bits, never 0 (what the connector accepts)."""
    return secrets.randbelow(2**63 - 1) + 1


def prefill_params(push_id: int) -> dict[str, Any]:
    """Prefill's ``kv_transfer_params`` for a pushed request: compute the prompt, write it where decode granted."""
    return {**PULL_PREFILL_PARAMS, "push_id": push_id}


def decode_params(source: dict[str, Any], push_id: int) -> dict[str, Any]:
    """Decode's ``kv_transfer_params`` for a pushed request: take the prompt's KV from the prefill at ``source``."""
    return {"do_remote_prefill": True, "push_id": push_id, **source}


class KvSources:
    """Where each prefill instance's KV lives, as its last answer said (keyed by the proxy's upstream)."""

    def __init__(self) -> None:
        self._known: dict[Hashable, dict[str, Any]] = {}

    def learn(self, prefill: Hashable, kv_params: Any) -> None:
        """Remember ``remote_ranks`` and ``remote_kv`` from a prefill's answer, if it has them (else change nothing).

        Only their shape is checked (a non-empty list, an object): decode checks the rest, as it does for
        pull mode's params."""
        if not isinstance(kv_params, dict):
            return
        ranks, kv = kv_params.get("remote_ranks"), kv_params.get("remote_kv")
        if isinstance(ranks, list) and ranks and isinstance(kv, dict):
            self._known[prefill] = {"remote_ranks": ranks, "remote_kv": kv}

    def forget(self, prefill: Hashable) -> None:
        """A push through ``prefill`` failed: its next request goes in pull mode and teaches the proxy anew."""
        self._known.pop(prefill, None)

    def of(self, prefill: Hashable) -> dict[str, Any] | None:
        """What the proxy knows of ``prefill``'s KV (None: nothing, send it a pull)."""
        return self._known.get(prefill)

    def __repr__(self) -> str:
        return f"<KvSources {len(self._known)} known>"
