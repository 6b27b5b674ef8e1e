"""The shm transport's side channel: how a target hands its pool memfds to an initiator.

No I/O here: messages are built and checked as bytes; the Unix socket, the
descriptors riding on it (``SCM_RIGHTS``) and the deadlines live in
:mod:`hixl.transports._shm_socket`. The socket is ``SOCK_SEQPACKET``, so every
message arrives whole, with exactly its own descriptors, or not at all.

One exchange per connection. The initiator sends one REQUEST::

    offset size field
    0      4    magic  b"HXSM"
    4      2    version (1)
    6      2    reserved (0)
    8      16   binding: ``Connection.binding("shm")`` of an authenticated TCP connection

— proof that it holds the session key of a connection the target is serving
right now (the target looks the binding up among its open connections). The
target answers with one or more REPLY messages, the last flagged LAST::

    0      4    magic  b"HXSM"
    4      2    version (1)
    6      1    status  0 GRANTED, 1 REFUSED
    7      1    flags   1 LAST
    8      4    count   grants in this message (at most MAX_PER_MESSAGE)
    12     16   proof: ``Connection.binding("shm-target")`` (zeros in a refusal)
    28     ...  GRANTED: count x (addr u64, length u64, flags u64 WRITABLE)
                REFUSED: the reason, UTF-8, at most MAX_REASON bytes

A GRANTED message carries ``count`` descriptors, one per grant, in order; the
LAST one carries one more after them: the read end of a pipe whose write end
only the target holds, which reports a hang-up once the target process is gone
(the initiator checks it before every copy, as cma checks a pidfd). The proof
lets the initiator tell the target from anything else listening at that path:
only the two ends of the TCP connection can compute it.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from .._exceptions import ProtocolError

__all__ = [
    "GRANT_WRITABLE",
    "MAX_GRANTS",
    "MAX_MESSAGE",
    "MAX_PER_MESSAGE",
    "REQUEST_SIZE",
    "Grant",
    "Refused",
    "Reply",
    "decode_reply",
    "decode_request",
    "encode_grants",
    "encode_refusal",
    "encode_request",
]

MAGIC = b"HXSM"
VERSION = 1
_REQUEST = struct.Struct("<4sHH16s")
_REPLY = struct.Struct("<4sHBBI16s")
_GRANT = struct.Struct("<QQQ")
REQUEST_SIZE = _REQUEST.size
GRANT_WRITABLE = 1
_GRANTED, _REFUSED = 0, 1
_LAST = 1
MAX_PER_MESSAGE = 250
"""Grants per message (with one descriptor each, and the liveness pipe): the kernel passes at most
253 descriptors at once."""
MAX_GRANTS = 1 << 16
"""Most grants one exchange may carry in all (a target has at most that many registrations)."""
MAX_REASON = 512
MAX_MESSAGE = _REPLY.size + MAX_PER_MESSAGE * _GRANT.size
"""Largest message either side sends; anything longer is malformed."""
_NO_PROOF = bytes(16)
_PAGE_MASK = 4095
_U64_MAX = (1 << 64) - 1


class Grant(NamedTuple):
    """One shared region as the target names it: ``length`` bytes at ``addr`` in its address space."""

    addr: int
    length: int
    writable: bool


class Reply(NamedTuple):
    """One decoded GRANTED message."""

    grants: list[Grant]
    last: bool


class Refused(Exception):
    """The target refused to share (its reason is the message)."""


def encode_request(binding: bytes) -> bytes:
    """The initiator's REQUEST for a connection whose ``binding("shm")`` is ``binding``."""
    if len(binding) != 16:
        raise ValueError("a binding is 16 bytes")
    return _REQUEST.pack(MAGIC, VERSION, 0, binding)


def decode_request(data: bytes) -> bytes:
    """The binding a REQUEST carries; :class:`ProtocolError` for anything else."""
    if len(data) != _REQUEST.size:
        raise ProtocolError(f"a request is {_REQUEST.size} bytes, not {len(data)}")
    magic, version, reserved, binding = _REQUEST.unpack(data)
    if magic != MAGIC or version != VERSION or reserved:
        raise ProtocolError("not an hixl shm request (magic, version or reserved field)")
    return bytes(binding)


def encode_grants(proof: bytes, grants: list[Grant]) -> list[bytes]:
    """GRANTED messages for ``grants`` (one message, empty, if there are none); send grant ``i``'s
    descriptor with the message that lists it, in order, and the liveness pipe after the last."""
    if len(grants) > MAX_GRANTS:
        raise ValueError(f"at most {MAX_GRANTS} grants")
    chunks = [grants[i : i + MAX_PER_MESSAGE] for i in range(0, len(grants), MAX_PER_MESSAGE)] or [[]]
    messages = []
    for n, chunk in enumerate(chunks):
        flags = _LAST if n == len(chunks) - 1 else 0
        body = b"".join(_GRANT.pack(g.addr, g.length, GRANT_WRITABLE if g.writable else 0) for g in chunk)
        messages.append(_REPLY.pack(MAGIC, VERSION, _GRANTED, flags, len(chunk), proof) + body)
    return messages


def encode_refusal(reason: str) -> bytes:
    """A REFUSED message saying why (cut to :data:`MAX_REASON` bytes)."""
    text = reason.encode("utf-8", "replace")[:MAX_REASON]
    return _REPLY.pack(MAGIC, VERSION, _REFUSED, _LAST, 0, _NO_PROOF) + text


def decode_reply(data: bytes, descriptors: int, proof: bytes) -> Reply:
    """Check one REPLY that came with ``descriptors`` descriptors against the expected ``proof``.

    Raises :class:`Refused` for a refusal and :class:`ProtocolError` for anything
    malformed: a bad header, a count that does not match the descriptors (one per
    grant, and the liveness pipe with the LAST), a proof that is not this
    connection's, a grant that is not whole pages of the address space.
    """
    if not _REPLY.size <= len(data) <= MAX_MESSAGE:
        raise ProtocolError(f"a reply of {len(data)} bytes")
    magic, version, status, flags, count, got_proof = _REPLY.unpack_from(data)
    if magic != MAGIC or version != VERSION or flags & ~_LAST:
        raise ProtocolError("not an hixl shm reply (magic, version or flags)")
    if status == _REFUSED:
        if count or descriptors:
            raise ProtocolError("a refusal carries no grants")
        raise Refused(data[_REPLY.size : _REPLY.size + MAX_REASON].decode("utf-8", "replace"))
    if status != _GRANTED:
        raise ProtocolError(f"unknown reply status {status}")
    if got_proof != proof:
        raise ProtocolError("the reply does not prove it comes from this connection's target")
    last = bool(flags & _LAST)
    if count > MAX_PER_MESSAGE or len(data) != _REPLY.size + count * _GRANT.size or count + last != descriptors:
        raise ProtocolError(f"a reply naming {count} grants in {len(data)} bytes came with {descriptors} descriptors")
    grants = []
    for i in range(count):
        addr, length, grant_flags = _GRANT.unpack_from(data, _REPLY.size + i * _GRANT.size)
        if grant_flags & ~GRANT_WRITABLE or addr == 0 or addr & _PAGE_MASK or not 0 < length <= _U64_MAX - addr:
            raise ProtocolError(f"grant {i} ({addr:#x}, +{length}, flags {grant_flags}) is malformed")
        grants.append(Grant(addr, length, bool(grant_flags & GRANT_WRITABLE)))
    return Reply(grants, last)
