"""Optional plotting for ``--plot``: matplotlib is an extra (``pip install 'hixl[plot]'``).

It is imported only when a plot is asked for, and never through ``pyplot``: a
bare :class:`matplotlib.figure.Figure` renders straight to a file, so no
global backend is chosen, no window opens and no display is needed.
"""

from __future__ import annotations

import io
from typing import Any

__all__ = ["MISSING", "PNG_DPI", "new_figure", "plotting_available", "save"]

MISSING = "--plot needs matplotlib, which is not installed: pip install 'hixl[plot]'"

#: Small PNGs (the README's examples are checked in): readable, well under 100 KB (see :func:`save`).
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
    """Write ``figure`` to ``path``; the format follows the extension (``.png``, ``.svg``, ``.pdf``).

    A PNG is written with a palette of 256 colours: a dozen antialiased series in full RGBA made
    the bench's plot 93-100 KB, depending on the figures drawn; as a palette it is about a third of
    that, and looks the same. (Pillow comes with matplotlib.)
    """
    if not path.lower().endswith(".png"):
        figure.savefig(path, dpi=PNG_DPI)
        return
    from PIL import Image

    rendered = io.BytesIO()
    figure.savefig(rendered, format="png", dpi=PNG_DPI)
    rendered.seek(0)
    with Image.open(rendered) as image:
        image.convert("RGB").quantize(colors=256).save(path, optimize=True)
