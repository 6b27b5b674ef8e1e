"""``hixl demo`` command registration (the implementation lives in :mod:`hixl.demo.run`)."""

from .run import add_parser

__all__ = ["add_parser"]
