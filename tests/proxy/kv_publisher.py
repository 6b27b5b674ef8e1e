"""vLLM's KV events as its publisher sends them, for the proxy's tests: batches in its wire format, and a publisher on real ZMQ sockets.

The batches are written here from plain lists and maps (what msgspec makes of
vLLM's ``KVEventBatch``: ``[ts, [event map, ...], dp_rank]``, each event tagged
by ``"type"``), not with the proxy's decoder, so that a test reading them
through the proxy checks its decoding against this independent encoding;
``tests/vllm/test_kv_events_wire.py`` checks both against vLLM's own classes.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

BLOCK = 4  # tokens per block in these tests


def stored(tokens: Sequence[int], parent: bytes | None = None, **extra: Any) -> tuple[dict[str, Any], bytes]:
    """A ``BlockStored`` of ``tokens`` (whole blocks of :data:`BLOCK`), chained from ``parent``; also its last block's hash.

    The hashes are made up from the tokens and the parent (the proxy never computes them)."""
    hashes, last = [], parent
    for start in range(0, len(tokens), BLOCK):
        last = hashlib.sha256(repr((last, tokens[start : start + BLOCK])).encode()).digest()
        hashes.append(last)
    event = {
        "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": list(tokens),
        "block_size": BLOCK, "lora_id": None, "medium": "GPU", "lora_name": None, **extra,
    }  # fmt: skip
    assert last is not None
    return event, last


def removed(hashes: Sequence[bytes]) -> dict[str, Any]:
    """A ``BlockRemoved`` of these blocks."""
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"}


def batch(*events: dict[str, Any]) -> bytes:
    """One published batch of ``events``."""
    return msgspec.msgpack.encode([time.time(), list(events), 0])


class Publisher:
    """A vLLM instance's event sockets, on 127.0.0.1: PUB (``endpoint``) and replay ROUTER (``replay``), as vLLM's publisher
    runs them. Faults to order: ``silent`` (the replay socket answers nothing), :meth:`publish` with ``skip`` (the
    batch goes to the replay buffer only: a subscriber sees a gap). :meth:`run` answers replays until cancelled."""

    def __init__(self, context: zmq.asyncio.Context, endpoint: str = "tcp://127.0.0.1:*", replay: str = "tcp://127.0.0.1:*") -> None:
        self.context = context
        self.task: asyncio.Task[None] | None = None  # its run(), where a test started it
        self._pub = context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self._router = context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(replay)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: list[tuple[int, bytes]] = []
        self.silent = False

    async def publish(self, payload: bytes, skip: bool = False) -> int:
        """Publish the next batch (``skip``: to the replay buffer only); its sequence number."""
        seq = len(self.buffer)
        self.buffer.append((seq, payload))
        if not skip:
            await self._pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        return seq

    async def run(self) -> None:
        """Answer replay requests (unless ``silent``) until cancelled."""
        while True:
            client, _, start = await self._router.recv_multipart()
            if self.silent:
                continue
            first = int.from_bytes(start, "big")
            for seq, payload in self.buffer:
                if seq >= first:
                    await self._router.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), payload])
            await self._router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        """Close both sockets (a restarted instance binds them again)."""
        self._pub.close(linger=0)
        self._router.close(linger=0)
