"""Turning rows into what people and programs read: the table and the ``--json`` file."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from .. import __version__
from .config import BenchConfig, format_size
from .peers import ENGINES, PeerResult
from .results import Row

__all__ = [
    "PEER_FIGURES",
    "failed",
    "format_number",
    "format_peers",
    "format_table",
    "summary",
    "to_json",
    "write_json",
]

COLUMNS = (
    "figure",
    "transport",
    "op",
    "size",
    "value",
    "baseline",
    "ratio",
    "target",
    "result",
    "compared with / note",
)


def format_number(value: float | None) -> str:
    """Three or so significant digits, never in exponent form; ``-`` for nothing."""
    if value is None:
        return "-"
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    if magnitude >= 0.01 or magnitude == 0:
        return f"{value:.3f}"
    return f"{value:.4f}"


def _cells(row: Row) -> tuple[str, ...]:
    ratio = row.ratio
    remarks = [f"vs {row.baseline_name}" if row.baseline_name else "", row.note]
    return (
        row.name,
        row.transport,
        row.op,
        "-" if row.size is None else format_size(row.size),
        f"{format_number(row.value)} {row.unit}",
        "-" if row.baseline is None else f"{format_number(row.baseline)} {row.unit}",
        "-" if ratio is None else f"{ratio:.2f}x",
        "" if row.target is None else str(row.target),
        _verdict(row),
        "; ".join(r for r in remarks if r),
    )


def _verdict(row: Row) -> str:
    if row.target is None:
        return ""
    if not row.judged:
        return "smoke"  # shown, not judged: see Row.judged
    return {True: "PASS", False: "FAIL", None: "-"}[row.passed]


def _aligned(header: Sequence[str], body: Sequence[Sequence[str]], numeric: set[int]) -> list[str]:
    """``header``, a rule and ``body``, each cell padded to its column (``numeric`` ones right-aligned)."""
    widths = [max(len(c) for c in col) for col in zip(header, *body)]

    def line(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(parts).rstrip()

    return [line(header), line(["-" * w for w in widths]), *(line(cells) for cells in body)]


def format_table(rows: Sequence[Row]) -> str:
    """An aligned text table, one line per row, a blank line between transports or scenarios."""
    header, rule, *lines = _aligned(COLUMNS, [_cells(row) for row in rows], {3, 4, 5, 6})
    out = [header, rule]
    previous: tuple[str, str] | None = None
    for row, text in zip(rows, lines):
        group = (row.scenario, row.transport)
        if previous is not None and group != previous:
            out.append("")
        previous = group
        out.append(text)
    return "\n".join(out)


PEER_FIGURES = ("bandwidth", "latency median", "latency p99", "batch")
"""The engine scenario's figures other engines' benchmarks measure too (:mod:`hixl.bench.peers`)."""


def format_peers(rows: Sequence[Row], peers: Sequence[PeerResult]) -> str:
    """hixl's figures and other engines', side by side: one line per (figure, op, size) this run
    measured, a column per hixl transport and per engine with figures; then each engine's status
    (measured, read from a file, not installed, failed) and the hixl transport it does the job of."""
    keyed: dict[tuple[str, str, int], dict[str, str]] = {}  # (name, op, size) -> column heading -> cell
    headings: list[str] = []
    for row in rows:
        if row.scenario == "engine" and row.name in PEER_FIGURES and row.size is not None:
            heading = f"hixl {row.transport}"
            keyed.setdefault((row.name, row.op, row.size), {})[heading] = f"{format_number(row.value)} {row.unit}"
            headings += [] if heading in headings else [heading]
    shown = [p for p in peers if p.figures]
    for peer in shown:
        heading = ENGINES[peer.engine].label
        headings.append(heading)
        for f in peer.figures:
            if (f.name, f.op, f.size) in keyed:  # the same sizes as hixl's, or none
                cell = "failed" if f.value is None else f"{format_number(f.value)} {f.unit}"
                keyed[(f.name, f.op, f.size)][heading] = cell
    header = ("figure", "op", "size", *headings)
    cells = [
        (name, op, format_size(size), *(found.get(h, "-") for h in headings))
        for (name, op, size), found in keyed.items()
    ]
    out = ["side by side (other engines measured alone, before or after this run: read their figures as indicative)"]
    if cells and shown:
        out += _aligned(header, cells, set(range(2, len(header))))
    for peer in peers:
        spec = ENGINES[peer.engine]
        notes = sorted({f.note for f in peer.figures if f.note})
        said = f"{spec.label}: {peer.status}; does the job of hixl {spec.like}; times {spec.timed}"
        out.append(said + "".join(f"; {n}" for n in notes))
    return "\n".join(out)


def failed(rows: Sequence[Row]) -> list[Row]:
    """The rows whose judged target was missed (what ``hixl bench --check`` fails on)."""
    return [r for r in rows if r.passed is False]


def summary(rows: Sequence[Row]) -> str:
    """``targets: 9 PASS, 2 FAIL (name transport op size, ...)``, plus how many a smoke run left unjudged."""
    judged = [r for r in rows if r.passed is not None]
    missed = failed(rows)
    unjudged = sum(1 for r in rows if r.target is not None and not r.judged)
    text = f"targets: {len(judged) - len(missed)} PASS, {len(missed)} FAIL"
    if unjudged:
        text += f", {unjudged} not judged (smoke sizes are too small for them: run without --quick)"
    if missed:
        names = ", ".join(
            " ".join(p for p in (r.transport, r.name, r.op, "" if r.size is None else format_size(r.size)) if p)
            for r in missed
        )
        text += f" ({names})"
    return text


def to_json(
    rows: Sequence[Row],
    config: BenchConfig,
    scenarios: Sequence[str],
    notes: Sequence[str],
    elapsed_s: float,
    peers: Sequence[PeerResult] = (),
) -> dict[str, Any]:
    """Everything a run found, as a JSON-able dict (``rows`` follow :meth:`Row.to_json`; ``peers``,
    other engines' figures where ``--compare``/``--peer-json`` asked for them, :meth:`PeerResult.to_json`)."""
    return {
        "tool": "hixl bench",
        "hixl_version": __version__,
        "scenarios": list(scenarios),
        "config": asdict(config),
        "machine": {
            "cpus": os.cpu_count(),
            "system": platform.system(),
            "kernel": platform.release(),
            "python": platform.python_version(),
        },
        "elapsed_s": elapsed_s,
        "notes": list(notes),
        "rows": [row.to_json() for row in rows],
        "peers": [peer.to_json() for peer in peers],
    }


def write_json(path: str, document: dict[str, Any]) -> None:
    """Write ``document`` to ``path`` (``-`` for stdout), indented, strictly valid JSON."""
    text = json.dumps(document, indent=2, default=str, allow_nan=False) + "\n"
    if path == "-":
        print(text, end="")
        return
    with open(path, "w") as f:
        f.write(text)
