"""vLLM's KV-cache events as they travel (``--kv-events-config``, publisher ``zmq``): bytes in, events out, no sockets.

vLLM's scheduler publishes, after each step that changed its prefix cache, one
*batch* on a ZMQ PUB socket as three frames: the topic, an 8-byte big-endian
sequence number (0, 1, 2, ... from the publisher's start) and the batch,
msgpack'd by msgspec: ``[ts, [event, ...], data_parallel_rank]``, each event a
map tagged by ``"type"``:

- ``BlockStored``: ``block_hashes`` (bytes, or ints with
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), ``parent_block_hash`` (None: the
  first block of a prompt), ``token_ids`` (every stored block's tokens, in
  order), ``block_size``, and what else entered the hashes (``lora_id``,
  ``lora_name``, ``extra_keys``: multimodal inputs, a cache salt), ``medium``
  and the KV cache group (``group_idx``);
- ``BlockRemoved``: ``block_hashes``, ``medium``, ``group_idx``;
- ``AllBlocksCleared``: the prefix cache was reset.

Its replay socket (a ROUTER, ``replay_endpoint``) answers a request for the
batches from sequence number N on (an empty frame, then N as 8 bytes big-endian)
with every batch it still holds from N on, each as ``b"", topic, seq, batch``,
then ``b"", b"", -1 (8 bytes, signed), b""``.

Decoding needs msgspec (vLLM's own encoder, which comes with vLLM), not vLLM.
Fields the proxy does not read are ignored, and so are event types it does not
know (a newer vLLM's); a frame or batch of the wrong shape raises
:class:`BadEvents`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "END_SEQ",
    "AllCleared",
    "BadEvents",
    "BlockHash",
    "Event",
    "Removed",
    "Stored",
    "decode_batch",
    "decode_published",
    "decode_replayed",
    "replay_request",
]

#: A block's hash as vLLM publishes it: bytes (sha256 and the like), or an int (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).
BlockHash = bytes | int

#: The sequence number that ends a replay.
END_SEQ = -1


class BadEvents(ValueError):
    """Frames or a batch that are not vLLM's KV events; the message says what is wrong."""


@dataclass(frozen=True)
class Stored:
    """``BlockStored``: blocks ``hashes`` now hold ``tokens`` (``block_size`` each), the first one's parent being ``parent``.

    ``plain``: no LoRA, multimodal input or cache salt entered the hashes, and
    the blocks are in the instance's own memory (``medium`` none or GPU) of its
    first KV cache group: blocks a prompt's token ids alone can be matched with."""

    hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    tokens: tuple[int, ...]
    block_size: int
    plain: bool


@dataclass(frozen=True)
class Removed:
    """``BlockRemoved``: blocks ``hashes`` were evicted (``plain``: from where :class:`Stored`'s plain blocks live)."""

    hashes: tuple[BlockHash, ...]
    plain: bool


@dataclass(frozen=True)
class AllCleared:
    """``AllBlocksCleared``: the instance dropped its whole prefix cache."""


Event = Stored | Removed | AllCleared

_PLAIN_MEDIA = (None, "GPU")  # vLLM's name for its own KV cache (also on the CPU backend); "CPU", "STORAGE": offload tiers
_PLAIN_GROUPS = (None, 0)


def replay_request(start: int) -> list[bytes]:
    """The frames a DEALER sends to ask for every batch from sequence number ``start`` on."""
    return [b"", start.to_bytes(8, "big")]


def decode_published(frames: Sequence[bytes]) -> tuple[int, bytes]:
    """A PUB message's ``(seq, batch)``: ``frames`` are topic, sequence number, batch."""
    if len(frames) != 3:
        raise BadEvents(f"a published batch has 3 frames (topic, seq, batch), not {len(frames)}")
    return _seq(frames[1]), frames[2]


def decode_replayed(frames: Sequence[bytes]) -> tuple[int, bytes]:
    """A replay answer's ``(seq, batch)``, as a DEALER receives it; ``seq`` is :data:`END_SEQ` at its end."""
    if len(frames) != 4 or frames[0]:
        raise BadEvents(f"a replayed batch has 4 frames (empty, topic, seq, batch), not {len(frames)}")
    return _seq(frames[2]), frames[3]


def _seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise BadEvents(f"a sequence number has 8 bytes, not {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def decode_batch(payload: bytes) -> list[Event]:
    """The events of one batch, in order."""
    import msgspec  # (here: a proxy without --kv-events needs no msgspec)

    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise BadEvents(f"a batch is not msgpack: {exc}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise BadEvents("a batch is [ts, [events], ...]")
    events = []
    for raw in batch[1]:
        event = _event(raw)
        if event is not None:
            events.append(event)
    return events


def _event(raw: Any) -> Event | None:
    if not isinstance(raw, dict):
        raise BadEvents(f"an event is a map, not {type(raw).__name__}")
    kind = raw.get("type")
    if kind == "AllBlocksCleared":
        return AllCleared()
    if kind not in ("BlockStored", "BlockRemoved"):
        return None  # a kind this proxy does not know: nothing it indexes
    hashes = raw.get("block_hashes")
    if not isinstance(hashes, list) or not all(isinstance(h, (bytes, int)) for h in hashes):
        raise BadEvents(f"{kind}'s block_hashes are a list of bytes or ints")
    place = raw.get("medium") in _PLAIN_MEDIA and raw.get("group_idx") in _PLAIN_GROUPS
    if kind == "BlockRemoved":
        return Removed(tuple(hashes), place)
    tokens, size, parent = raw.get("token_ids"), raw.get("block_size"), raw.get("parent_block_hash")
    if not isinstance(tokens, list) or not isinstance(size, int) or not isinstance(parent, (bytes, int, type(None))):
        raise BadEvents("BlockStored has token_ids (a list), block_size (an int) and parent_block_hash")
    salted = raw.get("lora_id") is not None or raw.get("lora_name") is not None or any(raw.get("extra_keys") or ())
    return Stored(tuple(hashes), parent, tuple(tokens), size, place and not salted)
