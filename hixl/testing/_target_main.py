"""Entry point of a :class:`~hixl.testing.TargetProcess` child (``python -m``)."""

from .._tools.child import child_connection
from .peer import _serve

if __name__ == "__main__":
    _serve(child_connection())
