"""A malicious target in its own process: it knows the secret and completes an honest
handshake, then lies in its cma advertisement.

``python impostor_main.py SECRET`` prints the ``"ip:port"`` it listens on, then reads one JSON line
from stdin saying what to lie about, serves one connection, and exits when its stdin closes. It
listens on a cma socket of its own, where it proves the connection's binding as an honest target
does (so the kernel names it as the peer's process), and names that socket:

- ``{"fifo": PATH}``: names itself (truthfully), but a FIFO nobody writes to as its generation fd
  (opening that for reading would block);
- ``{"pid": P, "probe_addr": A, "generation_fd": F, "generation": G}``: names process P — the
  initiator itself, say — having planted this connection's probe bytes at A in P (what a TCP WRITE
  into memory P registered would do; here ``process_vm_writev``, as this test runs as one user).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import tempfile

import numpy as np

from hixl import _protocol as proto
from hixl._iov import process_vm_writev
from hixl._protocol import shm as shm_proto
from hixl._protocol.connection import Connection
from hixl._session.address import boot_id
from hixl.testing import ScriptedPeer, ScriptedTarget
from hixl.transports._shm_socket import Credentials, GrantServer, Message


def main(secret: str) -> None:
    probe = ctypes.create_string_buffer(16)
    served: list[Connection] = []

    def prove(request: bytes, cred: Credentials) -> list[Message]:
        if served and shm_proto.decode_request(request) == served[0].binding("cma-socket"):
            return [(served[0].binding("cma-socket-target"), [])]
        return [(shm_proto.encode_refusal("not this connection"), [])]

    def script(peer: ScriptedPeer) -> None:
        assert isinstance(peer.recv(), proto.Hello)
        peer.send_raw(peer.conn.challenge())
        assert isinstance(peer.recv(), proto.Auth)
        served.append(peer.conn)
        binding = peer.conn.binding("cma")
        if "fifo" in lie:
            ctypes.memmove(probe, binding, 16)  # the probe bytes, truthfully, in this process
            cma = {"pid": os.getpid(), "probe_addr": ctypes.addressof(probe), "generation_fd": fifo_fd}
            generation = 0
        else:
            ctypes.memmove(probe, binding, 16)
            local = np.array([[ctypes.addressof(probe), 16]], dtype=np.uint64)
            remote = np.array([[lie["probe_addr"], 16]], dtype=np.uint64)
            assert process_vm_writev(lie["pid"], local.ctypes.data, 1, remote.ctypes.data, 1, 0) == 16
            cma = {"pid": lie["pid"], "probe_addr": lie["probe_addr"], "generation_fd": lie["generation_fd"]}
            generation = lie["generation"]
        welcome = {
            "engine": "impostor",
            "engine_id": "impostor",
            "boot_id": boot_id(),
            "generation": generation,
            "regions": lie.get("regions", []),
            "transports": {"cma": {**cma, "boot_id": boot_id(), "socket": server.path}, "tcp": {}},
        }
        peer.send_raw(peer.conn.welcome(welcome))
        peer.expect_closed(60)

    with tempfile.TemporaryDirectory() as where:
        server = GrantServer(os.path.join(where, "cma.sock"), prove, 5.0)
        try:
            with ScriptedTarget(script, secret) as fake:
                print(fake.engine, flush=True)
                lie = json.loads(sys.stdin.readline())
                fifo_fd = os.open(lie["fifo"], os.O_RDONLY | os.O_NONBLOCK) if "fifo" in lie else -1  # held, never written
                print("ready", flush=True)
                sys.stdin.read()
        finally:
            server.close()


if __name__ == "__main__":
    main(sys.argv[1])
