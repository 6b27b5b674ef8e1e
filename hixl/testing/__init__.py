"""Public test helpers: a target engine in a real child process, driven over a pipe.

Used by hixl's own tests and benchmark, and meant for users testing code that
sits on top of hixl: the peer is a real process with a real engine, so
nothing stands in for a transport. :class:`ScriptedPeer` and
:class:`ScriptedTarget` speak the real protocol frame by frame, with fault
injection, for the failures a real peer only shows by chance.
:mod:`hixl.testing.hosts` puts such peers on other "hosts" — network namespaces joined by
veth pairs, optionally with PID namespaces and users of their own — with links that can be cut.
"""

from .peer import TargetProcess
from .scripted import ScriptedPeer, ScriptedTarget

__all__ = ["ScriptedPeer", "ScriptedTarget", "TargetProcess"]
