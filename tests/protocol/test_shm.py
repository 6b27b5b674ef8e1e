"""The shm side channel's messages, sans I/O: requests and grants round-trip, grants split into
messages the kernel can carry, and every malformed message (or one that lacks this connection's
proof, or whose descriptors do not match) is refused."""

from __future__ import annotations

import struct

import pytest

from hixl import ProtocolError
from hixl._protocol import shm

PROOF = bytes(range(16))
ADDR = 0x7F00_0000_0000


def _grants(n: int) -> list[shm.Grant]:
    return [shm.Grant(ADDR + i * 8192, 4096 + i, i % 2 == 0) for i in range(n)]


def test_a_request_round_trips_and_is_exactly_its_size() -> None:
    binding = bytes(range(100, 116))
    request = shm.encode_request(binding)
    assert len(request) == shm.REQUEST_SIZE == 24
    assert shm.decode_request(request) == binding


@pytest.mark.parametrize(
    "data",
    [b"", b"HXSM", shm.encode_request(PROOF)[:-1], shm.encode_request(PROOF) + b"\0", b"XXXX" + bytes(20),
     struct.pack("<4sHH16s", b"HXSM", 2, 0, PROOF), struct.pack("<4sHH16s", b"HXSM", 1, 1, PROOF)],
    ids=["empty", "short", "one-short", "one-long", "magic", "version", "reserved"],
)
def test_malformed_requests_are_refused(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        shm.decode_request(data)


@pytest.mark.parametrize("count", [0, 1, shm.MAX_PER_MESSAGE, shm.MAX_PER_MESSAGE + 1, 3 * shm.MAX_PER_MESSAGE + 7])
def test_grants_round_trip_in_messages_the_kernel_can_carry(count: int) -> None:
    grants = _grants(count)
    messages = shm.encode_grants(PROOF, grants)
    assert len(messages) == max(1, -(-count // shm.MAX_PER_MESSAGE))
    got: list[shm.Grant] = []
    for i, message in enumerate(messages):
        assert len(message) <= shm.MAX_MESSAGE
        in_message = min(shm.MAX_PER_MESSAGE, count - len(got))
        last = i == len(messages) - 1
        reply = shm.decode_reply(message, in_message + last, PROOF)  # the LAST one has the liveness pipe too
        assert reply.last == last
        got += reply.grants
    assert got == grants


def test_a_refusal_says_why() -> None:
    refusal = shm.encode_refusal("uid 7 is not allowed" + "x" * 1000)
    with pytest.raises(shm.Refused, match="uid 7 is not allowed") as refused:
        shm.decode_reply(refusal, 0, PROOF)
    assert len(str(refused.value)) == shm.MAX_REASON


def test_a_reply_without_this_connections_proof_is_refused() -> None:
    (message,) = shm.encode_grants(bytes(16), _grants(1))
    with pytest.raises(ProtocolError, match="prove"):
        shm.decode_reply(message, 2, PROOF)


@pytest.mark.parametrize("descriptors", [0, 1, 3])
def test_descriptors_must_match_the_grants(descriptors: int) -> None:
    (message,) = shm.encode_grants(PROOF, _grants(1))  # one grant, plus the liveness pipe: 2
    with pytest.raises(ProtocolError, match="descriptors"):
        shm.decode_reply(message, descriptors, PROOF)


def _reply(addr: int, length: int, flags: int, status: int = 0, reply_flags: int = 1) -> bytes:
    return struct.pack("<4sHBBI16s", b"HXSM", 1, status, reply_flags, 1, PROOF) + struct.pack("<QQQ", addr, length, flags)


@pytest.mark.parametrize(
    ("data", "descriptors"),
    [
        (_reply(0, 4096, 0), 2),  # address 0
        (_reply(ADDR + 1, 4096, 0), 2),  # not page-aligned
        (_reply(ADDR, 0, 0), 2),  # empty
        (_reply(ADDR, (1 << 64) - ADDR, 0), 2),  # wraps past the top of the address space
        (_reply(ADDR, 4096, 2), 2),  # unknown grant flags
        (_reply(ADDR, 4096, 0, status=7), 2),  # unknown status
        (_reply(ADDR, 4096, 0, reply_flags=2), 2),  # unknown reply flags
        (_reply(ADDR, 4096, 0)[:-1], 2),  # cut short
        (_reply(ADDR, 4096, 0) + b"\0" * 24, 2),  # more grants than it says
        (b"HXSM" + bytes(shm.MAX_MESSAGE), 2),  # too long
        (struct.pack("<4sHBBI16s", b"HXSM", 1, 1, 1, 1, bytes(16)), 0),  # a refusal naming grants
        (struct.pack("<4sHBBI16s", b"HXSM", 1, 0, 1, shm.MAX_PER_MESSAGE + 1, PROOF), shm.MAX_PER_MESSAGE + 2),
    ],
    ids=["addr-0", "unaligned", "empty", "wraps", "grant-flags", "status", "flags", "short", "long", "huge",
         "refusal-with-grants", "too-many"],
)
def test_malformed_replies_are_refused(data: bytes, descriptors: int) -> None:
    with pytest.raises(ProtocolError):
        shm.decode_reply(data, descriptors, PROOF)
