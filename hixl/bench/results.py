"""Result rows and the statistics behind them.

A :class:`Row` is one figure of the report: what was measured (``name``,
``transport``, ``op``, ``size``), its ``value`` and ``unit``, and — where
there is one — the raw ``baseline`` it is compared with, their ``ratio``
(value / baseline) and a :class:`Target` that ratio (or, for absolute
figures such as idle CPU, the value itself) must meet. Rows never raise
when a target is missed: the report says FAIL and the run goes on (``hixl
bench --check`` turns a FAIL into a non-zero exit status).

A ``--quick`` run marks its rows ``smoke``: its sizes and repeat counts are
too small for ratios against raw calls to mean anything, so only targets
declared ``in_smoke`` (absolute limits such as idle CPU and RSS growth, which
hold at any size) are judged there; the others are shown but not judged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Row", "ScenarioResult", "Target", "median", "percentile"]


_COMPARE = {
    ">=": lambda x, limit: x >= limit,
    "<=": lambda x, limit: x <= limit,
    "<": lambda x, limit: x < limit,
}


@dataclass(frozen=True)
class Target:
    """The ratio (``on="ratio"``) or the value itself (``on="value"``) must satisfy ``cmp limit``.

    ``in_smoke``: whether a ``--quick`` run judges it too (see the module docstring).
    """

    cmp: str
    limit: float
    on: str = "ratio"
    in_smoke: bool = False

    def __post_init__(self) -> None:
        if self.cmp not in _COMPARE or self.on not in ("ratio", "value"):
            raise ValueError(f"bad target {self.cmp!r} {self.limit!r} on {self.on!r}")

    def met_by(self, value: float | None, ratio: float | None) -> bool | None:
        """True/False, or None when the figure it judges is missing."""
        x = ratio if self.on == "ratio" else value
        if x is None or not math.isfinite(x):
            return None
        return bool(_COMPARE[self.cmp](x, self.limit))

    def __str__(self) -> str:
        return f"{self.cmp}{self.limit:g}" + ("x" if self.on == "ratio" else "")


@dataclass(frozen=True)
class Row:
    """One measured figure (see the module docstring)."""

    name: str
    transport: str
    op: str
    size: int | None
    value: float
    unit: str
    baseline: float | None = None
    baseline_name: str = ""
    target: Target | None = None
    scenario: str = ""
    note: str = ""
    smoke: bool = False

    @property
    def ratio(self) -> float | None:
        """``value / baseline``, or None without a (positive) baseline."""
        if self.baseline is None or not self.baseline > 0:
            return None
        return self.value / self.baseline

    @property
    def passed(self) -> bool | None:
        """Whether the target is met; None without a target, or one a smoke run does not judge."""
        if self.target is None or not self.judged:
            return None
        return self.target.met_by(self.value, self.ratio)

    @property
    def judged(self) -> bool:
        """Whether this row's target is judged: every target in a full run, ``in_smoke`` ones in a smoke run."""
        return self.target is not None and (self.target.in_smoke or not self.smoke)

    def to_json(self) -> dict[str, Any]:
        """A flat, JSON-able dict (the ``--json`` schema of one row)."""
        return {
            "scenario": self.scenario,
            "name": self.name,
            "transport": self.transport,
            "op": self.op,
            "size": self.size,
            "value": _finite(self.value),
            "unit": self.unit,
            "baseline": _finite(self.baseline),
            "baseline_name": self.baseline_name,
            "ratio": _finite(self.ratio),
            "target": None
            if self.target is None
            else {"cmp": self.target.cmp, "limit": self.target.limit, "on": self.target.on, "text": str(self.target)},
            "pass": self.passed,
            "smoke": self.smoke,
            "note": self.note,
        }


def _finite(x: float | None) -> float | None:
    """JSON has no NaN or infinity: a figure that is not a number is missing."""
    return x if x is not None and math.isfinite(x) else None


def median(samples: Sequence[float]) -> float:
    """The median (mean of the middle two for an even count)."""
    return percentile(samples, 50.0)


def percentile(samples: Sequence[float], pct: float) -> float:
    """Linear-interpolated percentile of ``samples`` (numpy's default method)."""
    if not samples:
        raise ValueError("no samples")
    ordered = sorted(samples)
    pos = (len(ordered) - 1) * pct / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class ScenarioResult:
    """What a scenario hands back: its rows, notes for the reader (e.g. a skipped transport), and the
    latency samples behind its percentiles (µs, keyed ``(transport, op, size, contender)``, for plots)."""

    rows: list[Row]
    notes: list[str]
    latency_samples: dict[tuple[str, str, int, str], list[float]] = field(default_factory=dict)
