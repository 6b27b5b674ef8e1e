"""Timing loops that compare contenders fairly on a noisy two-core machine.

Contenders (hixl and its raw baseline) are measured *interleaved* — one
repetition of each in turn, alternating who goes first — rather than one
block after the other, so a burst of noise or a frequency change lands on
both instead of skewing their ratio. Warm-up repetitions run the same way
and are thrown away. All clocks are ``time.perf_counter_ns``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

__all__ = ["interleaved_latency", "interleaved_reps"]


def interleaved_reps(
    contenders: Mapping[str, Callable[[], None]], iterations: int, repeat: int, warmup: int
) -> dict[str, list[int]]:
    """Nanoseconds per repetition (``iterations`` calls each) for every contender, warm-up excluded."""
    names = list(contenders)
    times: dict[str, list[int]] = {name: [] for name in names}
    for rep in range(warmup + repeat):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            fn = contenders[name]
            start = time.perf_counter_ns()
            for _ in range(iterations):
                fn()
            elapsed = time.perf_counter_ns() - start
            if rep >= warmup:
                times[name].append(elapsed)
    return times


def interleaved_latency(
    contenders: Mapping[str, Callable[[], None]], iterations: int, warmup: int
) -> dict[str, list[int]]:
    """Nanoseconds of each single call, ``iterations`` samples per contender, alternating call by call."""
    names = list(contenders)
    fns = [contenders[name] for name in names]
    samples: list[list[int]] = [[] for _ in names]
    clock = time.perf_counter_ns
    for i in range(warmup + iterations):
        keep = i >= warmup
        for fn, out in zip(fns, samples):
            start = clock()
            fn()
            elapsed = clock() - start
            if keep:
                out.append(elapsed)
    return dict(zip(names, samples))
