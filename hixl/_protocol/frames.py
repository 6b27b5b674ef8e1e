"""Frames: encoding, decoding and validation, with no sockets and no threads.

Every frame is a fixed 28-byte little-endian header, a small *body* and, for
bulk transfers only, *data*::

    offset size field
    0      4    magic  b"HXL1"
    4      1    type   FrameType
    5      1    flags  (0)
    6      2    reserved (0)
    8      8    req_id  pairs a reply with its request (0 for unsolicited frames)
    16     4    body_len  bytes of body that follow the header
    20     8    data_len  bytes of raw data that follow the body

The body is parsed here into a :class:`Message`. The data is *not*: it is the
payload of a READ reply or a WRITE request, and the transport moves it straight
between the socket and registered memory (``readv``/``writev``), which is the
whole point of the design. Descriptor lists travel as raw ``uint64`` words
so that 10^5 of them parse with one ``frombuffer``. Handshake bodies are small
JSON objects: they are sent once per connection, so readability beats a few
microseconds.

Every frame type has its own body limit (:data:`BODY_LIMITS`), checked on the
header alone — before a byte of the body is buffered — so a peer cannot make
us allocate more than the frame it may legitimately send.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Union

import numpy as np

from .._exceptions import ProtocolError

MAGIC = b"HXL1"
VERSION = 3
"""Protocol version spoken by this hixl; negotiated in the handshake (HELLO offers a range).
Version 3: REGIONS and REVOKE carry a generation and may list only what changed."""
MIN_VERSION = 3
_HEADER = struct.Struct("<4sBBHQIQ")
HEADER_SIZE = _HEADER.size
MAX_NAME = 1024
"""Most bytes (UTF-8) of a notification's name, and of its message."""
MAX_DESCS = 1 << 16
"""Most descriptors one READ/WRITE frame carries; larger requests are split into several frames."""
MAX_REGIONS = 1 << 17
"""Most rows (regions added plus removed) a REGIONS or REVOKE frame lists."""
WHOLE = (1 << 64) - 1
"""The ``base`` of a REGIONS or REVOKE that lists every region, not what changed since a generation."""
MAX_META = 16 << 20
"""Largest published metadata value."""
_HANDSHAKE_BODY = 4096
_U64_MAX = (1 << 64) - 1
_ERROR_HEAD = struct.Struct("<I")
_NOTIFY_HEAD = struct.Struct("<H")
_DEADLINE = struct.Struct("<q")
_CLOCK = struct.Struct("<d")
_GENERATION = struct.Struct("<Q")
_CHANGE_HEAD = struct.Struct("<QQQ")  # REGIONS / REVOKE: generation, base, regions added
_WORD = np.dtype("<u8")
SMALL_DESCS = 8
"""Requests of up to this many descriptors take the latency path everywhere: packed and parsed in
plain Python here, validated without numpy by the engine, copied in one call by cma, answered in
one ``sendmsg`` by TCP — one constant, so the paths agree on what "small" is."""

REGION_WRITABLE = 1
"""Flag bit of a region row: peers may WRITE into it (else READ only)."""


class FrameType(enum.IntEnum):
    """What a frame carries; requests and their replies share a ``req_id``."""

    HELLO = 1
    WELCOME = 2
    REGIONS = 3
    QUERY_REGIONS = 4
    READ = 5
    WRITE = 6
    DATA = 7
    ACK = 8
    ERROR = 9
    NOTIFY = 10
    PING = 11
    PONG = 12
    BYE = 13
    QUERY_META = 14
    META = 15
    CHALLENGE = 16
    AUTH = 17
    REVOKE = 18
    REVOKED = 19


FRAME_TYPES: dict[int, FrameType] = {int(kind): kind for kind in FrameType}
"""Each frame type by its number: a dict lookup, where ``FrameType(number)`` runs ~0.3 µs of Python
(on every request of TCP's latency path, on both sides)."""


BODY_LIMITS: dict[FrameType, int] = {
    FrameType.HELLO: _HANDSHAKE_BODY,
    FrameType.CHALLENGE: _HANDSHAKE_BODY,
    FrameType.AUTH: _HANDSHAKE_BODY,
    FrameType.WELCOME: 64 * 1024 + 24 * MAX_REGIONS,
    FrameType.REGIONS: 24 + 24 * MAX_REGIONS,
    FrameType.QUERY_REGIONS: 0,
    FrameType.READ: _DEADLINE.size + 16 * MAX_DESCS,
    FrameType.WRITE: _DEADLINE.size + 16 * MAX_DESCS,
    FrameType.DATA: 0,
    FrameType.ACK: 0,
    FrameType.ERROR: _ERROR_HEAD.size + 4096,
    FrameType.NOTIFY: _NOTIFY_HEAD.size + 2 * MAX_NAME,
    FrameType.PING: 0,
    FrameType.PONG: _CLOCK.size,
    FrameType.BYE: 1024,
    FrameType.QUERY_META: MAX_NAME,
    FrameType.META: MAX_META,
    FrameType.REVOKE: 24 + 24 * MAX_REGIONS,
    FrameType.REVOKED: 8,
}
"""Largest body each frame type may have; checked before the body is read."""

MAX_BODY = max(BODY_LIMITS.values())


class Header(NamedTuple):
    """A decoded frame header (a tuple: made once per frame on the hot path)."""

    type: FrameType
    req_id: int
    body_len: int
    data_len: int


@dataclass(frozen=True)
class Hello:
    """Initiator -> target, first frame: offered versions, a fresh nonce, the initiator's clock.

    Nothing about the initiator's identity: that goes in AUTH, after the target proved itself.
    """

    info: dict[str, Any]
    req_id: int = 0


@dataclass(frozen=True)
class Challenge:
    """Target -> initiator: chosen version, the target's nonce and its proof of the secret."""

    info: dict[str, Any]
    req_id: int = 0


@dataclass(frozen=True)
class Auth:
    """Initiator -> target: its proof of the secret, then who it is."""

    info: dict[str, Any]
    req_id: int = 0


@dataclass(frozen=True)
class Welcome:
    """Target -> initiator once both proofs passed: identity, transports, regions (MAC'd)."""

    info: dict[str, Any]
    req_id: int = 0


@dataclass(frozen=True)
class Regions:
    """The target's registrations as of ``generation``: every region in ``added`` (``base`` is
    :data:`WHOLE`), or what changed since generation ``base`` — ``added`` and ``removed``.

    Each is an ``(N, 3)`` array of (addr, len, flags); ``flags`` bit
    :data:`REGION_WRITABLE`: peers may WRITE. Sent unsolicited (``req_id`` 0)
    whenever registrations change, and whole as the reply to QUERY_REGIONS.
    """

    generation: int
    base: int
    added: np.ndarray
    removed: np.ndarray
    req_id: int = 0


@dataclass(frozen=True)
class QueryRegions:
    """Initiator asks for the target's current regions."""

    req_id: int


@dataclass(frozen=True)
class ReadRequest:
    """Initiator asks the target to send the bytes of ``descs`` (N, 2: remote addr, len).

    ``deadline`` is in the *target's* monotonic clock, microseconds (0: none):
    a target that gets the request after it passed answers TIMEOUT, moving nothing.
    """

    req_id: int
    descs: np.ndarray
    deadline: int = 0


@dataclass(frozen=True)
class WriteRequest:
    """Initiator sends ``data_len`` bytes, right after this body, into ``descs`` on the target.

    ``deadline`` as for READ: the target lands no byte once it has passed.
    """

    req_id: int
    descs: np.ndarray
    data_len: int
    deadline: int = 0


@dataclass(frozen=True)
class Data:
    """Target's reply to READ: ``data_len`` raw bytes follow."""

    req_id: int
    data_len: int


@dataclass(frozen=True)
class Ack:
    """Success reply to WRITE or NOTIFY."""

    req_id: int


@dataclass(frozen=True)
class Error:
    """Failure reply: a :class:`~hixl.Status` code and a message."""

    req_id: int
    status: int
    message: str


@dataclass(frozen=True)
class Notify:
    """A small notification for the target's ``get_notifies`` queue."""

    req_id: int
    name: str
    msg: str


@dataclass(frozen=True)
class Ping:
    """Heartbeat; answered by PONG with the same ``req_id``."""

    req_id: int = 0


@dataclass(frozen=True)
class Pong:
    """Heartbeat answer; ``clock`` is the sender's monotonic clock (seconds), 0 if not given."""

    req_id: int = 0
    clock: float = 0.0


@dataclass(frozen=True)
class Bye:
    """Graceful close: the sender will send nothing more."""

    req_id: int = 0
    reason: str = field(default="")


@dataclass(frozen=True)
class Revoke:
    """Target -> initiator: "my registrations are now those of ``generation`` (given as in
    :class:`Regions`); stop using anything else, then confirm with REVOKED". Sent when
    registrations are withdrawn."""

    generation: int
    base: int
    added: np.ndarray
    removed: np.ndarray
    req_id: int = 0


@dataclass(frozen=True)
class Revoked:
    """Initiator -> target: no copy of ours touches memory outside the regions of ``generation``."""

    generation: int
    req_id: int = 0


@dataclass(frozen=True)
class QueryMeta:
    """Initiator asks for the metadata value the target published under ``key``."""

    req_id: int
    key: str


@dataclass(frozen=True)
class Meta:
    """Reply to QUERY_META: the published value (opaque bytes)."""

    req_id: int
    value: bytes


Message = Union[
    Hello,
    Challenge,
    Auth,
    Welcome,
    Regions,
    QueryRegions,
    ReadRequest,
    WriteRequest,
    Data,
    Ack,
    Error,
    Notify,
    Ping,
    Pong,
    Bye,
    QueryMeta,
    Meta,
    Revoke,
    Revoked,
]


def parse_header(raw: bytes | bytearray | memoryview) -> Header:
    """Decode and validate a header; raise :class:`ProtocolError` on anything odd."""
    if len(raw) != HEADER_SIZE:
        raise ProtocolError(f"header must be {HEADER_SIZE} bytes, got {len(raw)}")
    return parse_header_at(raw, 0)


_KINDS = {int(kind): kind for kind in FrameType}


def parse_header_at(buf: bytes | bytearray | memoryview, offset: int) -> Header:
    """:func:`parse_header` of the ``HEADER_SIZE`` bytes at ``offset`` in ``buf`` (no copy)."""
    magic, ftype, flags, reserved, req_id, body_len, data_len = _HEADER.unpack_from(buf, offset)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}: not a hixl peer")
    kind = _KINDS.get(ftype)
    if kind is None:
        raise ProtocolError(f"unknown frame type {ftype}")
    if flags or reserved:
        raise ProtocolError(f"reserved header bits set ({flags:#x}, {reserved:#x})")
    if body_len > BODY_LIMITS[kind]:
        raise ProtocolError(f"{kind.name} body of {body_len} bytes exceeds its {BODY_LIMITS[kind]}-byte limit")
    if data_len and kind not in (FrameType.WRITE, FrameType.DATA):
        raise ProtocolError(f"{kind.name} frame must not carry data")
    return Header(kind, req_id, body_len, data_len)


def _words(body: bytes | memoryview, width: int, what: str) -> np.ndarray:
    if len(body) % (8 * width):
        raise ProtocolError(f"{what} body of {len(body)} bytes is not a list of {width}-word rows")
    return np.frombuffer(body, dtype=_WORD).reshape(-1, width)


_SMALL_BODIES = {_DEADLINE.size + 16 * n: struct.Struct(f"<q{2 * n}Q") for n in range(1, SMALL_DESCS + 1)}


def _request(header: Header, body: bytes | memoryview) -> tuple[np.ndarray, int]:
    """Deadline and descriptors of a READ/WRITE body, validated."""
    small = _SMALL_BODIES.get(len(body))
    if small is not None:
        return _small_request(header, small.unpack(body))
    name = header.type.name
    if len(body) < _DEADLINE.size:
        raise ProtocolError(f"{name} body too short")
    (deadline,) = _DEADLINE.unpack_from(body)
    if deadline < 0:
        raise ProtocolError(f"{name} has a negative deadline")
    descs = _words(body[_DEADLINE.size :], 2, name)
    if len(descs) == 0:
        raise ProtocolError(f"{name} without descriptors")
    lens = descs[:, 1]
    if not lens.all():
        raise ProtocolError(f"{name} has a zero-length descriptor")
    # A range past 2**64 would wrap and pass the target's region check (addr + len
    # compared modulo 2**64); so would a byte count whose sum wraps.
    if (descs[:, 0] > np.uint64(_U64_MAX) - lens).any():
        raise ProtocolError(f"{name} has a descriptor that wraps around the address space")
    ends = np.cumsum(lens, dtype=np.uint64)
    if (ends[1:] < ends[:-1]).any():
        raise ProtocolError(f"{name} descriptors add up to more than 2**64 bytes")
    return descs, deadline


def _small_request(header: Header, words: tuple[int, ...]) -> tuple[np.ndarray, int]:
    """:func:`_request` for up to :data:`SMALL_DESCS` descriptors, checked in plain Python (the latency path)."""
    deadline = words[0]
    name = header.type.name
    if deadline < 0:
        raise ProtocolError(f"{name} has a negative deadline")
    total = 0
    for i in range(1, len(words), 2):
        addr, length = words[i], words[i + 1]
        if not length:
            raise ProtocolError(f"{name} has a zero-length descriptor")
        if addr > _U64_MAX - length:
            raise ProtocolError(f"{name} has a descriptor that wraps around the address space")
        total += length
    if total > _U64_MAX:
        raise ProtocolError(f"{name} descriptors add up to more than 2**64 bytes")
    return np.array(words[1:], dtype=np.uint64).reshape(-1, 2), deadline


def _json(body: bytes | memoryview, what: str) -> dict[str, Any]:
    try:
        info = json.loads(bytes(body))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"{what} body is not JSON: {exc}") from None
    if not isinstance(info, dict):
        raise ProtocolError(f"{what} body must be a JSON object")
    return info


def _text(raw: bytes | memoryview, what: str) -> str:
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError(f"{what} is not UTF-8") from None


_JSON_BODIED = {
    FrameType.HELLO: Hello,
    FrameType.CHALLENGE: Challenge,
    FrameType.AUTH: Auth,
    FrameType.WELCOME: Welcome,
}
_EMPTY_BODIED = {
    FrameType.QUERY_REGIONS: QueryRegions,
    FrameType.ACK: Ack,
    FrameType.PING: Ping,
}


def parse_body(header: Header, body: bytes | memoryview) -> Message:
    """Decode a frame body into its :data:`Message`, validating it against the header."""
    if len(body) != header.body_len:
        raise ProtocolError(f"body is {len(body)} bytes, header said {header.body_len}")
    kind, rid = header.type, header.req_id
    if kind is FrameType.READ:
        descs, deadline = _request(header, body)
        return ReadRequest(rid, descs, deadline)
    if kind is FrameType.DATA:
        if body:
            raise ProtocolError("DATA must have an empty body")
        return Data(rid, header.data_len)
    if kind in _EMPTY_BODIED:
        if body:
            raise ProtocolError(f"{kind.name} must have an empty body")
        return _EMPTY_BODIED[kind](rid)  # type: ignore[return-value]
    if kind in _JSON_BODIED:
        return _JSON_BODIED[kind](_json(body, kind.name), rid)  # type: ignore[return-value]
    if kind is FrameType.REGIONS:
        return Regions(*_region_change(body, "REGIONS"), rid)
    if kind is FrameType.WRITE:
        descs, deadline = _request(header, body)
        total = int(descs[:, 1].sum(dtype=np.uint64)) if len(descs) > 8 else sum(int(n) for n in descs[:, 1])
        if total != header.data_len:
            raise ProtocolError(f"WRITE descriptors cover {total} bytes, frame carries {header.data_len}")
        return WriteRequest(rid, descs, header.data_len, deadline)
    if kind is FrameType.PONG:
        if len(body) not in (0, _CLOCK.size):
            raise ProtocolError("PONG body must be empty or one clock reading")
        return Pong(rid, _CLOCK.unpack(body)[0] if body else 0.0)
    if kind is FrameType.ERROR:
        if len(body) < _ERROR_HEAD.size:
            raise ProtocolError("ERROR body too short")
        (status,) = _ERROR_HEAD.unpack_from(body)
        return Error(rid, status, _text(body[_ERROR_HEAD.size :], "ERROR message"))
    if kind is FrameType.NOTIFY:
        return _parse_notify(rid, body)
    if kind is FrameType.QUERY_META:
        return QueryMeta(rid, _text(body, "QUERY_META key"))
    if kind is FrameType.REVOKE:
        return Revoke(*_region_change(body, "REVOKE"), rid)
    if kind is FrameType.REVOKED:
        if len(body) != _GENERATION.size:
            raise ProtocolError("REVOKED body must be one generation number")
        return Revoked(_GENERATION.unpack(body)[0], rid)
    if kind is FrameType.META:
        return Meta(rid, bytes(body))
    assert kind is FrameType.BYE
    return Bye(rid, _text(body, "BYE reason"))


def _region_change(body: bytes | memoryview, what: str) -> tuple[int, int, np.ndarray, np.ndarray]:
    """Generation, base, added and removed rows of a REGIONS or REVOKE body, validated."""
    if len(body) < _CHANGE_HEAD.size:
        raise ProtocolError(f"{what} body too short")
    generation, base, n_added = _CHANGE_HEAD.unpack_from(body)
    rows = _words(body[_CHANGE_HEAD.size :], 3, what)
    if n_added > len(rows):
        raise ProtocolError(f"{what} says it adds {n_added} regions but lists {len(rows)}")
    if base != WHOLE and base > generation:
        raise ProtocolError(f"{what} of generation {generation} changes a newer one ({base})")
    if base == WHOLE and n_added != len(rows):
        raise ProtocolError(f"{what} listing every region also lists regions removed")
    return generation, base, rows[:n_added], rows[n_added:]


def _region_change_body(message: Regions | Revoke) -> bytes:
    head = _CHANGE_HEAD.pack(message.generation, message.base, len(message.added))
    return head + _words_bytes(message.added) + _words_bytes(message.removed)


def _parse_notify(rid: int, body: bytes | memoryview) -> Notify:
    if len(body) < _NOTIFY_HEAD.size:
        raise ProtocolError("NOTIFY body too short")
    (name_len,) = _NOTIFY_HEAD.unpack_from(body)
    rest = body[_NOTIFY_HEAD.size :]
    if name_len > len(rest):
        raise ProtocolError("NOTIFY name runs past the body")
    if name_len > MAX_NAME or len(rest) - name_len > MAX_NAME:
        raise ProtocolError(f"NOTIFY name and msg must each be at most {MAX_NAME} bytes")
    return Notify(rid, _text(rest[:name_len], "NOTIFY name"), _text(rest[name_len:], "NOTIFY msg"))


def _head(kind: FrameType, req_id: int, body_len: int, data_len: int = 0) -> bytes:
    """The header of a frame whose body is ``body_len`` bytes, checked against its limit."""
    if body_len > BODY_LIMITS[kind]:
        raise ValueError(f"{kind.name} body of {body_len} bytes exceeds its {BODY_LIMITS[kind]}-byte limit")
    return _HEADER.pack(MAGIC, kind, 0, 0, req_id, body_len, data_len)


def _frame(kind: FrameType, req_id: int, body: bytes = b"", data_len: int = 0) -> bytes:
    return _head(kind, req_id, len(body), data_len) + body


def _words_bytes(rows: np.ndarray) -> bytes:
    return np.ascontiguousarray(rows, dtype=_WORD).tobytes()


def encode_header(kind: FrameType, req_id: int, body_len: int, data_len: int = 0) -> bytes:
    """A bare header; for tests and fault injection that need frames no encoder would make."""
    return _HEADER.pack(MAGIC, kind, 0, 0, req_id, body_len, data_len)


_SMALL_PACKERS = [struct.Struct(f"<4sBBHQIQq{2 * n}Q") for n in range(SMALL_DESCS + 1)]


def small_request(kind: FrameType, req_id: int, deadline: int, pairs: list[tuple[int, int]], data_len: int) -> bytes:
    """A READ/WRITE frame for up to 8 (addr, len) pairs, packed in one step (the latency path).

    The same bytes :func:`encode` makes for the equivalent request.
    """
    if len(pairs) == 1:  # (the common case, without the flattening)
        return _SMALL_PACKERS[1].pack(MAGIC, kind, 0, 0, req_id, _DEADLINE.size + 16, data_len, deadline, *pairs[0])
    flat = [v for pair in pairs for v in pair]
    return _SMALL_PACKERS[len(pairs)].pack(MAGIC, kind, 0, 0, req_id, _DEADLINE.size + 16 * len(pairs), data_len, deadline, *flat)


def encode(message: Message) -> bytes:
    """Header and body of ``message`` as one ``bytes``; bulk data is sent separately.

    Raises ``ValueError`` for a message no peer would accept (a body over its limit).
    """
    kind = _KIND_OF[type(message)]
    if kind is FrameType.DATA:  # the hot replies first
        return _frame(kind, message.req_id, b"", message.data_len)  # type: ignore[union-attr]
    if kind is FrameType.ACK:
        return _frame(kind, message.req_id)
    if kind in _JSON_BODIED:
        body = json.dumps(message.info, separators=(",", ":")).encode()  # type: ignore[union-attr]
        return _frame(kind, message.req_id, body)
    if isinstance(message, (Regions, Revoke)):
        return _frame(kind, message.req_id, _region_change_body(message))
    if isinstance(message, ReadRequest):
        return _frame(kind, message.req_id, _DEADLINE.pack(message.deadline) + _words_bytes(message.descs))
    if isinstance(message, WriteRequest):
        body = _DEADLINE.pack(message.deadline) + _words_bytes(message.descs)
        return _frame(kind, message.req_id, body, message.data_len)
    if isinstance(message, Data):
        return _frame(kind, message.req_id, b"", message.data_len)
    if isinstance(message, Pong):
        return _frame(kind, message.req_id, _CLOCK.pack(message.clock) if message.clock else b"")
    if isinstance(message, Error):
        text = message.message.encode("utf-8", "replace")[: BODY_LIMITS[kind] - _ERROR_HEAD.size]
        return _frame(kind, message.req_id, _ERROR_HEAD.pack(message.status) + text.decode("utf-8", "ignore").encode())
    if isinstance(message, Notify):
        name = message.name.encode()
        if len(name) > MAX_NAME or len(message.msg.encode()) > MAX_NAME:
            raise ValueError(f"notify name and msg must each be at most {MAX_NAME} bytes")
        return _frame(kind, message.req_id, _NOTIFY_HEAD.pack(len(name)) + name + message.msg.encode())
    if isinstance(message, Bye):
        return _frame(kind, message.req_id, message.reason.encode()[:1024].decode("utf-8", "ignore").encode())
    if isinstance(message, QueryMeta):
        return _frame(kind, message.req_id, message.key.encode())
    if isinstance(message, Meta):
        return _frame(kind, message.req_id, message.value)
    if isinstance(message, Revoked):
        return _frame(kind, message.req_id, _GENERATION.pack(message.generation))
    return _frame(kind, message.req_id)


def encode_split(message: Message) -> tuple[bytes, bytes]:
    """:func:`encode` as (header, body) for a META, whose body (up to :data:`MAX_META`) can then
    be sent from where the value is stored instead of being copied behind its header; any other
    message is (its whole frame, ``b""``)."""
    if isinstance(message, Meta):
        return _head(FrameType.META, message.req_id, len(message.value)), message.value
    return encode(message), b""


_KIND_OF: dict[type, FrameType] = {
    Hello: FrameType.HELLO,
    Challenge: FrameType.CHALLENGE,
    Auth: FrameType.AUTH,
    Welcome: FrameType.WELCOME,
    Regions: FrameType.REGIONS,
    QueryRegions: FrameType.QUERY_REGIONS,
    ReadRequest: FrameType.READ,
    WriteRequest: FrameType.WRITE,
    Data: FrameType.DATA,
    Ack: FrameType.ACK,
    Error: FrameType.ERROR,
    Notify: FrameType.NOTIFY,
    Ping: FrameType.PING,
    Pong: FrameType.PONG,
    Bye: FrameType.BYE,
    QueryMeta: FrameType.QUERY_META,
    Meta: FrameType.META,
    Revoke: FrameType.REVOKE,
    Revoked: FrameType.REVOKED,
}


def kind_of(message: Message) -> FrameType:
    """The frame type that carries ``message``."""
    return _KIND_OF[type(message)]
