"""Fuzzing the frame codec (hypothesis) and the Connection state machine (a seeded bulk loop).

hypothesis is a test dependency (pyproject's ``test`` extra): these tests are not skipped.
"""

from __future__ import annotations

import json
import random
import struct
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hixl import AuthenticationFailed, ProtocolError
from hixl import _protocol as proto
from hixl._protocol import NEED_DATA, ConnState, Connection, ConnectionClosed, FrameType, Role
from hixl._protocol import frames as F

from .helpers import (
    INITIATOR_INFO,
    RECEIVABLE,
    SECRET,
    TARGET_INFO,
    FakeClock,
    any_message,
    clone,
    handshake,
    one_event,
    request,
)

U64 = st.integers(0, (1 << 64) - 1)
DEADLINE = st.integers(0, (1 << 63) - 1)
TEXT = st.text(max_size=64)
FAST = settings(max_examples=300, deadline=None)


def _decode(frame: bytes) -> proto.Message:
    header = proto.parse_header(frame[: proto.HEADER_SIZE])
    return proto.parse_body(header, frame[proto.HEADER_SIZE :])


@st.composite
def descriptors(draw: st.DrawFn) -> np.ndarray:
    """Valid (addr, len) pairs: nonzero lengths, no range past 2**64, total below 2**64."""
    n = draw(st.integers(1, 12))
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
REGION_ROWS = st.lists(st.tuples(U64, U64, U64), max_size=40).map(lambda rows: np.array(rows, dtype=np.uint64).reshape(-1, 3))
INFO = st.dictionaries(TEXT, JSONABLE, max_size=5)


@st.composite
def region_changes(draw: st.DrawFn) -> tuple[int, int, np.ndarray, np.ndarray]:
    """A REGIONS / REVOKE body: a whole table, or rows added and removed since an older generation."""
    generation = draw(st.integers(0, proto.WHOLE - 1))
    if draw(st.booleans()):
        return generation, proto.WHOLE, draw(REGION_ROWS), np.zeros((0, 3), np.uint64)
    return generation, draw(st.integers(0, generation)), draw(REGION_ROWS), draw(REGION_ROWS)


REGION_CHANGES = region_changes()
MESSAGES = st.one_of(
    st.builds(proto.Hello, INFO, U64),
    st.builds(proto.Challenge, INFO, U64),
    st.builds(proto.Auth, INFO, U64),
    st.builds(proto.Welcome, INFO, U64),
    st.tuples(REGION_CHANGES, U64).map(lambda c: proto.Regions(*c[0], c[1])),
    REGION_CHANGES.map(lambda c: proto.Revoke(*c)),
    st.builds(proto.QueryRegions, U64),
    st.builds(proto.ReadRequest, U64, descriptors(), DEADLINE),
    descriptors().flatmap(
        lambda d: st.builds(proto.WriteRequest, U64, st.just(d), st.just(int(d[:, 1].sum())), DEADLINE)
    ),
    st.builds(proto.Data, U64, U64),
    st.builds(proto.Ack, U64),
    st.builds(proto.Error, U64, st.integers(0, (1 << 32) - 1), TEXT),
    st.builds(proto.Notify, U64, TEXT, TEXT),
    st.builds(proto.Ping, U64),
    st.builds(proto.Pong, U64, st.floats()),
    st.builds(proto.Bye, U64, TEXT),
    st.builds(proto.QueryMeta, U64, TEXT),
    st.builds(proto.Meta, U64, st.binary(max_size=64)),
    st.builds(proto.Revoked, U64, U64),
)


@FAST
@given(MESSAGES)
def test_round_trip(message: proto.Message) -> None:
    frame = proto.encode(message)
    parsed = _decode(frame)
    assert type(parsed) is type(message) and proto.kind_of(parsed) is proto.kind_of(message)
    assert proto.encode(parsed) == frame
    if isinstance(message, (proto.ReadRequest, proto.WriteRequest)):
        assert parsed.deadline == message.deadline  # type: ignore[union-attr]
        assert np.array_equal(parsed.descs, message.descs)  # type: ignore[union-attr]
    if isinstance(message, (proto.Regions, proto.Revoke)):
        assert (parsed.generation, parsed.base) == (message.generation, message.base)  # type: ignore[union-attr]
        assert np.array_equal(parsed.added, message.added) and np.array_equal(parsed.removed, message.removed)  # type: ignore[union-attr]


@FAST
@given(st.binary(min_size=proto.HEADER_SIZE, max_size=proto.HEADER_SIZE))
def test_random_headers(raw: bytes) -> None:
    try:
        header = proto.parse_header(raw)
    except ProtocolError:
        return
    assert header.body_len <= proto.frames.BODY_LIMITS[header.type]
    assert header.data_len == 0 or header.type in (proto.FrameType.WRITE, proto.FrameType.DATA)


@FAST
@given(st.sampled_from(list(proto.FrameType)), U64, st.binary(max_size=96), st.integers(0, 1 << 20))
def test_random_bodies(kind: proto.FrameType, req_id: int, body: bytes, data_len: int) -> None:
    """Any body either parses into a message that re-encodes to a valid frame, or is refused."""
    if kind not in (proto.FrameType.WRITE, proto.FrameType.DATA):
        data_len = 0
    body = body[: proto.frames.BODY_LIMITS[kind]]
    raw = struct.pack("<4sBBHQIQ", b"HXL1", kind, 0, 0, req_id, len(body), data_len)
    try:
        message = proto.parse_body(proto.parse_header(raw), body)
    except ProtocolError:
        return
    if isinstance(message, (proto.ReadRequest, proto.WriteRequest)):
        ends = message.descs[:, 0].astype(object) + message.descs[:, 1].astype(object)
        assert all(0 < int(n) for n in message.descs[:, 1]) and max(ends) <= (1 << 64) - 1
        assert 0 <= message.deadline < 1 << 63
    if isinstance(message, proto.Notify):
        assert len(message.name.encode()) <= proto.frames.MAX_NAME and len(message.msg.encode()) <= proto.frames.MAX_NAME
    if isinstance(message, (proto.Hello, proto.Challenge, proto.Auth, proto.Welcome)):
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


# -- the Connection, driven with 10^5 mutated and random frames ------------------------------------
# A seeded loop, not hypothesis: hypothesis manages a few hundred examples a second here, and this
# needs 10^5 frames in seconds. Each session clones a connection at some point of an honest
# exchange (both roles, with and without a secret, from the first handshake frame on), feeds it
# the honest peer's remaining frames with mutations and random frames mixed in, cut into random
# chunks, and reacts like an engine would (CHALLENGE after HELLO, ...). Checked at every step:
# only ProtocolError / AuthenticationFailed come out (and then the connection is CLOSED), every
# session ends within a bounded number of steps, and the connection never holds more than one
# frame it could legitimately be sent now plus the chunk it was just fed.
FUZZ_FRAMES = 100_000
_I64 = (1 << 63) - 1
_JSON_KINDS = {FrameType.HELLO, FrameType.CHALLENGE, FrameType.AUTH, FrameType.WELCOME}
_WEIRD_JSON = [None, True, 0, -1, 1 << 70, 10**400, 1e300, float("inf"), float("nan"), "", "x" * 300, "ab" * 32, [], [2, 2], [1, 9], {}, {"a": 1}]


def _legal_now(conn: Connection) -> frozenset[FrameType]:
    stage = {ConnState.HANDSHAKE: "start", ConnState.AUTHENTICATED: "authenticated", ConnState.OPEN: "open", ConnState.CLOSING: "closing", ConnState.CLOSED: "closed"}[conn.state]
    if conn.role is Role.TARGET and stage == "start":
        return RECEIVABLE[(Role.TARGET, "start")] | RECEIVABLE[(Role.TARGET, "hello")]
    return RECEIVABLE[(conn.role, stage)]


def _held(conn: Connection) -> int:
    """Bytes the connection's receive buffer holds, consumed or not (white-box: the allocation)."""
    return len(conn._buf)


class _Scenario:
    """A connection at some point of an honest exchange, and what the honest peer sends it next."""

    def __init__(self, conn: Connection, handshake_frames: list[bytes], open_frames: list[bytes], on_open: list[F.Message]) -> None:
        self.conn, self.handshake_frames, self.open_frames, self.on_open = conn, handshake_frames, open_frames, on_open


def _scenarios() -> list[_Scenario]:
    out = []
    requests = [request(FrameType.READ, 1), request(FrameType.WRITE, 2), request(FrameType.NOTIFY, 3),
                request(FrameType.QUERY_REGIONS, 4), request(FrameType.QUERY_META, 5), request(FrameType.READ, 6)]
    replies = [F.encode(F.Data(1, 16)) + bytes(range(16)), F.encode(F.Ack(2)), F.encode(F.Ack(3)),
               F.encode(F.Regions(3, F.WHOLE, np.array([[4096, 8192, 1]], np.uint64), np.zeros((0, 3), np.uint64), 4)), F.encode(F.Meta(5, b"meta")),
               F.encode(F.Error(6, 6, "no")), F.encode(F.Ping(0)), F.encode(F.Pong(0, 1001.0)),
               F.encode(F.Regions(4, 3, np.zeros((2, 3), np.uint64), np.zeros((0, 3), np.uint64), 0)), F.encode(F.Error(0, 6, "note"))]
    to_target = [F.encode(request(FrameType.READ, 11)), F.encode(request(FrameType.WRITE, 12)) + b"12345678",
                 F.encode(request(FrameType.NOTIFY, 13)), F.encode(request(FrameType.QUERY_REGIONS, 14)),
                 F.encode(request(FrameType.QUERY_META, 15)), F.encode(request(FrameType.PING, 0)),
                 F.encode(request(FrameType.PONG, 0)), F.encode(F.WriteRequest(16, np.array([[4096, 3000]], np.uint64), 3000, 5)) + bytes(3000)]
    for secret in (SECRET, None):
        pair = handshake(secret, secret, clock_i=FakeClock(), clock_t=FakeClock(offset=7.0), until="start")
        i, t = pair.initiator, pair.target
        t_start = clone(t)
        hello = i.initiate()
        i_start = clone(i)
        one_event(t, hello)
        challenge = t.challenge()
        one_event(i, challenge)
        auth_frame = i.authenticate(dict(INITIATOR_INFO))
        one_event(t, auth_frame)
        welcome = t.welcome(dict(TARGET_INFO))
        one_event(i, welcome)
        t_open, i_open = clone(t), clone(i)
        for message in requests:
            i_open.send(message)
        out += [
            _Scenario(t_start, [hello, auth_frame], to_target, []),
            _Scenario(t_open, [], to_target, []),
            _Scenario(i_start, [challenge, welcome], replies, requests),
            _Scenario(i_open, [], replies, []),
        ]
    return out


def _random_frames() -> list[bytes]:
    frames = []
    for kind in FrameType:
        for req_id in (0, 1, 2, 5, 6, 12, 99, (1 << 64) - 1):
            frame = F.encode(any_message(kind, req_id))
            if kind is FrameType.WRITE:
                frame += bytes(8)
            frames.append(frame)
    frames.append(F.encode(F.Data(1, 1 << 40)))
    frames.append(F.encode(F.WriteRequest(11, np.array([[0, _I64]], np.uint64), _I64)))
    return frames


class _Fuzzer:
    def __init__(self, seed: int, scenarios: list[_Scenario] | None = None, random_frames: list[bytes] | None = None) -> None:
        self.rng = random.Random(seed)
        self.scenarios = scenarios or _scenarios()
        self.random_frames = random_frames or _random_frames()
        self.frames = 0  # mutated or random frames fed
        self.honest = 0
        self.refusals = 0
        self.opened = 0  # sessions that began in the handshake and got through it

    # -- making streams ------------------------------------------------------------------------
    def mutate(self, frame: bytes) -> bytes:
        rng = self.rng
        how = rng.randrange(15)
        b = bytearray(frame)
        if how == 0 and b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif how == 1:
            b[rng.randrange(min(len(b), F.HEADER_SIZE))] ^= 1 << rng.randrange(8)
        elif how == 2 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif how == 3:
            del b[rng.randrange(len(b) + 1) :]
        elif how == 4:
            b += rng.randbytes(rng.randrange(1, 40))
        elif how == 5:
            b[4] = rng.randrange(20)
        elif how == 6:
            b[8:16] = rng.choice((0, 1, 2, 3, 5, 6, 11, 12, rng.getrandbits(64), (1 << 64) - 1)).to_bytes(8, "little")
        elif how == 7:
            body = len(b) - F.HEADER_SIZE
            value = rng.choice((0, body - 1, body + 1, body + 1000, 4096, 4097, rng.getrandbits(32), (1 << 32) - 1))
            b[16:20] = max(0, value).to_bytes(4, "little")
        elif how == 8:
            b[20:28] = rng.choice((0, 1, 8, 9, 4096, 1 << 63, (1 << 64) - 1, rng.getrandbits(64))).to_bytes(8, "little")
        elif how == 9:
            return rng.randbytes(rng.randrange(0, 80))
        elif how == 10:
            return rng.choice(self.random_frames)
        elif how == 11:
            return frame + frame
        elif how == 12:
            return b""
        elif how == 13 and frame[4] in _JSON_KINDS:
            return self._mutate_json(frame)
        elif how == 14:
            kind = rng.choice(list(FrameType))
            limit = F.BODY_LIMITS[kind]
            return F.encode_header(kind, rng.choice((0, 1, 2)), rng.choice((limit, max(0, limit - 1)))) + rng.randbytes(rng.randrange(64))
        return bytes(b)

    def _mutate_json(self, frame: bytes) -> bytes:
        rng = self.rng
        header = F.parse_header(frame[: F.HEADER_SIZE])
        info = json.loads(frame[F.HEADER_SIZE :])
        keys = list(info) + ["versions", "nonce", "proof", "clock", "info", "mac", "version"]
        key = rng.choice(keys)
        if rng.random() < 0.2:
            info.pop(key, None)
        else:
            info[key] = rng.choice(_WEIRD_JSON)
        body = json.dumps(info).encode()
        return F.encode_header(header.type, header.req_id, len(body)) + body

    def stream(self, scenario: _Scenario) -> bytes:
        rng = self.rng
        opens = list(scenario.open_frames)
        rng.shuffle(opens)
        if rng.random() < 0.2:
            opens.append(F.encode(F.Bye(0, "bye")))
        parts = []
        for frame in scenario.handshake_frames + opens:
            while rng.random() < 0.1:
                parts.append(rng.choice(self.random_frames) if rng.random() < 0.7 else rng.randbytes(rng.randrange(1, 64)))
                self.frames += 1
            if rng.random() < 0.45:
                parts.append(self.mutate(frame))
                self.frames += 1
            else:
                parts.append(frame)
                self.honest += 1
        return b"".join(parts)

    # -- driving ----------------------------------------------------------------------------------
    def session(self) -> None:
        rng = self.rng
        scenario = rng.choice(self.scenarios)
        conn = clone(scenario.conn)
        stream = self.stream(scenario)
        eof = rng.random() < 0.5
        try:
            self._drive(conn, stream, eof, scenario.on_open)
            self.opened += bool(scenario.handshake_frames) and conn.state is not ConnState.HANDSHAKE
        except (ProtocolError, AuthenticationFailed):
            self.refusals += 1
            assert conn.state is ConnState.CLOSED and conn.closed_reason
            assert isinstance(conn.next_event(), ConnectionClosed)

    def _drive(self, conn: Connection, stream: bytes, eof: bool, on_open: list[F.Message]) -> None:
        rng = self.rng
        pos = 0
        steps, budget = 0, 2 * len(stream) + 64  # every step consumes a byte or waits for input: no hangs
        while True:
            # Drain what is buffered.
            while True:
                steps += 1
                assert steps <= budget, "the connection made no progress"
                if conn.data_left:
                    if conn.buffered:
                        conn.take_data(rng.choice((1, 5, conn.data_left, 1 << 20)))
                        continue
                    n = min(conn.data_left, len(stream) - pos, rng.choice((1, 100, 1 << 16)))
                    if n == 0:
                        break
                    conn.data_moved(n)  # read straight from the socket into memory
                    pos += n
                    continue
                event = conn.next_event()
                if event is NEED_DATA:
                    self._check_bound(conn, stream, pos)
                    break
                if isinstance(event, ConnectionClosed):
                    assert conn.state is ConnState.CLOSED
                    return
                self._react(conn, event, on_open)
            if pos >= len(stream):
                if not eof:
                    return
                conn.receive_data(b"")
                eof = False
                continue
            size = rng.choice((1, 3, 28, 29, 100, 1000, 1 << 16))
            chunk = stream[pos : pos + size]
            pos += len(chunk)
            pending = conn.buffered
            conn.receive_data(chunk)
            assert _held(conn) <= pending + len(chunk), "consumed bytes are still held"

    def _check_bound(self, conn: Connection, stream: bytes, pos: int) -> None:
        """Waiting for more: at most one frame is pending, of a kind the peer may send now."""
        pending = conn.buffered
        if conn.state is ConnState.CLOSED or pending < F.HEADER_SIZE:
            return
        header = F.parse_header(stream[pos - pending : pos - pending + F.HEADER_SIZE])
        assert header.type in _legal_now(conn), f"waiting for the body of a {header.type.name} while {conn.state.name}"
        assert pending < F.HEADER_SIZE + header.body_len <= F.HEADER_SIZE + F.BODY_LIMITS[header.type]

    def _react(self, conn: Connection, event: object, on_open: list[F.Message]) -> None:
        rng = self.rng
        if isinstance(event, F.Hello):
            conn.challenge()
        elif isinstance(event, F.Challenge) and conn.state is ConnState.AUTHENTICATED:
            conn.authenticate(dict(INITIATOR_INFO))
        elif isinstance(event, F.Auth):
            conn.welcome(dict(TARGET_INFO))
        elif isinstance(event, F.Welcome):
            for message in on_open:
                conn.send(message)
        if rng.random() < 0.05:  # and now and then, something this side may or may not send now
            try:
                conn.send(any_message(rng.choice(list(FrameType)), rng.choice((0, 1, 7, 21))))
            except ProtocolError:
                pass
        if conn.role is Role.INITIATOR and conn.state is ConnState.OPEN:
            deadline = conn.peer_deadline(time.monotonic() + rng.choice((0.0, 1.0, 1e9)))
            assert 0 < deadline <= _I64


@pytest.mark.timeout(120)
def test_connection_survives_10_5_mutated_and_random_frames() -> None:
    fuzzer = _Fuzzer(20261130, _SCENARIOS, _RANDOM_FRAMES)
    sessions = 0
    while fuzzer.frames < FUZZ_FRAMES:
        try:
            fuzzer.session()
        except Exception as exc:  # anything but a refusal: a bug; say which session to replay
            raise AssertionError(f"session {sessions} (seed 20261130): {exc!r}") from exc
        sessions += 1
    # The mix must exercise both outcomes and get through handshakes, or the fuzzer has gone blind.
    assert fuzzer.refusals > sessions // 10, (fuzzer.refusals, sessions)
    assert sessions - fuzzer.refusals > sessions // 100, (fuzzer.refusals, sessions)
    assert fuzzer.opened > 100, fuzzer.opened


_SCENARIOS = _scenarios()
_RANDOM_FRAMES = _random_frames()


@settings(max_examples=150, deadline=None)
@given(
    scenario=st.integers(0, len(_SCENARIOS) - 1),
    parts=st.lists(
        st.one_of(st.integers(0, len(_RANDOM_FRAMES) - 1), st.binary(max_size=60), st.sampled_from(["honest"])), max_size=12
    ),
    eof=st.booleans(),
    seed=st.integers(0, 1 << 32),
)
def test_connection_with_frames_hypothesis_picks(scenario: int, parts: list, eof: bool, seed: int) -> None:
    """The same checks as the bulk loop, on streams hypothesis builds (and shrinks, when one fails)."""
    fuzzer = _Fuzzer(seed, _SCENARIOS, _RANDOM_FRAMES)
    chosen = _SCENARIOS[scenario]
    honest = iter(chosen.handshake_frames + chosen.open_frames)
    stream = b"".join(
        next(honest, b"") if part == "honest" else _RANDOM_FRAMES[part] if isinstance(part, int) else part for part in parts
    )
    conn = clone(chosen.conn)
    try:
        fuzzer._drive(conn, stream, eof, chosen.on_open)
    except (ProtocolError, AuthenticationFailed):
        assert conn.state is ConnState.CLOSED


# -- the latency path's hand-packed frames ------------------------------------------------------------
@FAST
@given(st.booleans(), st.integers(1, (1 << 64) - 1), DEADLINE, st.lists(st.tuples(st.integers(0, 1 << 48), st.integers(1, 1 << 30)), min_size=1, max_size=8))
def test_small_requests_are_the_bytes_encode_makes(write: bool, req_id: int, deadline: int, pairs: list) -> None:
    rows = np.array(pairs, dtype=np.uint64)
    total = sum(n for _, n in pairs)
    message = proto.WriteRequest(req_id, rows, total, deadline) if write else proto.ReadRequest(req_id, rows, deadline)
    kind = proto.FrameType.WRITE if write else proto.FrameType.READ
    frame = F.small_request(kind, req_id, deadline, pairs, total if write else 0)
    assert frame == proto.encode(message)
    conn = at_open_initiator()
    assert conn.transfer_frame(write, req_id, deadline, pairs, total if write else 0) == frame
    assert conn.outstanding == 1


_OPEN_INITIATOR = handshake(SECRET, SECRET).initiator


def at_open_initiator() -> Connection:
    """An open initiator with nothing outstanding."""
    return clone(_OPEN_INITIATOR)


def test_transfer_frame_follows_the_rules_of_send() -> None:
    conn = at_open_initiator()
    conn.transfer_frame(False, 1, 0, [(4096, 8)], 0)
    for req_id in (0, 1):
        with pytest.raises(ProtocolError, match="zero or already in use"):
            conn.transfer_frame(True, req_id, 0, [(4096, 8)], 8)
    one_event(conn, F.encode(F.Data(1, 8)))  # answered: the id is free again
    conn.data_moved(8)
    conn.transfer_frame(True, 1, 0, [(4096, 8)], 8)
    conn.send(F.Bye())
    with pytest.raises(ProtocolError, match="may not send READ while CLOSING"):
        conn.transfer_frame(False, 2, 0, [(4096, 8)], 0)
    for other in (handshake(SECRET, SECRET).target, handshake(SECRET, SECRET, until="authenticated").initiator):
        with pytest.raises(ProtocolError, match="may not send"):
            other.transfer_frame(False, 2, 0, [(4096, 8)], 0)
