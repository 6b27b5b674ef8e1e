"""Shared fixtures: transports to parametrize over, target processes, leak checks, docs samples."""

from __future__ import annotations

import re
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from hixl.testing import TargetProcess
from hixl.testing.leaks import open_fds

TRANSPORTS = ["cma", "shm", "tcp"]


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    """Each built-in transport's name, forced through the engine's ``"transport"`` option."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def shared_target() -> Iterator[TargetProcess]:
    """A target with two 1 MiB buffers, shared by a module's tests that don't disturb it.

    Its buffers are pool memory (``hixl.empty(..., shared=True)``), so that every transport,
    shm included, moves them itself."""
    with TargetProcess([1 << 20, 1 << 20], shared=True) as tp:
        tp.fill(0, 7)
        yield tp


@pytest.fixture
def make_target(request: pytest.FixtureRequest) -> Iterator[Callable[..., TargetProcess]]:
    """Factory for targets a test may kill or freeze; always resumed and closed afterwards.

    In a test run with ``transport`` shm, the targets' buffers are pool memory (what shm moves;
    anything else it sends over TCP)."""
    started: list[TargetProcess] = []
    callspec = getattr(request.node, "callspec", None)
    shared = callspec is not None and callspec.params.get("transport") == "shm"

    def make(sizes: list[int] | None = None, options: dict | None = None) -> TargetProcess:
        tp = TargetProcess(sizes or [1 << 20], options, shared=shared)
        started.append(tp)
        return tp

    yield make
    for tp in started:
        if tp.exitcode is None:
            tp.stop(signal.SIGCONT)  # a frozen child could not exit cleanly
        tp.close()


@pytest.fixture
def gathers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many rows each call of shm's one-call gather (``Engine.read_rows``: ``hixl._accel.gather_rows``,
    or ``gather_checked_rows`` for checked rows) copied: spies on the real ones, to show a test ran that
    path. A call that refused its rows (nothing copied) is not counted."""
    from hixl.transports import shm

    calls: list[int] = []
    real, real_checked = shm._accel.gather_rows, shm._accel.gather_checked_rows

    def counted(dst: int, src: int, stride: int, rows: Any) -> None:
        real(dst, src, stride, rows)
        calls.append(len(rows))

    def counted_checked(*args: Any) -> int:
        torn = real_checked(*args)
        calls.append(len(args[2]))
        return torn  # type: ignore[no-any-return]

    monkeypatch.setattr(shm._accel, "gather_rows", counted)
    monkeypatch.setattr(shm._accel, "gather_checked_rows", counted_checked)
    return calls


class Resources:
    """What this process holds that an engine could leak: hixl threads and open fds."""

    @staticmethod
    def threads() -> set[threading.Thread]:
        """Live threads started by hixl (they are all named ``hixl-...``)."""
        return {t for t in threading.enumerate() if t.name.startswith("hixl-")}

    @staticmethod
    def fds() -> set[str]:
        """Open file descriptors, each with what it points to."""
        return set(open_fds())


@pytest.fixture
def resources() -> type[Resources]:
    """See :class:`Resources`."""
    return Resources


class DocsSample:
    """The output samples shown in ``docs/*.md``, and a check that real output still has their shape.

    A sample is the code block right after a ``<!-- output of: COMMAND -->`` line
    (a line ``...`` in it stands for lines left out). Its shape is the *label*
    of each line: the text before the first run of two spaces or ``": "``, with
    numbers and transport names made generic — what stays the same from run to
    run and machine to machine.
    """

    DOCS = Path(__file__).resolve().parents[1] / "docs"

    @classmethod
    def lines(cls, page: str, command: str) -> list[str]:
        """The lines of the sample of ``command`` in ``docs/page`` (an error if there is none)."""
        text = (cls.DOCS / page).read_text()
        marker = f"<!-- output of: {command} -->"
        assert marker in text, f"{page} has no sample marked {marker}"
        block = text.split(marker, 1)[1].split("```", 2)[1]
        return block.split("\n")[1:]  # drop the fence's language tag

    @staticmethod
    def label(line: str, chunks: int = 1) -> str:
        """The first ``chunks`` columns of ``line``, generic (see the class docstring); 0: the whole line."""
        generic = re.sub(r"\b(cma|shm|tcp)\b", "T", re.sub(r"\d+(\.\d+)?", "#", line.strip()))
        if chunks == 0:
            return generic
        columns = re.split(r"\s{2,}", generic.split(": ", 1)[0])
        return "  ".join(columns[:chunks])

    @classmethod
    def missing(cls, sample: Sequence[str], output: str, chunks: int = 1) -> list[str]:
        """Sample lines whose labels are not found, in the sample's order, among the output's."""
        have = [cls.label(line, chunks) for line in output.splitlines() if line.strip()]
        lost: list[str] = []
        position = 0
        for line in sample:
            if line.strip() in ("", "..."):  # "...": lines a sample leaves out
                continue
            want = cls.label(line, chunks)
            try:
                position = have.index(want, position) + 1
            except ValueError:
                lost.append(line)
        return lost


@pytest.fixture
def docs_sample() -> type[DocsSample]:
    """See :class:`DocsSample`."""
    return DocsSample
