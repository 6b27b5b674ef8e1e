"""The checks that make a pull consistent, and the checksum they compare.

:data:`ENABLED` exists for the tests alone: a test's child process sets it to
False to show that, without leases, header words, checksums and row checks,
its torture run *does* see torn reads — so the same run with them proves
something. Nothing in hixl reads it from the environment.

The checksum (:data:`CHECKSUM`, ``"mlh64"``) is a multilinear hash over the
bytes as 64-bit little-endian words ``w_i``, the tail zero-padded into one more
word: ``h = sum_i (w_i XOR k[i mod 256]) * m[i mod 256]  (mod 2**64)``, plus
``(nbytes XOR k_len) * m_len`` for the length (else ``b"abc"`` and ``b"abc\\0"``
would agree). The keys ``k`` and odd multipliers ``m`` are fixed, drawn from
SplitMix64's sequence (:func:`hixl._accel.weights_hash`, in C and in numpy).

What it guards is races, not attackers: the publisher is trusted, and a reader
must notice a *torn* read — some words of the version it acquired, some of the
one written over it (or of a half-written one). Any one changed word changes
``h``: its difference in ``w_i XOR k`` is non-zero and an odd ``m`` keeps it so.
A torn read changes many words (a page at least); its differences cancel only
if ``sum d_i m_i = 0 (mod 2**64)``, which for data chosen without knowing ``m``
happens with probability about ``2**-(64 - v)``, ``v`` the fewest trailing zero
bits of a ``d_i`` — near 0 for changed weights, whose low mantissa bits change.
(It is not a MAC: data built to collide collides; a checksum of a trusted
publisher does not need to resist that.)

Why not CRC-32, as before: ``zlib.crc32`` ran at 1 to 2 GiB/s here and made
most of a weights update's time (issue 36); CRC32C with SSE4.2 would be fast in
C, but its pure twin could not keep up. This one is one multiply and one add per
word, no carried state between words — memory speed in C — and three numpy
passes over a cache-sized chunk in the pure twin. Measured on this repository's
2-core VM (one core, busy neighbours; best of 5):

================================  ==========  ================  ==============
                                  C           pure (numpy)      CRC-32 (zlib)
================================  ==========  ================  ==============
hash, 1 MiB (in cache)            8.7 GB/s    2.3 GB/s          2.2 GB/s
hash, 64 MiB                      5.3 GB/s    3.8 GB/s          1.8 GB/s
copy + hash, 64 MiB               4.2 GB/s    1.6 GB/s          —
================================  ==========  ================  ==============

A publisher pays it once per version (snapshot: fused with its copy,
:func:`hixl._accel.copy_hash`; zero-copy: over the trainer's tensors), and a
subscriber once per tensor it pulls whole, when ``verify`` is on — each spread
over the engine's copy lanes (:mod:`hixl.weights._lanes`). A publisher made with
``checksums=False`` pays none (:data:`NO_CHECKSUM`): the leases and header words
alone prove its pulls, as the torture tests show.
"""

from __future__ import annotations

import numpy as np

from .._accel import copy_hash, weights_hash
from ._errors import Superseded

__all__ = ["CHECKSUM", "ENABLED", "NO_CHECKSUM", "check_header", "checksum_of", "copy_with_checksum"]

ENABLED = True
"""Test-only (see the module docstring): False skips every consistency check."""

CHECKSUM = "mlh64"
"""The name a manifest gives its checksums (the only one a subscriber accepts)."""

NO_CHECKSUM = "none"
"""What a manifest names when its publisher computes no checksums (``Publisher(checksums=False)``)."""


def copy_with_checksum(dst: np.ndarray, src: np.ndarray) -> int:
    """Copy the bytes of ``src`` into ``dst`` (1-D uint8 arrays of one size); the checksum of what landed."""
    return copy_hash(dst, src)


def checksum_of(data: np.ndarray) -> int:
    """The checksum of a contiguous array's bytes."""
    return weights_hash(data.reshape(-1).view(np.uint8))


def check_header(word: int, version: int, where: str) -> None:
    """Raise :class:`Superseded` unless the slot's header word, read after the data, still says ``version``."""
    if ENABLED and word != version:
        state = "being rewritten" if word == 0 else f"holding version {word}"
        raise Superseded(f"version {version} was overwritten while it was read: the slot at {where} is now {state}")
