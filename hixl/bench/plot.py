"""``hixl bench --plot FILE``: bandwidth against transfer size, and the latency distribution.

Above: every ``bandwidth`` row of the engine scenario, hixl (solid) next to the
raw baseline timed interleaved with it (dashed), per transport and direction.
Below: the distribution of single ``transfer_sync`` latencies (one curve per
contender: the share of calls at or under each latency), from the samples
behind the table's median and p99.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._tools.plot import new_figure, save
from .config import format_size
from .results import Row

__all__ = ["engine_figure", "plot_engine"]

_CURVE_POINTS = 250

_COLOURS = {
    ("cma", "READ"): "tab:blue",
    ("cma", "WRITE"): "tab:cyan",
    ("shm", "READ"): "tab:green",
    ("shm", "WRITE"): "tab:olive",
    ("tcp", "READ"): "tab:red",
    ("tcp", "WRITE"): "tab:orange",
}


def plot_engine(
    rows: Sequence[Row],
    latency_samples: dict[tuple[str, str, int, str], list[float]],
    path: str,
    *,
    smoke: bool,
) -> None:
    """Draw the engine scenario's bandwidth and latency figures into ``path``."""
    save(engine_figure(rows, latency_samples, smoke=smoke), path)


def engine_figure(
    rows: Sequence[Row],
    latency_samples: dict[tuple[str, str, int, str], list[float]],
    *,
    smoke: bool,
) -> Any:
    """The engine scenario's bandwidth and latency panels, as a matplotlib ``Figure``."""
    figure = new_figure(10, 8.4)  # one panel above the other, each with its legend on its right
    bandwidth, latency = figure.subplots(2, 1)
    _bandwidth(bandwidth, [r for r in rows if r.name == "bandwidth"])
    _latency(latency, latency_samples)
    title = "hixl bench: the engine against the raw calls it is built on"
    figure.suptitle(title + (" (--quick: smoke sizes, not measurements)" if smoke else ""))
    return figure


def _bandwidth(ax: Any, rows: Sequence[Row]) -> None:
    series: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        series.setdefault((row.transport, row.op), []).append(row)
    for (transport, op), points in series.items():
        points.sort(key=lambda r: r.size or 0)
        sizes = [r.size for r in points]
        colour = _COLOURS.get((transport, op), "grey")
        ax.plot(sizes, [r.value for r in points], "o-", color=colour, label=f"{transport} {op} hixl")
        # A curve's baseline may change call with the size (cma: pread on /proc/<pid>/mem for one
        # page, process_vm_* above): name each, with the sizes it was timed at.
        names: dict[str, list[int]] = {}
        for r in points:
            names.setdefault(r.baseline_name, []).append(r.size or 0)
        baseline = f"{transport} {op} " + ", ".join(_named_span(name, spans) for name, spans in names.items())
        ax.plot(sizes, [r.baseline for r in points], "x--", color=colour, label=baseline)
    ticks = sorted({r.size for r in rows if r.size})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [format_size(s) for s in ticks])
    ax.set_xlabel("single transfer size")
    ax.set_yscale("log")  # tcp at 4 KiB and cma at 512 MiB differ a thousandfold
    ax.set_ylabel("GiB/s")
    ax.set_title("bandwidth: hixl (solid) vs raw baseline (dashed)")
    ax.grid(True, alpha=0.3)
    _legend(ax)


def _latency(ax: Any, samples: dict[tuple[str, str, int, str], list[float]]) -> None:
    # One size keeps the picture readable: the smallest, where per-call overhead shows most.
    smallest = min((size for _, _, size, _ in samples), default=None)
    for (transport, op, size, contender), values in sorted(samples.items()):
        if size != smallest:
            continue
        ordered = sorted(values)
        # A few hundred points draw the same curve as 2000 and keep the PNG small enough to check in.
        picks = sorted({*range(0, len(ordered), max(1, len(ordered) // _CURVE_POINTS)), len(ordered) - 1})
        share = [100.0 * (i + 1) / len(ordered) for i in picks]
        ordered = [ordered[i] for i in picks]
        style = "-" if contender == "hixl" else "--"
        label = f"{transport} {op} {'hixl transfer_sync' if contender == 'hixl' else 'raw'}"
        ax.step(ordered, share, style, where="post", color=_COLOURS.get((transport, op), "grey"), label=label)
    ax.set_xscale("log")
    ax.set_xlabel("latency of one call (µs)")
    ax.set_ylabel("% of calls at or under")
    what = "" if smallest is None else f" of {format_size(smallest)}"
    ax.set_title(f"latency distribution, single transfers{what}")
    ax.grid(True, alpha=0.3)
    _legend(ax)


def _named_span(name: str, sizes: list[int]) -> str:
    low, high = format_size(min(sizes)), format_size(max(sizes))
    return f"{name} ({low})" if low == high else f"{name} ({low}-{high})"


def _legend(ax: Any) -> None:
    # Beside the panel, not on it: a dozen entries inside the axes hid the curves they name.
    if ax.get_legend_handles_labels()[0]:  # a run with every transport skipped has no curves
        ax.legend(fontsize="x-small", loc="center left", bbox_to_anchor=(1.01, 0.5))
