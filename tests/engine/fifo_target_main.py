"""A malicious target in its own process whose cma advertisement is honest but for one thing:
its "generation fd" is a FIFO nobody writes to (opening it for reading would block).

``python fifo_target_main.py SECRET FIFO_PATH`` prints the ``"ip:port"`` it listens on, serves
one connection, and exits when its stdin closes.
"""

from __future__ import annotations

import ctypes
import os
import sys

from hixl import _protocol as proto
from hixl._address import boot_id
from hixl.testing import ScriptedPeer, ScriptedTarget


def main(secret: str, fifo: str) -> None:
    fifo_fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # held open, never written
    probe = ctypes.create_string_buffer(16)

    def script(peer: ScriptedPeer) -> None:
        assert isinstance(peer.recv(), proto.Hello)
        peer.send_raw(peer.conn.challenge())
        assert isinstance(peer.recv(), proto.Auth)
        ctypes.memmove(probe, peer.conn.binding("cma"), 16)  # the probe bytes, truthfully, in this process
        cma = {"pid": os.getpid(), "boot_id": boot_id(), "probe_addr": ctypes.addressof(probe), "generation_fd": fifo_fd}
        welcome = {"engine": "fifo", "engine_id": "fifo", "boot_id": boot_id(), "generation": 0, "regions": [], "transports": {"cma": cma, "tcp": {}}}
        peer.send_raw(peer.conn.welcome(welcome))
        peer.expect_closed(60)

    with ScriptedTarget(script, secret) as fake:
        print(fake.engine, flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
