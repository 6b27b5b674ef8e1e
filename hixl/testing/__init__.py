"""Public test helpers: a target engine in a real child process, driven over a pipe.

Used by hixl's own tests and benchmark, and meant for users testing code that
sits on top of hixl: the peer is a real process with a real engine, so
nothing stands in for a transport.
"""

from .peer import TargetProcess

__all__ = ["TargetProcess"]
