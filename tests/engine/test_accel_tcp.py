"""TCP's latency path in hixl._accel (tcp_send, tcp_reply, tcp_land, tcp_request, tcp_land_words): the C extension
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
from hixl._memory import Registry
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
    calling thread burns CPU meanwhile), with 0 asleep (it burns almost none); caught either way.
    (The calling thread's CPU, not the process's: threads earlier tests left winding down once
    put 0.06 s on the process's clock during the sleep.)"""
    ours, peer = pair
    answer = threading.Timer(0.15, peer.sendall, [encode_header(F.ACK, 3, 0, 0)])
    cpu = time.thread_time()
    answer.start()
    assert impl.tcp_reply(ours, bytearray(1 << 12), 0, 3, time.monotonic() + 5, spin) == (F.ACK, HEADER_SIZE, 0)
    burnt = time.thread_time() - cpu
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
    cpu = time.thread_time()
    rest.start()
    assert impl.tcp_land(ours, bytearray(8), 0, 0, [(_addr(dst), 16)], time.monotonic() + 5, spin) == (16, 0)
    burnt = time.thread_time() - cpu
    rest.join()
    assert bytes(dst) == b"12345678abcdefgh"
    assert burnt > 0.03 if spin else burnt < 0.03, f"{burnt:.3f} s of CPU while waiting"


def _trickle(peer: socket.socket, data: bytes, piece: int, pause: float) -> threading.Thread:
    """Send ``data`` from another thread, ``piece`` bytes every ``pause`` seconds."""

    def run() -> None:
        for offset in range(0, len(data), piece):
            peer.sendall(data[offset : offset + piece])
            time.sleep(pause)

    sender = threading.Thread(target=run)
    sender.start()
    return sender


def _lowat(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)


def test_tcp_land_waits_for_a_large_datas_bytes_asleep_a_low_water_mark_at_a_time(
    impl: ModuleType, pair: tuple[socket.socket, socket.socket]
) -> None:
    """A DATA of TCP_LOWAT_FROM bytes trickling in: told to spin, a landing would burn a CPU for as
    long as it lasts (and read it a few segments at a time); it sleeps until TCP_LOWAT bytes came
    instead, and spins only for the last of them. The mark is 1 again when it returns."""
    ours, peer = pair
    total = impl.TCP_LOWAT_FROM
    data = np.random.default_rng(5).integers(0, 256, total, dtype=np.uint8).tobytes()
    dst = np.zeros(total, dtype=np.uint8)
    cpu, started = time.thread_time(), time.monotonic()
    sender = _trickle(peer, data, 64 << 10, 0.005)
    landed, _ = impl.tcp_land(ours, bytearray(8), 0, 0, [(_addr(dst), total)], time.monotonic() + 20, 1.0)
    burnt, took = time.thread_time() - cpu, time.monotonic() - started
    sender.join()
    assert landed == total and dst.tobytes() == data
    assert burnt < took / 2, f"{burnt:.3f} s of CPU in {took:.3f} s: it spun for the data"
    assert _lowat(ours) == 1


def test_tcp_land_reads_a_large_datas_last_bytes_though_fewer_than_the_mark(
    impl: ModuleType, pair: tuple[socket.socket, socket.socket]
) -> None:
    """All but a few bytes at once, the rest 0.2 s later: a mark above what is still to come would
    never be reached (the landing would sit out its time); the last bytes land as they come."""
    ours, peer = pair
    total = impl.TCP_LOWAT_FROM
    dst = np.zeros(total, dtype=np.uint8)
    sender = threading.Thread(target=peer.sendall, args=(bytes([7]) * (total - 1000),))
    sender.start()
    rest = threading.Timer(0.2, peer.sendall, [bytes([9]) * 1000])
    rest.start()
    started = time.monotonic()
    landed, _ = impl.tcp_land(ours, bytearray(8), 0, 0, [(_addr(dst), total)], started + 10)
    took = time.monotonic() - started
    sender.join()
    rest.join()
    assert landed == total and (dst[: total - 1000] == 7).all() and (dst[total - 1000 :] == 9).all()
    assert took < 5, f"the last 1000 bytes took {took:.1f} s"


def test_tcp_land_of_a_large_data_from_a_stalled_peer_stops_at_until(
    impl: ModuleType, pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, peer = pair
    total = impl.TCP_LOWAT_FROM
    dst = np.zeros(total, dtype=np.uint8)
    peer.sendall(bytes([3]) * (1 << 20))
    started = time.monotonic()
    landed, _ = impl.tcp_land(ours, bytearray(8), 0, 0, [(_addr(dst), total)], started + 0.3)
    assert landed == 1 << 20 and (dst[: 1 << 20] == 3).all() and not dst[1 << 20 :].any()
    assert 0.25 <= time.monotonic() - started < 3
    assert _lowat(ours) == 1


def test_tcp_land_reports_a_peer_that_closes_mid_data(impl: ModuleType, pair: tuple[socket.socket, socket.socket]) -> None:
    ours, peer = pair
    dst = np.zeros(16, dtype=np.uint8)
    peer.sendall(b"12")
    peer.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionResetError):
        impl.tcp_land(ours, bytearray(8), 0, 0, [(_addr(dst), 16)], time.monotonic() + 2)


# -- tcp_land_words: a target lands a WRITE's data from the socket, whole words only ------------------
def _iovs(*ranges: tuple[int, int]) -> np.ndarray:
    return np.array(ranges, dtype=np.uint64).reshape(-1, 2)


def _settled() -> None:
    time.sleep(0.05)  # (what the peer sent is in our socket)


@pytest.mark.parametrize("done", [0, 3], ids=["from-a-word", "three-bytes-into-one"])
def test_tcp_land_words_takes_only_whole_words_of_what_came(
    impl: ModuleType, pair: tuple[socket.socket, socket.socket], done: int
) -> None:
    """20 bytes of 40 due, ``done`` landed before: only what ends on a word of the data lands, the
    part-word stays in the socket (for the caller's buffer)."""
    ours, peer = pair
    dst = np.zeros(40, dtype=np.uint8)
    peer.sendall(b"a" * 20)
    _settled()
    iovs = _iovs((_addr(dst), 15), (_addr(dst, 15), 25))
    moved = impl.tcp_land_words(ours, iovs, 0, 40, done, 40, time.monotonic() + 5, 1 << 20)
    assert moved == 20 - (done + 20) % 8
    assert bytes(dst[:moved]) == b"a" * moved and not dst[moved:].any()
    assert ours.recv(64) == b"a" * (20 - moved)  # (left for the caller)


def test_tcp_land_words_lands_the_datas_last_bytes_whatever_their_length(
    impl: ModuleType, pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, peer = pair
    dst = np.zeros(16, dtype=np.uint8)
    peer.sendall(b"xyz12345678")
    _settled()
    # Rows from the second one on, the first of them shortened by what landed of it, as IovCursor keeps them.
    iovs = _iovs((_addr(dst), 5), (_addr(dst, 5), 11))
    assert impl.tcp_land_words(ours, iovs, 1, 11, 5, 11, time.monotonic() + 5, 1 << 20) == 11
    assert bytes(dst) == bytes(5) + b"xyz12345678"


def test_tcp_land_words_never_reads_past_want_nor_its_rows(impl: ModuleType, pair: tuple[socket.socket, socket.socket]) -> None:
    ours, peer = pair
    dst = np.zeros(64, dtype=np.uint8)
    peer.sendall(b"b" * 64)
    _settled()
    assert impl.tcp_land_words(ours, _iovs((_addr(dst), 64)), 0, 16, 0, 64, time.monotonic() + 5, 1 << 20) == 16
    assert impl.tcp_land_words(ours, _iovs((_addr(dst, 16), 24)), 0, 48, 16, 48, time.monotonic() + 5, 1 << 20) == 24
    assert bytes(dst[:40]) == b"b" * 40 and not dst[40:].any()
    assert len(ours.recv(64)) == 24


def test_tcp_land_words_reads_in_pieces_of_at_most_piece(impl: ModuleType, pair: tuple[socket.socket, socket.socket]) -> None:
    """A piece is what one readv takes: all of it still lands, piece after piece."""
    ours, peer = pair
    dst = np.zeros(100, dtype=np.uint8)
    peer.sendall(bytes(range(100)))
    _settled()
    assert impl.tcp_land_words(ours, _iovs((_addr(dst), 100)), 0, 100, 0, 100, time.monotonic() + 5, 8) == 100
    assert bytes(dst) == bytes(range(100))


def test_tcp_land_words_lands_nothing_once_until_passed(impl: ModuleType, pair: tuple[socket.socket, socket.socket]) -> None:
    ours, peer = pair
    dst = np.zeros(16, dtype=np.uint8)
    peer.sendall(b"c" * 16)
    _settled()
    assert impl.tcp_land_words(ours, _iovs((_addr(dst), 16)), 0, 16, 0, 16, time.monotonic() - 1, 1 << 20) == 0
    assert not dst.any()


@pytest.mark.parametrize("spin", [0.0, 0.3])
def test_tcp_land_words_waits_for_more_only_by_spinning_and_only_as_long_as_told(
    impl: ModuleType, pair: tuple[socket.socket, socket.socket], spin: float
) -> None:
    """A word now, the next 0.15 s later: with ``spin`` 0.3 s that one is tried for (CPU burnt)
    and lands too; with 0 the call returns with what came, at once — it never sleeps."""
    ours, peer = pair
    dst = np.zeros(16, dtype=np.uint8)
    peer.sendall(b"12345678")
    _settled()
    rest = threading.Timer(0.15, peer.sendall, [b"abcdefgh"])
    cpu, start = time.thread_time(), time.monotonic()
    rest.start()
    moved = impl.tcp_land_words(ours, _iovs((_addr(dst), 16)), 0, 16, 0, 16, time.monotonic() + 5, 1 << 20, spin)
    took, burnt = time.monotonic() - start, time.thread_time() - cpu
    rest.join()
    if spin:
        assert moved == 16 and bytes(dst) == b"12345678abcdefgh" and burnt > 0.03
    else:
        assert moved == 8 and took < 0.1 and burnt < 0.03


def test_tcp_land_words_waits_out_a_part_word_while_it_spins(impl: ModuleType, pair: tuple[socket.socket, socket.socket]) -> None:
    """Mid-stream the rest of a part-word comes with the next segment: within ``spin`` the call
    waits for it (and lands the word whole) rather than hand the part to the caller's buffer."""
    ours, peer = pair
    dst = np.zeros(16, dtype=np.uint8)
    peer.sendall(b"12345678abc")
    _settled()
    rest = threading.Timer(0.1, peer.sendall, [b"defgh"])
    rest.start()
    moved = impl.tcp_land_words(ours, _iovs((_addr(dst), 16)), 0, 16, 0, 16, time.monotonic() + 5, 1 << 20, 0.5)
    rest.join()
    assert moved == 16 and bytes(dst) == b"12345678abcdefgh"


def test_tcp_land_words_reports_a_peer_that_closes_mid_data(impl: ModuleType, pair: tuple[socket.socket, socket.socket]) -> None:
    ours, peer = pair
    dst = np.zeros(16, dtype=np.uint8)
    peer.sendall(b"12345678")
    peer.shutdown(socket.SHUT_WR)
    _settled()
    with pytest.raises(ConnectionResetError):
        impl.tcp_land_words(ours, _iovs((_addr(dst), 16)), 0, 16, 0, 16, time.monotonic() + 2, 1 << 20, 0.01)
    assert bytes(dst[:8]) == b"12345678"


@pytest.mark.parametrize(
    "args",
    [
        (np.zeros((1, 3), dtype=np.uint64), 0, 8, 0, 8, 8),
        (np.zeros((1, 2), dtype=np.int64), 0, 8, 0, 8, 8),
        (_iovs((0, 8)), 2, 8, 0, 8, 8),
        (_iovs((0, 8)), 0, 9, 0, 8, 8),
        (_iovs((0, 8)), 0, 8, 0, 8, 4),
        (_iovs((0, 8)), 0, -1, 0, 8, 8),
    ],
    ids=["three-columns", "signed", "first-past-the-rows", "want-above-left", "piece-under-a-word", "negative"],
)
def test_tcp_land_words_refuses_bad_arguments(impl: ModuleType, pair: tuple[socket.socket, socket.socket], args: tuple) -> None:
    iovs, first, want, done, left, piece = args
    with pytest.raises((TypeError, ValueError)):
        impl.tcp_land_words(pair[0], iovs, first, want, done, left, time.monotonic() + 1, piece)


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
    kind, have, end, req_id, deadline, pairs, data_len, unsent = answers[0]
    assert have == len(raw) and unsent is None  # (served only when given the registry)
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


# -- tcp_request given the registry: the C twin serves a READ or WRITE every rule lets through ---
@pytest.fixture
def registry() -> Iterator[tuple[Registry, np.ndarray, np.ndarray, np.ndarray]]:
    """A registry with a buffer registered read-only (a pattern in it: what a READ may read), one
    registered read-write (what a WRITE may write), and a buffer left unregistered."""
    readable = np.arange(1 << 15, dtype=np.uint32).view(np.uint8).copy()
    writable = np.zeros(1 << 17, dtype=np.uint8)
    unregistered = np.full(4096, 7, dtype=np.uint8)
    reg = Registry()
    reg.register(readable, access="r")
    reg.register(writable, access="rw")
    yield reg, readable, writable, unregistered


def _read_of(req_id: int, pairs: list[tuple[int, int]], deadline: int = 0) -> bytes:
    return _request(F.READ, req_id, deadline, pairs, 0)


def _write_of(req_id: int, pairs: list[tuple[int, int]], data: bytes, deadline: int = 0) -> bytes:
    return _request(F.WRITE, req_id, deadline, pairs, len(data)) + data


def test_tcp_request_serves_a_read_every_rule_lets_through(
    impl: ModuleType, pair: tuple[socket.socket, socket.socket], registry: tuple[Registry, np.ndarray, np.ndarray, np.ndarray]
) -> None:
    ours, peer = pair
    reg, buf, _, _ = registry
    pairs = [(_addr(buf, 100), 8), (_addr(buf, 5000), 300)]
    soon = int(time.monotonic() * 1e6) + 10_000_000
    frame = _read_of(42, pairs, soon)
    peer.sendall(frame + b"NEXT")  # (what follows it stays in scratch for the connection)
    time.sleep(0.05)
    scratch = bytearray(16 << 10)
    kind, have, end, req_id, deadline, got, data_len, unsent = impl.tcp_request(ours, scratch, reg)
    assert (kind, have, end, req_id, deadline, data_len) == (F.READ, len(frame) + 4, len(frame), 42, soon, 0)
    if impl is pure:  # the pure twin serves none: the caller's path does, with a hold on the ranges
        assert unsent is None and got == pairs
        return
    assert unsent == b"" and got is None
    want = encode_header(F.DATA, 42, 0, 308) + buf[100:108].tobytes() + buf[5000:5300].tobytes()
    assert _recv_exactly(peer, len(want)) == want
    assert bytes(scratch[end:have]) == b"NEXT"


def test_tcp_request_serves_a_write_every_rule_lets_through(
    impl: ModuleType, pair: tuple[socket.socket, socket.socket], registry: tuple[Registry, np.ndarray, np.ndarray, np.ndarray]
) -> None:
    ours, peer = pair
    reg, _, buf, _ = registry
    pairs = [(_addr(buf, 8), 5), (_addr(buf, 4096), 3), (_addr(buf, 4096), 2)]  # (in order: the last wins)
    frame = _write_of(7, pairs, b"hello" + b"abc" + b"XY")
    peer.sendall(frame + b"NEXT")
    time.sleep(0.05)
    scratch = bytearray(16 << 10)
    kind, have, end, req_id, _, got, data_len, unsent = impl.tcp_request(ours, scratch, reg)
    assert (kind, have, end, req_id, data_len) == (F.WRITE, len(frame) + 4, len(frame) - 10, 7, 10)
    if impl is pure:
        assert unsent is None and got == pairs and not buf.any()
        return
    assert unsent == b"" and got is None
    assert bytes(buf[8:13]) == b"hello" and bytes(buf[4096:4099]) == b"XYc" and int(buf.sum()) == sum(b"helloXYc")
    want = encode_header(F.ACK, 7, 0, 0)
    assert _recv_exactly(peer, len(want)) == want
    assert bytes(scratch[end + data_len : have]) == b"NEXT"


def test_tcp_request_serves_nothing_a_rule_refuses(
    impl: ModuleType, pair: tuple[socket.socket, socket.socket], registry: tuple[Registry, np.ndarray, np.ndarray, np.ndarray]
) -> None:
    ours, peer = pair
    reg, buf, rw, unregistered = registry
    ok, rw_ok = [(_addr(buf), 8)], [(_addr(rw), 8)]
    refused = {
        "no registry given": (_read_of(1, ok), None),
        "request id 0": (_read_of(0, ok), reg),
        "past its deadline": (_read_of(1, ok, 1), reg),
        "unregistered memory": (_read_of(1, [(_addr(unregistered), 8)]), reg),
        "one range of two past the registration": (_read_of(1, ok + [(_addr(buf, len(buf) - 4), 8)]), reg),
        "more than TCP_SERVE_MAX bytes": (_read_of(1, [(_addr(rw), impl.TCP_SERVE_MAX + 1)]), reg),
        "a WRITE into read-only memory": (_write_of(1, ok, b"x" * 8), reg),
        "a WRITE past its deadline": (_write_of(1, rw_ok, b"x" * 8, 1), reg),
        "a WRITE with request id 0": (_write_of(0, rw_ok, b"x" * 8), reg),
        "a WRITE whose data has not all come": (_write_of(1, rw_ok, b"x" * 8)[:-1], reg),
    }
    for why, (frame, told) in refused.items():
        peer.sendall(frame)
        time.sleep(0.02)
        answer = impl.tcp_request(ours, bytearray(16 << 10), told)
        assert answer[0] in (F.READ, F.WRITE) and answer[5] is not None and answer[7] is None, why
        if why == "a WRITE whose data has not all come":
            peer.sendall(b"x")  # (the rest, so the next frame starts clean)
            time.sleep(0.02)
            ours.recv(16)
    peer.settimeout(0.05)
    with pytest.raises(TimeoutError):  # nothing was sent for any of them
        peer.recv(1)
    assert buf.tobytes() == np.arange(1 << 15, dtype=np.uint32).view(np.uint8).tobytes() and not rw.any()
    # Deregistered, a buffer is no longer served (the table is read at the call).
    for handle in list(reg._by_range.values()):
        reg.deregister(handle)
    for frame in (_read_of(1, ok), _write_of(1, rw_ok, b"x" * 8)):
        peer.sendall(frame)
        time.sleep(0.02)
        assert impl.tcp_request(ours, bytearray(16 << 10), reg)[7] is None
    assert not rw.any()


@pytest.mark.skipif(_native() is None, reason="only the C twin serves")
def test_tcp_request_hands_back_what_a_full_socket_did_not_take(
    pair: tuple[socket.socket, socket.socket], registry: tuple[Registry, np.ndarray, np.ndarray, np.ndarray]
) -> None:
    native = _native()
    assert native is not None
    ours, peer = pair
    reg, buf, _, _ = registry
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sent = 0
    while True:  # fill our send side: the peer reads nothing yet
        try:
            sent += ours.send(b"\0" * 65536)
        except BlockingIOError:
            break
    peer.sendall(_read_of(9, [(_addr(buf, 64), 4000)]))
    time.sleep(0.05)
    answer = native.tcp_request(ours, bytearray(16 << 10), reg)
    want = encode_header(F.DATA, 9, 0, 4000) + buf[64:4064].tobytes()
    assert answer[7] is not None and len(answer[7]) <= len(want) and answer[7] == want[len(want) - len(answer[7]) :]
    taken = len(want) - len(answer[7])
    assert _recv_exactly(peer, sent + taken)[sent:] == want[:taken]


def test_the_twins_share_their_constants() -> None:
    for impl in IMPLS:
        assert (impl.TCP_WAIT, impl.TCP_EOF, impl.TCP_RANGES, impl.TCP_SERVE_MAX, impl.TCP_LOWAT, impl.TCP_LOWAT_FROM) == (
            pure.TCP_WAIT, pure.TCP_EOF, pure.TCP_RANGES, pure.TCP_SERVE_MAX, pure.TCP_LOWAT, pure.TCP_LOWAT_FROM
        )


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
