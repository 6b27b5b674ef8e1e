"""Torture: versions published back to back while subscribers pull the newest, on every transport.

Every pull that returns must hold exactly the version it returned (every word of a patterned version
``v`` is ``v``) — with checksums, and without them, where leases and header words alone prove it;
the same run with the consistency checks switched off (peer_main's test hook) must
show torn pulls — else the run could not have caught any.
"""

from __future__ import annotations

import time

import pytest

from .peers import Peer

VERSIONS, WORDS = 300, {"w": 1 << 17, "b": 1000}  # 1 MiB and a small tensor per version
# The scale: 1000 versions of 64 MiB while two subscribers pull, per transport (on the
# 2-core machine this was written on, about 90 s a transport).
SLOW_VERSIONS, SLOW_WORDS = 1000, {"w": 1 << 23, "b": 1000}


def torture(
    transport: str, versions: int, words: dict[str, int], unchecked: bool, interval: float = 0.0, checksums: bool = True
) -> list[dict[str, int]]:
    settings = {"transport": transport, "slots": 2, "lease": 10.0, "checksums": checksums}
    with Peer("publisher", settings) as publisher:
        publisher.do("publish_pattern", words)  # version 1: the subscribers make their plans against it
        subscribers = [
            Peer("subscriber", {**settings, "upstream": publisher.address}, unchecked=unchecked) for _ in range(2)
        ]
        try:
            for sub in subscribers:
                sub.start("torture", versions + 1, words, 600.0)
            publisher.do("start_stream", versions, words, interval)  # versions 2 .. versions + 1
            publisher.do("stream_done", 600.0)
            return [sub.answer("torture", 600.0) for sub in subscribers]
        finally:
            for sub in subscribers:
                sub.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("checksums", [True, False], ids=["checksums", "no-checksums"])
def test_no_pull_is_torn(transport: str, checksums: bool) -> None:
    # Paced: a 1 MiB version is copied and hashed in a fraction of a millisecond, faster than a
    # subscriber pulls and verifies it, so an unpaced stream is over before the subscribers pulled
    # more than a few; half a millisecond apart, they pull while versions keep coming (and some are superseded).
    results = torture(transport, VERSIONS, WORDS, unchecked=False, interval=0.0005, checksums=checksums)
    print(results)
    for counts in results:
        assert counts["torn"] == 0, counts
        assert counts["last"] == VERSIONS + 1, counts
        assert counts["pulls"] >= 10, counts  # it did pull while versions came out


@pytest.mark.timeout(300)
def test_without_the_checks_pulls_are_torn(transport: str) -> None:
    results = torture(transport, VERSIONS, WORDS, unchecked=True)
    print(results)
    assert sum(counts["torn"] for counts in results) > 0, results


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("checksums", [True, False], ids=["checksums", "no-checksums"])
def test_no_pull_is_torn_at_scale(transport: str, checksums: bool) -> None:
    start = time.monotonic()
    results = torture(transport, SLOW_VERSIONS, SLOW_WORDS, unchecked=False, checksums=checksums)
    print(f"{transport}: {SLOW_VERSIONS} versions of {8 * sum(SLOW_WORDS.values()) >> 20} MiB in "
          f"{time.monotonic() - start:.1f} s: {results}")
    for counts in results:
        assert counts["torn"] == 0, counts
        assert counts["last"] == SLOW_VERSIONS + 1, counts
