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
between the socket and registered memory (``recv_into``/``sendmsg``), which is
the whole point of the design. Descriptor lists travel as raw ``uint64`` pairs
(remote address, length) so that 10^5 of them parse with one ``frombuffer``.
Control bodies (hello/welcome) are small JSON objects: they are sent once per
connection, so readability beats a few microseconds.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np

from .._exceptions import ProtocolError

MAGIC = b"HXL1"
VERSION = 1
_HEADER = struct.Struct("<4sBBHQIQ")
HEADER_SIZE = _HEADER.size
MAX_BODY = 64 << 20
MAX_NAME = 1024
_U64_MAX = (1 << 64) - 1
_ERROR_HEAD = struct.Struct("<I")
_NOTIFY_HEAD = struct.Struct("<H")
_PAIR = np.dtype("<u8")


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


@dataclass(frozen=True)
class Header:
    """A decoded frame header."""

    type: FrameType
    req_id: int
    body_len: int
    data_len: int


@dataclass(frozen=True)
class Hello:
    """Client -> server, first frame: who the client is (for the same-host probe)."""

    info: dict[str, Any]
    req_id: int = 0


@dataclass(frozen=True)
class Welcome:
    """Server -> client reply to HELLO: identity, probe location, current regions."""

    info: dict[str, Any]
    req_id: int = 0


@dataclass(frozen=True)
class Regions:
    """The server's registered regions, as an ``(N, 2)`` array of (addr, len).

    Sent unsolicited (``req_id`` 0) whenever registrations change, and as the
    reply to QUERY_REGIONS.
    """

    regions: np.ndarray
    req_id: int = 0


@dataclass(frozen=True)
class QueryRegions:
    """Client asks for the server's current regions."""

    req_id: int


@dataclass(frozen=True)
class ReadRequest:
    """Client asks the server to send the bytes of ``descs`` (N, 2: remote addr, len)."""

    req_id: int
    descs: np.ndarray


@dataclass(frozen=True)
class WriteRequest:
    """Client sends ``data_len`` bytes, right after this body, into ``descs`` on the server."""

    req_id: int
    descs: np.ndarray
    data_len: int


@dataclass(frozen=True)
class Data:
    """Server's reply to READ: ``data_len`` raw bytes follow."""

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
    """A small notification for the server's ``get_notifies`` queue."""

    req_id: int
    name: str
    msg: str


@dataclass(frozen=True)
class Ping:
    """Heartbeat; answered by PONG with the same ``req_id``."""

    req_id: int = 0


@dataclass(frozen=True)
class Pong:
    """Heartbeat answer."""

    req_id: int = 0


@dataclass(frozen=True)
class Bye:
    """Graceful close: the sender will send nothing more."""

    req_id: int = 0
    reason: str = field(default="")


@dataclass(frozen=True)
class QueryMeta:
    """Client asks for the metadata value the target published under ``key``."""

    req_id: int
    key: str


@dataclass(frozen=True)
class Meta:
    """Reply to QUERY_META: the published value (opaque bytes)."""

    req_id: int
    value: bytes


Message = Union[
    Hello,
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
]


def parse_header(raw: bytes | bytearray | memoryview) -> Header:
    """Decode and validate a header; raise :class:`ProtocolError` on anything odd."""
    if len(raw) != HEADER_SIZE:
        raise ProtocolError(f"header must be {HEADER_SIZE} bytes, got {len(raw)}")
    magic, ftype, flags, reserved, req_id, body_len, data_len = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}: not a hixl peer")
    try:
        kind = FrameType(ftype)
    except ValueError:
        raise ProtocolError(f"unknown frame type {ftype}") from None
    if flags or reserved:
        raise ProtocolError(f"reserved header bits set ({flags:#x}, {reserved:#x})")
    if body_len > MAX_BODY:
        raise ProtocolError(f"body of {body_len} bytes exceeds the {MAX_BODY}-byte limit")
    if data_len and kind not in (FrameType.WRITE, FrameType.DATA):
        raise ProtocolError(f"{kind.name} frame must not carry data")
    return Header(kind, req_id, body_len, data_len)


def _pairs(body: bytes | memoryview, what: str) -> np.ndarray:
    if len(body) % 16:
        raise ProtocolError(f"{what} body of {len(body)} bytes is not a list of (addr, len) pairs")
    return np.frombuffer(body, dtype=_PAIR).reshape(-1, 2)


def _descs(header: Header, body: bytes | memoryview) -> np.ndarray:
    descs = _pairs(body, header.type.name)
    if len(descs) == 0:
        raise ProtocolError(f"{header.type.name} without descriptors")
    lens = descs[:, 1]
    if not lens.all():
        raise ProtocolError(f"{header.type.name} has a zero-length descriptor")
    # A range past 2**64 would wrap and pass the target's region check (addr + len
    # compared modulo 2**64); so would a byte count whose sum wraps.
    if (descs[:, 0] > np.uint64(_U64_MAX) - lens).any():
        raise ProtocolError(f"{header.type.name} has a descriptor that wraps around the address space")
    ends = np.cumsum(lens, dtype=np.uint64)
    if (ends[1:] < ends[:-1]).any():
        raise ProtocolError(f"{header.type.name} descriptors add up to more than 2**64 bytes")
    return descs


def _json(body: bytes | memoryview, what: str) -> dict[str, Any]:
    try:
        info = json.loads(bytes(body))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"{what} body is not JSON: {exc}") from None
    if not isinstance(info, dict):
        raise ProtocolError(f"{what} body must be a JSON object")
    return info


def _text(raw: bytes | memoryview, what: str) -> str:
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError(f"{what} is not UTF-8") from None


def parse_body(header: Header, body: bytes | memoryview) -> Message:
    """Decode a frame body into its :data:`Message`, validating it against the header."""
    if len(body) != header.body_len:
        raise ProtocolError(f"body is {len(body)} bytes, header said {header.body_len}")
    kind, rid = header.type, header.req_id
    empty_bodied = {
        FrameType.QUERY_REGIONS: QueryRegions,
        FrameType.ACK: Ack,
        FrameType.PING: Ping,
        FrameType.PONG: Pong,
    }
    if kind in empty_bodied:
        if body:
            raise ProtocolError(f"{kind.name} must have an empty body")
        return empty_bodied[kind](rid)  # type: ignore[return-value]
    if kind is FrameType.HELLO:
        return Hello(_json(body, "HELLO"), rid)
    if kind is FrameType.WELCOME:
        return Welcome(_json(body, "WELCOME"), rid)
    if kind is FrameType.REGIONS:
        return Regions(_pairs(body, "REGIONS"), rid)
    if kind is FrameType.READ:
        return ReadRequest(rid, _descs(header, body))
    if kind is FrameType.WRITE:
        descs = _descs(header, body)
        total = int(descs[:, 1].sum(dtype=np.uint64))
        if total != header.data_len:
            raise ProtocolError(f"WRITE descriptors cover {total} bytes, frame carries {header.data_len}")
        return WriteRequest(rid, descs, header.data_len)
    if kind is FrameType.DATA:
        if body:
            raise ProtocolError("DATA must have an empty body")
        return Data(rid, header.data_len)
    if kind is FrameType.ERROR:
        if len(body) < _ERROR_HEAD.size:
            raise ProtocolError("ERROR body too short")
        (status,) = _ERROR_HEAD.unpack_from(body)
        return Error(rid, status, _text(body[_ERROR_HEAD.size :], "ERROR message"))
    if kind is FrameType.NOTIFY:
        if len(body) < _NOTIFY_HEAD.size:
            raise ProtocolError("NOTIFY body too short")
        (name_len,) = _NOTIFY_HEAD.unpack_from(body)
        rest = body[_NOTIFY_HEAD.size :]
        if name_len > len(rest):
            raise ProtocolError("NOTIFY name runs past the body")
        name, msg = _text(rest[:name_len], "NOTIFY name"), _text(rest[name_len:], "NOTIFY msg")
        return Notify(rid, name, msg)
    if kind is FrameType.QUERY_META:
        return QueryMeta(rid, _text(body, "QUERY_META key"))
    if kind is FrameType.META:
        return Meta(rid, bytes(body))
    assert kind is FrameType.BYE
    return Bye(rid, _text(body, "BYE reason"))


def _frame(kind: FrameType, req_id: int, body: bytes = b"", data_len: int = 0) -> bytes:
    return _HEADER.pack(MAGIC, kind, 0, 0, req_id, len(body), data_len) + body


def _pairs_bytes(pairs: np.ndarray) -> bytes:
    return np.ascontiguousarray(pairs, dtype=_PAIR).tobytes()


def encode(message: Message) -> bytes:
    """Header and body of ``message`` as one ``bytes``; bulk data is sent separately."""
    if isinstance(message, (Hello, Welcome)):
        kind = FrameType.HELLO if isinstance(message, Hello) else FrameType.WELCOME
        return _frame(kind, message.req_id, json.dumps(message.info, separators=(",", ":")).encode())
    if isinstance(message, Regions):
        return _frame(FrameType.REGIONS, message.req_id, _pairs_bytes(message.regions))
    if isinstance(message, ReadRequest):
        return _frame(FrameType.READ, message.req_id, _pairs_bytes(message.descs))
    if isinstance(message, WriteRequest):
        return _frame(FrameType.WRITE, message.req_id, _pairs_bytes(message.descs), message.data_len)
    if isinstance(message, Data):
        return _frame(FrameType.DATA, message.req_id, b"", message.data_len)
    if isinstance(message, Error):
        body = _ERROR_HEAD.pack(message.status) + message.message.encode("utf-8", "replace")
        return _frame(FrameType.ERROR, message.req_id, body)
    if isinstance(message, Notify):
        name = message.name.encode()
        if len(name) > MAX_NAME or len(message.msg.encode()) > MAX_NAME:
            raise ValueError(f"notify name and msg must each be at most {MAX_NAME} bytes")
        return _frame(FrameType.NOTIFY, message.req_id, _NOTIFY_HEAD.pack(len(name)) + name + message.msg.encode())
    if isinstance(message, Bye):
        return _frame(FrameType.BYE, message.req_id, message.reason.encode())
    if isinstance(message, QueryMeta):
        return _frame(FrameType.QUERY_META, message.req_id, message.key.encode())
    if isinstance(message, Meta):
        return _frame(FrameType.META, message.req_id, message.value)
    simple = {QueryRegions: FrameType.QUERY_REGIONS, Ack: FrameType.ACK, Ping: FrameType.PING, Pong: FrameType.PONG}
    return _frame(simple[type(message)], message.req_id)
