"""Shared by the protocol tests: honest connection pairs, a reference driver, and the spec's tables.

The tables here are written out from the protocol's docstrings, not imported from
the implementation, so a test that compares the two can fail.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np

from hixl._protocol import (
    PeerFatal,
    RegionsPushed,
    NEED_DATA,
    ConnState,
    Connection,
    ConnectionClosed,
    FrameType,
    Role,
)
from hixl._protocol import frames as F
from hixl._protocol.auth import Secret

SECRET = Secret(b"correct horse battery staple")
INITIATOR_INFO = {"engine": "127.0.0.1:1", "engine_id": "ii"}
TARGET_INFO = {"engine": "127.0.0.1:2", "pid": 4242, "generation": 2, "regions": [[4096, 8192, 1]]}
_NO_ROWS = np.zeros((0, 3), np.uint64)

_T = FrameType
INITIATOR_OPEN = frozenset(
    {_T.READ, _T.WRITE, _T.NOTIFY, _T.QUERY_REGIONS, _T.QUERY_META, _T.PING, _T.PONG, _T.BYE, _T.REVOKED}
)
TARGET_OPEN = frozenset({_T.REGIONS, _T.DATA, _T.ACK, _T.ERROR, _T.META, _T.PING, _T.PONG, _T.BYE, _T.REVOKE})

SENDABLE: dict[tuple[Role, str], frozenset[FrameType]] = {
    (Role.INITIATOR, "start"): frozenset(),  # its HELLO is sent: each handshake step goes once
    (Role.INITIATOR, "authenticated"): frozenset(),  # and so is its AUTH
    (Role.INITIATOR, "open"): INITIATOR_OPEN,
    (Role.INITIATOR, "closing"): frozenset({_T.BYE, _T.PONG}),
    (Role.INITIATOR, "closed"): frozenset(),
    (Role.TARGET, "start"): frozenset({_T.ERROR}),  # a CHALLENGE only answers a HELLO
    (Role.TARGET, "hello"): frozenset({_T.ERROR}),  # and goes once
    (Role.TARGET, "authenticated"): frozenset({_T.WELCOME, _T.ERROR}),
    (Role.TARGET, "open"): TARGET_OPEN,
    (Role.TARGET, "closing"): frozenset({_T.BYE, _T.PONG}),
    (Role.TARGET, "closed"): frozenset(),
}
"""What each side may send at each stage (module docstring of connection.py).

Stages are points in a connection's life: ``hello`` is the target after HELLO (and its CHALLENGE).
"""

RECEIVABLE: dict[tuple[Role, str], frozenset[FrameType]] = {
    (Role.INITIATOR, "start"): frozenset({_T.CHALLENGE, _T.ERROR}),
    (Role.INITIATOR, "authenticated"): frozenset({_T.WELCOME, _T.ERROR}),
    (Role.INITIATOR, "open"): TARGET_OPEN,
    (Role.INITIATOR, "closing"): TARGET_OPEN,
    (Role.INITIATOR, "closed"): frozenset(),
    (Role.TARGET, "start"): frozenset({_T.HELLO}),
    (Role.TARGET, "hello"): frozenset({_T.AUTH}),
    (Role.TARGET, "authenticated"): frozenset(),
    (Role.TARGET, "open"): INITIATOR_OPEN,
    (Role.TARGET, "closing"): INITIATOR_OPEN,
    (Role.TARGET, "closed"): frozenset(),
}
"""What each side may receive at each stage."""

STATE_OF = {
    "start": ConnState.HANDSHAKE,
    "hello": ConnState.HANDSHAKE,
    "authenticated": ConnState.AUTHENTICATED,
    "open": ConnState.OPEN,
    "closing": ConnState.CLOSING,
    "closed": ConnState.CLOSED,
}

# Requests an initiator at stage "open"/"closing" has outstanding (see at()), and what answers each.
OUTSTANDING = {1: _T.READ, 2: _T.WRITE, 3: _T.NOTIFY, 4: _T.QUERY_REGIONS, 5: _T.QUERY_META}


class FakeClock:
    """A monotonic clock a test moves by hand; ``offset`` models another host's clock."""

    def __init__(self, now: float = 1000.0, offset: float = 0.0) -> None:
        self.now = now
        self.offset = offset

    def __call__(self) -> float:
        return self.now + self.offset

    def skewed(self, offset: float) -> _Skewed:
        """The same time as read by another host's clock, ``offset`` seconds ahead of this one."""
        return _Skewed(self, offset)


class _Skewed:
    def __init__(self, base: FakeClock, offset: float) -> None:
        self._base = base
        self.offset = offset

    def __call__(self) -> float:
        return self._base() + self.offset


def descs(*rows: tuple[int, int]) -> np.ndarray:
    return np.array(rows, dtype=np.uint64).reshape(-1, 2)


def request(kind: FrameType, req_id: int) -> F.Message:
    """A well-formed initiator request (or PING/PONG/BYE) of ``kind``."""
    return {
        _T.READ: lambda: F.ReadRequest(req_id, descs((4096, 16)), 123),
        _T.WRITE: lambda: F.WriteRequest(req_id, descs((4096, 4), (8192, 4)), 8, 0),
        _T.NOTIFY: lambda: F.Notify(req_id, "name", "msg"),
        _T.QUERY_REGIONS: lambda: F.QueryRegions(req_id),
        _T.QUERY_META: lambda: F.QueryMeta(req_id, "key"),
        _T.PING: lambda: F.Ping(req_id),
        _T.PONG: lambda: F.Pong(req_id, 5.0),
        _T.BYE: lambda: F.Bye(0, "done"),
        _T.REVOKED: lambda: F.Revoked(3, req_id),
    }[kind]()


def reply(kind: FrameType, req_id: int) -> F.Message:
    """A well-formed target frame of ``kind``."""
    return {
        _T.REGIONS: lambda: F.Regions(3, F.WHOLE, np.array([[4096, 8192, 1]], dtype=np.uint64), _NO_ROWS, req_id),
        _T.DATA: lambda: F.Data(req_id, 16),
        _T.ACK: lambda: F.Ack(req_id),
        _T.ERROR: lambda: F.Error(req_id, 6, "no"),
        _T.META: lambda: F.Meta(req_id, b"value"),
        _T.PING: lambda: F.Ping(req_id),
        _T.PONG: lambda: F.Pong(req_id, 7.0),
        _T.BYE: lambda: F.Bye(0, "done"),
        _T.REVOKE: lambda: F.Revoke(4, F.WHOLE, np.array([[4096, 8192, 1]], dtype=np.uint64), _NO_ROWS),  # newer than at()'s
    }[kind]()


# What answers each outstanding request of at(): the id and a reply of the right kind.
ANSWER = {_T.DATA: 1, _T.ACK: 2, _T.META: 5, _T.REGIONS: 4}


def any_message(kind: FrameType, req_id: int = 7) -> F.Message:
    """Some well-formed message of every kind (handshake bodies are not valid proofs)."""
    nonce = "ab" * 32
    if kind is _T.HELLO:
        return F.Hello({"versions": [F.MIN_VERSION, F.VERSION], "nonce": nonce, "clock": 1.0})
    if kind is _T.CHALLENGE:
        return F.Challenge({"version": F.VERSION, "nonce": nonce, "proof": "00" * 32, "clock": 1.0})
    if kind is _T.AUTH:
        return F.Auth({"proof": "00" * 32, "info": {}})
    if kind is _T.WELCOME:
        return F.Welcome({"info": {}, "mac": "00" * 32})
    if kind in INITIATOR_OPEN:
        return request(kind, req_id)
    return reply(kind, req_id)


@dataclasses.dataclass
class Pair:
    """Both ends of one honest connection and every frame each sent, in order."""

    initiator: Connection
    target: Connection
    to_target: list[bytes]
    to_initiator: list[bytes]


def frame_of(event: Any) -> FrameType:
    """The frame type an event came in: a message's own, or the ERROR / REGIONS behind the events
    the connection makes of the unsolicited ones (PeerFatal, RegionsPushed)."""
    if isinstance(event, PeerFatal):
        return FrameType.ERROR
    if isinstance(event, RegionsPushed):
        return FrameType.REGIONS
    return F.kind_of(event)


def one_event(conn: Connection, data: bytes) -> Any:
    conn.receive_data(data)
    event = conn.next_event()
    assert event is not NEED_DATA, "a whole frame was fed"
    if not conn.data_left:  # and nothing more: the frame was consumed exactly
        after = conn.next_event()
        assert after is NEED_DATA or (conn.state is ConnState.CLOSED and isinstance(after, ConnectionClosed))
    return event


def handshake(
    secret_i: Secret | None = SECRET,
    secret_t: Secret | None = SECRET,
    *,
    clock_i: Any = None,
    clock_t: Any = None,
    until: str = "open",
    versions: tuple[int, int] = (F.MIN_VERSION, F.VERSION),
    nonces: tuple[str, str] | None = None,
) -> Pair:
    """Run the handshake between fresh ends up to ``until`` (a stage of the initiator); both ends
    speak ``versions``, and ``nonces`` (initiator's, target's) replaces fresh ones."""
    kw_i: dict[str, Any] = {"clock": clock_i} if clock_i else {}
    kw_t: dict[str, Any] = {"clock": clock_t} if clock_t else {}
    if nonces is not None:
        kw_i["nonce_source"], kw_t["nonce_source"] = (lambda: nonces[0]), (lambda: nonces[1])
    i = Connection(Role.INITIATOR, secret_i, versions=versions, **kw_i)
    t = Connection(Role.TARGET, secret_t, versions=versions, **kw_t)
    pair = Pair(i, t, [], [])
    if until == "start":
        return pair
    pair.to_target.append(i.initiate())
    assert isinstance(one_event(t, pair.to_target[-1]), F.Hello)
    pair.to_initiator.append(t.challenge())
    if until == "hello":
        return pair
    assert isinstance(one_event(i, pair.to_initiator[-1]), F.Challenge)
    pair.to_target.append(i.authenticate(dict(INITIATOR_INFO)))
    assert isinstance(one_event(t, pair.to_target[-1]), F.Auth)
    if until == "authenticated":
        return pair
    pair.to_initiator.append(t.welcome(dict(TARGET_INFO)))
    assert isinstance(one_event(i, pair.to_initiator[-1]), F.Welcome)
    return pair


def at(role: Role, stage: str, secret: Secret | None = SECRET) -> Connection:
    """A connection of ``role`` at ``stage``; an initiator that is open has OUTSTANDING requests."""
    if stage == "start":
        conn = Connection(role, secret)
        if role is Role.INITIATOR:
            conn.initiate()
        return conn
    if stage == "hello":
        assert role is Role.TARGET
        return handshake(secret, secret, until="hello").target
    if stage == "authenticated":
        pair = handshake(secret, secret, until="authenticated")
        return pair.initiator if role is Role.INITIATOR else pair.target
    pair = handshake(secret, secret)
    conn = pair.initiator if role is Role.INITIATOR else pair.target
    if role is Role.INITIATOR:
        for req_id, kind in OUTSTANDING.items():
            conn.send(request(kind, req_id))
    else:
        conn.send(F.Revoke(3, 2, _NO_ROWS, _NO_ROWS))  # what request(REVOKED) confirms
    if stage == "closing":
        conn.send(F.Bye(0, "closing"))
    elif stage == "closed":
        conn.receive_data(F.encode(F.Bye(0, "peer leaves")))
        assert isinstance(conn.next_event(), F.Bye)
    assert conn.state is STATE_OF[stage]
    return conn


def clone(conn: Connection) -> Connection:
    """An independent copy of ``conn`` (same nonces): a shallow copy with its containers copied.

    Much faster than ``deepcopy``, which the fuzz test cannot afford per session.
    """
    twin = copy.copy(conn)
    for name, value in vars(conn).items():
        if isinstance(value, (bytearray, dict, list, set)):
            setattr(twin, name, copy.copy(value))
    return twin


def normalize(event: Any) -> Any:
    """A comparable form of an event (numpy arrays as bytes and shape, messages inside events too)."""
    if event is NEED_DATA or isinstance(event, ConnectionClosed):
        return repr(event)
    fields = []
    for f in dataclasses.fields(event):
        value = getattr(event, f.name)
        if dataclasses.is_dataclass(value):
            value = normalize(value)
        elif isinstance(value, np.ndarray):
            value = (value.shape, value.astype("<u8").tobytes())
        elif isinstance(value, float) and value != value:
            value = "nan"
        fields.append((f.name, value))
    return (type(event).__name__, tuple(fields))


class Driver:
    """Feeds chunks to a connection the way an I/O driver would, and records what comes out.

    It moves bulk data with take_data (what arrived with the frame) and reacts to the
    handshake like an engine: CHALLENGE after HELLO, AUTH after CHALLENGE, WELCOME after AUTH;
    ``on_open`` are messages an initiator sends once the WELCOME arrived.
    """

    def __init__(self, conn: Connection, on_open: Iterable[F.Message] = ()) -> None:
        self.conn = conn
        self.on_open = list(on_open)
        self.log: list[Any] = []
        self.sent: list[bytes] = []
        self.error: BaseException | None = None
        self._data: bytearray | None = None

    def feed(self, chunk: bytes) -> None:
        """What one recv returned (never empty: that is :meth:`close`)."""
        if self.error is not None or not chunk:
            return
        self.conn.receive_data(chunk)
        self._drain()

    def _drain(self) -> None:
        conn = self.conn
        try:
            while True:
                if conn.data_left:
                    if not conn.buffered:
                        return
                    assert self._data is not None
                    self._data += conn.take_data(conn.data_left)
                    if conn.data_left:
                        return
                    self.log.append(("data", bytes(self._data)))
                    self._data = None
                    continue
                event = conn.next_event()
                if event is NEED_DATA:
                    return
                self.log.append(normalize(event))
                if isinstance(event, ConnectionClosed):
                    return
                if conn.data_left:
                    self._data = bytearray()
                self._react(event)
        except Exception as exc:  # recorded, compared by the tests
            self.error = exc
            self.log.append(("raised", type(exc).__name__, str(exc)))

    def _react(self, event: Any) -> None:
        conn = self.conn
        if isinstance(event, F.Hello):
            self.sent.append(conn.challenge())
        elif isinstance(event, F.Challenge) and conn.state is ConnState.AUTHENTICATED:
            self.sent.append(conn.authenticate(dict(INITIATOR_INFO)))
        elif isinstance(event, F.Auth):
            self.sent.append(conn.welcome(dict(TARGET_INFO)))
        elif isinstance(event, F.Welcome):
            self.sent.extend(conn.send(m) for m in self.on_open)

    def close(self) -> None:
        """The peer closed its end: recv returned nothing."""
        if self.error is None:
            self.conn.receive_data(b"")
            self._drain()

    def outcome(self) -> tuple[Any, ...]:
        return (tuple(self.log), self.conn.state, self.conn.version, tuple(self.sent), self.conn.data_left)
