"""Fan-out through a relay: the publisher serves one relay, the relay serves three subscribers.

Who pulls from whom: each subscriber knows only the relay's address and pulls from the relay's
slots; the relay's own subscriber pulls every version from the publisher.
"""

from __future__ import annotations

import pytest

from .peers import Peer

W = {"w": 1 << 15, "b": 10}


@pytest.mark.timeout(120)
def test_three_subscribers_pull_every_version_through_one_relay(transport: str) -> None:
    settings = {"transport": transport, "lease": 5.0}
    with Peer("publisher", settings) as pub, Peer("relay", {**settings, "upstream": pub.address}) as relay:
        pub.do("publish_pattern", W)
        subscribers = [Peer("subscriber", {**settings, "upstream": relay.address}) for _ in range(3)]
        try:
            for sub in subscribers:
                sub.start("torture", 30, W, 60.0)
            pub.do("start_stream", 29, W)  # versions 2 .. 30
            pub.do("stream_done", 60.0)
            for sub in subscribers:
                counts = sub.answer("torture", 60.0)
                assert counts["torn"] == 0 and counts["last"] == 30 and counts["pulls"] >= 1, counts
            # The relay is what they read: the publisher goes, the relay still serves version 30.
            pub.kill()
            assert subscribers[0].do("pull", W, None) == 30 and subscribers[0].do("last_is", 30)
        finally:
            for sub in subscribers:
                sub.close()
