"""Property-based fuzzing of the frame codec (skipped without hypothesis)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from hixl import ProtocolError
from hixl import _protocol as proto

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings
from hypothesis import strategies as st

U64 = st.integers(0, (1 << 64) - 1)
TEXT = st.text(max_size=64)
FAST = settings(max_examples=300, deadline=None)


def _decode(frame: bytes) -> proto.Message:
    header = proto.parse_header(frame[: proto.HEADER_SIZE])
    return proto.parse_body(header, frame[proto.HEADER_SIZE :])


@st.composite
def descriptors(draw: st.DrawFn) -> np.ndarray:
    """Valid (addr, len) pairs: nonzero lengths, no range past 2**64, total below 2**64."""
    n = draw(st.integers(1, 40))
    rows = []
    for _ in range(n):
        length = draw(st.integers(1, 1 << 40))
        addr = draw(st.integers(0, (1 << 64) - 1 - length))
        rows.append((addr, length))
    return np.array(rows, dtype=np.uint64)


JSONABLE = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 53), 1 << 53) | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
MESSAGES = st.one_of(
    st.builds(proto.Hello, st.dictionaries(TEXT, JSONABLE, max_size=5), U64),
    st.builds(proto.Welcome, st.dictionaries(TEXT, JSONABLE, max_size=5), U64),
    st.builds(proto.Regions, descriptors(), U64),
    st.builds(proto.QueryRegions, U64),
    st.builds(proto.ReadRequest, U64, descriptors()),
    descriptors().flatmap(lambda d: st.builds(proto.WriteRequest, U64, st.just(d), st.just(int(d[:, 1].sum())))),
    st.builds(proto.Data, U64, U64),
    st.builds(proto.Ack, U64),
    st.builds(proto.Error, U64, st.integers(0, (1 << 32) - 1), TEXT),
    st.builds(proto.Notify, U64, TEXT, TEXT),
    st.builds(proto.Ping, U64),
    st.builds(proto.Pong, U64),
    st.builds(proto.Bye, U64, TEXT),
    st.builds(proto.QueryMeta, U64, TEXT),
    st.builds(proto.Meta, U64, st.binary(max_size=64)),
)


@FAST
@given(MESSAGES)
def test_round_trip(message: proto.Message) -> None:
    frame = proto.encode(message)
    assert proto.encode(_decode(frame)) == frame


@FAST
@given(st.binary(min_size=proto.HEADER_SIZE, max_size=proto.HEADER_SIZE))
def test_random_headers(raw: bytes) -> None:
    try:
        header = proto.parse_header(raw)
    except ProtocolError:
        return
    assert header.body_len <= proto.frames.MAX_BODY


@FAST
@given(st.sampled_from(list(proto.FrameType)), U64, st.binary(max_size=96), st.integers(0, 1 << 20))
def test_random_bodies(kind: proto.FrameType, req_id: int, body: bytes, data_len: int) -> None:
    """Any body either parses into a message that re-encodes to a valid frame, or is refused."""
    if kind not in (proto.FrameType.WRITE, proto.FrameType.DATA):
        data_len = 0
    raw = struct.pack("<4sBBHQIQ", b"HXL1", kind, 0, 0, req_id, len(body), data_len)
    try:
        message = proto.parse_body(proto.parse_header(raw), body)
    except ProtocolError:
        return
    if isinstance(message, (proto.ReadRequest, proto.WriteRequest)):
        ends = message.descs[:, 0].astype(object) + message.descs[:, 1].astype(object)
        assert all(0 < int(n) for n in message.descs[:, 1]) and max(ends) <= (1 << 64) - 1
    if isinstance(message, (proto.Hello, proto.Welcome)):
        return  # JSON text need not re-encode byte for byte (spacing, escapes)
    assert _decode(proto.encode(message)) is not None


@FAST
@given(st.binary(max_size=200))
def test_random_streams(stream: bytes) -> None:
    """Garbage split into frames never raises anything but ProtocolError."""
    while len(stream) >= proto.HEADER_SIZE:
        try:
            header = proto.parse_header(stream[: proto.HEADER_SIZE])
            end = proto.HEADER_SIZE + header.body_len
            if end > len(stream):
                return
            proto.parse_body(header, stream[proto.HEADER_SIZE : end])
        except ProtocolError:
            return
        stream = stream[end:]
