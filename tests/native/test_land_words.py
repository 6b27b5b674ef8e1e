"""tcp_land_words with ``done`` not on a word of the data (issue 34): the C twin lands exactly what
the pure one does — nothing where no word of the data ends in the bytes that came — and never
reads outside its iovecs, however short they are. Real sockets on 127.0.0.1; every case runs on
both twins."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import ModuleType

import numpy as np
import pytest

from hixl._accel import pure

from .harness import Pair


@pytest.fixture
def pair() -> Iterator[Pair]:
    connection = Pair()
    yield connection
    connection.close()


def _land(
    impl: ModuleType, pair: Pair, sent: bytes, rows: list[int], want: int, done: int, left: int
) -> tuple[object, bytes, bytes]:
    """What ``tcp_land_words`` answers with ``sent`` in the socket, what it landed in rows of the
    given lengths (a guard byte after each), and what it left in the socket."""
    dst = np.zeros(sum(rows) + len(rows), dtype=np.uint8)
    at, iovs = 0, []
    for length in rows:
        iovs.append((int(dst.ctypes.data) + at, length))
        at += length + 1
    pair.feed(sent, eof=False)
    try:
        iovecs = np.array(iovs, dtype=np.uint64)
        answer: object = impl.tcp_land_words(pair.ours, iovecs, 0, want, done, left, time.monotonic() + 2, 1 << 20)
    except OSError as exc:
        answer = type(exc).__name__
    return answer, dst.tobytes(), pair.rest()


def test_a_part_word_short_of_the_next_word_lands_nothing(native: ModuleType, pair: Pair) -> None:
    """3 bytes of the data landed before, 2 more came: 5 is no word's end, so nothing lands and
    both bytes stay in the socket for the caller's buffer (the C twin landed them: n underflowed)."""
    for impl in (pure, native):
        assert _land(impl, pair, b"ab", [16], 16, 3, 16) == (0, bytes(17), b"ab"), impl.__name__


def test_rows_shorter_than_the_cut_are_never_read_past(native: ModuleType, pair: Pair) -> None:
    """The same with rows as short as the bytes that came: the word cut walked off the front of
    its iovec array (``iov[-1]``, then a readv of a negative count: EINVAL)."""
    for impl in (pure, native):
        assert _land(impl, pair, b"ab", [2], 2, 3, 100) == (0, bytes(3), b"ab"), impl.__name__


@pytest.mark.parametrize("done", range(16))
def test_the_twins_land_the_same_whatever_done_is(native: ModuleType, pair: Pair, done: int) -> None:
    """Every ``done`` against every count of bytes come (to two words' worth), in rows of one,
    three and 16 bytes, mid-data and at its end: the same answer, memory and socket in both."""
    for sent in range(1, 18):
        for rows in ([1] * 20, [3] * 7, [16, 16]):
            for left in (sent, 64):
                want = min(left, sum(rows))
                data = bytes(range(65, 65 + sent))
                landed = [_land(impl, pair, data, rows, want, done, left) for impl in (pure, native)]
                assert landed[0] == landed[1], (sent, rows, left, landed)

