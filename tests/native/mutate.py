"""Seeded mutations of a fuzz case: a JSON object whose strings are hex bytes (what a peer sends)
and whose numbers are lengths, offsets and counts (what a peer or a caller says).

Every mutation is drawn from one :class:`random.Random`, so a run is the same run every time; a
case is changed in one to three places, each by a rule that finds the bugs this kind of code has:
off-by-one and off-by-a-word lengths, the boundaries of 64-bit and signed arithmetic, a byte
flipped or a length field overwritten inside a frame, lists grown past a limit or shortened.
"""

from __future__ import annotations

import random
import struct
from typing import Any

U64 = 1 << 64
BOUNDARIES = (0, 1, 7, 8, 9, 15, 16, 63, 64, 65, 4095, 4096, 65535, 65536, (1 << 31) - 1, 1 << 31, (1 << 63) - 1, U64 - 1)
"""Values a length or an offset goes wrong at."""
INTERESTING_BYTES = (0, 1, 5, 6, 7, 8, 0x7F, 0x80, 0xFF)
"""Bytes with a meaning in a frame: READ, WRITE, DATA, ACK, and the sign and range edges."""


def mutate(case: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """A copy of ``case`` changed in one to three places. A list inside a list is a record (a row,
    a descriptor): its fields change, never their number."""
    for _ in range(rng.randint(1, 3)):
        case = _value(case, rng)
    return case


def _value(value: Any, rng: random.Random, record: bool = False) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return _int(value, rng)
    if isinstance(value, float):
        return rng.choice((0.0, value / 2, value * 2, -value))
    if isinstance(value, str):
        return _bytes(bytes.fromhex(value), rng).hex()
    if isinstance(value, list):
        return _list(value, rng, record)
    if isinstance(value, dict) and value:
        key = rng.choice(sorted(value))
        return {**value, key: _value(value[key], rng)}
    return value


def _int(value: int, rng: random.Random) -> int:
    rule = rng.randrange(6)
    if rule == 0:
        return value + rng.choice((-9, -8, -7, -1, 1, 7, 8, 9))
    if rule == 1:
        return rng.choice(BOUNDARIES)
    if rule == 2:
        return value ^ (1 << rng.randrange(64))
    if rule == 3:
        return rng.choice((value * 2, value // 2, -value, value + rng.randrange(1, 64)))
    if rule == 4:
        return rng.randrange(U64)
    return rng.randrange(max(1, value + 1))


def _bytes(data: bytes, rng: random.Random) -> bytes:
    raw = bytearray(data)
    rule = rng.randrange(7)
    at = rng.randrange(len(raw) + 1)
    if rule == 0 and raw:
        raw[min(at, len(raw) - 1)] ^= 1 << rng.randrange(8)
    elif rule == 1 and raw:
        raw[min(at, len(raw) - 1)] = rng.choice(INTERESTING_BYTES)
    elif rule == 2:
        raw[at:at] = rng.randbytes(rng.choice((1, 3, 8, 17)))
    elif rule == 3:
        del raw[at : at + rng.choice((1, 4, 8, 28))]
    elif rule == 4:
        del raw[at:]
    elif rule == 5 and raw:
        raw[at:at] = raw[rng.randrange(len(raw)) :][: rng.randrange(1, 64)]
    else:  # a little-endian length or address field overwritten in place
        raw[at : at + 8] = struct.pack("<Q", rng.choice(BOUNDARIES))
    return bytes(raw)


def _list(items: list[Any], rng: random.Random, record: bool) -> list[Any]:
    """One item changed, or, unless the list is a record, one repeated (past a limit, maybe) or dropped."""
    items = list(items)
    rule = 0 if record else rng.randrange(4)
    if rule <= 1 and items:
        i = rng.randrange(len(items))
        items[i] = _value(items[i], rng, record=True)
    elif rule == 2 and items:
        i = rng.randrange(len(items))
        items[i:i] = [items[i]] * rng.choice((1, 2, 9, 70))  # (past a limit: 8, 16, 64 items)
    elif rule == 3 and items:
        del items[rng.randrange(len(items))]
    return items
