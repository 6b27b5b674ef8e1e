"""Entry point of the bench target child (``python -m hixl.bench._target_main FD``)."""

from .._tools.child import child_connection
from .target import _serve

if __name__ == "__main__":
    _serve(child_connection())
