"""Entry point of the weights scenario's publisher and nodes (``python -m hixl.bench._weights_peer_main FD``)."""

from .weights_peers import main

if __name__ == "__main__":
    main()
