"""A one-line progress bar on stderr: ``[#####.....] 12/40 cma READ 64 MiB``.

No dependency and no thread: it redraws when a step starts or ends. It stays
silent when disabled or when the stream is not a terminal (logs and pipes
get only the final table). Scenarios call :meth:`Progress.expect` with the
number of steps they will take, then wrap each in :meth:`Progress.step`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """See the module docstring. ``enabled=None`` means "if ``stream`` is a TTY"."""

    def __init__(self, stream: TextIO | None = None, enabled: bool | None = None, width: int = 30) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = enabled
        self.width = width
        self.total = 0
        self.done = 0
        self._shown = 0

    def expect(self, steps: int) -> None:
        """Announce ``steps`` more steps (scenarios call this before they start)."""
        self.total += steps

    @contextlib.contextmanager
    def step(self, label: str) -> Iterator[None]:
        """Show ``label`` while the block runs; count one step done when it ends (even on error)."""
        self._draw(label)
        try:
            yield
        finally:
            self.done += 1
            self._draw(label)

    def skip(self, steps: int) -> None:
        """Count ``steps`` announced steps as done without running them."""
        self.done += steps

    def render(self, label: str) -> str:
        """The bar's text for the current count (no carriage return)."""
        total = max(self.total, self.done, 1)
        filled = self.width * self.done // total
        return f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{total} {label}"

    def _draw(self, label: str) -> None:
        if not self.enabled:
            return
        text = self.render(label)
        pad = max(0, self._shown - len(text))
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()
        self._shown = len(text)

    def close(self) -> None:
        """Erase the bar so the table starts on a clean line."""
        if self.enabled and self._shown:
            self.stream.write("\r" + " " * self._shown + "\r")
            self.stream.flush()
            self._shown = 0
