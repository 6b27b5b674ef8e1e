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
from .results import Row

__all__ = ["failed", "format_number", "format_table", "summary", "to_json", "write_json"]

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


def format_table(rows: Sequence[Row]) -> str:
    """An aligned text table, one line per row, a blank line between transports or scenarios."""
    body = [_cells(row) for row in rows]
    widths = [max(len(c) for c in col) for col in zip(COLUMNS, *body)]
    numeric = {3, 4, 5, 6}  # right-aligned columns

    def line(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(parts).rstrip()

    out = [line(COLUMNS), line(["-" * w for w in widths])]
    previous: tuple[str, str] | None = None
    for row, cells in zip(rows, body):
        group = (row.scenario, row.transport)
        if previous is not None and group != previous:
            out.append("")
        previous = group
        out.append(line(cells))
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
    rows: Sequence[Row], config: BenchConfig, scenarios: Sequence[str], notes: Sequence[str], elapsed_s: float
) -> dict[str, Any]:
    """Everything a run found, as a JSON-able dict (``rows`` follow :meth:`Row.to_json`)."""
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
    }


def write_json(path: str, document: dict[str, Any]) -> None:
    """Write ``document`` to ``path`` (``-`` for stdout), indented, strictly valid JSON."""
    text = json.dumps(document, indent=2, default=str, allow_nan=False) + "\n"
    if path == "-":
        print(text, end="")
        return
    with open(path, "w") as f:
        f.write(text)
