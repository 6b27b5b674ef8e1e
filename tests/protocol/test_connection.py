"""The Connection state machine, sans I/O: handshake and proofs, legality of every frame in every
state, request ids, goodbyes, bulk data, deadlines across two clocks, and that how a stream is cut
into chunks never changes what comes out of it."""

from __future__ import annotations

import json
import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hixl import AuthenticationFailed, ProtocolError
from hixl._protocol import NEED_DATA, ConnState, Connection, ConnectionClosed, FrameType, PeerFatal, RegionsPushed, Role
from hixl._protocol import auth
from hixl._protocol import frames as F

from .helpers import (
    ANSWER,
    INITIATOR_INFO,
    OUTSTANDING,
    RECEIVABLE,
    SECRET,
    SENDABLE,
    STATE_OF,
    TARGET_INFO,
    Driver,
    FakeClock,
    any_message,
    at,
    clone,
    descs,
    frame_of,
    handshake,
    one_event,
    request,
)

OTHER = auth.Secret(b"not the secret")
NO_ROWS = np.zeros((0, 3), np.uint64)


def _body(frame: bytes) -> dict:
    return json.loads(frame[F.HEADER_SIZE :])


def _refuses(conn: Connection, frame: bytes, error: type[Exception], match: str) -> None:
    conn.receive_data(frame)
    with pytest.raises(error, match=match):
        conn.next_event()
    assert conn.state is ConnState.CLOSED
    assert isinstance(conn.next_event(), ConnectionClosed)


# -- handshakes -----------------------------------------------------------------------------------
@pytest.mark.parametrize("secret", [SECRET, None], ids=["secret", "no-secret"])
def test_full_handshake(secret: auth.Secret | None) -> None:
    i, t = Connection(Role.INITIATOR, secret), Connection(Role.TARGET, secret)
    assert i.state is t.state is ConnState.HANDSHAKE and i.version == t.version == 0
    hello = i.initiate()
    assert isinstance(one_event(t, hello), F.Hello) and t.state is ConnState.HANDSHAKE
    assert t.version == F.VERSION
    challenge = t.challenge()
    assert isinstance(one_event(i, challenge), F.Challenge)
    assert i.state is ConnState.AUTHENTICATED and i.version == F.VERSION
    auth_frame = i.authenticate(dict(INITIATOR_INFO))
    assert isinstance(one_event(t, auth_frame), F.Auth)
    assert t.state is ConnState.AUTHENTICATED and t.peer_info == INITIATOR_INFO
    welcome = t.welcome(dict(TARGET_INFO))
    assert t.state is ConnState.OPEN
    assert isinstance(one_event(i, welcome), F.Welcome)
    assert i.state is ConnState.OPEN and i.peer_info == TARGET_INFO
    assert i.binding("probe") == t.binding("probe")
    # What each side says before the other proved itself: nothing about the engine.
    assert set(_body(hello)) == {"versions", "nonce", "clock"}
    assert set(_body(challenge)) == {"version", "nonce", "proof", "clock"}
    assert _body(hello)["nonce"] != _body(challenge)["nonce"]
    assert "OPEN" in repr(i) and "initiator" in repr(i)


def test_the_secret_is_what_is_proven() -> None:
    """With and without a secret the exchange runs; the proofs differ, so they depend on it."""
    with_secret, without = handshake(SECRET, SECRET), handshake(None, None)
    for pair in (with_secret, without):
        assert pair.initiator.state is pair.target.state is ConnState.OPEN
    nonce_i, nonce_t = _body(with_secret.to_target[0])["nonce"], _body(with_secret.to_initiator[0])["nonce"]
    assert _body(with_secret.to_initiator[0])["proof"] == auth.proof(SECRET.key, "target", nonce_t, nonce_i, F.VERSION)
    assert _body(with_secret.to_initiator[0])["proof"] != auth.proof(b"", "target", nonce_t, nonce_i, F.VERSION)


@pytest.mark.parametrize(
    ("secret_i", "secret_t"), [(SECRET, OTHER), (None, SECRET), (SECRET, None)], ids=["different", "initiator-none", "target-none"]
)
def test_wrong_secret_is_detected_by_the_initiator(secret_i: auth.Secret | None, secret_t: auth.Secret | None) -> None:
    """The target proves itself first, so the initiator is the one to find out; it says nothing more."""
    pair = handshake(secret_i, secret_t, until="hello")
    i = pair.initiator
    _refuses(i, pair.to_initiator[-1], AuthenticationFailed, "target could not prove")
    with pytest.raises(ProtocolError):
        i.authenticate(dict(INITIATOR_INFO))  # no AUTH, no identity, to a target that failed
    for text in (i.closed_reason, repr(i)):
        assert "horse" not in text and "not the secret" not in text


@pytest.mark.parametrize("attacker_key", [OTHER.key, b""], ids=["wrong-secret", "no-secret"])
def test_wrong_secret_is_detected_by_the_target(attacker_key: bytes) -> None:
    """An initiator that skips the check (an attacker) is caught by the target's own check."""
    pair = handshake(SECRET, SECRET, until="hello")
    t = pair.target
    nonce_i, nonce_t = _body(pair.to_target[0])["nonce"], _body(pair.to_initiator[0])["nonce"]
    forged = auth.proof(attacker_key, "initiator", nonce_i, nonce_t, F.VERSION)
    _refuses(t, F.encode(F.Auth({"proof": forged, "info": {}})), AuthenticationFailed, "initiator could not prove")
    assert t.peer_info == {}
    with pytest.raises(ProtocolError):
        t.welcome(dict(TARGET_INFO))
    assert "horse" not in t.closed_reason


@pytest.mark.parametrize("proof", [None, 0, ["x"], "", "zz" * 32, "\ud800" * 64], ids=repr)
def test_auth_without_a_usable_proof(proof: object) -> None:
    pair = handshake(SECRET, SECRET, until="hello")
    info = {"info": {}} if proof is None else {"proof": proof, "info": {}}
    _refuses(pair.target, F.encode(F.Auth(info)), AuthenticationFailed, "could not prove")


def test_auth_without_info_is_refused() -> None:
    pair = handshake(SECRET, SECRET, until="hello")
    nonce_i, nonce_t = _body(pair.to_target[0])["nonce"], _body(pair.to_initiator[0])["nonce"]
    good = auth.proof(SECRET.key, "initiator", nonce_i, nonce_t, F.VERSION)
    _refuses(pair.target, F.encode(F.Auth({"proof": good, "info": [1]})), ProtocolError, "no info object")


def test_a_target_proof_cannot_be_reflected_as_the_initiators() -> None:
    pair = handshake(SECRET, SECRET, until="hello")
    challenge = _body(pair.to_initiator[0])
    # Echo the target's own proof back; then the target-labelled proof over the initiator's nonce order.
    nonce_i, nonce_t = _body(pair.to_target[0])["nonce"], challenge["nonce"]
    for proof in (challenge["proof"], auth.proof(SECRET.key, "target", nonce_i, nonce_t, F.VERSION)):
        t = clone(pair.target)
        _refuses(t, F.encode(F.Auth({"proof": proof, "info": {}})), AuthenticationFailed, "initiator could not prove")
    # The genuine one passes on the same connection: the refusals were about the proof alone.
    good = auth.proof(SECRET.key, "initiator", nonce_i, nonce_t, F.VERSION)
    assert isinstance(one_event(clone(pair.target), F.encode(F.Auth({"proof": good, "info": {}}))), F.Auth)


def test_an_initiator_proof_cannot_be_reflected_as_the_targets() -> None:
    pair = handshake(SECRET, SECRET, until="hello")
    challenge = _body(pair.to_initiator[0])
    nonce_i, nonce_t = _body(pair.to_target[0])["nonce"], challenge["nonce"]
    for proof in (
        auth.proof(SECRET.key, "initiator", nonce_t, nonce_i, F.VERSION),  # same order, other label
        auth.proof(SECRET.key, "initiator", nonce_i, nonce_t, F.VERSION),  # the initiator's own AUTH proof
    ):
        i = clone(pair.initiator)
        _refuses(i, F.encode(F.Challenge(challenge | {"proof": proof})), AuthenticationFailed, "target could not prove")
    assert isinstance(one_event(clone(pair.initiator), pair.to_initiator[0]), F.Challenge)


def test_a_recorded_handshake_does_not_work_on_a_new_connection() -> None:
    old = handshake(SECRET, SECRET)
    # A recorded CHALLENGE to a new initiator: its nonce is new, so the proof is not for it.
    _refuses(handshake(SECRET, SECRET, until="start").initiator, old.to_initiator[0], AuthenticationFailed, "could not prove")
    # A recorded AUTH to a new target, after a fresh HELLO.
    _refuses(handshake(SECRET, SECRET, until="hello").target, old.to_target[1], AuthenticationFailed, "could not prove")


@pytest.mark.parametrize("secret", [SECRET, None], ids=["secret", "no-secret"])
def test_a_replayed_welcome_is_refused(secret: auth.Secret | None) -> None:
    old_welcome = handshake(secret, secret).to_initiator[-1]
    # After the new target's proof passed: the MAC is under another connection's session key.
    fresh = handshake(secret, secret, until="authenticated").initiator
    _refuses(fresh, old_welcome, AuthenticationFailed, "replayed or forged")
    assert fresh.peer_info == {}
    # Before the CHALLENGE it is out of place altogether.
    _refuses(handshake(secret, secret, until="start").initiator, old_welcome, ProtocolError, "expected CHALLENGE or ERROR")


def test_a_tampered_welcome_is_refused() -> None:
    pair = handshake(SECRET, SECRET, until="authenticated")
    welcome = _body(pair.target.welcome(dict(TARGET_INFO)))
    forged = {"info": TARGET_INFO | {"pid": 1}, "mac": welcome["mac"]}
    _refuses(clone(pair.initiator), F.encode(F.Welcome(forged)), AuthenticationFailed, "replayed or forged")
    _refuses(clone(pair.initiator), F.encode(F.Welcome({"info": TARGET_INFO})), AuthenticationFailed, "replayed")
    _refuses(clone(pair.initiator), F.encode(F.Welcome({"mac": welcome["mac"]})), ProtocolError, "no info object")
    assert isinstance(one_event(clone(pair.initiator), F.encode(F.Welcome(welcome))), F.Welcome)


def test_the_target_says_nothing_about_itself_before_auth_passed() -> None:
    """What the target-side API lets the engine produce, state by state."""
    about_target = [
        F.Welcome({"info": TARGET_INFO, "mac": ""}),
        F.Regions(3, F.WHOLE, np.array([[4096, 8192, 1]], dtype=np.uint64), np.zeros((0, 3), np.uint64)),
        F.Meta(1, b"catalog"),
        F.Data(1, 8),
        F.Ack(1),
    ]
    pair = handshake(SECRET, SECRET, until="start")
    t = pair.target
    for stage in ("before HELLO", "after HELLO", "after CHALLENGE"):
        if stage == "after HELLO":
            assert isinstance(one_event(t, pair.initiator.initiate()), F.Hello)
        if stage == "after CHALLENGE":
            challenge = t.challenge()
        for message in about_target:
            with pytest.raises(ProtocolError, match="may not send"):
                t.send(message)
        with pytest.raises(ProtocolError, match="may not send WELCOME"):
            t.welcome(dict(TARGET_INFO))
        with pytest.raises(ProtocolError, match="no session key"):
            t.binding("probe")
        assert t.state is ConnState.HANDSHAKE, stage
    assert set(_body(challenge)) == {"version", "nonce", "proof", "clock"}
    # A failed AUTH closes: still nothing.
    failed = clone(t)
    _refuses(failed, F.encode(F.Auth({"proof": "00" * 32, "info": {}})), AuthenticationFailed, "could not prove")
    for message in about_target:
        with pytest.raises(ProtocolError, match="may not send"):
            failed.send(message)
    # The AUTH that passes opens the WELCOME, and only that until it is sent.
    assert isinstance(one_event(pair.initiator, challenge), F.Challenge)
    assert isinstance(one_event(t, pair.initiator.authenticate({})), F.Auth)
    assert t.state is ConnState.AUTHENTICATED
    for message in about_target[1:]:
        with pytest.raises(ProtocolError, match="while AUTHENTICATED"):
            t.send(message)
    t.welcome(dict(TARGET_INFO))
    assert t.send(about_target[1])


def test_the_initiator_says_who_it_is_only_after_the_target_proved_itself() -> None:
    i = Connection(Role.INITIATOR, SECRET)
    for step in range(2):  # before and after its HELLO
        with pytest.raises(ProtocolError, match="may not send AUTH"):
            i.authenticate(dict(INITIATOR_INFO))
        with pytest.raises(ProtocolError, match="may not send READ"):
            i.send(request(FrameType.READ, 1))
        if step == 0:
            i.initiate()
    with pytest.raises(ProtocolError, match="may not send HELLO"):
        i.initiate()  # once only


def test_the_target_may_refuse_the_handshake() -> None:
    pair = handshake(SECRET, SECRET, until="hello")
    refusal = clone(pair.target).refuse(7, "too many connections")
    i = pair.initiator
    event = one_event(i, refusal)
    assert isinstance(event, F.Error) and event.status == 7
    assert i.state is ConnState.CLOSED and "too many connections" in i.closed_reason
    t = clone(pair.target)
    t.refuse(7, "no")
    assert t.state is ConnState.CLOSED


# -- version negotiation -----------------------------------------------------------------------
def _hello(versions: object) -> bytes:
    return F.encode(F.Hello({"versions": versions, "nonce": "ab" * 32, "clock": 0.0}))


@pytest.mark.parametrize(
    ("offered", "chosen"), [([1, 3], 3), ([3, 9], 4), ([2, 2], 2), ([0, 4], 4), ([4, 4], 4), ([2, 1 << 70], 4)]
)
def test_version_negotiation_picks_the_highest_common(offered: list, chosen: int) -> None:
    t = Connection(Role.TARGET, versions=(2, 4))
    assert isinstance(one_event(t, _hello(offered)), F.Hello)
    assert t.version == chosen
    assert _body(t.challenge())["version"] == chosen


@pytest.mark.parametrize("offered", [[5, 9], [0, 1], [4, 2], [-5, -1]])
def test_disjoint_versions_are_refused(offered: list) -> None:
    _refuses(Connection(Role.TARGET, versions=(2, 4)), _hello(offered), ProtocolError, "no common protocol version")


@pytest.mark.parametrize("offered", [None, 2, [2], [2, 2, 2], ["2", "2"], [2.0, 2], [True, 2], {"a": 2}], ids=repr)
def test_a_hello_without_a_version_range(offered: object) -> None:
    hello = {"nonce": "ab" * 32} if offered is None else {"versions": offered, "nonce": "ab" * 32}
    _refuses(Connection(Role.TARGET), F.encode(F.Hello(hello)), ProtocolError, "version")


@pytest.mark.parametrize("nonce", [None, 1, "ab", "ab" * 33, "zz" * 32, "\u00e9" * 64], ids=repr)
def test_a_handshake_without_a_valid_nonce(nonce: object) -> None:
    hello = {"versions": [F.MIN_VERSION, F.VERSION]} | ({} if nonce is None else {"nonce": nonce})
    _refuses(Connection(Role.TARGET), F.encode(F.Hello(hello)), ProtocolError, "HELLO .*nonce")
    pair = handshake(SECRET, SECRET, until="hello")
    challenge = _body(pair.to_initiator[0])
    challenge = {k: v for k, v in challenge.items() if k != "nonce"} | ({} if nonce is None else {"nonce": nonce})
    _refuses(pair.initiator, F.encode(F.Challenge(challenge)), ProtocolError, "CHALLENGE .*nonce")


@pytest.mark.parametrize("version", [None, 0, 1, F.VERSION + 1, "2", 2.0], ids=repr)
def test_the_initiator_refuses_a_version_it_does_not_speak(version: object) -> None:
    pair = handshake(SECRET, SECRET, until="hello")
    challenge = _body(pair.to_initiator[0]) | {"version": version}
    _refuses(pair.initiator, F.encode(F.Challenge(challenge)), ProtocolError, "version")


def test_a_downgraded_version_fails_the_proof() -> None:
    """The chosen version is inside the proof: a man in the middle cannot lower it."""
    pair = handshake(SECRET, SECRET, until="hello", versions=(2, 3))
    challenge = _body(pair.to_initiator[0])
    assert challenge["version"] == 3
    _refuses(pair.initiator, F.encode(F.Challenge(challenge | {"version": 2})), AuthenticationFailed, "could not prove")


# -- the legality table ------------------------------------------------------------------------
CELLS = [(role, stage) for role, stage in SENDABLE if (role, stage) in RECEIVABLE]
_AT: dict[tuple[Role, str], Connection] = {}


def _at(role: Role, stage: str) -> Connection:
    """A fresh copy of a connection at ``stage`` (handshakes are slow here: one per cell, cloned)."""
    if (role, stage) not in _AT:
        _AT[role, stage] = at(role, stage)
    return clone(_AT[role, stage])


def _sample(role: Role, kind: FrameType) -> F.Message:
    """A message of ``kind`` that ``role`` could send, with an id that suits the receiver."""
    if role is Role.INITIATOR:
        return any_message(kind, 50 + int(kind))  # fresh ids for requests
    return any_message(kind, ANSWER.get(kind, 0))  # replies to the OUTSTANDING requests of at()


@pytest.mark.parametrize(("role", "stage"), CELLS, ids=[f"{r.value}-{s}" for r, s in CELLS])
def test_send_legality(role: Role, stage: str) -> None:
    for kind in FrameType:
        conn, split = _at(role, stage), _at(role, stage)  # send_split follows the same table
        before = (conn.state, conn.outstanding)
        message = _sample(role, kind)
        if kind in SENDABLE[(role, stage)]:
            frame = conn.send(message)
            assert F.parse_header(frame[: F.HEADER_SIZE]).type is kind
            assert b"".join(split.send_split(message)) == frame and split.state is conn.state
        else:
            for sender, send in ((conn, conn.send), (split, split.send_split)):
                with pytest.raises(ProtocolError, match=f"may not send {kind.name} while {STATE_OF[stage].name}"):
                    send(message)
                assert (sender.state, sender.outstanding) == before, kind  # a refusal changes nothing


def _honest(role: Role, stage: str, kind: FrameType) -> tuple[Connection, bytes]:
    """The connection and the genuine handshake frame it expects next (a proof only it accepts)."""
    if (role, stage, kind) == (Role.INITIATOR, "start", FrameType.CHALLENGE):
        pair = handshake(SECRET, SECRET, until="hello")
        return pair.initiator, pair.to_initiator[-1]
    if (role, stage, kind) == (Role.TARGET, "hello", FrameType.AUTH):
        pair = handshake(SECRET, SECRET, until="hello")
        one_event(pair.initiator, pair.to_initiator[-1])
        return pair.target, pair.initiator.authenticate({})
    assert (role, stage, kind) == (Role.INITIATOR, "authenticated", FrameType.WELCOME)
    pair = handshake(SECRET, SECRET, until="authenticated")
    return pair.initiator, pair.target.welcome(dict(TARGET_INFO))


@pytest.mark.parametrize(("role", "stage"), CELLS, ids=[f"{r.value}-{s}" for r, s in CELLS])
def test_receive_legality(role: Role, stage: str) -> None:
    peer = Role.TARGET if role is Role.INITIATOR else Role.INITIATOR
    for kind in FrameType:
        legal = kind in RECEIVABLE[(role, stage)]
        if legal and kind in (FrameType.CHALLENGE, FrameType.AUTH, FrameType.WELCOME):
            conn, frame = _honest(role, stage, kind)
        else:
            conn, frame = _at(role, stage), F.encode(_sample(peer, kind))
        if stage == "closed":
            conn.receive_data(frame)
            assert isinstance(conn.next_event(), ConnectionClosed)  # nothing is parsed any more
            continue
        if legal:
            assert frame_of(one_event(conn, frame)) is kind
            continue
        # Refused on the header alone: the body of a frame that may not come is never waited for.
        conn.receive_data(frame[: F.HEADER_SIZE])
        with pytest.raises(ProtocolError, match=f"{kind.name}"):
            conn.next_event()
        assert conn.state is ConnState.CLOSED and conn.outstanding == 0, kind


def test_an_illegal_frame_is_refused_before_its_body_is_buffered() -> None:
    """A peer that has not proven itself cannot make the target wait for a 16 MiB META body."""
    t = Connection(Role.TARGET, SECRET)
    t.receive_data(F.encode_header(FrameType.META, 1, F.BODY_LIMITS[FrameType.META]))
    with pytest.raises(ProtocolError, match="expected HELLO .* got META"):
        t.next_event()
    t2 = Connection(Role.TARGET, SECRET)
    t2.receive_data(F.encode_header(FrameType.HELLO, 0, F.BODY_LIMITS[FrameType.HELLO]))
    assert t2.next_event() is NEED_DATA  # the one frame it may send: up to 4 KiB


# -- request ids -----------------------------------------------------------------------------------
def test_request_ids_on_send() -> None:
    i = at(Role.INITIATOR, "open")
    assert i.outstanding == len(OUTSTANDING)
    for kind in (FrameType.READ, FrameType.WRITE, FrameType.NOTIFY, FrameType.QUERY_REGIONS, FrameType.QUERY_META):
        with pytest.raises(ProtocolError, match="request id 0 is zero"):
            i.send(request(kind, 0))
        with pytest.raises(ProtocolError, match="request id 1 is zero or already in use"):
            i.send(request(kind, 1))
    assert i.outstanding == len(OUTSTANDING)
    i.send(request(FrameType.PING, 0))  # not requests: no id needed, nothing remembered
    i.send(request(FrameType.PING, 1))
    assert i.outstanding == len(OUTSTANDING)
    # An answered id is free again.
    assert isinstance(one_event(i, F.encode(F.Ack(2))), F.Ack)
    assert i.outstanding == len(OUTSTANDING) - 1
    i.send(request(FrameType.READ, 2))
    i.forget_request(2)
    i.forget_request(999)  # unknown: nothing
    assert i.outstanding == len(OUTSTANDING) - 1
    _refuses(i, F.encode(F.Data(2, 16)), ProtocolError, "answers no request")


@pytest.mark.parametrize(
    ("reply", "match"),
    [
        (F.Ack(99), "ACK answers no request of ours \\(id 99\\)"),
        (F.Data(2, 16), "DATA answers no request"),  # 2 is a WRITE
        (F.Ack(1), "ACK answers no request"),  # 1 is a READ
        (F.Meta(4, b""), "META answers no request"),  # 4 is QUERY_REGIONS
        (F.Regions(3, F.WHOLE, np.zeros((0, 3), np.uint64), np.zeros((0, 3), np.uint64), 5), "REGIONS answers no request"),  # 5 is QUERY_META
        (F.Error(99, 1, "x"), "ERROR answers no request"),
        (F.Bye(1, "x"), "BYE answers no request"),
    ],
    ids=repr,
)
def test_replies_must_answer_an_outstanding_request_of_the_right_kind(reply: F.Message, match: str) -> None:
    _refuses(at(Role.INITIATOR, "open"), F.encode(reply), ProtocolError, match)


def test_every_request_gets_exactly_one_answer() -> None:
    i = at(Role.INITIATOR, "open")
    replies = [F.Data(1, 16), F.Ack(2), F.Ack(3), F.Regions(3, F.WHOLE, np.zeros((1, 3), np.uint64), np.zeros((0, 3), np.uint64), 4), F.Meta(5, b"v")]
    for n, message in enumerate(replies, 1):
        assert isinstance(one_event(i, F.encode(message)), type(message))
        i.data_moved(i.data_left)
        assert i.outstanding == len(OUTSTANDING) - n
    _refuses(i, F.encode(F.Ack(2)), ProtocolError, "answers no request")


@pytest.mark.parametrize("req_id", [1, 2, 3, 4, 5])
def test_error_answers_any_request(req_id: int) -> None:
    i = at(Role.INITIATOR, "open")
    assert isinstance(one_event(i, F.encode(F.Error(req_id, 6, "no"))), F.Error)
    assert i.outstanding == len(OUTSTANDING) - 1


def test_unsolicited_frames_need_no_request() -> None:
    i = at(Role.INITIATOR, "open")
    for message in (F.Ping(0), F.Ping(77), F.Pong(78, 1.0)):
        assert isinstance(one_event(i, F.encode(message)), type(message))
    pushed = one_event(i, F.encode(F.Regions(4, 2, np.ones((2, 3), np.uint64), np.zeros((0, 3), np.uint64))))
    assert isinstance(pushed, RegionsPushed) and pushed.update.added.tolist() == [[1, 1, 1]] * 2  # its own event
    assert i.outstanding == len(OUTSTANDING) and i.state is ConnState.OPEN
    fatal = one_event(i, F.encode(F.Error(0, 6, "going away")))
    assert fatal == PeerFatal(6, "going away") and i.state is ConnState.CLOSED  # ends the connection


def test_data_must_carry_what_the_read_asked_for() -> None:
    """The connection knows each READ's length: a DATA of another is refused on its header."""
    for wrong in (0, 15, 17, 1 << 40):
        _refuses(at(Role.INITIATOR, "open"), F.encode(F.Data(1, wrong)), ProtocolError, "the READ asked for 16")
    fast = at(Role.INITIATOR, "open")  # the latency path's READ, packed from pairs: the same rule
    fast.transfer_frame(False, 9, 0, [(4096, 8), (8192, 4)], 0)
    _refuses(fast, F.encode(F.Data(9, 8)), ProtocolError, "the READ asked for 12")


def test_revocations_are_tracked_both_ways() -> None:
    """REVOKE generations only grow; a REVOKED must confirm one the target announced (it confirms
    the older ones with it), and a REVOKE the newer one covers is refused to the sender."""
    pair = handshake(SECRET, SECRET)
    i, t = pair.initiator, pair.target
    one_event(i, t.send(F.Revoke(3, F.WHOLE, NO_ROWS, NO_ROWS)))
    one_event(i, t.send(F.Revoke(5, 3, NO_ROWS, NO_ROWS)))
    assert t.newest_revoke == 5
    with pytest.raises(ProtocolError, match="not newer"):
        t.send(F.Revoke(4, F.WHOLE, NO_ROWS, NO_ROWS))
    assert isinstance(one_event(t, i.send(F.Revoked(5))), F.Revoked)  # confirms 3 too
    _refuses(clone(t), i.send(F.Revoked(3)), ProtocolError, "no outstanding REVOKE")
    _refuses(clone(i), F.encode(F.Revoke(5, F.WHOLE, NO_ROWS, NO_ROWS)), ProtocolError, "not newer")


def test_region_updates_follow_on_from_the_generation_the_initiator_knows() -> None:
    """WELCOME names the generation of its regions; a REGIONS or REVOKE listing only what changed
    must change exactly the generation the initiator knows, and each moves it on — on both ends."""
    pair = handshake(SECRET, SECRET)
    i, t = pair.initiator, pair.target
    assert i.regions_generation == t.regions_generation == TARGET_INFO["generation"] == 2
    rows = np.array([[1 << 20, 4096, 1]], dtype=np.uint64)
    assert isinstance(one_event(i, t.send(F.Regions(4, 2, rows, NO_ROWS))), RegionsPushed)
    assert i.regions_generation == t.regions_generation == 4
    # The target refuses to send a change of a generation the peer does not know ...
    with pytest.raises(ProtocolError, match="changes since generation 3: the initiator knows generation 4"):
        t.send(F.Regions(5, 3, rows, NO_ROWS))
    with pytest.raises(ProtocolError, match="older than 4"):
        t.send(F.Regions(3, F.WHOLE, rows, NO_ROWS))
    # ... and the initiator refuses one it is sent (a forged or reordered update).
    _refuses(clone(i), F.encode(F.Regions(6, 5, rows, NO_ROWS)), ProtocolError, "initiator knows generation 4")
    _refuses(clone(i), F.encode(F.Revoke(6, 3, NO_ROWS, rows)), ProtocolError, "initiator knows generation 4")
    # A whole table (the answer to QUERY_REGIONS, here) moves it on from anywhere not older.
    i.send(F.QueryRegions(4))
    whole = F.Regions(7, F.WHOLE, rows, NO_ROWS, 4)
    assert isinstance(one_event(i, t.send(whole)), F.Regions) and i.regions_generation == 7


@pytest.mark.parametrize("generation", [None, -1, "2", 1.5, 1 << 64], ids=repr)
def test_a_welcome_must_name_its_regions_generation(generation: object) -> None:
    pair = handshake(SECRET, SECRET, until="authenticated")
    info = {k: v for k, v in TARGET_INFO.items() if k != "generation"} | ({} if generation is None else {"generation": generation})
    with pytest.raises(ProtocolError, match="names no registration generation"):
        pair.target.welcome(info)


def test_the_nonce_source_is_injectable() -> None:
    initiator = Connection(Role.INITIATOR, SECRET, nonce_source=lambda: "11" * 32)
    hello = one_event(Connection(Role.TARGET, SECRET), initiator.initiate())
    assert isinstance(hello, F.Hello) and hello.info["nonce"] == "11" * 32


@pytest.mark.parametrize("kind", [FrameType.READ, FrameType.WRITE, FrameType.NOTIFY, FrameType.QUERY_REGIONS, FrameType.QUERY_META], ids=lambda k: k.name)
def test_the_target_refuses_request_id_zero(kind: FrameType) -> None:
    _refuses(at(Role.TARGET, "open"), F.encode(request(kind, 0)), ProtocolError, f"{kind.name} with request id 0")
    assert isinstance(one_event(at(Role.TARGET, "open"), F.encode(request(kind, 1))), type(request(kind, 1)))


def test_a_reply_split_across_chunks_is_matched_once() -> None:
    i = at(Role.INITIATOR, "open")
    frame = F.encode(F.Meta(5, b"x" * 100))
    i.receive_data(frame[:40])
    assert i.next_event() is NEED_DATA and i.next_event() is NEED_DATA
    assert i.outstanding == len(OUTSTANDING)
    i.receive_data(frame[40:])
    assert isinstance(i.next_event(), F.Meta) and i.outstanding == len(OUTSTANDING) - 1


# -- goodbyes and the end of the stream -----------------------------------------------------------
def test_bye_sent_then_received() -> None:
    i = at(Role.INITIATOR, "open")
    i.send(F.Bye(0, "finalizing"))
    assert i.state is ConnState.CLOSING and i.outstanding == len(OUTSTANDING)
    with pytest.raises(ProtocolError, match="may not send READ while CLOSING"):
        i.send(request(FrameType.READ, 9))
    i.send(F.Pong(0))
    # Replies to what was in flight still arrive and are matched.
    assert isinstance(one_event(i, F.encode(F.Ack(2))), F.Ack)
    assert isinstance(one_event(i, F.encode(F.Bye(0, "bye too"))), F.Bye)
    assert i.state is ConnState.CLOSED and "bye too" in i.closed_reason and i.outstanding == 0
    assert isinstance(i.next_event(), ConnectionClosed)
    with pytest.raises(ProtocolError, match="while CLOSED"):
        i.send(F.Bye())


@pytest.mark.parametrize("role", list(Role), ids=lambda r: r.value)
def test_bye_received_closes(role: Role) -> None:
    conn = at(role, "open")
    conn.receive_data(F.encode(F.Bye(0)) + F.encode(F.Ping(0)))
    assert isinstance(conn.next_event(), F.Bye)
    assert conn.state is ConnState.CLOSED and "no reason given" in conn.closed_reason
    assert isinstance(conn.next_event(), ConnectionClosed)  # what came after the BYE is never parsed
    assert conn.outstanding == 0


@pytest.mark.parametrize(("role", "stage"), [(Role.INITIATOR, "start"), (Role.TARGET, "start"), (Role.TARGET, "hello"), (Role.INITIATOR, "open"), (Role.TARGET, "open"), (Role.INITIATOR, "closing")])
def test_eof_between_frames_closes(role: Role, stage: str) -> None:
    conn = at(role, stage)
    conn.receive_data(F.encode(any_message(FrameType.PING, 0)) if stage in ("open", "closing") else b"")
    if stage in ("open", "closing"):
        assert isinstance(conn.next_event(), F.Ping)
    conn.receive_data(b"")
    assert isinstance(conn.next_event(), ConnectionClosed)
    assert conn.state is ConnState.CLOSED and "closed the connection" in conn.closed_reason
    assert isinstance(conn.next_event(), ConnectionClosed)


@pytest.mark.parametrize("cut", [1, F.HEADER_SIZE - 1, F.HEADER_SIZE, F.HEADER_SIZE + 5])
def test_eof_in_the_middle_of_a_frame(cut: int) -> None:
    conn = at(Role.TARGET, "open")
    frame = F.encode(request(FrameType.NOTIFY, 3))
    conn.receive_data(frame[:cut])
    assert conn.next_event() is NEED_DATA
    conn.receive_data(b"")
    with pytest.raises(ProtocolError, match=f"ended {cut} bytes into a frame"):
        conn.next_event()
    assert conn.state is ConnState.CLOSED and "middle of a frame" in conn.closed_reason


def test_frames_before_eof_still_come_out() -> None:
    conn = at(Role.TARGET, "open")
    conn.receive_data(F.encode(F.Ping(0)) + F.encode(request(FrameType.NOTIFY, 3)))
    conn.receive_data(b"")
    assert isinstance(conn.next_event(), F.Ping)
    assert isinstance(conn.next_event(), F.Notify)
    assert isinstance(conn.next_event(), ConnectionClosed)


def test_a_closed_connection_keeps_nothing_it_is_fed() -> None:
    conn = at(Role.TARGET, "closed")
    for _ in range(100):
        conn.receive_data(bytes(4096))
    assert conn.buffered == 0 and isinstance(conn.next_event(), ConnectionClosed)


def test_the_buffer_does_not_grow_however_the_stream_is_cut() -> None:
    """Frames pipelined so that every chunk ends inside a frame: memory must stay flat."""
    conn = at(Role.TARGET, "open")
    ping = F.encode(F.Ping(0))
    stream = ping * 5_000
    conn.receive_data(stream[:1])
    tracemalloc.start()
    try:
        for start in range(1, len(stream), len(ping)):
            conn.receive_data(stream[start : start + len(ping)])
            assert isinstance(conn.next_event(), F.Ping) and conn.next_event() is NEED_DATA
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert conn.buffered == len(ping) - 1 or conn.buffered == 0
    assert peak < 64 * 1024, f"{peak} bytes held for a stream of 28-byte frames"


# -- bulk data ------------------------------------------------------------------------------------
def test_write_data_is_handed_to_the_driver() -> None:
    t = at(Role.TARGET, "open")
    payload = F.encode(F.Bye(0, "looks like a frame")).ljust(64, b"\x00")  # data is never parsed
    write = F.WriteRequest(9, descs((4096, 40), (8192, 24)), 64)
    t.receive_data(F.encode(write) + payload[:10])
    event = t.next_event()
    assert isinstance(event, F.WriteRequest) and t.data_left == 64
    with pytest.raises(RuntimeError, match="64 bytes of data must be moved"):
        t.next_event()
    assert t.take_data(4) == payload[:4] and t.data_left == 60
    assert t.take_data(1 << 20) == payload[4:10] and t.data_left == 54  # only what arrived
    assert t.take_data(100) == b""
    with pytest.raises(RuntimeError, match="only 54 were due"):
        t.data_moved(55)
    t.data_moved(50)  # the driver read these straight from the socket into memory
    t.receive_data(payload[60:] + F.encode(F.Ping(0)))
    assert t.take_data(100) == payload[60:] and t.data_left == 0
    assert isinstance(t.next_event(), F.Ping) and t.state is ConnState.OPEN


def test_read_data_is_handed_to_the_driver() -> None:
    i = at(Role.INITIATOR, "open")
    i.receive_data(F.encode(F.Data(1, 16)))
    assert isinstance(i.next_event(), F.Data) and i.data_left == 16 and i.outstanding == len(OUTSTANDING) - 1
    assert i.take_data(16) == b""
    i.data_moved(16)
    assert i.next_event() is NEED_DATA


def test_data_left_at_eof_is_the_drivers_to_report() -> None:
    t = at(Role.TARGET, "open")
    t.receive_data(F.encode(F.WriteRequest(9, descs((4096, 8)), 8)) + b"abc")
    assert isinstance(t.next_event(), F.WriteRequest)
    t.receive_data(b"")
    assert t.take_data(8) == b"abc"
    with pytest.raises(RuntimeError):
        t.next_event()


# -- deadlines across two clocks ---------------------------------------------------------------------
def _clocked_pair(offset: float, d1: float, d2: float) -> tuple[Connection, Connection, FakeClock]:
    """A handshake between hosts whose clocks differ by ``offset``; HELLO takes d1, CHALLENGE d2."""
    clock = FakeClock(now=500.0)
    i = Connection(Role.INITIATOR, SECRET, clock=clock)
    t = Connection(Role.TARGET, SECRET, clock=clock.skewed(offset))
    hello = i.initiate()
    clock.now += d1
    one_event(t, hello)
    challenge = t.challenge()
    clock.now += d2
    one_event(i, challenge)
    one_event(t, i.authenticate({}))
    one_event(i, t.welcome({"generation": 0}))
    return i, t, clock


@settings(max_examples=150, deadline=None)
@given(
    offset=st.floats(-400, 1e6),  # a monotonic clock never reads below 0: the target's stays >= 100 s
    d1=st.floats(0, 0.5),
    d2=st.floats(0, 0.5),
    pongs=st.lists(st.tuples(st.floats(0, 0.5), st.floats(0, 0.5)), max_size=4),
    ahead=st.floats(0, 3600),
)
def test_peer_deadline_is_never_later_than_ours(offset: float, d1: float, d2: float, pongs: list, ahead: float) -> None:
    i, t, clock = _clocked_pair(offset, d1, d2)
    best_delay = d2
    for delay_before, delay_after in pongs:  # the target stamps a PONG, it takes delay_after to arrive
        clock.now += delay_before
        pong = t.send(F.Pong(0, t._clock()))
        clock.now += delay_after
        one_event(i, pong)
        best_delay = min(best_delay, delay_after)
    ours = clock.now + ahead
    theirs = i.peer_deadline(ours) / 1e6
    # The target's clock reads ours + offset at the moment ours reads ``ours``.
    slack = 1e-6 * max(1.0, abs(ours + offset)) + 1e-6  # float rounding of the conversion
    assert theirs <= ours + offset + slack
    # ... and not earlier than the guard plus the best one-way delay seen (a tight lower bound).
    if ours + offset - 0.010 - best_delay > 1e-3:
        assert theirs >= ours + offset - 0.010 - best_delay - slack
    assert i.peer_deadline(None) == 0
    assert 0 < i.peer_deadline(ours) < 1 << 63


def test_a_tighter_clock_sample_wins_and_a_looser_one_is_ignored() -> None:
    i, t, clock = _clocked_pair(100.0, 0.0, 0.4)
    first = i.peer_deadline(clock.now + 1)
    loose = t.send(F.Pong(0, t._clock()))
    clock.now += 0.9
    one_event(i, loose)
    assert i.peer_deadline(clock.now + 1) - first == pytest.approx(0.9e6, abs=2)  # same offset as before
    tight = t.send(F.Pong(0, t._clock()))
    clock.now += 0.001
    one_event(i, tight)
    assert i.peer_deadline(clock.now + 1) - first == pytest.approx((0.9 + 0.001 + 0.399) * 1e6, abs=2)


@pytest.mark.parametrize("clock_value", [math.inf, -math.inf, math.nan, 1e300, -1e300])
def test_an_absurd_peer_clock_never_breaks_a_deadline(clock_value: float) -> None:
    i, t, clock = _clocked_pair(0.0, 0.0, 0.0)
    one_event(i, F.encode(F.Pong(0, clock_value)))
    deadline = i.peer_deadline(clock.now + 5)
    assert 0 < deadline < 1 << 63
    F.encode(F.ReadRequest(1, descs((4096, 1)), deadline))  # and it fits in a frame
    if math.isfinite(clock_value) and clock_value < 0:
        return
    if not math.isfinite(clock_value):  # ignored: the handshake's sample stands
        assert deadline == int((clock.now + 5 - 0.010) * 1e6)


@pytest.mark.parametrize(
    "clock_value",
    [10**400, -(10**400), "1.0", True, None, [1], math.inf, math.nan],
    ids=["10**400", "-10**400", "str", "bool", "none", "list", "inf", "nan"],
)
def test_an_unusable_challenge_clock_is_ignored(clock_value: object) -> None:
    clock = FakeClock()
    pair = handshake(SECRET, SECRET, clock_i=clock, clock_t=clock, until="hello")
    challenge = _body(pair.to_initiator[0]) | {"clock": clock_value}
    i = pair.initiator
    assert isinstance(one_event(i, F.encode(F.Challenge(challenge))), F.Challenge)
    assert i.state is ConnState.AUTHENTICATED
    assert i.peer_deadline(clock.now + 1) == int((clock.now + 1 - 0.010) * 1e6)


# -- binding -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("secret", [SECRET, None], ids=["secret", "no-secret"])
def test_binding_is_shared_by_both_ends_and_by_no_other_connection(secret: auth.Secret | None) -> None:
    a, b = handshake(secret, secret), handshake(secret, secret)
    assert len(a.initiator.binding("cma")) == 16
    assert a.initiator.binding("cma") == a.target.binding("cma")
    assert a.initiator.binding("cma") != a.initiator.binding("other")
    assert a.initiator.binding("cma") != b.initiator.binding("cma")
    # Available once the proofs passed, on each side.
    half = handshake(secret, secret, until="authenticated")
    assert half.initiator.binding("cma") == half.target.binding("cma")
    with pytest.raises(ProtocolError, match="no session key"):
        handshake(secret, secret, until="hello").initiator.binding("cma")


def test_binding_depends_on_the_secret() -> None:
    """Same nonces, different secrets: different bindings (the secret is in the session key)."""
    nonces = ("11" * 32, "22" * 32)
    a, b, c = (handshake(secret, secret, nonces=nonces) for secret in (SECRET, OTHER, SECRET))
    assert a.initiator.binding("cma") == c.initiator.binding("cma")  # the nonces were the only other input
    assert a.initiator.binding("cma") != b.initiator.binding("cma")
    assert b.initiator.binding("cma") == b.target.binding("cma")


# -- chunking never matters ---------------------------------------------------------------------------
def _target_script() -> tuple[Connection, bytes]:
    """A fresh target and everything an honest initiator sends it, through a goodbye."""
    pair = handshake(SECRET, SECRET, clock_i=FakeClock(), clock_t=FakeClock(offset=3.0), until="start")
    t0 = clone(pair.target)  # the same nonces, untouched: what the tests feed
    i, t = pair.initiator, pair.target
    stream = [i.initiate()]
    one_event(t, stream[0])
    one_event(i, t.challenge())
    stream.append(i.authenticate(dict(INITIATOR_INFO)))
    one_event(t, stream[-1])
    one_event(i, t.welcome(dict(TARGET_INFO)))
    payload = F.encode(F.Bye(0, "x")) * 3 + bytes(range(256))
    for message in (
        request(FrameType.READ, 1),
        F.WriteRequest(2, descs((4096, len(payload) - 100), (1 << 40, 100)), len(payload), 77),
        request(FrameType.NOTIFY, 3),
        request(FrameType.PING, 0),
        request(FrameType.QUERY_META, 4),
        F.WriteRequest(5, descs((8192, 1)), 1),
        request(FrameType.QUERY_REGIONS, 6),
        request(FrameType.PONG, 0),
    ):
        stream.append(i.send(message))
        if isinstance(message, F.WriteRequest):
            stream.append(payload if message.data_len == len(payload) else b"\x00")
    stream.append(i.send(F.Bye(0, "done")))
    return t0, b"".join(stream)


def _initiator_script() -> tuple[Connection, list[F.Message], bytes]:
    """A fresh initiator (after its HELLO), what it sends on WELCOME, and the target's whole side."""
    pair = handshake(SECRET, SECRET, clock_i=FakeClock(), clock_t=FakeClock(offset=3.0), until="start")
    i, t = pair.initiator, pair.target
    one_event(t, i.initiate())
    i0 = clone(i)
    data = F.encode(F.Ack(2)) * 2  # looks like frames, is data
    requests = [F.ReadRequest(1, descs((4096, len(data))), 123), request(FrameType.WRITE, 2), request(FrameType.QUERY_META, 3), request(FrameType.NOTIFY, 4)]
    stream = [t.challenge()]
    one_event(i, stream[0])
    one_event(t, i.authenticate(dict(INITIATOR_INFO)))
    stream.append(t.welcome(dict(TARGET_INFO)))
    one_event(i, stream[-1])
    for message in requests:
        i.send(message)
    stream += [
        t.send(F.Ping(0)),
        t.send(F.Data(1, len(data))) + data,
        t.send(F.Regions(3, 2, np.array([[1, 2, 3]], dtype=np.uint64), np.zeros((0, 3), np.uint64), 0)),
        t.send(F.Ack(2)),
        t.send(F.Pong(9, 123.0)),
        t.send(F.Meta(3, b"m" * 300)),
        t.send(F.Error(4, 6, "full")),
        t.send(F.Bye(0, "target done")),
    ]
    return i0, requests, b"".join(stream)


TARGET_SCRIPT = _target_script()
INITIATOR_SCRIPT = _initiator_script()
TAILS = [b"", F.encode(F.Ping(0))[:13], b"HXL1\xff" + bytes(23), F.encode_header(FrameType.META, 1, 5) + b"ab"]


def _run(side: str, chunks: list[bytes], eof: bool) -> tuple:
    if side == "target":
        conn, on_open = clone(TARGET_SCRIPT[0]), []
    else:
        conn, on_open = clone(INITIATOR_SCRIPT[0]), INITIATOR_SCRIPT[1]
    driver = Driver(conn, on_open)
    for chunk in chunks:
        driver.feed(chunk)
    if eof:
        driver.close()
    return driver.outcome()


def _stream(side: str, tail: int, cut: int | None) -> bytes:
    stream = (TARGET_SCRIPT[1] if side == "target" else INITIATOR_SCRIPT[2])
    if side == "target":
        stream = stream[: -len(F.encode(F.Bye(0, "done")))]  # keep it open so the tail is parsed
    else:
        stream = stream[: -len(F.encode(F.Bye(0, "target done")))]
    stream += TAILS[tail]
    return stream if cut is None else stream[:cut]


@pytest.mark.parametrize("side", ["target", "initiator"])
@pytest.mark.parametrize("tail", range(len(TAILS)))
@pytest.mark.parametrize("eof", [False, True])
def test_one_byte_at_a_time_is_the_same_as_whole(side: str, tail: int, eof: bool) -> None:
    stream = _stream(side, tail, None)
    whole = _run(side, [stream], eof)
    assert _run(side, [stream[k : k + 1] for k in range(len(stream))], eof) == whole
    log = whole[0]
    assert whole[1] is (ConnState.CLOSED if eof or tail >= 2 else ConnState.OPEN)
    assert sum(1 for entry in log if entry[0] == "data") == (2 if side == "target" else 1)
    if tail >= 2:
        assert log[-1][0] == "raised"


def test_the_whole_scripts_end_in_a_goodbye() -> None:
    for side, stream in (("target", TARGET_SCRIPT[1]), ("initiator", INITIATOR_SCRIPT[2])):
        outcome = _run(side, [stream], False)
        assert outcome[1] is ConnState.CLOSED and outcome[0][-2][0] == "Bye", side
        assert outcome[0][-1] == "ConnectionClosed()" and not any(entry[0] == "raised" for entry in outcome[0])


@settings(max_examples=60, deadline=None)
@given(
    side=st.sampled_from(["target", "initiator"]),
    tail=st.integers(0, len(TAILS) - 1),
    cut=st.one_of(st.none(), st.integers(0, 4000)),
    eof=st.booleans(),
    data=st.data(),
)
def test_any_chunking_is_the_same_as_whole(side: str, tail: int, cut: int | None, eof: bool, data: st.DataObject) -> None:
    stream = _stream(side, tail, cut)
    points = sorted(set(data.draw(st.lists(st.integers(0, len(stream)), max_size=40))))
    chunks = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)]) if b > a]
    assert b"".join(chunks) == stream
    assert _run(side, chunks, eof) == _run(side, [stream], eof)


@pytest.mark.parametrize("role", [Role.INITIATOR, Role.TARGET], ids=lambda r: r.value)
def test_the_fast_path_agrees_with_the_tables(role: Role) -> None:
    """Every frame the latency path takes a shortcut for gets the tables' verdict: the same answer,
    or the same refusal — for answered and unanswered ids, right and wrong lengths, every kind."""
    conn = at(role, "open")
    for kind in FrameType:
        for req_id in (0, 1, 2, 3, 9):
            for data_len in (0, 8, 16):
                verdicts = []
                for check in (conn._check_incoming, conn._check_by_table):
                    try:
                        verdicts.append(check(kind, req_id, data_len))
                    except ProtocolError as exc:
                        verdicts.append(str(exc))
                assert verdicts[0] == verdicts[1], (kind, req_id, data_len)


def test_the_receive_table_is_the_send_table_seen_from_the_other_side() -> None:
    from hixl._protocol.connection import _HANDSHAKE_STEPS, _RECEIVABLE, _SENDABLE

    for role, peer in ((Role.INITIATOR, Role.TARGET), (Role.TARGET, Role.INITIATOR)):
        for state in (ConnState.OPEN, ConnState.CLOSING):  # the peer may be OPEN while we close
            assert _RECEIVABLE[(role, state)] == _SENDABLE[(peer, ConnState.OPEN)]
        handshake_sent = _SENDABLE[(peer, ConnState.HANDSHAKE)] | _SENDABLE[(peer, ConnState.AUTHENTICATED)]
        assert frozenset().union(*_HANDSHAKE_STEPS[role]) == handshake_sent
