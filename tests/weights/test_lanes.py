"""The per-tensor passes of a version spread over copy lanes: same results, in order, errors raised."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hixl.weights._checks import checksum_of
from hixl.weights._lanes import SPREAD_FROM, spread


def test_results_come_back_in_the_jobs_order_from_more_than_one_thread() -> None:
    arrays = [np.full(n << 20, n, np.uint8) for n in (1, 9, 3, 5, 2)]
    threads: set[str] = set()

    def work(a: np.ndarray) -> int:
        threads.add(threading.current_thread().name)
        return checksum_of(a)

    got = spread(work, arrays, [len(a) for a in arrays], lanes=2)
    assert got == [checksum_of(a) for a in arrays]
    assert len(threads) == 2


def test_little_work_stays_in_the_calling_thread() -> None:
    threads: set[str] = set()
    jobs = list(range(8))
    assert spread(lambda j: threads.add(threading.current_thread().name) or j * j, jobs, [SPREAD_FROM // 16] * 8, 4) == [
        j * j for j in jobs
    ]
    assert threads == {threading.current_thread().name}


def test_a_failing_job_is_raised_after_every_lane_stopped() -> None:
    def work(j: int) -> int:
        if j == 3:
            raise ValueError("job 3")
        return j

    with pytest.raises(ValueError, match="job 3"):
        spread(work, list(range(6)), [SPREAD_FROM] * 6, lanes=3)
    assert not [t for t in threading.enumerate() if t.name == "hixl-weights-lane"]
