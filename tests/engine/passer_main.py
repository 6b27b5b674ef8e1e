"""M, an insider: an engine that knows the secret and passes descriptors on, so that the
initiator I's same-host copies "to M" would touch a third, honest engine V.

``python passer_main.py SECRET MODE`` prints the ``"ip:port"`` it listens on, serves one
connection (I's), reads what it needs to know about V as JSON lines from stdin
(``{"engine", "pid", "addrs", "size"}``: V's address, pid, buffer addresses and their size) and
exits when its stdin closes. By MODE:

- ``shm-grant``: once I authenticated, it prints a JSON line ``{"lure", "inode"}``: an engine
  address of its own whose shm socket hands whoever fetches grants there (V, told to connect to it)
  250 copies of M's end of the I<->M socket (``inode``) as "memfds" and then stalls, so that V holds
  them while it waits for the rest. With V's line read, it plants I<->M's cma probe bytes in V's
  buffer 0 with an ordinary TCP WRITE, waits until the lure has handed the socket over, and names
  V in its WELCOME: V's pid, V's cma socket, the planted bytes, V's generation fd, and V's
  read-only and unregistered buffers (1, 2) as its own regions, writable.
- ``inherit``: the same, but it prints ``{"pid", "fd", "inode"}`` (its pid and its end of the
  I<->M socket): V is an engine started afterwards that took that descriptor (``pidfd_getfd``)
  before it exec'd, and holds it from its start.
- ``forward-memfds``: it fetches V's shm grants (V shares its pool memory with any authenticated
  peer) and offers exactly those memfds to I as its own, with V's buffers as its regions.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import sys
import tempfile
import threading
from typing import Any

import numpy as np

import hixl
from hixl import Engine, Op
from hixl import _protocol as proto
from hixl._protocol import shm as shm_proto
from hixl._session.address import boot_id
from hixl.testing import ScriptedPeer, ScriptedTarget
from hixl.transports._shm_socket import Credentials, GrantServer, Message, fetch

PLANT_AT = 4096  # where M writes the cma probe bytes into V's buffer 0
LURED = 0x7F0000000000  # where the lure's "grants" say they are


def _say(what: dict[str, Any]) -> None:
    print(json.dumps(what), flush=True)


def _authenticate(peer: ScriptedPeer) -> None:
    assert isinstance(peer.recv(), proto.Hello)
    peer.send_raw(peer.conn.challenge())
    assert isinstance(peer.recv(), proto.Auth)


class Lure:
    """An engine address of M's whose shm socket hands out ``fd`` (250 times) and stalls."""

    def __init__(self, secret: str, fd: int) -> None:
        self.handed = threading.Event()
        self._stop = threading.Event()
        self._proofs: queue.Queue[bytes] = queue.Queue()
        self._dir = tempfile.TemporaryDirectory()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(os.path.join(self._dir.name, "shm.sock"))
        self._listener.listen(4)
        self._held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._hand_over, args=(fd,), daemon=True)
        self._thread.start()
        self.target = ScriptedTarget(self._serve, secret)

    def _serve(self, peer: ScriptedPeer) -> None:
        shm = {"boot_id": boot_id(), "socket": self._listener.getsockname()}
        peer.accept_handshake([(LURED, 251 * 4096, 1)], boot_id=boot_id(), transports={"shm": shm, "tcp": {}})
        self._proofs.put(peer.conn.binding("shm-target"))
        self._stop.wait(30)

    def _hand_over(self, fd: int) -> None:
        conn, _ = self._listener.accept()
        conn.recv(64)  # the request: whatever it proves, the "grants" follow
        grants = [shm_proto.Grant(LURED + i * 4096, 4096, True) for i in range(251)]
        first = shm_proto.encode_grants(self._proofs.get(timeout=20), grants)[0]  # 250 of them, not the last
        socket.send_fds(conn, [first], [fd] * shm_proto.MAX_PER_MESSAGE)
        self._held.append(conn)  # open: the fetcher waits for the rest until its deadline
        self.handed.set()

    def close(self) -> None:
        self._stop.set()
        self.target.close()
        self._listener.close()
        for conn in self._held:
            conn.close()
        self._dir.cleanup()


def _plant_and_name(secret: str, victim: dict[str, Any], binding: bytes) -> tuple[dict[str, Any], int]:
    """Plant ``binding`` in V's buffer 0 over TCP; V's cma facts and its registration generation."""
    with ScriptedPeer.connect(victim["engine"], secret) as spy:
        advertised = spy.handshake()
    with Engine("127.0.0.1", {"auth_secret": secret, "transport": "tcp"}) as planter:
        plant = hixl.empty(16)
        plant[:] = np.frombuffer(binding, np.uint8)
        planter.register_mem(plant)
        planter.connect(victim["engine"])
        planter.transfer_sync(victim["engine"], Op.WRITE, [(int(plant.ctypes.data), victim["addrs"][0] + PLANT_AT, 16)])
    theirs = advertised["transports"]["cma"]
    cma = {
        "pid": victim["pid"],
        "boot_id": boot_id(),
        "pid_namespace": theirs["pid_namespace"],
        "socket": theirs.get("socket"),  # (an hixl that proves its process has one)
        "probe_addr": victim["addrs"][0] + PLANT_AT,
        "generation_fd": theirs["generation_fd"],
    }
    return cma, int(advertised["generation"])


def _name_the_victim(peer: ScriptedPeer, secret: str, mode: str, victims: queue.Queue[dict[str, Any]]) -> None:
    own = peer.sock.fileno()
    inode = os.fstat(own).st_ino
    lure = Lure(secret, own) if mode == "shm-grant" else None
    try:
        _say({"lure": lure.target.engine, "inode": inode} if lure else {"pid": os.getpid(), "fd": own, "inode": inode})
        victim = victims.get(timeout=60)
        cma, generation = _plant_and_name(secret, victim, peer.conn.binding("cma"))
        if lure is not None:
            assert lure.handed.wait(30), "V never fetched the lure's grants"
        size = victim["size"]
        welcome = {
            "engine": "insider",
            "engine_id": "insider",
            "boot_id": boot_id(),
            "generation": generation,
            "regions": [[victim["addrs"][1], size, 1], [victim["addrs"][2], size, 1]],
            "transports": {"cma": cma, "tcp": {}},
        }
        peer.send_raw(peer.conn.welcome(welcome))
        peer.expect_closed(30)
    finally:
        if lure is not None:
            lure.close()


def _forward_memfds(peer: ScriptedPeer, secret: str, victims: queue.Queue[dict[str, Any]]) -> None:
    victim = victims.get(timeout=60)
    with ScriptedPeer.connect(victim["engine"], secret) as spy:
        advertised = spy.handshake()
        path = advertised["transports"]["shm"]["socket"]
        fetched = fetch(path, spy.conn.binding("shm"), spy.conn.binding("shm-target"), 10.0)
    alive_r, alive_w = os.pipe()

    def answer(request: bytes, cred: Credentials) -> list[Message]:
        grants = [r.grant for r in fetched.received]
        fds = [os.dup(r.fd) for r in fetched.received] + [os.dup(alive_r)]
        return [(shm_proto.encode_grants(peer.conn.binding("shm-target"), grants)[0], fds)]

    with tempfile.TemporaryDirectory() as where:
        server = GrantServer(os.path.join(where, "shm.sock"), answer, 5.0)
        try:
            regions = [(r.grant.addr, r.grant.length, int(r.grant.writable)) for r in fetched.received]
            peer.accept_handshake(regions, boot_id=boot_id(), transports={"shm": {"boot_id": boot_id(), "socket": server.path}, "tcp": {}})
            peer.expect_closed(30)
        finally:
            server.close()
            for fd in [r.fd for r in fetched.received] + [fetched.liveness, alive_r, alive_w]:
                os.close(fd)


def main(secret: str, mode: str) -> None:
    victims: queue.Queue[dict[str, Any]] = queue.Queue()

    def script(peer: ScriptedPeer) -> None:
        if mode == "forward-memfds":
            _forward_memfds(peer, secret, victims)
            return
        _authenticate(peer)
        _name_the_victim(peer, secret, mode, victims)

    with ScriptedTarget(script, secret) as fake:
        print(fake.engine, flush=True)
        for line in sys.stdin:
            victims.put(json.loads(line))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
