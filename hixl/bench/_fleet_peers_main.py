"""Entry point of a fleet bench peer process (``python -m hixl.bench._fleet_peers_main FD``)."""

from .._tools.child import child_connection
from .fleet_peers import _serve

if __name__ == "__main__":
    _serve(child_connection())
