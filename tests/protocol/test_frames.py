"""The wire protocol, sans I/O: every frame round-trips, the header layout is byte-exact, and
every malformed header or body is refused with ProtocolError, each frame type against its own
body limit."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from hixl import ProtocolError
from hixl import _protocol as proto
from hixl._protocol.frames import (
    BODY_LIMITS,
    MAGIC,
    MAX_DESCS,
    MAX_META,
    MAX_NAME,
    MAX_REGIONS,
    REGION_WRITABLE,
    VERSION,
    WHOLE,
    encode_split,
)

U64_MAX = (1 << 64) - 1
I64_MAX = (1 << 63) - 1
_HEADER = struct.Struct("<4sBBHQIQ")


def _descs(*rows: tuple[int, int]) -> np.ndarray:
    return np.array(rows, dtype=np.uint64).reshape(-1, 2)


def _regions(*rows: tuple[int, int, int]) -> np.ndarray:
    return np.array(rows, dtype=np.uint64).reshape(-1, 3)


def decode(frame: bytes) -> proto.Message:
    """Split one encoded frame (header + body, no data) and parse it."""
    header = proto.parse_header(frame[: proto.HEADER_SIZE])
    body = frame[proto.HEADER_SIZE :]
    assert len(body) == header.body_len
    return proto.parse_body(header, body)


def header(kind: int, req_id: int = 0, body_len: int = 0, data_len: int = 0, magic: bytes = MAGIC,
           flags: int = 0, reserved: int = 0) -> bytes:
    return _HEADER.pack(magic, kind, flags, reserved, req_id, body_len, data_len)


# -- round trips -------------------------------------------------------------------------
MESSAGES = {
    "hello": proto.Hello({"versions": [2, VERSION], "nonce": "ab" * 32, "nested": {"x": [1, 2]}}, 3),
    "challenge": proto.Challenge({"version": VERSION, "nonce": "cd" * 32, "proof": "ef" * 32, "clock": 1.5}),
    "auth": proto.Auth({"proof": "01" * 32, "info": {"engine": "127.0.0.1:5"}}, 0),
    "welcome": proto.Welcome({"info": {"engine": "1.2.3.4:5", "regions": [[4096, 8192, 1]]}, "mac": "00"}, 3),
    "regions": proto.Regions(4, WHOLE, _regions((4096, 8192, REGION_WRITABLE), (1 << 47, 1 << 30, 0)), _regions(), 9),
    "regions-flags": proto.Regions(U64_MAX - 1, WHOLE, _regions((0, U64_MAX, U64_MAX)), _regions(), 0),
    "regions-empty": proto.Regions(0, WHOLE, _regions(), _regions(), 0),
    "regions-delta": proto.Regions(9, 7, _regions((4096, 8192, 1)), _regions((1 << 40, 4096, 0), (8192, 1, 1))),
    "regions-unchanged": proto.Regions(9, 9, _regions(), _regions()),
    "query-regions": proto.QueryRegions(12),
    "read": proto.ReadRequest(1 << 63, _descs((4096, 1), (U64_MAX - 16, 16)), 0),
    "read-deadline": proto.ReadRequest(1, _descs((4096, 1)), 123_456_789),
    "read-deadline-max": proto.ReadRequest(1, _descs((4096, 1)), I64_MAX),
    "write": proto.WriteRequest(7, _descs((4096, 100), (9000, 23)), 123),
    "write-deadline": proto.WriteRequest(7, _descs((4096, 100), (9000, 23)), 123, 1),
    "data": proto.Data(8, 1 << 40),
    "data-empty": proto.Data(8, 0),
    "ack": proto.Ack(U64_MAX),
    "error": proto.Error(4, 6, "queue full: caf\u00e9"),
    "error-empty": proto.Error(4, 1, ""),
    "notify": proto.Notify(5, "kv/\u4e2d", "msg \u00e9"),
    "notify-empty": proto.Notify(5, "", ""),
    "notify-max": proto.Notify(5, "n" * MAX_NAME, "\u00e9" * (MAX_NAME // 2)),
    "ping": proto.Ping(11),
    "pong": proto.Pong(11),
    "pong-clock": proto.Pong(11, 12345.678),
    "pong-negative-clock": proto.Pong(0, -1.0e-9),
    "bye": proto.Bye(0, "target finalized"),
    "bye-empty": proto.Bye(),
    "query-meta": proto.QueryMeta(2, "layout/\u00e9"),
    "meta": proto.Meta(2, b"\x00\xff binary"),
    "revoke": proto.Revoke(7, WHOLE, _regions((4096, 8192, 1), (1 << 40, 4096, 0)), _regions()),
    "revoke-all": proto.Revoke(8, WHOLE, _regions(), _regions()),
    "revoke-delta": proto.Revoke(8, 6, _regions(), _regions((4096, 8192, 1))),
    "revoked": proto.Revoked(7),
}


def _same(a: proto.Message, b: proto.Message) -> bool:
    if type(a) is not type(b):
        return False
    for name in a.__dataclass_fields__:  # type: ignore[union-attr]
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            if not (isinstance(y, np.ndarray) and x.shape == y.shape and np.array_equal(x, y)):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("message", list(MESSAGES.values()), ids=list(MESSAGES))
def test_round_trip(message: proto.Message) -> None:
    frame = proto.encode(message)
    parsed = decode(frame)
    assert _same(parsed, message), (parsed, message)
    assert proto.encode(parsed) == frame


def test_every_frame_type_is_covered() -> None:
    kinds = {proto.parse_header(proto.encode(m)[: proto.HEADER_SIZE]).type for m in MESSAGES.values()}
    assert kinds == set(proto.FrameType)


def test_parse_body_accepts_memoryview() -> None:
    frame = proto.encode(MESSAGES["read"])
    h = proto.parse_header(memoryview(frame)[: proto.HEADER_SIZE])
    assert _same(proto.parse_body(h, memoryview(frame)[proto.HEADER_SIZE :]), MESSAGES["read"])


def test_many_descriptors_parse_as_one_array() -> None:
    n = MAX_DESCS
    descs = np.stack([np.arange(n, dtype=np.uint64) * 4096 + 4096, np.full(n, 4096, np.uint64)], axis=1)
    frame = proto.encode(proto.WriteRequest(1, descs, n * 4096, 99))
    assert len(frame) == proto.HEADER_SIZE + BODY_LIMITS[proto.FrameType.WRITE]
    parsed = decode(frame)
    assert isinstance(parsed, proto.WriteRequest)
    assert parsed.descs.shape == (n, 2) and np.array_equal(parsed.descs, descs) and parsed.deadline == 99


def test_many_regions_parse_as_one_array() -> None:
    n = MAX_REGIONS
    rows = np.stack([np.arange(n, dtype=np.uint64) << np.uint64(12), np.full(n, 4096, np.uint64), np.arange(n, dtype=np.uint64) & np.uint64(1)], axis=1)
    parsed = decode(proto.encode(proto.Regions(1, WHOLE, rows, _regions())))
    assert isinstance(parsed, proto.Regions)
    assert parsed.added.shape == (n, 3) and np.array_equal(parsed.added, rows) and parsed.removed.shape == (0, 3)


def test_encode_refuses_bodies_over_their_limit() -> None:
    """Larger requests must be split by the caller; the encoder never makes a frame a peer refuses."""
    too_many = np.ones((MAX_DESCS + 1, 2), dtype=np.uint64)
    for message in (
        proto.ReadRequest(1, too_many),
        proto.WriteRequest(1, too_many, MAX_DESCS + 1),
        proto.Regions(1, WHOLE, np.ones((MAX_REGIONS + 1, 3), dtype=np.uint64), _regions()),
        proto.Revoke(2, 1, np.ones((MAX_REGIONS, 3), dtype=np.uint64), _regions((1, 1, 1))),
        proto.Meta(1, bytes(MAX_META + 1)),
        proto.QueryMeta(1, "k" * (MAX_NAME + 1)),
        proto.Hello({"pad": "x" * BODY_LIMITS[proto.FrameType.HELLO]}),
        proto.Auth({"pad": "x" * BODY_LIMITS[proto.FrameType.AUTH]}),
    ):
        with pytest.raises(ValueError, match="limit"):
            proto.encode(message)
    assert len(proto.encode(proto.Meta(1, bytes(MAX_META)))) == proto.HEADER_SIZE + MAX_META
    with pytest.raises(ValueError, match="limit"):
        encode_split(proto.Meta(1, bytes(MAX_META + 1)))


@pytest.mark.parametrize("message", list(MESSAGES.values()), ids=list(MESSAGES))
def test_a_split_frame_is_the_frame(message: proto.Message) -> None:
    """encode_split gives META's header and its value itself (not a copy); anything else whole."""
    header, body = encode_split(message)
    assert header + body == proto.encode(message)
    assert body is message.value if isinstance(message, proto.Meta) else body == b""


def test_long_error_and_bye_texts_are_cut_to_their_limit_on_valid_utf8() -> None:
    for text in ("x" * 10_000, "\u00e9" * 10_000, "\U0001f600" * 5_000):
        error = decode(proto.encode(proto.Error(1, 6, text)))
        assert isinstance(error, proto.Error) and text.startswith(error.message)
        assert len(error.message.encode()) > BODY_LIMITS[proto.FrameType.ERROR] - 4 - 4
        bye = decode(proto.encode(proto.Bye(0, text)))
        assert isinstance(bye, proto.Bye) and text.startswith(bye.reason)
        assert BODY_LIMITS[proto.FrameType.BYE] - 4 < len(bye.reason.encode()) <= BODY_LIMITS[proto.FrameType.BYE]


# -- byte-exact layout -------------------------------------------------------------------
def test_header_layout() -> None:
    assert proto.HEADER_SIZE == 28
    frame = proto.encode(proto.WriteRequest(0x0102030405060708, _descs((0x1122334455667788, 5)), 5, 0x0A0B0C0D))
    assert frame[0:4] == b"HXL1"
    assert frame[4] == proto.FrameType.WRITE == 6
    assert frame[5] == 0 and frame[6:8] == b"\x00\x00"
    assert frame[8:16] == bytes([8, 7, 6, 5, 4, 3, 2, 1])  # req_id, little-endian
    assert frame[16:20] == (24).to_bytes(4, "little")  # body_len: deadline + one (addr, len) pair
    assert frame[20:28] == (5).to_bytes(8, "little")  # data_len
    assert frame[28:36] == (0x0A0B0C0D).to_bytes(8, "little")  # deadline, signed little-endian
    assert frame[36:] == (0x1122334455667788).to_bytes(8, "little") + (5).to_bytes(8, "little")


def test_read_and_regions_layout() -> None:
    read = proto.encode(proto.ReadRequest(1, _descs((4096, 7)), 5))
    assert read[16:20] == (24).to_bytes(4, "little") and read[20:28] == bytes(8)
    assert read[28:] == (5).to_bytes(8, "little") + (4096).to_bytes(8, "little") + (7).to_bytes(8, "little")
    regions = proto.encode(proto.Regions(5, 3, _regions((4096, 8192, REGION_WRITABLE)), _regions((1 << 20, 64, 0))))
    assert regions[4] == proto.FrameType.REGIONS and regions[16:20] == (72).to_bytes(4, "little")
    words = (5, 3, 1, 4096, 8192, REGION_WRITABLE, 1 << 20, 64, 0)  # generation, base, count added, rows
    assert regions[28:] == b"".join(v.to_bytes(8, "little") for v in words)
    assert REGION_WRITABLE == 1


def test_exact_bytes_of_small_frames() -> None:
    assert proto.encode(proto.Ping(1)) == b"HXL1\x0b\x00\x00\x00" + b"\x01" + bytes(7) + bytes(4) + bytes(8)
    assert proto.encode(proto.Error(2, 6, "x")) == (
        b"HXL1\x09\x00\x00\x00" + b"\x02" + bytes(7) + b"\x05\x00\x00\x00" + bytes(8) + b"\x06\x00\x00\x00x"
    )
    assert proto.encode(proto.Notify(3, "ab", "c")) == (
        b"HXL1\x0a\x00\x00\x00" + b"\x03" + bytes(7) + b"\x05\x00\x00\x00" + bytes(8) + b"\x02\x00abc"
    )
    assert proto.encode(proto.Data(4, 258)) == b"HXL1\x07\x00\x00\x00" + b"\x04" + bytes(7) + bytes(4) + b"\x02\x01" + bytes(6)
    assert proto.encode(proto.Hello({"a": 1})) == b"HXL1\x01\x00\x00\x00" + bytes(8) + b"\x07\x00\x00\x00" + bytes(8) + b'{"a":1}'
    assert proto.encode(proto.Challenge({"a": 1})) == b"HXL1\x10\x00\x00\x00" + bytes(8) + b"\x07\x00\x00\x00" + bytes(8) + b'{"a":1}'
    assert proto.encode(proto.Auth({"a": 1})) == b"HXL1\x11\x00\x00\x00" + bytes(8) + b"\x07\x00\x00\x00" + bytes(8) + b'{"a":1}'
    assert proto.encode(proto.Pong(5)) == b"HXL1\x0c\x00\x00\x00" + b"\x05" + bytes(7) + bytes(4) + bytes(8)
    assert proto.encode(proto.Pong(5, 2.0)) == (
        b"HXL1\x0c\x00\x00\x00" + b"\x05" + bytes(7) + b"\x08\x00\x00\x00" + bytes(8) + struct.pack("<d", 2.0)
    )


def test_frame_type_numbers_are_stable() -> None:
    """The numbers are on the wire: changing one breaks compatibility with every peer."""
    assert {t.name: int(t) for t in proto.FrameType} == {
        "HELLO": 1, "WELCOME": 2, "REGIONS": 3, "QUERY_REGIONS": 4, "READ": 5, "WRITE": 6, "DATA": 7,
        "ACK": 8, "ERROR": 9, "NOTIFY": 10, "PING": 11, "PONG": 12, "BYE": 13, "QUERY_META": 14, "META": 15,
        "CHALLENGE": 16, "AUTH": 17, "REVOKE": 18, "REVOKED": 19,
    }


# -- parse_header validation -------------------------------------------------------------
@pytest.mark.parametrize("size", [0, 1, 27, 29, 56])
def test_header_of_the_wrong_size(size: int) -> None:
    with pytest.raises(ProtocolError, match="28 bytes"):
        proto.parse_header(bytes(size))


@pytest.mark.parametrize("magic", [b"HXL0", b"HXL2", b"hxl1", b"\x00\x00\x00\x00", b"GET "])
def test_bad_magic(magic: bytes) -> None:
    with pytest.raises(ProtocolError, match="magic"):
        proto.parse_header(header(proto.FrameType.PING, magic=magic))


@pytest.mark.parametrize("kind", [0, 20, 99, 255])
def test_unknown_frame_type(kind: int) -> None:
    with pytest.raises(ProtocolError, match="unknown frame type"):
        proto.parse_header(header(kind))


@pytest.mark.parametrize(("flags", "reserved"), [(1, 0), (0x80, 0), (0, 1), (0, 0x8000), (3, 3)])
def test_reserved_bits(flags: int, reserved: int) -> None:
    with pytest.raises(ProtocolError, match="reserved"):
        proto.parse_header(header(proto.FrameType.PING, flags=flags, reserved=reserved))


def test_every_frame_type_has_a_body_limit() -> None:
    assert set(BODY_LIMITS) == set(proto.FrameType)
    assert max(BODY_LIMITS.values()) == proto.frames.MAX_BODY
    # Small things stay small: nothing before the handshake may announce more than 4 KiB.
    for kind in (proto.FrameType.HELLO, proto.FrameType.CHALLENGE, proto.FrameType.AUTH):
        assert BODY_LIMITS[kind] == 4096
    for kind in (proto.FrameType.QUERY_REGIONS, proto.FrameType.DATA, proto.FrameType.ACK, proto.FrameType.PING):
        assert BODY_LIMITS[kind] == 0
    assert BODY_LIMITS[proto.FrameType.PONG] == 8
    assert BODY_LIMITS[proto.FrameType.NOTIFY] == 2 + 2 * MAX_NAME
    assert BODY_LIMITS[proto.FrameType.READ] == BODY_LIMITS[proto.FrameType.WRITE] == 8 + 16 * MAX_DESCS
    assert BODY_LIMITS[proto.FrameType.REGIONS] == BODY_LIMITS[proto.FrameType.REVOKE] == 24 + 24 * MAX_REGIONS


@pytest.mark.parametrize("kind", list(proto.FrameType), ids=lambda t: t.name)
def test_body_size_limit_is_checked_on_the_header(kind: proto.FrameType) -> None:
    limit = BODY_LIMITS[kind]
    assert proto.parse_header(header(kind, body_len=limit)).body_len == limit
    for body_len in (limit + 1, limit + 4096, 0xFFFFFFFF):
        with pytest.raises(ProtocolError, match=f"{kind.name} body of {body_len} bytes exceeds"):
            proto.parse_header(header(kind, body_len=body_len))


@pytest.mark.parametrize("kind", [t for t in proto.FrameType if t not in (proto.FrameType.WRITE, proto.FrameType.DATA)], ids=lambda t: t.name)
def test_data_on_a_frame_that_has_none(kind: proto.FrameType) -> None:
    with pytest.raises(ProtocolError, match="must not carry data"):
        proto.parse_header(header(kind, data_len=1))


@pytest.mark.parametrize("kind", [proto.FrameType.WRITE, proto.FrameType.DATA], ids=lambda t: t.name)
def test_data_frames_may_carry_any_amount(kind: proto.FrameType) -> None:
    assert proto.parse_header(header(kind, req_id=5, data_len=U64_MAX)) == proto.Header(kind, 5, 0, U64_MAX)


# -- parse_body validation ---------------------------------------------------------------
def _parse(kind: proto.FrameType, body: bytes, data_len: int = 0) -> proto.Message:
    """Parse ``body`` as a ``kind`` frame; ``data_len`` is used only where data is allowed."""
    if kind not in (proto.FrameType.WRITE, proto.FrameType.DATA):
        data_len = 0
    return proto.parse_body(proto.parse_header(header(kind, 1, len(body), data_len)), body)


def test_body_length_must_match_the_header() -> None:
    h = proto.parse_header(header(proto.FrameType.BYE, body_len=4))
    for body in (b"abc", b"abcde"):
        with pytest.raises(ProtocolError, match="header said 4"):
            proto.parse_body(h, body)


EMPTY_BODIED = [proto.FrameType.QUERY_REGIONS, proto.FrameType.ACK, proto.FrameType.PING, proto.FrameType.DATA]


@pytest.mark.parametrize("kind", EMPTY_BODIED, ids=lambda t: t.name)
def test_empty_bodied_frames_refuse_a_body(kind: proto.FrameType) -> None:
    with pytest.raises(ProtocolError, match="exceeds its 0-byte limit"):
        _parse(kind, b"x")
    # Defence in depth: parse_body refuses it too, given a header nobody validated.
    with pytest.raises(ProtocolError, match="empty body"):
        proto.parse_body(proto.Header(kind, 1, 1, 0), b"x")


@pytest.mark.parametrize("size", [1, 4, 7])
def test_pong_body_is_empty_or_one_clock(size: int) -> None:
    with pytest.raises(ProtocolError, match="PONG body must be empty or one clock"):
        _parse(proto.FrameType.PONG, bytes(size))
    assert _parse(proto.FrameType.PONG, b"") == proto.Pong(1, 0.0)
    assert _parse(proto.FrameType.PONG, struct.pack("<d", -3.25)) == proto.Pong(1, -3.25)


JSON_BODIED = [proto.FrameType.HELLO, proto.FrameType.CHALLENGE, proto.FrameType.AUTH, proto.FrameType.WELCOME]


def test_deeply_nested_json_is_refused_not_a_crash() -> None:
    for kind in JSON_BODIED:
        with pytest.raises(ProtocolError, match="JSON"):
            _parse(kind, b"[" * min(BODY_LIMITS[kind], 200_000))


@pytest.mark.parametrize("kind", JSON_BODIED, ids=lambda t: t.name)
@pytest.mark.parametrize("body", [b"", b"{", b"[1]", b'"text"', b"42", b"\xff\xfe{}", b"null"], ids=repr)
def test_control_bodies_must_be_json_objects(kind: proto.FrameType, body: bytes) -> None:
    with pytest.raises(ProtocolError, match="JSON"):
        _parse(kind, body)


@pytest.mark.parametrize("kind", [proto.FrameType.READ, proto.FrameType.WRITE], ids=lambda t: t.name)
@pytest.mark.parametrize("size", [1, 8, 15, 17, 24])
def test_descriptor_bodies_must_be_pairs(kind: proto.FrameType, size: int) -> None:
    with pytest.raises(ProtocolError, match="not a list of 2-word rows"):
        _parse(kind, _deadline(0) + bytes(size), data_len=0)


@pytest.mark.parametrize("kind", [proto.FrameType.REGIONS, proto.FrameType.REVOKE], ids=lambda t: t.name)
@pytest.mark.parametrize("size", [1, 8, 16, 23])
def test_region_changes_need_their_head(kind: proto.FrameType, size: int) -> None:
    with pytest.raises(ProtocolError, match=f"{kind.name} body too short"):
        _parse(kind, bytes(size))


@pytest.mark.parametrize("kind", [proto.FrameType.REGIONS, proto.FrameType.REVOKE], ids=lambda t: t.name)
@pytest.mark.parametrize("size", [1, 8, 16, 23, 25, 32])
def test_region_bodies_must_be_triples(kind: proto.FrameType, size: int) -> None:
    with pytest.raises(ProtocolError, match=f"{kind.name} body .* not a list of 3-word rows"):
        _parse(kind, struct.pack("<QQQ", 2, 1, 0) + bytes(size))


@pytest.mark.parametrize("kind", [proto.FrameType.REGIONS, proto.FrameType.REVOKE], ids=lambda t: t.name)
@pytest.mark.parametrize(
    ("head", "rows", "why"),
    [
        ((5, 4, 2), 1, "adds 2 regions but lists 1"),
        ((5, 6, 0), 0, "changes a newer one"),
        ((5, WHOLE, 1), 2, "also lists regions removed"),
    ],
    ids=["more-added-than-listed", "base-after-generation", "whole-with-removals"],
)
def test_region_changes_that_cannot_be_right(kind: proto.FrameType, head: tuple[int, int, int], rows: int, why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        _parse(kind, struct.pack("<QQQ", *head) + bytes(24 * rows))


@pytest.mark.parametrize("kind", [proto.FrameType.READ, proto.FrameType.WRITE], ids=lambda t: t.name)
@pytest.mark.parametrize("size", [0, 1, 7])
def test_requests_need_a_deadline(kind: proto.FrameType, size: int) -> None:
    with pytest.raises(ProtocolError, match=f"{kind.name} body too short"):
        _parse(kind, bytes(size))


@pytest.mark.parametrize("kind", [proto.FrameType.READ, proto.FrameType.WRITE], ids=lambda t: t.name)
@pytest.mark.parametrize("deadline", [-1, -(1 << 63)])
def test_negative_deadline(kind: proto.FrameType, deadline: int) -> None:
    with pytest.raises(ProtocolError, match="negative deadline"):
        _parse(kind, _deadline(deadline) + _pairs((4096, 8)), data_len=8)


@pytest.mark.parametrize("kind", [proto.FrameType.READ, proto.FrameType.WRITE], ids=lambda t: t.name)
@pytest.mark.parametrize("deadline", [0, 1, I64_MAX])
def test_deadline_is_parsed(kind: proto.FrameType, deadline: int) -> None:
    message = _parse(kind, _deadline(deadline) + _pairs((4096, 8)), data_len=8)
    assert isinstance(message, (proto.ReadRequest, proto.WriteRequest)) and message.deadline == deadline


@pytest.mark.parametrize("kind", [proto.FrameType.READ, proto.FrameType.WRITE], ids=lambda t: t.name)
def test_requests_need_descriptors(kind: proto.FrameType) -> None:
    with pytest.raises(ProtocolError, match="without descriptors"):
        _parse(kind, _deadline(0))


def _deadline(value: int) -> bytes:
    return struct.pack("<q", value)


def _pairs(*rows: tuple[int, int]) -> bytes:
    """A READ/WRITE body: no deadline, then the descriptors."""
    return _descs(*rows).astype("<u8").tobytes()


def _request(*rows: tuple[int, int]) -> bytes:
    return _deadline(0) + _pairs(*rows)


@pytest.mark.parametrize("kind", [proto.FrameType.READ, proto.FrameType.WRITE], ids=lambda t: t.name)
def test_zero_length_descriptor(kind: proto.FrameType) -> None:
    with pytest.raises(ProtocolError, match="zero-length"):
        _parse(kind, _request((4096, 16), (8192, 0)), data_len=16)


@pytest.mark.parametrize("kind", [proto.FrameType.READ, proto.FrameType.WRITE], ids=lambda t: t.name)
@pytest.mark.parametrize("row", [(U64_MAX, 1), (U64_MAX - 15, 17), (4096, U64_MAX), (1 << 63, 1 << 63)])
def test_descriptor_wrapping_around_the_address_space(kind: proto.FrameType, row: tuple[int, int]) -> None:
    # (addr + len) mod 2**64 would pass a region check; the parser must refuse it.
    with pytest.raises(ProtocolError, match="wraps"):
        _parse(kind, _request(row), data_len=(row[1]) % (1 << 64))


def test_descriptor_ending_at_the_top_of_the_address_space() -> None:
    message = _parse(proto.FrameType.READ, _request((U64_MAX - 16, 16)))
    assert isinstance(message, proto.ReadRequest)


def test_write_lengths_adding_up_past_2_64() -> None:
    with pytest.raises(ProtocolError, match="2\\*\\*64"):
        _parse(proto.FrameType.WRITE, _request((4096, 1 << 63), (4096, 1 << 63)), data_len=0)


@pytest.mark.parametrize("data_len", [0, 99, 101, 1 << 40])
def test_write_data_length_must_match_its_descriptors(data_len: int) -> None:
    with pytest.raises(ProtocolError, match="cover 100 bytes"):
        _parse(proto.FrameType.WRITE, _request((4096, 60), (9000, 40)), data_len=data_len)


def test_error_body() -> None:
    for body in (b"", b"\x01\x00\x00"):
        with pytest.raises(ProtocolError, match="too short"):
            _parse(proto.FrameType.ERROR, body)
    with pytest.raises(ProtocolError, match="UTF-8"):
        _parse(proto.FrameType.ERROR, b"\x01\x00\x00\x00\xff")


def test_notify_body() -> None:
    for body in (b"", b"\x01"):
        with pytest.raises(ProtocolError, match="too short"):
            _parse(proto.FrameType.NOTIFY, body)
    with pytest.raises(ProtocolError, match="runs past"):
        _parse(proto.FrameType.NOTIFY, b"\x05\x00abcd")
    with pytest.raises(ProtocolError, match="NOTIFY name is not UTF-8"):
        _parse(proto.FrameType.NOTIFY, b"\x01\x00\xffmsg")
    with pytest.raises(ProtocolError, match="NOTIFY msg is not UTF-8"):
        _parse(proto.FrameType.NOTIFY, b"\x01\x00n\xc3")
    assert _parse(proto.FrameType.NOTIFY, b"\x04\x00abcd") == proto.Notify(1, "abcd", "")


def test_notify_limits_are_enforced_on_receive() -> None:
    """The body limit alone would let a 1025-byte name through; each field has its own."""
    at_limit = struct.pack("<H", MAX_NAME) + b"n" * MAX_NAME + b"m" * MAX_NAME
    assert _parse(proto.FrameType.NOTIFY, at_limit) == proto.Notify(1, "n" * MAX_NAME, "m" * MAX_NAME)
    for name_len, msg_len in ((MAX_NAME + 1, 0), (0, MAX_NAME + 1), (MAX_NAME + 1, MAX_NAME - 1), (2 * MAX_NAME, 0)):
        body = struct.pack("<H", name_len) + b"n" * name_len + b"m" * msg_len
        assert len(body) <= BODY_LIMITS[proto.FrameType.NOTIFY]
        with pytest.raises(ProtocolError, match="at most 1024 bytes"):
            _parse(proto.FrameType.NOTIFY, body)


@pytest.mark.parametrize(("kind", "what"), [(proto.FrameType.BYE, "BYE"), (proto.FrameType.QUERY_META, "QUERY_META"), (proto.FrameType.ERROR, "ERROR")])
def test_text_bodies_must_be_utf8(kind: proto.FrameType, what: str) -> None:
    with pytest.raises(ProtocolError, match=f"{what} .*UTF-8"):
        _parse(kind, (b"\x01\x00\x00\x00" if kind is proto.FrameType.ERROR else b"") + b"\x80abc")


def test_encode_refuses_oversized_notifications() -> None:
    for notify in (proto.Notify(1, "n" * (MAX_NAME + 1), ""), proto.Notify(1, "", "\u00e9" * (MAX_NAME // 2 + 1))):
        with pytest.raises(ValueError):
            proto.encode(notify)


def test_errors_are_protocol_errors_not_crashes() -> None:
    """Random bodies for every frame type raise ProtocolError or parse — nothing else."""
    rng = np.random.default_rng(0)
    for kind in proto.FrameType:
        for _ in range(200):
            size = min(int(rng.integers(0, 64)), BODY_LIMITS[kind])
            body = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            data_len = int(rng.integers(0, 1 << 20)) if kind in (proto.FrameType.WRITE, proto.FrameType.DATA) else 0
            try:
                _parse(kind, body, data_len)
            except ProtocolError:
                pass
