"""Sealed records, sans I/O: what a seal hands out is exactly what the other end sealed, in order,
and nothing else — a record altered, replayed, reordered, reflected, moved from another connection
or cut short is refused, before a byte of it is handed out; and how an encrypting handshake
switches both ends to records (and refuses an end that does not encrypt)."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hixl import EncryptionMismatch, IntegrityError, ProtocolError
from hixl._protocol import Connection, Role
from hixl._protocol import frames as F
from hixl._protocol import seal as S

from .helpers import INITIATOR_INFO, SECRET, TARGET_INFO, one_event

KEY = bytes(range(32))


def _pair(rekey: int = S.REKEY_RECORDS, key: bytes = KEY) -> tuple[S.Seal, S.Seal]:
    return S.Seal(key, "initiator", rekey_records=rekey), S.Seal(key, "target", rekey_records=rekey)


def _opened(opener: S.Opener) -> list[bytes]:
    """Every whole record ``opener`` holds, opened."""
    out = []
    while (n := opener.next_size()) is not None:
        buf = bytearray(n)
        opener.open_into(memoryview(buf))
        out.append(bytes(buf))
    return out


def _refused(opener: S.Opener, data: bytes) -> None:
    """``data`` fed to ``opener`` yields no plaintext: IntegrityError, then every later call too."""
    opener.feed(data)
    with pytest.raises(IntegrityError):
        _opened(opener)
    with pytest.raises(IntegrityError):
        opener.next_size()


# -- round trips ------------------------------------------------------------------------------------
def test_records_open_to_what_was_sealed_in_order() -> None:
    i, t = _pair()
    messages = [b"x", os.urandom(1000), os.urandom(S.RECORD_MAX)]
    stream = b"".join(i.sealer.seal(m) for m in messages)
    assert all(m not in stream for m in messages[1:])  # (ciphertext, not plaintext)
    t.opener.feed(stream)
    assert _opened(t.opener) == messages
    assert t.opener.held == 0


def test_a_record_is_its_plaintext_plus_the_overhead_and_the_length_is_in_clear() -> None:
    i, _ = _pair()
    record = i.sealer.seal(b"abc")
    assert len(record) == 3 + S.OVERHEAD
    assert record[: S.HEADER] == (3).to_bytes(4, "little")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=300), min_size=1, max_size=8), st.integers(1, 50))
def test_any_cut_of_the_stream_opens_the_same(messages: list[bytes], step: int) -> None:
    i, t = _pair()
    stream = b"".join(i.sealer.seal(m) for m in messages)
    out = []
    for k in range(0, len(stream), step):
        t.opener.feed(stream[k : k + step])
        out += _opened(t.opener)
    assert out == messages


def test_seal_all_cuts_a_long_plaintext_into_full_records() -> None:
    i, t = _pair()
    data = os.urandom(2 * S.RECORD_MAX + 5)
    t.opener.feed(i.sealer.seal_all(data))
    assert [len(p) for p in _opened(t.opener)] == [S.RECORD_MAX, S.RECORD_MAX, 5]


def test_a_driver_receives_straight_into_the_opener() -> None:
    i, t = _pair()
    record = i.sealer.seal(b"hello")
    assert t.opener.needed == S.HEADER
    view = t.opener.space(3)
    view[:] = record[:3]
    del view
    t.opener.filled(3)
    assert t.opener.needed == 1
    t.opener.feed(record[3:6])
    assert t.opener.needed == len(record) - 6 and t.opener.next_size() is None
    t.opener.feed(record[6:])
    assert t.opener.needed == 0 and _opened(t.opener) == [b"hello"]


# -- what is refused --------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["length", "ciphertext", "tag"])
def test_a_flipped_bit_anywhere_is_refused(where: str) -> None:
    i, t = _pair()
    record = bytearray(i.sealer.seal(os.urandom(100)))
    at = {"length": 0, "ciphertext": S.HEADER + 50, "tag": len(record) - 1}[where]
    record[at] ^= 0x01
    if where == "length":  # (it now announces 101 bytes: one more byte completes the record)
        record += b"\0"
    _refused(t.opener, bytes(record))


def test_a_record_replayed_is_refused() -> None:
    i, t = _pair()
    first = i.sealer.seal(b"transfer 1")
    t.opener.feed(first)
    assert _opened(t.opener) == [b"transfer 1"]
    _refused(t.opener, first)


def test_records_reordered_are_refused() -> None:
    i, t = _pair()
    a, b = i.sealer.seal(b"first"), i.sealer.seal(b"second")
    _refused(t.opener, b + a)


def test_a_record_dropped_from_the_stream_fails_the_next() -> None:
    i, t = _pair()
    i.sealer.seal(b"dropped on the way")
    _refused(t.opener, i.sealer.seal(b"after it"))


def test_a_record_reflected_back_at_its_sender_is_refused() -> None:
    i, _ = _pair()
    _refused(i.opener, i.sealer.seal(b"echo"))


def test_a_record_of_another_connection_is_refused() -> None:
    other, _ = _pair(key=bytes(32))
    _, t = _pair()
    _refused(t.opener, other.sealer.seal(b"from elsewhere"))


def test_a_stream_cut_inside_a_record_hands_out_nothing_of_it() -> None:
    i, t = _pair()
    record = i.sealer.seal(os.urandom(500))
    t.opener.feed(record[:-1])
    assert _opened(t.opener) == []
    with pytest.raises(ProtocolError, match="ended 519 bytes into a sealed record"):
        t.opener.end_of_stream()


def test_a_record_cut_short_and_its_length_shortened_to_match_is_refused() -> None:
    i, t = _pair()
    record = i.sealer.seal(os.urandom(500))
    cut = (400).to_bytes(4, "little") + record[S.HEADER : S.HEADER + 400 + S.TAG]
    _refused(t.opener, cut)


def test_a_stream_that_ends_between_records_ends_cleanly() -> None:
    i, t = _pair()
    t.opener.feed(i.sealer.seal(b"whole"))
    assert _opened(t.opener) == [b"whole"]
    t.opener.end_of_stream()  # (nothing held: the end of the stream, not of a record)


@pytest.mark.parametrize("length", [0, S.RECORD_MAX + 1, (1 << 32) - 1])
def test_a_length_no_sender_makes_is_refused_on_the_header_alone(length: int) -> None:
    _, t = _pair()
    _refused(t.opener, length.to_bytes(4, "little"))  # (before waiting for, or buffering, its body)


def test_the_sealer_refuses_an_empty_or_oversized_record() -> None:
    i, _ = _pair()
    for size in (0, S.RECORD_MAX + 1):
        with pytest.raises(ValueError):
            i.sealer.seal(bytes(size))


# -- keys -----------------------------------------------------------------------------------------
def test_each_direction_has_its_own_key_and_each_handshake_its_own_keys() -> None:
    keys = S.direction_keys(KEY, b"transcript")
    assert keys["initiator"] != keys["target"] and KEY not in keys.values()
    assert S.direction_keys(KEY, b"another transcript")["initiator"] != keys["initiator"]
    with pytest.raises(ValueError):
        S.direction_keys(b"short")


def test_both_ends_move_to_the_next_key_together_and_never_reuse_a_nonce() -> None:
    i, t = _pair(rekey=3)
    messages = [bytes([n]) * 10 for n in range(10)]
    records = [i.sealer.seal(m) for m in messages]
    t.opener.feed(b"".join(records))
    assert _opened(t.opener) == messages
    # Under one key the same plaintext never seals to the same bytes: numbers never repeat...
    again, _ = _pair(rekey=3)
    same = [again.sealer.seal(b"z" * 10) for _ in range(7)]
    assert len(set(same)) == 7
    # ...and record 3, the first under the next key, is not record 0 under the first key again.
    fresh, _ = _pair(rekey=1 << 30)
    assert fresh.sealer.seal(messages[3]) != records[3]


def test_a_record_sealed_under_a_retired_key_is_refused() -> None:
    i, t = _pair(rekey=2)
    old, _ = _pair(rekey=1 << 30)  # (the same first key, never moving on)
    for n in range(2):
        t.opener.feed(i.sealer.seal(b"%d" % n))
    assert len(_opened(t.opener)) == 2
    old.sealer.seal(b"0")
    old.sealer.seal(b"1")
    _refused(t.opener, old.sealer.seal(b"2"))  # record number 2 under the first key: retired


# -- the handshake's switch -----------------------------------------------------------------------
def _handshake(encrypt_i: bool, encrypt_t: bool) -> tuple[Connection, Connection, bytes]:
    i = Connection(Role.INITIATOR, SECRET, encrypt=encrypt_i)
    t = Connection(Role.TARGET, SECRET, encrypt=encrypt_t)
    assert isinstance(one_event(t, i.initiate()), F.Hello)
    return i, t, t.challenge()


def test_an_encrypting_handshake_seals_everything_after_the_challenge() -> None:
    i, t, challenge = _handshake(True, True)
    assert json.loads(challenge[F.HEADER_SIZE :])["encrypt"] is True
    assert t.seal is not None and i.seal is None
    assert isinstance(one_event(i, challenge), F.Challenge)
    assert i.seal is not None
    # AUTH and WELCOME go as records: each end opens the other's, and only the other's.
    auth = i.seal.sealer.seal_all(i.authenticate(dict(INITIATOR_INFO)))
    t.seal.opener.feed(auth)
    assert isinstance(one_event(t, b"".join(_opened(t.seal.opener))), F.Auth)
    welcome = t.seal.sealer.seal_all(t.welcome(dict(TARGET_INFO)))
    assert b"regions" not in welcome  # (what the target says about itself is not in clear)
    i.seal.opener.feed(welcome)
    assert isinstance(one_event(i, b"".join(_opened(i.seal.opener))), F.Welcome)


def test_plaintext_handshakes_say_nothing_about_encryption() -> None:
    i, t, challenge = _handshake(False, False)
    assert "encrypt" not in json.loads(challenge[F.HEADER_SIZE :])
    assert isinstance(one_event(i, challenge), F.Challenge)
    assert i.seal is None and t.seal is None and not t.encryption_mismatch


@pytest.mark.parametrize(("encrypt_i", "encrypt_t"), [(True, False), (False, True)], ids=["initiator-only", "target-only"])
def test_a_mismatch_is_refused_by_both_ends(encrypt_i: bool, encrypt_t: bool) -> None:
    i, t, challenge = _handshake(encrypt_i, encrypt_t)
    assert t.encryption_mismatch and t.seal is None  # (the target's driver refuses after this CHALLENGE)
    i.receive_data(challenge)
    with pytest.raises(EncryptionMismatch, match="encrypt=True"):
        i.next_event()
    assert i.seal is None


@pytest.mark.parametrize("altered", ["hello", "challenge"])
def test_what_went_in_clear_is_authenticated_by_the_first_record(altered: str) -> None:
    """A clock in the HELLO or CHALLENGE, altered on the way (no proof covers it): both ends go on,
    but their keys differ, so the AUTH — the first record — fails, and the connection with it."""
    i = Connection(Role.INITIATOR, SECRET, encrypt=True)
    t = Connection(Role.TARGET, SECRET, encrypt=True)

    def alter(frame: bytes) -> bytes:
        body = json.loads(frame[F.HEADER_SIZE :])
        body["clock"] += 1000.0
        return F.encode((F.Hello if altered == "hello" else F.Challenge)(body))

    hello = i.initiate()
    assert isinstance(one_event(t, alter(hello) if altered == "hello" else hello), F.Hello)
    challenge = t.challenge()
    assert isinstance(one_event(i, alter(challenge) if altered == "challenge" else challenge), F.Challenge)
    t.seal.opener.feed(i.seal.sealer.seal_all(i.authenticate(dict(INITIATOR_INFO))))
    with pytest.raises(IntegrityError):
        _opened(t.seal.opener)


def test_before_its_auth_a_peer_may_make_the_target_buffer_no_more_than_an_auth() -> None:
    """Records are up to 256 KiB; until the initiator's AUTH proved it, the target takes none longer
    than that AUTH may be (so an unproven peer costs it what it cost before: one handshake frame)."""
    i, t, challenge = _handshake(True, True)
    assert isinstance(one_event(i, challenge), F.Challenge)
    assert i.seal is not None and t.seal is not None
    t.seal.opener.feed(i.seal.sealer.seal(bytes(F.HEADER_SIZE + 4096 + 1)))
    with pytest.raises(IntegrityError, match="may come now"):
        t.seal.opener.next_size()
    # An honest AUTH fits, and once it is read, records may be as long as any.
    i2, t2, challenge2 = _handshake(True, True)
    one_event(i2, challenge2)
    t2.seal.opener.feed(i2.seal.sealer.seal(i2.authenticate(dict(INITIATOR_INFO))))
    assert isinstance(one_event(t2, b"".join(_opened(t2.seal.opener))), F.Auth)
    assert t2.seal.opener.limit == S.RECORD_MAX


def test_bytes_past_the_hello_before_the_challenge_are_refused() -> None:
    i = Connection(Role.INITIATOR, SECRET, encrypt=True)
    t = Connection(Role.TARGET, SECRET, encrypt=True)
    t.receive_data(i.initiate() + b"plaintext smuggled behind the HELLO")
    assert isinstance(t.next_event(), F.Hello)
    with pytest.raises(ProtocolError, match="came in plaintext"):
        t.challenge()
    assert t.seal is None
