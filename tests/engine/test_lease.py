"""The lease same-host copies hold: shared by copies, exclusive for a REVOKE, which comes first."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from hixl import HixlTimeout
from hixl._session.peer_regions import Lease


def test_copies_hold_it_together() -> None:
    lease = Lease()
    first, second = lease.enter(), lease.enter()
    assert first and second and first != second
    lease.leave(first)
    lease.leave(second)


def test_a_revoke_waits_for_every_copy_in_flight_then_has_it_alone() -> None:
    lease = Lease()
    tokens = [lease.enter() for _ in range(3)]
    entered = threading.Event()
    order: list[str] = []

    def revoke() -> None:
        with lease.exclusive(time.monotonic() + 10):
            entered.set()
            order.append("revoke")

    thread = threading.Thread(target=revoke)
    thread.start()
    time.sleep(0.05)
    assert lease.revoking and not entered.is_set()
    assert lease.enter() == 0  # a new copy steps aside while the revoke waits
    for token in tokens:
        assert not entered.is_set()
        order.append("copy ended")
        lease.leave(token)
    thread.join(5)
    assert entered.is_set() and order == ["copy ended"] * 3 + ["revoke"]
    assert not lease.revoking and lease.enter()  # and copies go on afterwards


@contextmanager
def _revoking(lease: Lease) -> Iterator[threading.Event]:
    """Another thread holds ``lease`` exclusively until the returned event is set (or the block ends)."""
    inside, release = threading.Event(), threading.Event()

    def revoke() -> None:
        with lease.exclusive(time.monotonic() + 10):
            inside.set()
            release.wait(5)

    thread = threading.Thread(target=revoke)
    thread.start()
    inside.wait(5)
    try:
        yield release
    finally:
        release.set()
        thread.join(5)


def test_a_copy_waiting_for_a_revoke_goes_on_after_it() -> None:
    lease = Lease()
    got: list[float] = []

    def copy() -> None:
        with lease.shared(time.monotonic() + 10):
            got.append(time.monotonic())

    with _revoking(lease) as release:
        copier = threading.Thread(target=copy)
        copier.start()
        time.sleep(0.05)
        assert not got  # waits while the revoke holds the lease
        released_at = time.monotonic()
        release.set()
        copier.join(5)
    assert got and got[0] >= released_at


def test_a_copy_that_outlasts_the_deadline_fails_the_revoke_and_leaves_the_lease_usable() -> None:
    lease = Lease()
    token = lease.enter()
    with pytest.raises(HixlTimeout, match="still ran at the deadline"):
        with lease.exclusive(time.monotonic() + 0.05):
            raise AssertionError("the block must not run while a copy holds the lease")
    assert not lease.revoking
    lease.leave(token)
    with lease.exclusive(time.monotonic() + 1):
        pass


def test_a_copy_waits_no_longer_than_its_deadline_for_a_revoke() -> None:
    lease = Lease()
    with _revoking(lease), pytest.raises(HixlTimeout):
        with lease.shared(time.monotonic() + 0.05):
            raise AssertionError("no copy runs while the revoke holds the lease")
