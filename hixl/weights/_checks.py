"""The checks that make a pull consistent, and the checksums they compare.

:data:`ENABLED` exists for the tests alone: a test's child process sets it to
False to show that, without leases, header words, checksums and row checks,
its torture run *does* see torn reads — so the same run with them proves
something. Nothing in hixl reads it from the environment.

CRC-32 (``zlib.crc32``) runs at about 2 GiB/s on one core of the machine these
modules were written on (0.46 s per GiB): a publisher pays it once per version,
computing it over each chunk right after copying it (still in cache), and a
subscriber once per tensor it pulls whole, when ``verify`` is on.
"""

from __future__ import annotations

import zlib

import numpy as np

from ._errors import Superseded

__all__ = ["ENABLED", "check_header", "copy_with_crc", "crc_of"]

ENABLED = True
"""Test-only (see the module docstring): False skips every consistency check."""

_CHUNK = 1 << 20  # copied, then checksummed while it is still in the cache


def copy_with_crc(dst: np.ndarray, src: np.ndarray) -> int:
    """Copy the bytes of ``src`` into ``dst`` (1-D uint8 arrays of one size); the CRC-32 of what landed."""
    crc = 0
    for start in range(0, len(src), _CHUNK):
        chunk = dst[start : start + _CHUNK]
        np.copyto(chunk, src[start : start + _CHUNK])
        crc = zlib.crc32(chunk.data, crc)
    return crc


def crc_of(data: np.ndarray) -> int:
    """The CRC-32 of a contiguous array's bytes."""
    return zlib.crc32(data.reshape(-1).view(np.uint8).data)


def check_header(word: int, version: int, where: str) -> None:
    """Raise :class:`Superseded` unless the slot's header word, read after the data, still says ``version``."""
    if ENABLED and word != version:
        state = "being rewritten" if word == 0 else f"holding version {word}"
        raise Superseded(f"version {version} was overwritten while it was read: the slot at {where} is now {state}")
