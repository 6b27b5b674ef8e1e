"""Entry point of the kv scenario's prefill child (``python -m hixl.bench._kv_prefill_main FD``)."""

from .._tools.child import child_connection
from .kv_prefill import _serve

if __name__ == "__main__":
    _serve(child_connection())
