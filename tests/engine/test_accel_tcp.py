"""TCP's latency path in hixl._accel (tcp_send, tcp_reply, tcp_land, tcp_request): the C extension
and its pure-Python twin move exactly the bytes asked for, stop waiting when told, recognise only
the frames the protocol's own parser accepts (with the same fields), and agree on every input.
Real sockets (a connected pair), no mocks; a peer that stalls is one that stops writing."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator
from types import ModuleType

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hixl import _protocol as proto
from hixl._exceptions import ProtocolError
from hixl._accel import pure
from hixl._protocol.connection import Connection, ConnState, Role
from hixl._protocol.frames import HEADER_SIZE, encode_header, parse_body, parse_header_at

F = proto.FrameType


def _native() -> ModuleType | None:
    try:
        from hixl._accel import _native
    except ImportError:
        return None
    return _native


IMPLS = [pure] + ([_native()] if _native() is not None else [])


@pytest.fixture(params=IMPLS, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def impl(request: pytest.FixtureRequest) -> ModuleType:
    return request.param


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """Two connected TCP sockets on 127.0.0.1; ours (the first) non-blocking, as hixl's are."""
    listener = socket.create_server(("127.0.0.1", 0))
    peer = socket.create_connection(listener.getsockname(), timeout=5)
    ours, _ = listener.accept()
    listener.close()
    ours.setblocking(False)
    peer.settimeout(5)
    yield ours, peer
    ours.close()
    peer.close()


def _addr(buf: np.ndarray, offset: int = 0) -> int:
    return int(buf.ctypes.data) + offset


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "peer closed early"
        out += chunk
    return out


# -- tcp_send ----------------------------------------------------------------------------------
def test_tcp_send_sends_the_frame_then_the_ranges_from_memory(impl: ModuleType, pair: tuple[socket.socket, socket.socket]) -> None:
    ours, peer = pair
    mem = np.arange(64, dtype=np.uint8)
    ranges = [(_addr(mem, 3), 5), (_addr(mem, 40), 2)]
    sent = impl.tcp_send(ours, b"FRAME", ranges, 0, time.monotonic() + 5)
    assert sent == 12
    assert _recv_exactly(peer, 12) == b"FRAME" + bytes(mem[3:8]) + bytes(mem[40:42])


def test_tcp_send_resumes_from_an_offset(impl: ModuleType, pair: tuple[socket.socket, socket.socket]) -> None:
    ours, peer = pair
    mem = np.arange(16, dtype=np.uint8)
    assert impl.tcp_send(ours, b"HEAD", [(_addr(mem), 8)], 6, time.monotonic() + 5) == 12
    assert _recv_exactly(peer, 6) == bytes(mem[2:8])


def test_tcp_send_to_a_peer_that_reads_nothing_stops_at_until(impl: ModuleType, pair: tuple[socket.socket, socket.socket]) -> None:
    ours, peer = pair
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    big = np.zeros(16 << 20, dtype=np.uint8)
    started = time.monotonic()
    sent = impl.tcp_send(ours, b"F", [(_addr(big), big.nbytes)], 0, started + 0.2)
    waited = time.monotonic() - started
    assert 0 < sent < big.nbytes + 1
    assert 0.15 <= waited < 2.0


def test_tcp_send_refuses_what_is_not_a_short_list_of_ranges(impl: ModuleType, pair: tuple[socket.socket, socket.socket]) -> None:
    ours, _ = pair
    for bad in ([(1, 2, 3)], [(1, -1)], [(1 << 64, 1)], [(0, 1)] * (impl.TCP_RANGES + 1), ((0, 1),)):
        with pytest.raises(ValueError):
            impl.tcp_send(ours, b"x", bad, 0, time.monotonic() + 1)
    with pytest.raises(ValueError):
        impl.tcp_send(ours, b"x", [], 2, time.monotonic() + 1)  # an offset past the end


# -- tcp_reply ---------------------------------------------------------------------------------
def _reply(impl: ModuleType, ours: socket.socket, req_id: int, wait: float = 2.0) -> tuple[int, int, int]:
    return impl.tcp_reply(ours, bytearray(16 << 10), 0, req_id, time.monotonic() + wait)


def test_tcp_reply_recognises_the_expected_data_and_ack(impl: ModuleType, pair: tuple[socket.socket, socket.socket]) -> None:
    ours, peer = pair
    peer.sendall(encode_header(F.DATA, 7, 0, 8) + b"12345678")
    assert _reply(impl, ours, 7) == (F.DATA, HEADER_SIZE + 8, 8)
    peer.sendall(encode_header(F.ACK, 9, 0, 0))
    assert _reply(impl, ours, 9) == (F.ACK, HEADER_SIZE, 0)


@pytest.mark.parametrize(
    "frame",
    [
        encode_header(F.DATA, 8, 0, 8),  # another request's
        encode_header(F.ERROR, 7, 0, 0),  # a refusal
        encode_header(F.PING, 7, 0, 0),
        encode_header(F.DATA, 7, 4, 8),  # a body on a DATA
        encode_header(F.ACK, 7, 0, 3),  # data on an ACK
        b"HXL2" + encode_header(F.DATA, 7, 0, 8)[4:],  # bad magic
        encode_header(F.DATA, 7, 0, 8)[:5] + b"\x01" + encode_header(F.DATA, 7, 0, 8)[6:],  # flags
    ],
    ids=["other-id", "error", "ping", "body", "ack-data", "magic", "flags"],
)
def test_tcp_reply_leaves_anything_else_to_the_connection(
    impl: ModuleType, pair: tuple[socket.socket, socket.socket], frame: bytes
) -> None:
    ours, peer = pair
    peer.sendall(frame)
    assert _reply(impl, ours, 7) == (0, len(frame), 0)


def test_tcp_reply_from_a_peer_that_stalls_mid_header_waits_until_told(
    impl: ModuleType, pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, peer = pair
    peer.sendall(encode_header(F.ACK, 1, 0, 0)[:10])
    scratch = bytearray(1 << 12)
    started = time.monotonic()
    kind, have, _ = impl.tcp_reply(ours, scratch, 0, 1, started + 0.2)
    assert (kind, have) == (impl.TCP_WAIT, 10)
    assert 0.15 <= time.monotonic() - started < 2.0
    peer.sendall(encode_header(F.ACK, 1, 0, 0)[10:])  # the rest: resumed from what it holds
    assert impl.tcp_reply(ours, scratch, have, 1, time.monotonic() + 2) == (F.ACK, HEADER_SIZE, 0)


@pytest.mark.parametrize("spin", [0.0, 0.3])
def test_tcp_reply_spins_for_its_reply_only_as_long_as_told(
    impl: ModuleType, pair: tuple[socket.socket, socket.socket], spin: float
) -> None:
    """A reply due 0.15 s later: with ``spin`` 0.3 s it is waited for by trying again (the
    process burns CPU meanwhile), with 0 asleep (it burns almost none); caught either way."""
    ours, peer = pair
    answer = threading.Timer(0.15, peer.sendall, [encode_header(F.ACK, 3, 0, 0)])
    cpu = time.process_time()
    answer.start()
    assert impl.tcp_reply(ours, bytearray(1 << 12), 0, 3, time.monotonic() + 5, spin) == (F.ACK, HEADER_SIZE, 0)
    burnt = time.process_time() - cpu
    answer.join()
    assert burnt > 0.03 if spin else burnt < 0.03, f"{burnt:.3f} s of CPU while waiting"


def test_tcp_reply_reports_the_end_of_the_stream(impl: ModuleType, pair: tuple[socket.socket, socket.socket]) -> None:
    ours, peer = pair
    peer.sendall(b"HXL")
    peer.shutdown(socket.SHUT_WR)
    assert _reply(impl, ours, 1) == (impl.TCP_EOF, 3, 0)


# -- tcp_land ----------------------------------------------------------------------------------
def test_tcp_land_takes_what_came_with_the_header_then_reads_the_rest_straight_in(
    impl: ModuleType, pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, peer = pair
    dst = np.zeros(64, dtype=np.uint8)
    scratch = bytearray(64)
    scratch[10:16] = b"abcdef"
    peer.sendall(b"ghijkl" + b"NEXT")
    ranges = [(_addr(dst, 0), 4), (_addr(dst, 32), 8)]
    landed, end = impl.tcp_land(ours, scratch, 10, 16, ranges, time.monotonic() + 2)
    assert (landed, end) == (12, 16)
    assert bytes(dst[0:4]) == b"abcd" and bytes(dst[32:40]) == b"efghijkl"
    assert not dst[4:32].any() and not dst[40:].any()  # nothing outside the ranges
    assert _recv_exactly(ours_blocking(ours), 4) == b"NEXT"  # nothing read beyond the data


def ours_blocking(sock: socket.socket) -> socket.socket:
    sock.settimeout(5)
    return sock


def test_tcp_land_leaves_what_follows_the_data_in_scratch(impl: ModuleType, pair: tuple[socket.socket, socket.socket]) -> None:
    ours, _ = pair
    dst = np.zeros(8, dtype=np.uint8)
    scratch = bytearray(b"....12345678PING")
    assert impl.tcp_land(ours, scratch, 4, len(scratch), [(_addr(dst), 8)], time.monotonic() + 1) == (8, 12)
    assert bytes(dst) == b"12345678"


def test_tcp_land_from_a_stalled_peer_lands_nothing_after_until(impl: ModuleType, pair: tuple[socket.socket, socket.socket]) -> None:
    ours, peer = pair
    dst = np.zeros(16, dtype=np.uint8)
    peer.sendall(b"1234")
    started = time.monotonic()
    landed, _ = impl.tcp_land(ours, bytearray(8), 0, 0, [(_addr(dst), 16)], started + 0.2)
    assert landed == 4 and bytes(dst[:4]) == b"1234"
    assert 0.15 <= time.monotonic() - started < 2.0
    peer.sendall(b"5678")
    time.sleep(0.05)
    assert impl.tcp_land(ours, bytearray(8), 0, 0, [(_addr(dst, 4), 12)], time.monotonic() - 1) == (0, 0)
    assert not dst[4:].any()  # past until, not a byte read into memory


@pytest.mark.parametrize("spin", [0.0, 0.3])
def test_tcp_land_spins_for_the_rest_only_as_long_as_told(
    impl: ModuleType, pair: tuple[socket.socket, socket.socket], spin: float
) -> None:
    """Half the data now, the rest 0.15 s later: with ``spin`` 0.3 s the rest is waited for by
    trying again (CPU burnt), with 0 asleep; all of it lands either way."""
    ours, peer = pair
    dst = np.zeros(16, dtype=np.uint8)
    peer.sendall(b"12345678")
    rest = threading.Timer(0.15, peer.sendall, [b"abcdefgh"])
    cpu = time.process_time()
    rest.start()
    assert impl.tcp_land(ours, bytearray(8), 0, 0, [(_addr(dst), 16)], time.monotonic() + 5, spin) == (16, 0)
    burnt = time.process_time() - cpu
    rest.join()
    assert bytes(dst) == b"12345678abcdefgh"
    assert burnt > 0.03 if spin else burnt < 0.03, f"{burnt:.3f} s of CPU while waiting"


def test_tcp_land_reports_a_peer_that_closes_mid_data(impl: ModuleType, pair: tuple[socket.socket, socket.socket]) -> None:
    ours, peer = pair
    dst = np.zeros(16, dtype=np.uint8)
    peer.sendall(b"12")
    peer.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionResetError):
        impl.tcp_land(ours, bytearray(8), 0, 0, [(_addr(dst), 16)], time.monotonic() + 2)


# -- tcp_request: recognised only what the parser accepts, with the same fields ------------------
def _request(kind: int, req_id: int, deadline: int, pairs: list[tuple[int, int]], data_len: int, body_extra: int = 0) -> bytes:
    body = struct.pack("<q", deadline) + b"".join(struct.pack("<QQ", a, n) for a, n in pairs)
    return encode_header(kind, req_id, len(body) + body_extra, data_len) + body


def _parsed(raw: bytes) -> tuple[int, int, int, list[tuple[int, int]], int] | None:
    """What the protocol's parser makes of the first frame in ``raw``; None if it refuses it or it is not whole."""
    if len(raw) < HEADER_SIZE:
        return None
    try:
        header = parse_header_at(raw, 0)
        if len(raw) < HEADER_SIZE + header.body_len:
            return None
        message = parse_body(header, raw[HEADER_SIZE : HEADER_SIZE + header.body_len])
    except ProtocolError:
        return None
    if not isinstance(message, (proto.ReadRequest, proto.WriteRequest)):
        return None
    pairs = [(int(a), int(n)) for a, n in message.descs.tolist()]
    return int(header.type), message.req_id, message.deadline, pairs, header.data_len


_u64 = st.one_of(st.integers(0, 1 << 20), st.integers((1 << 64) - (1 << 20), (1 << 64) - 1), st.integers(0, (1 << 64) - 1))
_frames = st.builds(
    _request,
    kind=st.sampled_from([F.READ, F.WRITE, F.ACK, 0, 99]),
    req_id=st.integers(0, 1 << 40),
    deadline=st.integers(-(1 << 63), (1 << 63) - 1),
    pairs=st.lists(st.tuples(_u64, _u64), min_size=0, max_size=10),
    data_len=st.one_of(st.just(0), st.integers(0, 1 << 16), _u64),
    body_extra=st.sampled_from([0, 0, 0, 1, -1, 16]),
)


@settings(max_examples=400, deadline=None)
@given(frame=_frames, cut=st.integers(0, 400), tail=st.binary(max_size=8))
def test_tcp_request_recognises_exactly_what_the_parser_accepts(frame: bytes, cut: int, tail: bytes) -> None:
    raw = (frame + tail)[: max(cut, 1)] if cut < len(frame) else frame + tail
    verdict = _parsed(raw)
    answers = []
    for impl in IMPLS:
        ours, peer = socket.socketpair()  # (a stream socket whose sends are all readable at once)
        with ours, peer:
            peer.sendall(raw)
            ours.setblocking(False)
            answers.append(impl.tcp_request(ours, bytearray(16 << 10)))
    assert all(a == answers[0] for a in answers), answers  # the twins agree
    kind, have, end, req_id, deadline, pairs, data_len = answers[0]
    assert have == len(raw)
    if kind > 0:
        small = verdict is not None and 1 <= len(verdict[3]) <= proto.frames.SMALL_DESCS
        assert small and verdict == (kind, req_id, deadline, pairs, data_len)
        assert end == HEADER_SIZE + 8 + 16 * len(pairs)
    elif verdict is not None and len(verdict[3]) <= proto.frames.SMALL_DESCS:
        pytest.fail(f"the parser accepts {verdict}, tcp_request did not recognise it")


def test_tcp_request_on_an_empty_socket_and_at_its_end(impl: ModuleType, pair: tuple[socket.socket, socket.socket]) -> None:
    ours, peer = pair
    assert impl.tcp_request(ours, bytearray(16 << 10))[0] == impl.TCP_WAIT
    peer.shutdown(socket.SHUT_WR)
    time.sleep(0.05)
    assert impl.tcp_request(ours, bytearray(16 << 10))[0] == impl.TCP_EOF


def test_the_twins_share_their_constants() -> None:
    for impl in IMPLS:
        assert (impl.TCP_WAIT, impl.TCP_EOF, impl.TCP_RANGES) == (pure.TCP_WAIT, pure.TCP_EOF, pure.TCP_RANGES)


# -- the connection's accounting for what the driver recognised ----------------------------------
def _open(role: Role) -> Connection:
    """A connection in OPEN, as a handshake leaves it (the tests of the handshake are elsewhere)."""
    conn = Connection(role)
    conn.state = ConnState.OPEN
    return conn


@pytest.mark.parametrize(
    "kind, req_id, data_len",
    [(F.DATA, 1, 8), (F.DATA, 1, 9), (F.DATA, 2, 8), (F.ACK, 3, 0), (F.ACK, 1, 0), (F.DATA, 3, 0)],
    ids=["data", "data-wrong-length", "data-unknown-id", "ack", "ack-to-a-read", "data-to-a-write"],
)
def test_took_frame_gives_the_verdict_next_event_gives(kind: F, req_id: int, data_len: int) -> None:
    outcomes = []
    for straight in (False, True):
        conn = _open(Role.INITIATOR)
        conn.transfer_frame(False, 1, 0, [(4096, 8)], 0)  # a READ of 8 B
        conn.transfer_frame(True, 3, 0, [(4096, 8)], 8)  # a WRITE of 8 B
        try:
            if straight:
                conn.took_frame(kind, req_id, data_len)
            else:
                conn.receive_data(encode_header(kind, req_id, 0, data_len))
                conn.next_event()
            outcomes.append(("accepted", conn.data_left, conn.outstanding, conn.state))
        except ProtocolError:
            outcomes.append(("refused", conn.state))
    assert outcomes[0] == outcomes[1]


def test_took_frame_on_the_target_refuses_request_id_zero_as_the_parser_does() -> None:
    conn = _open(Role.TARGET)
    with pytest.raises(ProtocolError):
        conn.took_frame(F.READ, 0, 0)
    assert conn.state is ConnState.CLOSED


def test_took_frame_only_with_nothing_buffered_and_only_for_the_fast_frames() -> None:
    conn = _open(Role.INITIATOR)
    conn.receive_data(b"x")
    with pytest.raises(RuntimeError):
        conn.took_frame(F.ACK, 1, 0)
    with pytest.raises(ValueError):
        _open(Role.INITIATOR).took_frame(F.READ, 1, 0)


def test_reply_frame_is_what_send_makes() -> None:
    conn = _open(Role.TARGET)
    assert conn.reply_frame(F.DATA, 5, 8) == proto.encode(proto.Data(5, 8))
    assert conn.reply_frame(F.ACK, 5) == proto.encode(proto.Ack(5))
    with pytest.raises(ProtocolError):
        _open(Role.INITIATOR).reply_frame(F.ACK, 5)
