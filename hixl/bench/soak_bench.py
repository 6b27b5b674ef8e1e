"""``hixl bench --scenario soak``: the soak test of :mod:`hixl.testing.soak`, as benchmark rows.

Its knobs travel in ``BenchConfig.extra`` (``soak_duration``,
``soak_targets``, ``soak_initiators``, ``soak_concurrency``,
``soak_fault_interval``); ``--quick`` shortens it to a few seconds. The
transports of the run are the initiators' (alternating). Corrupted bytes and
leaks have a target of 0, judged in a quick run too.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from ..testing.soak import SoakConfig, SoakReport, run_soak
from .config import BenchConfig
from .progress import Progress
from .results import Row, ScenarioResult, Target, median

__all__ = ["QUICK_DURATION", "describe", "run", "soak_config"]

QUICK_DURATION = 5.0
_KNOBS = {f"soak_{f.name}": f.name for f in fields(SoakConfig)}


def soak_config(config: BenchConfig) -> SoakConfig:
    """The soak ``config`` asks for: defaults (shorter with ``--quick``), ``soak_*`` keys of ``extra`` applied."""
    soak = SoakConfig(transports=config.transports)
    if config.quick:
        soak = replace(soak, duration=QUICK_DURATION)
    knobs: dict[str, Any] = {_KNOBS[k]: v for k, v in config.extra.items() if k in _KNOBS and v is not None}
    return replace(soak, **knobs)


def describe(config: BenchConfig) -> str:
    """A few words for the run's header line."""
    soak = soak_config(config)
    return f"soak {soak.duration:g} s, {soak.targets} targets x {soak.initiators} initiators x {soak.concurrency}"


def _sigkills(report: SoakReport) -> str:
    return "SIGKILLs: " + (", ".join(f"{n} {k}" for k, n in sorted(report.faults.items())) or "none")


def _rows(report: SoakReport, transports: str) -> list[Row]:
    zero = Target("<=", 0, on="value", in_smoke=True)
    lat = sorted(report.death_to_failure)

    def row(name: str, value: float, unit: str = "", target: Target | None = None, note: str = "") -> Row:
        return Row(name, transports, "", None, value, unit, target=target, scenario="soak", note=note)

    rows = [
        row("transfers run", report.transfers, note=f"{report.failed} failed, {report.refused} refused at submit"),
        row("transfers verified", report.verified, target=Target(">=", 1, on="value", in_smoke=True)),
        row("datadist verified", report.datadist_verified, note=f"{report.datadist_failed} failed"),
        row("faults injected", sum(report.faults.values()), note=_sigkills(report)),
    ]
    if lat:
        rows += [
            row("death -> failed, median", median(lat) * 1e3, "ms", note=f"{len(lat)} pending requests"),
            row("death -> failed, max", lat[-1] * 1e3, "ms"),
        ]
    return rows + [
        row("corrupted bytes", report.corrupted_bytes, "B", zero),
        row("leaks", report.leaks, "", zero, note="threads, fds, mappings of the survivors"),
    ]


def run(config: BenchConfig, progress: Progress) -> ScenarioResult:
    """Run the soak; its figures as rows, its full report (and any violation) as notes."""
    soak = soak_config(config)
    progress.expect(1)
    with progress.step(f"soak: {describe(config)}"):
        report = run_soak(soak)
    kept = ("failed with", "violation")  # the rest of the summary is in the rows
    notes = [f"soak: {' '.join(line.split())}" for line in report.summary().splitlines() if line.startswith(kept)]
    return ScenarioResult(_rows(report, ",".join(soak.transports)), notes)
