"""Optional plotting for ``--plot``: matplotlib is an extra (``pip install 'hixl[plot]'``).

It is imported only when a plot is asked for, and never through ``pyplot``: a
bare :class:`matplotlib.figure.Figure` renders straight to a file, so no
global backend is chosen, no window opens and no display is needed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MISSING", "PNG_DPI", "new_figure", "plotting_available", "save"]

MISSING = "--plot needs matplotlib, which is not installed: pip install 'hixl[plot]'"

#: Small PNGs (the README's examples are checked in): readable, well under 100 KB.
PNG_DPI = 80


def plotting_available() -> bool:
    """Whether matplotlib can be imported (check before a long run, not after it)."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        return False
    return True


def new_figure(width: float, height: float) -> Any:
    """A fresh matplotlib ``Figure`` of ``width`` x ``height`` inches, with a tight layout."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def save(figure: Any, path: str) -> None:
    """Write ``figure`` to ``path``; the format follows the extension (``.png``, ``.svg``, ``.pdf``)."""
    options = {"pil_kwargs": {"optimize": True}} if path.lower().endswith(".png") else {}
    figure.savefig(path, dpi=PNG_DPI, **options)
