"""Timing loops that compare contenders fairly on a noisy two-core machine.

Contenders (hixl and its raw baseline) are measured *interleaved* — one
repetition of each in turn, alternating who goes first — rather than one
block after the other, so a burst of noise or a frequency change lands on
both instead of skewing their ratio. Warm-up repetitions run the same way
and are thrown away. A contender in another process (:class:`SelfTimed`)
times its own repetition there, so the message that starts it is not
counted. Single-call latencies alternate in short bursts rather than call
by call (see :func:`interleaved_latency`). All clocks are
``time.perf_counter_ns``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = ["SelfTimed", "interleaved_latency", "interleaved_reps"]


@dataclass(frozen=True)
class SelfTimed:
    """A contender that runs a repetition where it lives (another process) and times it there."""

    run: Callable[[int], int]
    """Make this many calls; return the nanoseconds they took, by the clock where they ran."""


def interleaved_reps(
    contenders: Mapping[str, Callable[[], None] | SelfTimed], iterations: int, repeat: int, warmup: int
) -> dict[str, list[int]]:
    """Nanoseconds per repetition (``iterations`` calls each) for every contender, warm-up excluded."""
    names = list(contenders)
    times: dict[str, list[int]] = {name: [] for name in names}
    for rep in range(warmup + repeat):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            elapsed = _repetition(contenders[name], iterations)
            if rep >= warmup:
                times[name].append(elapsed)
    return times


def _repetition(contender: Callable[[], None] | SelfTimed, iterations: int) -> int:
    if isinstance(contender, SelfTimed):
        return contender.run(iterations)
    start = time.perf_counter_ns()
    for _ in range(iterations):
        contender()
    return time.perf_counter_ns() - start


def interleaved_latency(
    contenders: Mapping[str, Callable[[], None]], iterations: int, warmup: int, burst: int = 25
) -> dict[str, list[int]]:
    """Nanoseconds of each single call, ``iterations`` samples per contender, in alternating bursts.

    Each contender makes ``burst`` calls in a row, the first of them untimed, then the
    next contender does; who goes first alternates. Alternating call by call would time
    each call right after the other contender's: a plain 8-byte socket echo measured
    between two ``transfer_sync`` calls takes twice as long as in a loop of its own (the
    engine's threads are still settling on both sides, the caches hold its data), and the
    baseline should be the fastest plain loop. A burst's first call pays that hand-over
    and is dropped; noise still lands on every contender alike, a burst apart.
    """
    if burst < 2:
        raise ValueError(f"a burst must have at least 2 calls (the first is not timed), not {burst}")
    names = list(contenders)
    samples: dict[str, list[int]] = {name: [] for name in names}
    for name in names:  # warm-up: every contender's path primed, nothing kept
        fn = contenders[name]
        for _ in range(warmup):
            fn()
    clock = time.perf_counter_ns
    round_ = 0
    while any(len(out) < iterations for out in samples.values()):
        for name in names if round_ % 2 == 0 else names[::-1]:
            fn, out = contenders[name], samples[name]
            fn()  # the hand-over call (see above)
            for _ in range(min(burst - 1, iterations - len(out))):
                start = clock()
                fn()
                out.append(clock() - start)
        round_ += 1
    return samples
