"""Entry point of a :class:`~hixl.testing.datadist_peer.DataDistProcess` child (``python -m``)."""

from .._tools.child import child_connection
from .datadist_peer import _serve

if __name__ == "__main__":
    _serve(child_connection())
