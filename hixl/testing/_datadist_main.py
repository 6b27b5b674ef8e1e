"""Entry point of a :class:`~hixl.testing.datadist_peer.DataDistProcess` child (``python -m``)."""

import sys
from multiprocessing.connection import Connection

from .datadist_peer import _serve

if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
