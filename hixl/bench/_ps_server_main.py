"""Entry point of the ps scenario's servers (``python -m hixl.bench._ps_server_main FD``)."""

from .ps_server import main

if __name__ == "__main__":
    main()
