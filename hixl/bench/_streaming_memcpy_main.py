"""Entry point of shm's streaming-memcpy baseline helper (``python -m hixl.bench._streaming_memcpy_main FD``)."""

from .._tools.child import child_connection
from .streaming_memcpy import serve

if __name__ == "__main__":
    serve(child_connection())
