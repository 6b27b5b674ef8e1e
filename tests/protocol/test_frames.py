"""The wire protocol, sans I/O: every frame round-trips, the header layout is byte-exact, and
every malformed header or body is refused with ProtocolError."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from hixl import ProtocolError
from hixl import _protocol as proto
from hixl._protocol.frames import MAGIC, MAX_BODY, MAX_NAME, VERSION

U64_MAX = (1 << 64) - 1
_HEADER = struct.Struct("<4sBBHQIQ")


def _descs(*rows: tuple[int, int]) -> np.ndarray:
    return np.array(rows, dtype=np.uint64).reshape(-1, 2)


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
    "hello": proto.Hello({"engine": "127.0.0.1:5", "engine_id": "ab", "nested": {"x": [1, 2]}}, 3),
    "welcome": proto.Welcome({"engine": "1.2.3.4:5", "regions": [[4096, 8192]], "version": VERSION}, 3),
    "regions": proto.Regions(_descs((4096, 8192), (1 << 47, 1 << 30)), 9),
    "regions-empty": proto.Regions(_descs(), 0),
    "query-regions": proto.QueryRegions(12),
    "read": proto.ReadRequest(1 << 63, _descs((4096, 1), (U64_MAX - 16, 16))),
    "write": proto.WriteRequest(7, _descs((4096, 100), (9000, 23)), 123),
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
    "bye": proto.Bye(0, "target finalized"),
    "bye-empty": proto.Bye(),
    "query-meta": proto.QueryMeta(2, "layout/\u00e9"),
    "meta": proto.Meta(2, b"\x00\xff binary"),
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
    n = 100_000
    descs = np.stack([np.arange(n, dtype=np.uint64) * 4096 + 4096, np.full(n, 4096, np.uint64)], axis=1)
    parsed = decode(proto.encode(proto.WriteRequest(1, descs, n * 4096)))
    assert isinstance(parsed, proto.WriteRequest)
    assert parsed.descs.shape == (n, 2) and np.array_equal(parsed.descs, descs)


# -- byte-exact layout -------------------------------------------------------------------
def test_header_layout() -> None:
    assert proto.HEADER_SIZE == 28
    frame = proto.encode(proto.WriteRequest(0x0102030405060708, _descs((0x1122334455667788, 5)), 5))
    assert frame[0:4] == b"HXL1"
    assert frame[4] == proto.FrameType.WRITE == 6
    assert frame[5] == 0 and frame[6:8] == b"\x00\x00"
    assert frame[8:16] == bytes([8, 7, 6, 5, 4, 3, 2, 1])  # req_id, little-endian
    assert frame[16:20] == (16).to_bytes(4, "little")  # body_len
    assert frame[20:28] == (5).to_bytes(8, "little")  # data_len
    assert frame[28:] == (0x1122334455667788).to_bytes(8, "little") + (5).to_bytes(8, "little")


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


def test_frame_type_numbers_are_stable() -> None:
    """The numbers are on the wire: changing one breaks compatibility with every peer."""
    assert {t.name: int(t) for t in proto.FrameType} == {
        "HELLO": 1, "WELCOME": 2, "REGIONS": 3, "QUERY_REGIONS": 4, "READ": 5, "WRITE": 6, "DATA": 7,
        "ACK": 8, "ERROR": 9, "NOTIFY": 10, "PING": 11, "PONG": 12, "BYE": 13, "QUERY_META": 14, "META": 15,
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


@pytest.mark.parametrize("kind", [0, 16, 99, 255])
def test_unknown_frame_type(kind: int) -> None:
    with pytest.raises(ProtocolError, match="unknown frame type"):
        proto.parse_header(header(kind))


@pytest.mark.parametrize(("flags", "reserved"), [(1, 0), (0x80, 0), (0, 1), (0, 0x8000), (3, 3)])
def test_reserved_bits(flags: int, reserved: int) -> None:
    with pytest.raises(ProtocolError, match="reserved"):
        proto.parse_header(header(proto.FrameType.PING, flags=flags, reserved=reserved))


def test_body_size_limit() -> None:
    assert proto.parse_header(header(proto.FrameType.HELLO, body_len=MAX_BODY)).body_len == MAX_BODY
    for body_len in (MAX_BODY + 1, 0xFFFFFFFF):
        with pytest.raises(ProtocolError, match="exceeds"):
            proto.parse_header(header(proto.FrameType.HELLO, body_len=body_len))


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


@pytest.mark.parametrize(
    "kind", [proto.FrameType.QUERY_REGIONS, proto.FrameType.ACK, proto.FrameType.PING, proto.FrameType.PONG, proto.FrameType.DATA]
)
def test_empty_bodied_frames_refuse_a_body(kind: proto.FrameType) -> None:
    with pytest.raises(ProtocolError, match="empty body"):
        _parse(kind, b"x")


@pytest.mark.parametrize("kind", [proto.FrameType.HELLO, proto.FrameType.WELCOME], ids=lambda t: t.name)
@pytest.mark.parametrize("body", [b"", b"{", b"[1]", b'"text"', b"42", b"\xff\xfe{}", b"null"], ids=repr)
def test_control_bodies_must_be_json_objects(kind: proto.FrameType, body: bytes) -> None:
    with pytest.raises(ProtocolError, match="JSON"):
        _parse(kind, body)


@pytest.mark.parametrize("kind", [proto.FrameType.REGIONS, proto.FrameType.READ, proto.FrameType.WRITE], ids=lambda t: t.name)
@pytest.mark.parametrize("size", [1, 8, 15, 17, 24])
def test_descriptor_bodies_must_be_pairs(kind: proto.FrameType, size: int) -> None:
    with pytest.raises(ProtocolError, match="pairs"):
        _parse(kind, bytes(size), data_len=0)


@pytest.mark.parametrize("kind", [proto.FrameType.READ, proto.FrameType.WRITE], ids=lambda t: t.name)
def test_requests_need_descriptors(kind: proto.FrameType) -> None:
    with pytest.raises(ProtocolError, match="without descriptors"):
        _parse(kind, b"")


def _pairs(*rows: tuple[int, int]) -> bytes:
    return _descs(*rows).astype("<u8").tobytes()


@pytest.mark.parametrize("kind", [proto.FrameType.READ, proto.FrameType.WRITE], ids=lambda t: t.name)
def test_zero_length_descriptor(kind: proto.FrameType) -> None:
    with pytest.raises(ProtocolError, match="zero-length"):
        _parse(kind, _pairs((4096, 16), (8192, 0)), data_len=16)


@pytest.mark.parametrize("kind", [proto.FrameType.READ, proto.FrameType.WRITE], ids=lambda t: t.name)
@pytest.mark.parametrize("row", [(U64_MAX, 1), (U64_MAX - 15, 17), (4096, U64_MAX), (1 << 63, 1 << 63)])
def test_descriptor_wrapping_around_the_address_space(kind: proto.FrameType, row: tuple[int, int]) -> None:
    # (addr + len) mod 2**64 would pass a region check; the parser must refuse it.
    with pytest.raises(ProtocolError, match="wraps"):
        _parse(kind, _pairs(row), data_len=(row[1]) % (1 << 64))


def test_descriptor_ending_at_the_top_of_the_address_space() -> None:
    message = _parse(proto.FrameType.READ, _pairs((U64_MAX - 16, 16)))
    assert isinstance(message, proto.ReadRequest)


def test_write_lengths_adding_up_past_2_64() -> None:
    with pytest.raises(ProtocolError, match="2\\*\\*64"):
        _parse(proto.FrameType.WRITE, _pairs((4096, 1 << 63), (4096, 1 << 63)), data_len=0)


@pytest.mark.parametrize("data_len", [0, 99, 101, 1 << 40])
def test_write_data_length_must_match_its_descriptors(data_len: int) -> None:
    with pytest.raises(ProtocolError, match="cover 100 bytes"):
        _parse(proto.FrameType.WRITE, _pairs((4096, 60), (9000, 40)), data_len=data_len)


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


@pytest.mark.parametrize(("kind", "what"), [(proto.FrameType.BYE, "BYE"), (proto.FrameType.QUERY_META, "QUERY_META")])
def test_text_bodies_must_be_utf8(kind: proto.FrameType, what: str) -> None:
    with pytest.raises(ProtocolError, match=f"{what} .*UTF-8"):
        _parse(kind, b"\x80abc")


def test_encode_refuses_oversized_notifications() -> None:
    for notify in (proto.Notify(1, "n" * (MAX_NAME + 1), ""), proto.Notify(1, "", "\u00e9" * (MAX_NAME // 2 + 1))):
        with pytest.raises(ValueError):
            proto.encode(notify)


def test_errors_are_protocol_errors_not_crashes() -> None:
    """Random bodies for every frame type raise ProtocolError or parse — nothing else."""
    rng = np.random.default_rng(0)
    for kind in proto.FrameType:
        for _ in range(200):
            body = rng.integers(0, 256, int(rng.integers(0, 64)), dtype=np.uint8).tobytes()
            data_len = int(rng.integers(0, 1 << 20)) if kind in (proto.FrameType.WRITE, proto.FrameType.DATA) else 0
            try:
                _parse(kind, body, data_len)
            except ProtocolError:
                pass
