"""``hixl bench --plot``'s engine figure: legends beside the curves, not on them; baselines named right."""

from __future__ import annotations

import pytest

from hixl.bench.plot import engine_figure
from hixl.bench.results import Row

pytest.importorskip("matplotlib")

SIZES = [4096, 65536, 1 << 20, 16 << 20]


def _rows() -> list[Row]:
    rows = []
    for transport in ("cma", "shm", "tcp"):
        for op in ("READ", "WRITE"):
            for size in SIZES:
                raw = "pread /proc/<pid>/mem" if transport == "cma" and size == 4096 else f"{transport} raw"
                rows.append(Row("bandwidth", transport, op, size, 1.0 + size / 1e6, "GiB/s", 2.0, raw))
    return rows


def _samples() -> dict[tuple[str, str, int, str], list[float]]:
    return {(t, op, 8, who): [1.0 + i / 100 for i in range(200)]
            for t in ("cma", "shm", "tcp") for op in ("READ", "WRITE") for who in ("hixl", "raw")}


def test_legends_leave_the_curves_uncovered() -> None:
    figure = engine_figure(_rows(), _samples(), smoke=False)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)
    canvas.draw()  # constrained layout places everything on the first draw
    renderer = canvas.get_renderer()
    for ax in figure.axes:
        legend, panel = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer)
        assert not legend.overlaps(panel), (ax.get_title(), legend, panel)
        assert figure.bbox.contains(legend.x0, legend.y0) and figure.bbox.contains(legend.x1, legend.y1)


def test_a_baseline_that_changes_call_with_the_size_names_each() -> None:
    figure = engine_figure(_rows(), _samples(), smoke=False)
    labels = figure.axes[0].get_legend_handles_labels()[1]
    assert "cma READ pread /proc/<pid>/mem (4 KiB), cma raw (64 KiB-16 MiB)" in labels
    assert "tcp WRITE tcp raw (4 KiB-16 MiB)" in labels
