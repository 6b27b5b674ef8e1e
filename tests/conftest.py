"""Shared fixtures: transports to parametrize over, target processes, leak checks."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator

import pytest

from hixl.testing import TargetProcess

TRANSPORTS = ["cma", "tcp"]


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    """Each built-in transport's name, forced through the engine's ``"transport"`` option."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def shared_target() -> Iterator[TargetProcess]:
    """A target with two 1 MiB buffers, shared by a module's tests that don't disturb it."""
    with TargetProcess([1 << 20, 1 << 20]) as tp:
        tp.fill(0, 7)
        yield tp


@pytest.fixture
def make_target() -> Iterator[Callable[..., TargetProcess]]:
    """Factory for targets a test may kill or freeze; always resumed and closed afterwards."""
    started: list[TargetProcess] = []

    def make(sizes: list[int] | None = None, options: dict | None = None) -> TargetProcess:
        tp = TargetProcess(sizes or [1 << 20], options)
        started.append(tp)
        return tp

    yield make
    for tp in started:
        if tp.exitcode is None:
            tp.stop(signal.SIGCONT)  # a frozen child could not exit cleanly
        tp.close()


class Resources:
    """What this process holds that an engine could leak: hixl threads and open fds."""

    @staticmethod
    def threads() -> set[threading.Thread]:
        """Live threads started by hixl (they are all named ``hixl-...``)."""
        return {t for t in threading.enumerate() if t.name.startswith("hixl-")}

    @staticmethod
    def fds() -> set[str]:
        """Open file descriptors, each with what it points to."""
        fds = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                fds.add(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
            except OSError:
                pass  # the listing's own descriptor, closed already
        return fds


@pytest.fixture
def resources() -> type[Resources]:
    """See :class:`Resources`."""
    return Resources
