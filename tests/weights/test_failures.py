"""Failures with real processes: readers stopped or killed mid-pull, a publisher killed mid-pull, and
every wait ending at its timeout.

A reader frozen mid-pull is made deterministic by peer_main's StallingEngine: the subscriber child
stops itself (SIGSTOP) after it acquired its version and before it reads a byte.
"""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest

import hixl
from hixl.weights import Publisher, Subscriber

from .peers import Peer

W = {"w": 4096}
LEASE = 2.0


@pytest.mark.timeout(60)
def test_a_stopped_reader_holds_its_slot_one_lease_then_its_pull_is_superseded(transport: str) -> None:
    settings = {"transport": transport, "slots": 2, "lease": LEASE}
    with Peer("publisher", settings) as pub, Peer("subscriber", {**settings, "upstream": pub.address}) as sub:
        pub.do("publish_pattern", W)  # version 1, in one slot
        sub.start("pull", W, 1, True)  # acquires version 1, then stops before reading
        sub.wait_stopped()
        assert pub.do("publish_pattern", W)[0] == 2  # the other slot: at once
        version, seconds = pub.do("publish_pattern", W)  # version 1's slot: only once its lease ran out
        assert version == 3
        assert LEASE - 0.5 <= seconds <= LEASE + 1.5, seconds
        sub.signal(signal.SIGCONT)  # it reads version 1's slot, which holds version 3 now
        with pytest.raises(RuntimeError, match="Superseded: version 1 was overwritten"):
            sub.answer("pull")
        assert sub.do("pull", W, None) == 3 and sub.do("last_is", 3)


@pytest.mark.timeout(60)
def test_a_killed_reader_holds_its_slot_no_longer_than_one_lease(transport: str) -> None:
    settings = {"transport": transport, "slots": 2, "lease": LEASE}
    with Peer("publisher", settings) as pub:
        pub.do("publish_pattern", W)
        with Peer("subscriber", {**settings, "upstream": pub.address}) as sub:
            sub.start("pull", W, 1, True)
            sub.wait_stopped()
            sub.kill()
        pub.do("publish_pattern", W)
        version, seconds = pub.do("publish_pattern", W)  # in the killed reader's slot
        assert version == 3 and seconds <= LEASE + 0.5, seconds


@pytest.mark.timeout(60)
def test_a_publisher_killed_mid_pull_leaves_the_last_complete_version(transport: str) -> None:
    settings = {"transport": transport, "slots": 2, "lease": LEASE}
    pub = Peer("publisher", settings)
    try:
        with Peer("subscriber", {**settings, "upstream": pub.address}) as sub:
            pub.do("publish_pattern", W)
            assert sub.do("pull", W, None) == 1
            pub.do("publish_pattern", W)
            sub.start("keep_and_pull", W, 2)  # pulls version 2 into other arrays, stopping before it reads
            sub.wait_stopped()
            pub.kill()
            sub.signal(signal.SIGCONT)
            with pytest.raises(RuntimeError, match="PeerDisconnected"):
                sub.answer("keep_and_pull")
            assert sub.do("kept") == (1, True)  # the subscriber's version, and version 1's arrays intact
    finally:
        pub.close()


@pytest.mark.timeout(60)
def test_waits_end_at_their_timeouts() -> None:
    with hixl.Engine("127.0.0.1:0") as pub_engine, hixl.Engine("127.0.0.1:0") as sub_engine:
        publisher = Publisher(pub_engine, lease=LEASE)
        subscriber = Subscriber(sub_engine, pub_engine.local_engine)
        start = time.monotonic()
        with pytest.raises(hixl.HixlTimeout):
            subscriber.wait_version(1, timeout=0.5)
        assert time.monotonic() - start < 1.5
        publisher.publish({"w": np.ones(8)})
        assert subscriber.wait_version(1, timeout=5) == 1
        with pytest.raises(hixl.HixlTimeout):
            subscriber.wait_version(2, timeout=0.3)
        subscriber.close()
        publisher.close()


@pytest.mark.timeout(60)
def test_a_wait_ends_when_the_publisher_dies() -> None:
    pub = Peer("publisher", {"transport": "tcp"})
    try:
        with hixl.Engine("127.0.0.1:0") as engine:
            subscriber = Subscriber(engine, pub.address)
            pub.do("publish_pattern", W)
            assert subscriber.wait_version(1, timeout=5) == 1
            pub.kill()
            start = time.monotonic()
            with pytest.raises(hixl.PeerDisconnected):
                subscriber.wait_version(2, timeout=20)
            assert time.monotonic() - start < 10
    finally:
        pub.close()
