"""One hixl connection as a state machine: bytes in, events out, and frames to send. No I/O.

Theory of operation (in the spirit of h11). A :class:`Connection` is one side
(initiator or target) of one connection. The I/O driver feeds it what the
socket gave (:meth:`Connection.receive_data`) and pulls events
(:meth:`Connection.next_event`): each event is a decoded
:mod:`~hixl._protocol.frames` message, :data:`NEED_DATA` when the buffer holds no
complete frame, or :class:`ConnectionClosed`. To send, the driver asks the
connection for the bytes of a message (:meth:`Connection.send`), which refuses
anything this side may not send in the current state.

The tables decide, both ways: ``_SENDABLE`` says what each side may send in
each state, ``_RECEIVABLE`` (and ``_HANDSHAKE_STEPS``) what it may receive — the
other side's ``_SENDABLE`` seen from here, which a test checks — and ``_REPLIES``
which reply answers which request. The connection also keeps what the rules
need beyond the frame kind: each outstanding request (a DATA must carry exactly
the bytes its READ asked for), the REVOKE generations (they only grow; a
REVOKED must confirm one that was announced) and the registration generation
the initiator knows (WELCOME names it; a REGIONS or REVOKE that lists only
what changed must change exactly that one, and each moves it on). Drivers
never re-check any of it.
The latency path takes a shortcut through the same tables for the frames it
sees most; a test holds it to the tables' verdict. Frames that end or change
the connection without answering anything come out as their own events:
:class:`RegionsPushed` (REGIONS with request id 0) and :class:`PeerFatal`
(ERROR with request id 0, after which the connection is CLOSED).

States, the same on both sides::

    HANDSHAKE ──proofs checked──> AUTHENTICATED ──WELCOME──> OPEN ──BYE sent──> CLOSING
        │                              │                      │                   │
        └───────── refusal, EOF, BYE received, protocol error ─┴───────────────────┴──> CLOSED

The handshake is a mutual challenge–response (see :mod:`hixl._protocol.auth`)::

    initiator                                 target
    HELLO {versions, nonce_i, clock}   ->
                                       <-     CHALLENGE {version, nonce_t, proof_t, clock}
    (checks proof_t: AUTHENTICATED)
    AUTH {proof_i, info}               ->     (checks proof_i: AUTHENTICATED)
                                       <-     WELCOME {info, mac}        (both: OPEN)

Nothing about either engine (pid, regions, nonces of the same-host probe,
metadata) is sent before the other side's proof passed. The WELCOME carries a
MAC under the session key, so a WELCOME recorded from another connection is
refused.

Encrypted connections (``encrypt=True`` on both ends; HELLO and CHALLENGE say
``"encrypt": true``): once the CHALLENGE is sent (target) or its proof checked
(initiator), each side has the session key, and everything after — from AUTH
and WELCOME on, both ways — travels in sealed records (:mod:`hixl._protocol.seal`,
the keys derived from the session key and from the HELLO and CHALLENGE as each
side sent or received them, so that an alteration of either makes the first sealed
record fail): the connection makes its :attr:`Connection.seal` then, and the driver
seals and opens the bytes while the connection goes on parsing plain frames. A side
whose setting differs refuses the connection
(:class:`~hixl.EncryptionMismatch`): the initiator on reading the CHALLENGE, the
target by an ERROR after its CHALLENGE. Nothing falls back to plaintext.

Bulk data (the payload of WRITE and DATA) is not turned into events: after such
a frame the driver moves ``data_left`` bytes itself, straight between the socket
and registered memory, first taking whatever the connection had already
buffered (:meth:`Connection.take_data`) and reporting the rest
(:meth:`Connection.data_moved`). That keeps transfers zero-copy while the
parser stays byte-exact: feeding a stream one byte at a time yields the same
events as feeding it whole.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar


from .._exceptions import AuthenticationFailed, EncryptionMismatch, ProtocolError
from .._types import IdentityEnum
from . import auth
from .frames import (
    BODY_LIMITS,
    HEADER_SIZE,
    MIN_VERSION,
    SMALL_DESCS,
    VERSION,
    WHOLE,
    Ack,
    Auth,
    Bye,
    Challenge,
    Data,
    Error,
    FrameType,
    Hello,
    Message,
    Pong,
    ReadRequest,
    Regions,
    Revoke,
    Revoked,
    Welcome,
    WriteRequest,
    encode,
    encode_header,
    encode_split,
    kind_of,
    small_request,
    parse_body,
    parse_header_at,
)
from .seal import RECORD_MAX, Seal

__all__ = ["NEED_DATA", "ConnState", "Connection", "ConnectionClosed", "PeerFatal", "RegionsPushed", "Role"]

T = TypeVar("T", bytes, bytearray)


class Role(IdentityEnum):
    """Which side of a connection this is."""

    INITIATOR = "initiator"
    TARGET = "target"


class ConnState(IdentityEnum):
    """Where a connection is in its life (see the module docstring)."""

    HANDSHAKE = "HANDSHAKE"
    AUTHENTICATED = "AUTHENTICATED"
    OPEN = "OPEN"
    CLOSING = "CLOSING"
    CLOSED = "CLOSED"


class _NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = _NeedData()
"""Returned by :meth:`Connection.next_event` when no complete frame is buffered."""


@dataclass(frozen=True)
class ConnectionClosed:
    """The peer closed its end (end of stream)."""


_F = FrameType
_OPEN_BY: dict[Role, frozenset[FrameType]] = {
    Role.INITIATOR: frozenset(
        {_F.READ, _F.WRITE, _F.NOTIFY, _F.QUERY_REGIONS, _F.QUERY_META, _F.PING, _F.PONG, _F.BYE, _F.REVOKED}
    ),
    Role.TARGET: frozenset(
        {_F.REGIONS, _F.DATA, _F.ACK, _F.ERROR, _F.META, _F.PING, _F.PONG, _F.BYE, _F.REVOKE}
    ),
}
# What each side may send in each state. During the handshake the target may answer with
# ERROR (a refusal) and then closes; CLOSING allows the goodbye and heartbeats' answers only.
_SENDABLE: dict[tuple[Role, ConnState], frozenset[FrameType]] = {
    (Role.INITIATOR, ConnState.HANDSHAKE): frozenset({_F.HELLO}),
    (Role.INITIATOR, ConnState.AUTHENTICATED): frozenset({_F.AUTH}),
    (Role.INITIATOR, ConnState.OPEN): _OPEN_BY[Role.INITIATOR],
    (Role.TARGET, ConnState.HANDSHAKE): frozenset({_F.CHALLENGE, _F.ERROR}),
    (Role.TARGET, ConnState.AUTHENTICATED): frozenset({_F.WELCOME, _F.ERROR}),
    (Role.TARGET, ConnState.OPEN): _OPEN_BY[Role.TARGET],
    (Role.INITIATOR, ConnState.CLOSING): frozenset({_F.BYE, _F.PONG}),
    (Role.TARGET, ConnState.CLOSING): frozenset({_F.BYE, _F.PONG}),
}
# What each side may receive in each state: the other side's _SENDABLE, seen from here. The
# handshake goes in steps (the frames of it received so far), each allowing one frame; from
# OPEN on, whatever the peer may send while OPEN (it may not have seen our BYE yet when we are
# CLOSING). A test checks this against _SENDABLE.
_HANDSHAKE_STEPS: dict[Role, tuple[frozenset[FrameType], ...]] = {
    Role.TARGET: (frozenset({_F.HELLO}), frozenset({_F.AUTH})),
    Role.INITIATOR: (frozenset({_F.CHALLENGE, _F.ERROR}), frozenset({_F.WELCOME, _F.ERROR})),
}
_RECEIVABLE: dict[tuple[Role, ConnState], frozenset[FrameType]] = {
    (Role.INITIATOR, ConnState.OPEN): _OPEN_BY[Role.TARGET],
    (Role.INITIATOR, ConnState.CLOSING): _OPEN_BY[Role.TARGET],
    (Role.TARGET, ConnState.OPEN): _OPEN_BY[Role.INITIATOR],
    (Role.TARGET, ConnState.CLOSING): _OPEN_BY[Role.INITIATOR],
}
# The replies an initiator's request may get (ERROR always may come instead).
_REPLIES: dict[FrameType, frozenset[FrameType]] = {
    _F.READ: frozenset({_F.DATA}),
    _F.WRITE: frozenset({_F.ACK}),
    _F.NOTIFY: frozenset({_F.ACK}),
    _F.QUERY_REGIONS: frozenset({_F.REGIONS}),
    _F.QUERY_META: frozenset({_F.META}),
}
# Frames that answer no request: pushed by the target (req_id 0), or heartbeats (any id).
_UNSOLICITED: frozenset[FrameType] = frozenset({_F.REGIONS, _F.PING, _F.PONG, _F.BYE, _F.ERROR, _F.REVOKE, _F.REVOKED})
_HEARTBEATS = frozenset({_F.PING, _F.PONG})
_HANDSHAKE_KINDS = frozenset({_F.HELLO, _F.CHALLENGE, _F.AUTH, _F.WELCOME})
_IN_CLEAR = frozenset({_F.HELLO, _F.CHALLENGE})
"""The frames an encrypting handshake sends before its keys exist: their bytes go into the keys."""
# The latency path: the frames a side receives most, in OPEN, checked in fewer steps. Derived
# from the tables above (and checked against the general path frame by frame in a test).
_FAST: dict[Role, frozenset[FrameType]] = {
    Role.TARGET: frozenset({_F.READ, _F.WRITE}) & _RECEIVABLE[(Role.TARGET, ConnState.OPEN)],
    Role.INITIATOR: frozenset({_F.DATA, _F.ACK}) & _RECEIVABLE[(Role.INITIATOR, ConnState.OPEN)],
}
_I64_MAX = (1 << 63) - 1
_PLAIN = frozenset({ReadRequest, WriteRequest, Data, Ack})
"""Messages that change no state when received."""
DEADLINE_GUARD = 0.010
"""Seconds by which a deadline sent to the target is moved earlier (chunk time, clock reads)."""


@dataclass(frozen=True)
class RegionsPushed:
    """Event (initiator): the target's registrations changed; ``update`` says how (checked
    against the generation this side knew: apply it to the regions of that generation)."""

    update: Regions


@dataclass(frozen=True)
class PeerFatal:
    """Event: the peer reports an error that ends the connection (an ERROR frame with request id 0)."""

    status: int
    message: str


Event = Message | ConnectionClosed | _NeedData | RegionsPushed | PeerFatal


@dataclass
class _Request:
    """What an initiator remembers of a request until its reply: its kind, and for a READ the
    bytes of DATA it must be answered with."""

    kind: FrameType
    data_len: int = 0


class Connection:
    """One side of one hixl connection; see the module docstring.

    ``secret`` is the shared secret (``None``: no authentication).
    ``clock`` is the monotonic clock, ``nonce_source`` makes this side's nonce
    (default :func:`~hixl._protocol.auth.fresh_nonce`) and ``versions`` is the range of
    protocol versions this side speaks (default: this hixl's); all injectable for tests.
    ``encrypt``: this side seals everything after the handshake's proofs and refuses a peer that
    does not (see the module docstring).
    """

    def __init__(
        self,
        role: Role,
        secret: auth.Secret | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        nonce_source: Callable[[], str] | None = None,
        versions: tuple[int, int] = (MIN_VERSION, VERSION),
        encrypt: bool = False,
    ) -> None:
        self.role = role
        self.encrypt = encrypt
        self.seal: Seal | None = None
        """The connection's seal once the handshake switched to sealed records (``encrypt``); the
        driver's to use (see the module docstring)."""
        self.encryption_mismatch = ""
        """Target, after the HELLO: why the initiator's ``encrypt`` differs from ours ("" if it does not)."""
        self._transcript = hashlib.sha256() if encrypt else None  # (the frames sent in clear, until sealed)
        self._low, self._high = versions
        self.state = ConnState.HANDSHAKE
        self.version = 0
        """The negotiated protocol version (0 until the handshake chose one)."""
        self.peer_info: dict[str, Any] = {}
        """What the peer said about itself: AUTH's ``info`` (target side) or WELCOME's (initiator)."""
        self.closed_reason = ""
        self.data_left = 0
        """Bytes of bulk data that follow the last event, for the driver to move."""
        self._key = secret.key if secret is not None else b""
        self._clock = clock
        self._buf = bytearray()
        self._pos = 0
        self._nonce = (nonce_source or auth.fresh_nonce)()
        self._peer_nonce = ""
        self._session_key = b""
        self._steps = 0  # handshake frames received so far
        self._handshake_sent: set[FrameType] = set()
        self._outstanding: dict[int, _Request] = {}
        self._revokes: list[int] = []  # target: REVOKE generations sent and not yet confirmed
        self._confirmed_revoke = 0  # target: the newest generation the peer confirmed
        self._last_revoke = 0  # initiator: the newest REVOKE generation received
        self._regions_generation = 0
        self._clock_offset: float | None = None
        self._offset_at = 0.0

    # -- handshake ------------------------------------------------------------------------------
    def initiate(self) -> bytes:
        """Initiator: the HELLO that opens the handshake."""
        info: dict[str, Any] = {"versions": [self._low, self._high], "nonce": self._nonce, "clock": self._clock()}
        if self.encrypt:
            info["encrypt"] = True
        return self._transcribed(self.send(Hello(info)))

    def challenge(self) -> bytes:
        """Target, after the HELLO event: the CHALLENGE with this side's proof. With ``encrypt`` on
        both sides, what follows it is sealed both ways (:attr:`seal`); if only one side has it,
        :attr:`encryption_mismatch` says so, and the driver refuses the connection after this."""
        proof = auth.proof(self._key, "target", self._nonce, self._peer_nonce, self.version)
        info: dict[str, Any] = {"version": self.version, "nonce": self._nonce, "proof": proof, "clock": self._clock()}
        if self.encrypt:
            info["encrypt"] = True
        frame = self._transcribed(self.send(Challenge(info)))
        self._session_key = auth.session_key(self._key, self._peer_nonce, self._nonce, self.version)
        if self.encrypt and not self.encryption_mismatch:
            self._start_sealing()
        return frame

    def authenticate(self, info: dict[str, Any]) -> bytes:
        """Initiator, after the CHALLENGE event (target proved itself): AUTH with our proof and ``info``."""
        proof = auth.proof(self._key, "initiator", self._nonce, self._peer_nonce, self.version)
        return self.send(Auth({"proof": proof, "info": info}))

    def welcome(self, info: dict[str, Any]) -> bytes:
        """Target, after the AUTH event: the WELCOME, MAC'd under the session key; the connection opens.

        ``info["generation"]`` is the registration generation its ``regions`` are of: later
        region updates to this peer are counted from it.
        """
        self._regions_generation = _generation_of(info)
        return self.send(Welcome({"info": info, "mac": auth.mac(self._session_key, "welcome", _canonical(info))}))

    def refuse(self, status: int, message: str) -> bytes:
        """Target: the ERROR that refuses a handshake; the connection is CLOSED after it."""
        data = self.send(Error(0, status, message))
        self._close(f"refused: {message}")
        return data

    def binding(self, label: str) -> bytes:
        """16 bytes only the two ends of this authenticated connection can compute.

        Used to bind a same-host probe to this connection: the target puts them in
        its memory, the initiator checks that the process it would copy into holds them.
        """
        if self.state not in (ConnState.AUTHENTICATED, ConnState.OPEN):
            raise ProtocolError("no session key before the handshake's proofs passed")
        return bytes.fromhex(auth.mac(self._session_key, "binding:" + label, b""))[:16]

    # -- sending --------------------------------------------------------------------------------
    def send(self, message: Message) -> bytes:
        """The bytes of ``message``, after checking this side may send it now.

        Requests (initiator) are remembered until their reply arrives; sending
        BYE moves the connection to CLOSING. Raises :class:`ProtocolError`
        for a frame this side may not send in this state.
        """
        self._sending(message)
        return encode(message)

    def send_encoded(self, message: Message, frame: bytes) -> bytes:
        """:meth:`send` for a ``message`` encoded once (``frame``) for many connections — the same
        REGIONS pushed to every peer: checked and recorded here as usual, not encoded again."""
        self._sending(message)
        return frame

    def send_split(self, message: Message) -> tuple[bytes, bytes]:
        """:meth:`send`, as (header, body) for a META (see :func:`~.frames.encode_split`): its value,
        up to 16 MiB, then goes to the socket from where it is stored, not copied behind the header."""
        self._sending(message)
        return encode_split(message)

    def _sending(self, message: Message) -> None:
        """Check that this side may send ``message`` now and record what sending it changes."""
        kind = kind_of(message)
        if kind not in _SENDABLE.get((self.role, self.state), ()):
            raise ProtocolError(f"a {self.role.value} may not send {kind.name} while {self.state.name}")
        if kind in _HANDSHAKE_KINDS:
            # Each handshake step once, in order (a CHALLENGE answers a HELLO).
            if kind in self._handshake_sent or (kind is _F.CHALLENGE and not self._steps):
                raise ProtocolError(
                    f"a {self.role.value} may not send {kind.name} while {self.state.name} "
                    "(each handshake step once, a CHALLENGE only after a HELLO)"
                )
            self._handshake_sent.add(kind)
        if kind in _REPLIES and self.role is Role.INITIATOR:
            if message.req_id == 0 or message.req_id in self._outstanding:
                raise ProtocolError(f"request id {message.req_id} is zero or already in use")
            data_len = int(message.descs[:, 1].sum()) if isinstance(message, ReadRequest) else 0
            self._outstanding[message.req_id] = _Request(kind, data_len)
        elif isinstance(message, Revoke):
            if message.generation <= self.newest_revoke:
                raise ProtocolError(f"REVOKE generation {message.generation} is not newer than {self.newest_revoke}")
            self._region_update(message, "send")
            self._revokes.append(message.generation)
        elif isinstance(message, Regions):
            self._region_update(message, "send")
        elif kind is _F.WELCOME:
            self.state = ConnState.OPEN
        elif kind is _F.BYE:
            self.state = ConnState.CLOSING

    def transfer_frame(self, write: bool, req_id: int, deadline: int, pairs: list[tuple[int, int]], data_len: int) -> bytes:
        """The bytes of a small READ or WRITE (the latency path): as :meth:`send` with a
        :class:`ReadRequest`/:class:`WriteRequest`, without building numpy arrays."""
        count = len(pairs)
        if not 0 < count <= SMALL_DESCS:
            raise ValueError(f"the latency path packs 1 to {SMALL_DESCS} descriptors, not {count}")
        # (One pair is the common case, and every generator this path skips is ~0.2 us of a ~10 us round trip.)
        self.sent_small(write, req_id, 0 if write else pairs[0][1] if count == 1 else sum([n for _, n in pairs]))
        return small_request(_F.WRITE if write else _F.READ, req_id, deadline, pairs, data_len)

    def sent_small(self, write: bool, req_id: int, expected: int) -> None:
        """Account for a small READ (``expected`` bytes of DATA due) or WRITE ``req_id`` as sent: what
        :meth:`transfer_frame` does before it packs the frame. For a driver that packed and sent
        it itself (:class:`hixl._accel.TcpSmall`) and hands it back unanswered."""
        kind = _F.WRITE if write else _F.READ
        if self.state is not ConnState.OPEN or self.role is not Role.INITIATOR:
            raise ProtocolError(f"a {self.role.value} may not send {kind.name} while {self.state.name}")
        if req_id == 0 or req_id in self._outstanding:
            raise ProtocolError(f"request id {req_id} is zero or already in use")
        self._outstanding[req_id] = _Request(kind, expected)

    @property
    def regions_generation(self) -> int:
        """The registration generation the initiator knows: told by the WELCOME, then by every
        REGIONS and REVOKE (on the target: sent; on the initiator: received)."""
        return self._regions_generation

    def _region_update(self, message: Regions | Revoke, verb: str) -> None:
        """Check that a REGIONS or REVOKE follows on from the generation the initiator knows; move it on."""
        name = kind_of(message).name
        if message.base != WHOLE and message.base != self._regions_generation:
            raise ProtocolError(
                f"a {name} may not {verb} the changes since generation {message.base}: "
                f"the initiator knows generation {self._regions_generation}"
            )
        if message.generation < self._regions_generation:
            raise ProtocolError(f"a {name} of generation {message.generation} is older than {self._regions_generation}")
        self._regions_generation = message.generation

    @property
    def newest_revoke(self) -> int:
        """Target: the generation of the newest REVOKE sent (0: none). A REVOKE of an older one is
        refused: the newer one, which lists the regions as of later, covers it."""
        return self._revokes[-1] if self._revokes else self._confirmed_revoke

    def forget_request(self, req_id: int) -> None:
        """Stop expecting a reply to ``req_id`` (used when the request can never be answered)."""
        self._outstanding.pop(req_id, None)

    @property
    def outstanding(self) -> int:
        """Requests sent and not yet answered."""
        return len(self._outstanding)

    # -- receiving ------------------------------------------------------------------------------
    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Feed bytes from the socket; ``b""`` means the peer closed its end."""
        if not data:
            self._eof = True
            return
        if self.state is ConnState.CLOSED:
            return  # nothing more is parsed: don't let a peer fill our memory
        if self._pos:
            # Drop what was consumed, however the stream is cut, so the buffer holds at most
            # one unparsed frame plus this chunk (deleting a bytearray's front is cheap).
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    _eof = False

    @property
    def buffered(self) -> int:
        """Bytes received and not yet consumed."""
        return len(self._buf) - self._pos

    def next_event(self) -> Event:
        """The next event: a message, :data:`NEED_DATA`, or :class:`ConnectionClosed`.

        Raises :class:`ProtocolError` for a malformed or out-of-place frame and
        :class:`~hixl.AuthenticationFailed` for a failed proof; the connection is
        CLOSED after either.
        """
        if self.data_left:
            raise RuntimeError(f"{self.data_left} bytes of data must be moved before the next frame")
        if self.state is ConnState.CLOSED:
            return ConnectionClosed()
        if self.buffered < HEADER_SIZE:
            return self._end_of_input()
        try:
            pos = self._pos
            header = parse_header_at(self._buf, pos)
            # Checked on the header alone, before waiting for the body: a peer can make us
            # buffer no more than the largest frame it may send now (a HELLO, before the proofs).
            answers = self._check_incoming(header.type, header.req_id, header.data_len)
            end = pos + HEADER_SIZE + header.body_len
            if len(self._buf) < end:
                return self._end_of_input()
            if answers is not None:
                del self._outstanding[answers]
            if self._transcript is not None and header.type in _IN_CLEAR:
                self._transcribed(self._buf[pos:end])
            # A copy: parsed messages (numpy views of descriptors) must not alias the buffer.
            body = bytes(self._buf[pos + HEADER_SIZE : end]) if header.body_len else b""
            message = parse_body(header, body)
            self._pos = end
            self.data_left = header.data_len
            return self._react(message)
        except (ProtocolError, AuthenticationFailed, EncryptionMismatch) as exc:
            self._close(str(exc))
            raise

    def _end_of_input(self) -> Event:
        if self._eof:
            if self.buffered:
                self._close("the peer closed the connection in the middle of a frame")
                raise ProtocolError(f"connection ended {self.buffered} bytes into a frame")
            self._close("the peer closed the connection")
            return ConnectionClosed()
        return NEED_DATA

    def take_data(self, limit: int) -> bytes:
        """Up to ``limit`` bytes of the current bulk data that arrived with its frame."""
        if limit < 0:
            raise ValueError(f"negative limit {limit}")
        n = min(limit, self.data_left, self.buffered)
        data = bytes(self._buf[self._pos : self._pos + n])
        self._pos += n
        self.data_left -= n
        return data

    def data_moved(self, nbytes: int) -> None:
        """The driver moved ``nbytes`` of the current bulk data straight from the socket."""
        if not 0 <= nbytes <= self.data_left:
            raise RuntimeError(f"moved {nbytes} bytes, only {self.data_left} were due")
        self.data_left -= nbytes

    def took_frame(self, kind: FrameType, req_id: int, data_len: int) -> None:
        """The driver recognised one of the frames this side receives most (``_FAST``: an
        initiator's bodiless DATA or ACK, a target's small READ or WRITE) straight off the socket
        (TCP's latency path, see :func:`hixl._accel.tcp_reply` / :func:`~hixl._accel.tcp_request`),
        and parsed it itself: account for it as :meth:`next_event` would for the same bytes —
        refused by the same checks (a :class:`ProtocolError` closes the connection), the request
        it answers forgotten, ``data_len`` bytes of data due. Only with nothing buffered, so that
        frames stay in stream order."""
        if kind not in _FAST[self.role]:
            raise ValueError(f"took_frame is for the frames a {self.role.value} receives most, not {kind!r}")
        if self.data_left or self.buffered:
            raise RuntimeError("a frame read past buffered bytes would leave the stream out of order")
        if self.state is ConnState.CLOSED:
            raise ProtocolError(f"{kind.name} after the connection closed")
        try:
            answers = self._check_incoming(kind, req_id, data_len)
        except ProtocolError as exc:
            self._close(str(exc))
            raise
        if answers is not None:
            del self._outstanding[answers]
        self.data_left = data_len

    def reply_frame(self, kind: FrameType, req_id: int, data_len: int = 0) -> bytes:
        """Target: the bytes of a DATA (``data_len`` bytes of data follow) or an ACK for
        ``req_id`` — :meth:`send` of that message, without building it (the latency path)."""
        if kind not in (_F.DATA, _F.ACK) or (data_len and kind is not _F.DATA):
            raise ValueError(f"reply_frame makes a DATA or a bodiless ACK, not a {kind!r} with {data_len} bytes")
        if kind not in _SENDABLE.get((self.role, self.state), ()):
            raise ProtocolError(f"a {self.role.value} may not send {kind.name} while {self.state.name}")
        return encode_header(kind, req_id, 0, data_len)

    def _receivable(self) -> frozenset[FrameType]:
        """What the peer may send us now, by the tables (see ``_RECEIVABLE``)."""
        if self.state in (ConnState.HANDSHAKE, ConnState.AUTHENTICATED):
            steps = _HANDSHAKE_STEPS[self.role]
            return steps[self._steps] if self._steps < len(steps) else frozenset()
        return _RECEIVABLE.get((self.role, self.state), frozenset())

    def _check_incoming(self, kind: FrameType, req_id: int, data_len: int) -> int | None:
        """Refuse a frame the peer may not send now; the request id it answers, if any. No side effects."""
        if self.state is ConnState.OPEN and kind in _FAST[self.role]:
            # The transfers themselves, in the state they live in: the tables' verdict in fewer steps.
            if self.role is Role.TARGET:
                if req_id:
                    return None
            else:
                request = self._outstanding.get(req_id)
                if request is not None and kind in _REPLIES[request.kind] and data_len == request.data_len:
                    return req_id
        return self._check_by_table(kind, req_id, data_len)

    def _check_by_table(self, kind: FrameType, req_id: int, data_len: int) -> int | None:
        """:meth:`_check_incoming` the long way, straight from the tables (what the fast path must agree with)."""
        allowed = self._receivable()
        peer = Role.TARGET if self.role is Role.INITIATOR else Role.INITIATOR
        if kind not in allowed:
            if self.state in (ConnState.HANDSHAKE, ConnState.AUTHENTICATED):
                wanted = " or ".join(sorted(k.name for k in allowed)) or "nothing"
                raise ProtocolError(f"expected {wanted} from the {peer.value} during the handshake, got {kind.name}")
            raise ProtocolError(f"unexpected {kind.name} from the {peer.value} while {self.state.name}")
        if self.role is Role.INITIATOR and self.state in (ConnState.OPEN, ConnState.CLOSING):
            return self._match_reply(kind, req_id, data_len)
        if self.role is Role.TARGET and kind in _REPLIES and req_id == 0:
            raise ProtocolError(f"{kind.name} with request id 0")
        return None

    def _match_reply(self, kind: FrameType, req_id: int, data_len: int) -> int | None:
        if kind in _UNSOLICITED and (req_id == 0 or kind in _HEARTBEATS):
            return None
        request = self._outstanding.get(req_id)
        if request is None or (kind is not _F.ERROR and kind not in _REPLIES[request.kind]):
            raise ProtocolError(f"{kind.name} answers no request of ours (id {req_id})")
        if kind is _F.DATA and data_len != request.data_len:
            raise ProtocolError(f"DATA carries {data_len} bytes, the READ asked for {request.data_len}")
        return req_id

    def _react(self, message: Message) -> Event:
        """State changes the handshake, goodbyes and revocations bring; the event to report."""
        if type(message) in _PLAIN:
            return message
        if isinstance(message, (Hello, Challenge, Auth, Welcome)):
            self._steps += 1
        if isinstance(message, Hello):
            self._on_hello(message.info)
        elif isinstance(message, Challenge):
            self._on_challenge(message.info)
        elif isinstance(message, Auth):
            self._on_auth(message.info)
        elif isinstance(message, Welcome):
            self._on_welcome(message.info)
        elif isinstance(message, Error) and self.state in (ConnState.HANDSHAKE, ConnState.AUTHENTICATED):
            self._close(f"refused: {message.message}")
        elif isinstance(message, Error) and message.req_id == 0:
            self._close(f"the peer reported a fatal error: {message.message}")
            return PeerFatal(message.status, message.message)
        elif isinstance(message, Regions):
            self._region_update(message, "apply")
            if message.req_id == 0:
                return RegionsPushed(message)
        elif isinstance(message, Revoke):
            if message.generation <= self._last_revoke:
                raise ProtocolError(f"REVOKE generation {message.generation} is not newer than {self._last_revoke}")
            self._region_update(message, "apply")
            self._last_revoke = message.generation
        elif isinstance(message, Revoked):
            if message.generation not in self._revokes:
                raise ProtocolError(f"REVOKED confirms generation {message.generation}, which no outstanding REVOKE announced")
            self._confirmed_revoke = message.generation
            del self._revokes[: self._revokes.index(message.generation) + 1]  # it confirms the older ones too
        elif isinstance(message, Bye):
            self._close(f"the peer said goodbye ({message.reason or 'no reason given'})")
        elif isinstance(message, Pong) and self.role is Role.INITIATOR and message.clock:
            self._clock_sample(message.clock)
        return message

    def _on_hello(self, info: dict[str, Any]) -> None:
        versions = info.get("versions")
        if not (isinstance(versions, list) and len(versions) == 2 and all(type(v) is int for v in versions)):
            raise ProtocolError(f"HELLO offers no version range (hixl before protocol {MIN_VERSION}?)")
        low, high = max(versions[0], self._low), min(versions[1], self._high)
        if low > high:
            raise ProtocolError(
                f"no common protocol version: the initiator speaks {versions[0]}..{versions[1]}, "
                f"this engine {self._low}..{self._high}"
            )
        self.version = high
        self._peer_nonce = _nonce(info, "HELLO")
        if (info.get("encrypt") is True) != self.encrypt:
            self.encryption_mismatch = (
                "this engine encrypts its links (encrypt=True) and the initiator does not: no plaintext link"
                if self.encrypt
                else "the initiator encrypts its links (encrypt=True) and this engine does not (encrypt=False)"
            )

    def _on_challenge(self, info: dict[str, Any]) -> None:
        version = info.get("version")
        if type(version) is not int or not self._low <= version <= self._high:
            raise ProtocolError(f"the target chose protocol version {version!r}; this engine speaks {self._low}..{self._high}")
        self.version = version
        self._peer_nonce = _nonce(info, "CHALLENGE")
        expected = auth.proof(self._key, "target", self._peer_nonce, self._nonce, version)
        if not auth.verify(expected, info.get("proof")):
            raise AuthenticationFailed(
                "the target could not prove it knows the shared secret "
                "(auth_secret / HIXL_AUTH_SECRET differ between the two engines?)"
            )
        if (info.get("encrypt") is True) != self.encrypt:
            raise EncryptionMismatch(
                "this engine encrypts its links (encrypt=True) and the target does not: no plaintext link"
                if self.encrypt
                else "the target encrypts its links (encrypt=True): connect with encrypt=True too"
            )
        self._clock_sample(info.get("clock"))
        self._session_key = auth.session_key(self._key, self._nonce, self._peer_nonce, version)
        self.state = ConnState.AUTHENTICATED
        if self.encrypt:
            self._start_sealing()

    def _start_sealing(self) -> None:
        """From the next byte on, both ways, the stream is sealed records (see the module docstring).
        Nothing may have come after the frame that switched it: each side sends its next step only
        once it has this one's answer, so bytes already here were sent past the handshake's turn."""
        if self.buffered:
            raise ProtocolError(f"{self.buffered} bytes came in plaintext where only sealed records may")
        assert self._transcript is not None
        self.seal = Seal(self._session_key, self.role.value, self._transcript.digest())
        self._transcript = None
        if self.role is Role.TARGET:
            # Until its AUTH proved it, the peer may send that one frame, in one record, and no more.
            self.seal.opener.limit = HEADER_SIZE + BODY_LIMITS[_F.AUTH]

    def _transcribed(self, frame: T) -> T:
        """``frame``, a HELLO or CHALLENGE sent or received, hashed into what the seal's keys derive
        from (encrypting; see the module docstring)."""
        if self._transcript is not None:
            self._transcript.update(frame)
        return frame

    def _on_auth(self, info: dict[str, Any]) -> None:
        expected = auth.proof(self._key, "initiator", self._peer_nonce, self._nonce, self.version)
        if not auth.verify(expected, info.get("proof")):
            raise AuthenticationFailed("the initiator could not prove it knows the shared secret")
        peer_info = info.get("info")
        if not isinstance(peer_info, dict):
            raise ProtocolError("AUTH carries no info object")
        self.peer_info = peer_info
        self.state = ConnState.AUTHENTICATED
        if self.seal is not None:
            self.seal.opener.limit = RECORD_MAX

    def _on_welcome(self, info: dict[str, Any]) -> None:
        peer_info = info.get("info")
        if not isinstance(peer_info, dict):
            raise ProtocolError("WELCOME carries no info object")
        if not auth.verify(auth.mac(self._session_key, "welcome", _canonical(peer_info)), info.get("mac")):
            raise AuthenticationFailed("the WELCOME was not made for this connection (replayed or forged)")
        self._regions_generation = _generation_of(peer_info)
        self.peer_info = peer_info
        self.state = ConnState.OPEN

    def _close(self, reason: str) -> None:
        if self.state is not ConnState.CLOSED:
            self.state = ConnState.CLOSED
            self.closed_reason = reason
            self._outstanding.clear()

    # -- deadlines across two clocks --------------------------------------------------------------
    def _clock_sample(self, peer_clock: object) -> None:
        # Anything but a finite number (NaN, inf, a JSON int too big for a float) says nothing.
        if isinstance(peer_clock, bool) or not isinstance(peer_clock, (int, float)):
            return
        try:
            peer_clock = float(peer_clock)
        except OverflowError:
            return
        if not math.isfinite(peer_clock):
            return
        # The peer read ``peer_clock`` no later than now, so peer - ours >= peer_clock - now:
        # a lower bound of the offset. The tightest recent one wins; old ones expire (drift).
        now = self._clock()
        sample = peer_clock - now
        if self._clock_offset is None or sample > self._clock_offset or now - self._offset_at > 30.0:
            self._clock_offset, self._offset_at = sample, now

    def peer_deadline(self, deadline: float | None) -> int:
        """Our monotonic ``deadline`` as the peer's clock in microseconds, never later than ours.

        0 means none. The conversion uses a lower bound of the clock offset, so the
        peer's deadline falls no later than ours (by the handshake's round trip at most
        earlier): a target that lands nothing past it lands nothing after we report TIMEOUT.
        """
        if deadline is None:
            return 0
        offset = self._clock_offset if self._clock_offset is not None else 0.0
        # Clamped to what a frame's signed 64-bit deadline holds (an absurd peer clock).
        micros = int((deadline + offset - DEADLINE_GUARD) * 1e6)
        return micros if 0 < micros <= _I64_MAX else max(1, min(_I64_MAX, micros))

    def __repr__(self) -> str:
        return (
            f"<Connection {self.role.value} {self.state.name} v{self.version} "
            f"outstanding={len(self._outstanding)} buffered={self.buffered}>"
        )


def _nonce(info: dict[str, Any], what: str) -> str:
    nonce = info.get("nonce")
    if not isinstance(nonce, str) or len(nonce) != auth.NONCE_HEX:
        raise ProtocolError(f"{what} carries no valid nonce")
    try:
        bytes.fromhex(nonce)
    except ValueError:
        raise ProtocolError(f"{what} nonce is not hex") from None
    return nonce


def _generation_of(info: dict[str, Any]) -> int:
    """A WELCOME info's registration generation (that of its ``regions``)."""
    generation = info.get("generation")
    if type(generation) is not int or not 0 <= generation < WHOLE:
        raise ProtocolError(f"WELCOME names no registration generation (got {generation!r})")
    return generation


def _canonical(info: dict[str, Any]) -> bytes:
    return json.dumps(info, sort_keys=True, separators=(",", ":")).encode()
