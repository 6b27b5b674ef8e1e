"""Zero-copy publishing: readers read the trainer's own tensors, and ``wait_released`` says when the
trainer may write them again — a reader whose lease ran out meanwhile is told, never given a mix."""

from __future__ import annotations

import signal

import pytest

from .peers import Peer

W = {"w": 4096, "b": 16}
LEASE = 2.0


@pytest.mark.timeout(60)
def test_the_trainer_writes_again_only_once_readers_are_done(transport: str) -> None:
    settings = {"transport": transport, "lease": LEASE, "mode": "zero-copy"}
    with Peer("publisher", settings) as trainer, Peer("subscriber", {**settings, "upstream": trainer.address}) as sub:
        assert trainer.do("publish_pattern", W)[0] == 1
        assert sub.do("pull", W, None) == 1 and sub.do("last_is", 1)
        assert trainer.do("wait_released", 1, 5.0) < 0.5  # nobody reads it now
        trainer.do("write", "w", 2)
        trainer.do("write", "b", 2)
        assert trainer.do("republish")[0] == 2  # the same tensors, where they are
        sub.start("pull", W, 2, True)  # acquires version 2, stops before reading
        sub.wait_stopped()
        with pytest.raises(RuntimeError, match="HixlTimeout"):
            trainer.do("wait_released", 2, 0.3)  # its lease holds
        assert LEASE - 0.8 <= trainer.do("wait_released", 2, 10.0) <= LEASE + 1.0
        trainer.do("write", "w", 3)  # the trainer's next step, in place
        sub.signal(signal.SIGCONT)
        with pytest.raises(RuntimeError, match="Superseded"):
            sub.answer("pull")
        trainer.do("write", "b", 3)
        assert trainer.do("republish")[0] == 3
        assert sub.do("pull", W, None) == 3 and sub.do("last_is", 3)
