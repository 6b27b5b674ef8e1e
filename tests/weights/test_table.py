"""Parameter-server tables: rows gathered one-sidedly while the server updates them are never torn."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import hixl
from hixl.weights import Subscriber, TornRows

from .peer_main import row_pattern
from .peers import Peer

ROWS, WORDS = 64, 1024  # few, long rows, all updated at once: gathers race updates all the time


def churned(transport: str, unchecked: bool) -> dict[str, int]:
    settings = {"transport": transport}
    with Peer("publisher", settings) as server:
        server.do("table", "emb", ROWS, WORDS)
        with Peer("subscriber", {**settings, "upstream": server.address}, unchecked=unchecked) as worker:
            server.do("churn", "emb", 3.0, ROWS)
            counts = worker.do("gather", "emb", 3.0, 32)
            counts.update(server.do("stream_done", 30.0))
            return counts  # type: ignore[no-any-return]


@pytest.mark.timeout(60)
def test_no_gathered_row_is_torn(transport: str) -> None:
    counts = churned(transport, unchecked=False)
    print(counts)
    assert counts["torn"] == 0 and counts["gathers"] >= 10 and counts["updates"] >= 10, counts


@pytest.mark.timeout(60)
def test_without_the_row_checks_rows_are_torn(transport: str) -> None:
    counts = churned(transport, unchecked=True)
    print(counts)
    assert counts["torn"] > 0, counts


@pytest.fixture(scope="module")
def server() -> Iterator[Peer]:
    with Peer("publisher", {"transport": "auto"}) as peer:
        peer.do("table", "big", 100_000, 32)  # 256-byte rows
        yield peer


def test_a_gather_returns_the_rows_asked_for(server: Peer, transport: str) -> None:
    with hixl.Engine("127.0.0.1", {"transport": transport}) as engine:  # a worker needs no listening engine
        worker = Subscriber(engine, server.address)
        rows = np.random.default_rng(7).choice(100_000, 1024, replace=False)
        rows[:2] = [3, 3]  # a row asked for twice comes twice
        out, versions = np.zeros((1024, 32), np.uint64), np.zeros(1024, np.int64)
        assert worker.pull_rows("big", rows, out, versions=versions, timeout=10) == 1
        assert np.array_equal(out, row_pattern(rows, 1, 32)) and (versions == 1).all()
        worker.close()


def test_a_row_that_stays_torn_is_refused(server: Peer) -> None:
    server.do("table", "torn", 16, 4)
    server.do("tear_row", "torn", 5)
    with hixl.Engine("127.0.0.1") as engine:
        worker = Subscriber(engine, server.address)
        out = np.full((3, 4), 9, np.uint64)
        with pytest.raises(TornRows, match="1 row") as caught:
            worker.pull_rows("torn", [4, 5, 6], out, timeout=10)
        assert caught.value.rows == [1] and (out == 9).all()  # position 1 (row 5); out untouched
        worker.close()


@pytest.mark.parametrize(
    ("indices", "out", "error"),
    [
        ([100_000], np.zeros((1, 32), np.uint64), r"row numbers must be in \[0, 100000\)"),
        ([-1], np.zeros((1, 32), np.uint64), "row numbers must be in"),
        ([[1]], np.zeros((1, 32), np.uint64), "1-D sequence"),
        ([1, 2], np.zeros((1, 32), np.uint64), r"out must be C-contiguous uint64 of shape \(2, 32\)"),
        ([1], np.zeros((1, 32), np.float64), "out must be"),
        ([1, 2], np.zeros((32, 2), np.uint64).T, "out must be C-contiguous"),
    ],
)
def test_a_wrong_gather_is_refused(server: Peer, indices: list, out: np.ndarray, error: str) -> None:
    with hixl.Engine("127.0.0.1") as engine:
        worker = Subscriber(engine, server.address)
        with pytest.raises(hixl.ParamInvalid, match=error):
            worker.pull_rows("big", indices, out, timeout=10)
        worker.close()
