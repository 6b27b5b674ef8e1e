"""Self-checking memory contents for the soak test: every 8-byte word says who put it there.

A word at (the target's) virtual address ``addr`` is ``tag << 32 | mix(addr, tag)``:
the high half names its writer, the low half is a hash of the address and the
tag, so a word copied to the wrong place, torn, or made of anything else fails
:func:`valid`. Tags:

- ``CANARY``: memory that is not registered (guards around and between
  registrations, memory in quarantine after deregistration, an initiator's
  local bytes outside the descriptors in flight). Any other word found there
  is a byte that moved into memory its owner had let go.
- fill tags ``1 .. CANARY-1``: a target's registration generation; a region is
  filled with one fill tag before it is registered.
- write tags (high bit set): ``WRITE_BIT | writer << SEQ_BITS | seq``: what an
  initiator WRITEs (``writer``: that initiator incarnation, ``seq`` its count).

Pure numpy, no I/O: the soak's targets and initiators both use it.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "CANARY",
    "SEQ_BITS",
    "WRITER_BITS",
    "WRITE_BIT",
    "describe",
    "fill",
    "tags",
    "valid",
    "words",
    "write_tag",
]

WORD = 8
CANARY = 0x7FFF_FFFF
WRITE_BIT = 0x8000_0000
WRITER_BITS = 7
SEQ_BITS = 24
_K_ADDR = np.uint64(0x9E37_79B9_7F4A_7C15)
_K_TAG = np.uint64(0xC2B2_AE3D_27D4_EB4F)
_LOW = np.uint64(0xFFFF_FFFF)
_32 = np.uint64(32)


def write_tag(writer: int, seq: int) -> int:
    """The tag of initiator ``writer``'s ``seq``-th WRITE (both wrap to their bit widths)."""
    return WRITE_BIT | (writer % (1 << WRITER_BITS)) << SEQ_BITS | seq % (1 << SEQ_BITS)


def _mix(addrs: np.ndarray, tag_words: np.ndarray) -> np.ndarray:
    # Multiply-xorshift; numpy uint64 arithmetic wraps, which is what a hash wants.
    h = (addrs >> np.uint64(3)) * _K_ADDR ^ tag_words * _K_TAG
    return (h ^ (h >> _32)) & _LOW


def words(addr: int, count: int, tag: int) -> np.ndarray:
    """``count`` words (``uint64``) with ``tag``, as they belong at ``addr``, ``addr + 8``, ..."""
    addrs = np.uint64(addr) + np.arange(count, dtype=np.uint64) * np.uint64(WORD)
    tag_words = np.full(count, tag, dtype=np.uint64)
    return tag_words << _32 | _mix(addrs, tag_words)


def fill(buf: np.ndarray, addr: int, tag: int) -> None:
    """Fill the byte array ``buf`` (a multiple of 8 bytes, at ``addr``) with ``tag``'s words."""
    buf.view(np.uint64)[:] = words(addr, buf.size // WORD, tag)


def tags(buf: np.ndarray) -> np.ndarray:
    """The tag of every word of the byte array ``buf``."""
    return buf.view(np.uint64) >> _32


def valid(buf: np.ndarray, addr: int) -> np.ndarray:
    """Per word of ``buf`` (which lives at ``addr``): whether it is a well-formed word for that address."""
    w = buf.view(np.uint64)
    addrs = np.uint64(addr) + np.arange(w.size, dtype=np.uint64) * np.uint64(WORD)
    return (w & _LOW) == _mix(addrs, w >> _32)  # type: ignore[no-any-return]


def describe(buf: np.ndarray, addr: int, bad: np.ndarray) -> str:
    """What the words of ``buf`` that ``bad`` marks are: ``"3 words from 0x...: 2 canary, 1 malformed"``."""
    t = tags(buf)[bad]
    ok = valid(buf, addr)[bad]
    kinds = {
        "canary": int((ok & (t == CANARY)).sum()),
        "fill": int((ok & (t < CANARY)).sum()),
        "write": int((ok & (t > CANARY)).sum()),
        "malformed": int((~ok).sum()),
    }
    first = addr + int(np.argmax(bad)) * WORD
    text = ", ".join(f"{n} {k}" for k, n in kinds.items() if n)
    return f"{int(bad.sum())} words from {first:#x}: {text} (first tag {int(t[0]):#x})"
