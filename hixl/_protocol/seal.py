"""Sealed records: AES-256-GCM over a connection's byte stream (``encrypt=True``). Pure code, no I/O.

Theory of operation. Once a handshake between two encrypting engines has a session key (see
:mod:`hixl._protocol.auth`: known to the two ends only, and only if they share the secret), each
direction of the stream stops being frames and becomes a sequence of *records*, each carrying
the next piece of that direction's frames and bulk data, encrypted and authenticated::

    offset  size  field
    0       4     n: bytes of plaintext (little-endian), 1 .. RECORD_MAX; the AEAD's associated data
    4       n     ciphertext
    4 + n   16    GCM tag

Each direction has a key of its own, derived from the session key with a label that names the
direction (HKDF-Expand, RFC 5869, SHA-256): a record can never be reflected back at its sender.
The derivation also takes a hash of the handshake's frames sent in clear (HELLO and CHALLENGE,
as this end sent or received them): if anyone altered them on the way, the two ends' keys
differ and the first record fails — what was said in clear is authenticated after all.
A record's nonce is its number within its key (8 bytes little-endian, then 4 zero bytes) and is
never sent: both ends count, so a record replayed, dropped, reordered or moved from another
connection fails its tag, and so does one whose length was altered (the length is authenticated
too). Every :data:`REKEY_RECORDS` records both ends replace that direction's key with one derived
from it and count from 0 again: a nonce never repeats under a key, the count never wraps, and
one key never protects more than ``REKEY_RECORDS * RECORD_MAX`` bytes (256 GiB), within
AES-GCM's usage limits (TLS 1.3 allows 2^24.5 records of 16 KiB per key: about 370 GiB).

:class:`Opener` opens only whole records, and verifies each before a byte of it is handed out:
a driver lands a record's plaintext in memory only once its tag has passed. A tag that fails is
:class:`~hixl.IntegrityError`; the opener refuses everything after it.

The AEAD is ``cryptography``'s (imported when the first seal is made; ``pip install
hixl[encrypt]``). Its calls hold the GIL for as long as they run (measured on cryptography 48:
``encrypt_into``, ``decrypt_into``, ``encrypt``, ``decrypt`` and the ``Cipher`` API's
``update_into`` alike: a thread spinning beside a 256 MiB call is held off for all of it), so
records stay small — one :data:`RECORD_MAX` record is 25-45 us of AES here, after which other
threads get the GIL back (and the socket calls between records release it).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Any

from .._exceptions import IntegrityError, ProtocolError

__all__ = [
    "HEADER",
    "OVERHEAD",
    "RECORD_MAX",
    "REKEY_RECORDS",
    "TAG",
    "Opener",
    "Seal",
    "Sealer",
    "aead_unavailable",
    "direction_keys",
]

RECORD_MAX = 256 << 10
"""Most plaintext bytes one record carries. AES-GCM runs as fast on records this size as on any
(here: 6 GB/s sealing, 10 GB/s opening, as at 64 KiB; 5 and 9.6 at 1 MiB, whose buffers leave the
caches), and a record four times smaller costs a receiver a third more CPU per byte (the calls
around each record, measured end to end). It also bounds what a connection buffers of a record
in flight, and how long one AEAD call holds the GIL (~25 us opening, ~45 us sealing)."""
HEADER = 4
TAG = 16
OVERHEAD = HEADER + TAG
"""Bytes a record adds to its plaintext."""
REKEY_RECORDS = 1 << 20
"""Records sealed under one key before both ends move to the next (with records of up to
:data:`RECORD_MAX` bytes: 256 GiB per key)."""
_LENGTH = struct.Struct("<I")
_NONCE = struct.Struct("<Q4x")
_LABELS = {"initiator": b"hixl seal v1: initiator to target", "target": b"hixl seal v1: target to initiator"}
_NEXT_KEY = b"hixl seal v1: next key"


def aead_unavailable() -> str | None:
    """Why records cannot be sealed here (``cryptography`` is not installed), or None."""
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError as exc:
        return f"encrypt=True needs the cryptography package (pip install hixl[encrypt]): {exc}"
    if not hasattr(AESGCM, "encrypt_into"):  # (records are sealed and opened into buffers of ours)
        return "encrypt=True needs a newer cryptography, with AESGCM.encrypt_into (pip install hixl[encrypt])"
    return None


def _invalid_tag() -> type[Exception]:
    """What the AEAD raises for a record that fails its tag (imported with it, when first needed)."""
    from cryptography.exceptions import InvalidTag

    return InvalidTag


def _expand(key: bytes, label: bytes) -> bytes:
    """HKDF-Expand (RFC 5869) of one SHA-256 block: ``key`` is already a uniformly random key (an
    HMAC output), so no extract step."""
    return hmac.new(key, label + b"\x01", hashlib.sha256).digest()


def direction_keys(session_key: bytes, transcript: bytes = b"") -> dict[str, bytes]:
    """The key of each direction, by its sender's role (``"initiator"``, ``"target"``), for a
    handshake whose frames in clear hash to ``transcript``."""
    if len(session_key) < 32:
        raise ValueError("a seal needs a session key of at least 32 bytes")
    return {role: _expand(session_key, label + b"|" + transcript) for role, label in _LABELS.items()}


class _Keyed:
    """One direction's key, its AEAD and the number of the next record under it."""

    __slots__ = ("_aead", "_key", "_number", "_rekey")

    def __init__(self, key: bytes, rekey_records: int) -> None:
        if rekey_records < 1:
            raise ValueError("rekey_records must be positive")
        self._rekey = rekey_records
        self._set_key(key)

    def _set_key(self, key: bytes) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._key = key
        self._aead: Any = AESGCM(key)
        self._number = 0

    def _nonce(self) -> bytes:
        """The next record's nonce; the record after it is numbered one more (or starts a new key)."""
        nonce = _NONCE.pack(self._number)
        self._number += 1
        return nonce

    def _advance(self) -> None:
        """Called once the record numbered last is sealed or opened: at the key's quota, the next key."""
        if self._number >= self._rekey:
            self._set_key(_expand(self._key, _NEXT_KEY))


class Sealer(_Keyed):
    """The sending half: plaintext in, records out (see the module docstring)."""

    __slots__ = ()

    def seal_into(self, plaintext: memoryview, out: memoryview) -> int:
        """Seal ``plaintext`` (1 to :data:`RECORD_MAX` bytes) as the next record, written at the
        start of ``out`` (writable, at least ``len(plaintext) + OVERHEAD`` bytes); the record's size."""
        n = plaintext.nbytes
        if not 0 < n <= RECORD_MAX:
            raise ValueError(f"a record carries 1 to {RECORD_MAX} bytes, not {n}")
        header = _LENGTH.pack(n)
        out[:HEADER] = header
        self._aead.encrypt_into(self._nonce(), plaintext, header, out[HEADER : HEADER + n + TAG])
        self._advance()
        return n + OVERHEAD

    def seal(self, plaintext: Any) -> bytes:
        """``plaintext`` (any buffer of up to :data:`RECORD_MAX` bytes) as one record."""
        view = memoryview(plaintext).cast("B")
        out = bytearray(view.nbytes + OVERHEAD)
        self.seal_into(view, memoryview(out))
        return bytes(out)

    def seal_all(self, plaintext: Any) -> bytes:
        """``plaintext`` of any length (at least 1 byte) as records of :data:`RECORD_MAX` bytes and a last one."""
        with memoryview(plaintext).cast("B") as view:
            return b"".join(self.seal(view[i : i + RECORD_MAX]) for i in range(0, len(view), RECORD_MAX))


class Opener(_Keyed):
    """The receiving half: ciphertext in (any cut of the stream), the plaintext of whole, verified
    records out. It holds what arrived of records not yet opened, in a buffer of its own that a
    driver can receive into directly (:meth:`space`, :meth:`filled`)."""

    __slots__ = ("_broken", "_buf", "_end", "_front", "_start", "_view", "limit")

    def __init__(self, key: bytes, rekey_records: int) -> None:
        super().__init__(key, rekey_records)
        self.limit = RECORD_MAX
        """Most plaintext bytes a record may announce now (a connection lowers it until its peer
        proved itself: what an unproven peer makes us buffer stays what its next frame may be)."""
        self._buf = bytearray()
        self._view = memoryview(self._buf)
        self._start = 0  # the held ciphertext is _buf[_start:_end]
        self._end = 0
        self._front = -1  # the plaintext length of the record in front, once its header is read
        self._broken = ""

    @property
    def held(self) -> int:
        """Bytes of ciphertext held: records (or the start of one) not yet opened."""
        return self._end - self._start

    def _read_front(self) -> int:
        """The plaintext length of the record in front (-1 until its header is held), checked: a
        length no sender makes is refused on the header alone, before its body is waited for."""
        self._check()
        if self._end - self._start < HEADER:
            return -1
        (n,) = _LENGTH.unpack_from(self._buf, self._start)
        if not 0 < n <= self.limit:
            self._break(f"a record announced {n} bytes (1 to {self.limit} may come now)")
        self._front = n
        return n

    @property
    def needed(self) -> int:
        """Bytes still to come before the record in front is whole (0: it is)."""
        n = self._front if self._front >= 0 else self._read_front()
        if n < 0:
            return HEADER - self.held
        return max(0, n + OVERHEAD - self.held)

    def next_size(self) -> int | None:
        """The plaintext length of the record in front if it is whole (None if it is not)."""
        n = self._front if self._front >= 0 else self._read_front()
        return n if n >= 0 and self._end - self._start >= n + OVERHEAD else None

    def space(self, nbytes: int) -> memoryview:
        """Room for ``nbytes`` more ciphertext, to receive into (then :meth:`filled`). Use the view
        at once and let it go."""
        if len(self._buf) - self._end < nbytes:
            held = self._end - self._start
            if self._start and len(self._buf) - held >= nbytes:
                self._buf[:held] = self._buf[self._start : self._end]  # (what is held moves to the front)
            else:
                grown = bytearray(held + nbytes)
                grown[:held] = self._view[self._start : self._end]
                self._buf, self._view = grown, memoryview(grown)
            self._start, self._end = 0, held
        return self._view[self._end : self._end + nbytes]

    def filled(self, nbytes: int) -> None:
        """``nbytes`` of ciphertext were written at the start of the last :meth:`space`."""
        if not 0 <= nbytes <= len(self._buf) - self._end:
            raise ValueError(f"filled {nbytes} bytes past the space given")
        self._end += nbytes

    def feed(self, data: Any) -> None:
        """Take ``data`` (ciphertext, any buffer) as it came."""
        n = memoryview(data).nbytes
        if n:
            self.space(n)[:] = memoryview(data).cast("B")
            self.filled(n)

    def open_into(self, out: memoryview) -> int:
        """Open the whole record in front into ``out`` (a writable memoryview of at least
        :meth:`next_size` bytes): its plaintext length. :class:`~hixl.IntegrityError` if its tag
        fails — ``out`` then holds garbage (a scratch buffer, never memory anyone reads) — and for
        every call after that."""
        n = self.next_size()
        if n is None:
            raise ValueError("no whole record to open")
        start, view = self._start, self._view
        try:
            self._aead.decrypt_into(
                self._nonce(), view[start + HEADER : start + n + OVERHEAD], view[start : start + HEADER], out[:n]
            )
        except _invalid_tag():
            self._break("a record failed its integrity check: altered, replayed, reordered or not ours")
        self._start += n + OVERHEAD
        if self._start == self._end:
            self._start = self._end = 0
        self._front = -1
        self._advance()
        return n

    def end_of_stream(self) -> None:
        """The stream ended: :class:`~hixl.ProtocolError` if it ended inside a record (cut short,
        or its sender died mid-send); nothing of that record was ever handed out."""
        self._check()
        if self.held:
            self._broken = "the stream ended inside a record"
            self._front = -1
            raise ProtocolError(f"the connection ended {self.held} bytes into a sealed record")

    def _check(self) -> None:
        if self._broken:
            raise IntegrityError(f"sealed stream refused after an earlier failure: {self._broken}")

    def _break(self, reason: str) -> None:
        self._broken = reason
        self._front = -1  # (every later call goes by _check)
        raise IntegrityError(reason)


class Seal:
    """Both halves for one end of one connection: ``sealer`` for what ``role`` sends, ``opener``
    for what it receives; keys from ``session_key`` and the handshake's ``transcript`` (see the
    module docstring)."""

    __slots__ = ("opener", "sealer")

    def __init__(self, session_key: bytes, role: str, transcript: bytes = b"", rekey_records: int = REKEY_RECORDS) -> None:
        if role not in _LABELS:
            raise ValueError(f"role must be 'initiator' or 'target', not {role!r}")
        keys = direction_keys(session_key, transcript)
        peer = "target" if role == "initiator" else "initiator"
        self.sealer = Sealer(keys[role], rekey_records)
        self.opener = Opener(keys[peer], rekey_records)

    def __repr__(self) -> str:
        return f"<Seal AES-256-GCM held={self.opener.held}>"
