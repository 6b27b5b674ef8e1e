"""Engine life cycle: finalize (idle, connected, twice), context manager, disconnect, nothing leaked."""

from __future__ import annotations

import os
import socket
import time

import numpy as np
import pytest

import hixl
from hixl import Engine, HixlError, NotifyDesc, Op, PeerDisconnected, TransferStatus
from hixl.testing import TargetProcess

pytestmark = pytest.mark.timeout(60)


def _addr(buf: np.ndarray) -> int:
    return int(buf.ctypes.data)


def _exercise(eng: Engine, target: str, remote_addr: int) -> None:
    """Use every kind of thread an initiator has: sync, async worker, notify."""
    buf = hixl.empty(1 << 20)
    eng.register_mem(buf)
    eng.transfer_sync(target, Op.READ, [(_addr(buf), remote_addr, 1 << 20)])
    req = eng.transfer_async(target, Op.WRITE, [(_addr(buf), remote_addr, 4096)])
    assert req.wait(10) is TransferStatus.COMPLETED
    eng.send_notify(target, NotifyDesc("a", "b"))


def test_finalize_idle_engines_twice(resources) -> None:  # type: ignore[no-untyped-def]
    threads, fds = resources.threads(), resources.fds()
    for address in ("127.0.0.1", "127.0.0.1:0"):
        eng = Engine(address)
        eng.finalize()
        eng.finalize()
        assert "finalized" in repr(eng)
    assert resources.threads() <= threads
    assert resources.fds() == fds


def test_failed_construction_leaves_nothing_behind(resources) -> None:  # type: ignore[no-untyped-def]
    threads, fds = resources.threads(), resources.fds()
    for address, options in [
        ("127.0.0.1", {"transport": "rdma"}),
        ("127.0.0.1", {"bogus": 1}),
        ("192.0.2.1:0", {}),  # not a local address: cannot listen
        ("not-an-address", {}),
    ]:
        with pytest.raises(HixlError):
            Engine(address, options)
    assert resources.threads() <= threads
    assert resources.fds() == fds


def test_finalize_with_a_target_process_connected(transport: str, shared_target: TargetProcess, resources) -> None:  # type: ignore[no-untyped-def]
    threads, fds = resources.threads(), resources.fds()
    eng = Engine("127.0.0.1:0", {"transport": transport})
    eng.connect(shared_target.engine)
    _exercise(eng, shared_target.engine, shared_target.addrs[1])
    # The target process is also connected to us, so we serve a connection too, and a handled
    # notification on a worker.
    shared_target.call("connect", eng.local_engine)
    eng.handle_notifies("probe", lambda notify: None)
    with Engine("127.0.0.1") as sender:
        sender.connect(eng.local_engine)
        sender.send_notify(eng.local_engine, NotifyDesc("probe", "x"))
    assert len(resources.threads() - threads) >= 4  # I/O loop, a worker, link reader, async worker
    eng.finalize()
    assert resources.threads() <= threads, "hixl threads left after finalize"
    assert resources.fds() == fds, "descriptors left open after finalize"
    eng.finalize()
    with pytest.raises(HixlError, match="finalized"):
        eng.connect(shared_target.engine)
    # The target saw us go and still works for others.
    with pytest.raises(PeerDisconnected):
        shared_target.call("transfer_sync", eng.local_engine, Op.READ, [(shared_target.addrs[0], 1, 1)])
    shared_target.call("disconnect", eng.local_engine)
    with Engine("127.0.0.1", {"transport": transport}) as other:
        other.connect(shared_target.engine)
        _exercise(other, shared_target.engine, shared_target.addrs[1])


def test_finalize_both_ends_in_one_process(transport: str, resources) -> None:  # type: ignore[no-untyped-def]
    threads, fds = resources.threads(), resources.fds()
    target = Engine("127.0.0.1:0")
    region = hixl.empty(1 << 20, shared=transport == "shm")  # (pool memory: what shm moves)
    target.register_mem(region)
    initiator = Engine("127.0.0.1", {"transport": transport})
    initiator.connect(target.local_engine)
    assert initiator.transport_of(target.local_engine) == transport
    _exercise(initiator, target.local_engine, _addr(region))
    assert target.get_notifies() == [NotifyDesc("a", "b")]
    # The target goes first: the initiator's link learns it at once (BYE) ...
    target.finalize()
    buf = hixl.empty(4096)
    initiator.register_mem(buf)
    with pytest.raises(PeerDisconnected):
        initiator.transfer_sync(target.local_engine, Op.READ, [(_addr(buf), _addr(region), 16)])
    initiator.finalize()
    del region  # pool memory holds descriptors of its own until it is freed
    assert resources.threads() <= threads
    assert resources.fds() == fds


def test_context_manager(shared_target: TargetProcess, resources) -> None:  # type: ignore[no-untyped-def]
    threads, fds = resources.threads(), resources.fds()
    with Engine("127.0.0.1:0") as eng:
        eng.connect(shared_target.engine)
        _exercise(eng, shared_target.engine, shared_target.addrs[1])
        assert repr(eng).startswith(f"<Engine {eng.local_engine} target+initiator 1 peer(s)")
    assert "finalized" in repr(eng)
    with pytest.raises(HixlError, match="finalized"):
        eng.register_mem(hixl.empty(16))
    assert resources.threads() <= threads
    assert resources.fds() == fds
    # Leaving by an exception finalizes too, and the exception propagates.
    with pytest.raises(KeyError), Engine("127.0.0.1:0") as eng:
        eng.connect(shared_target.engine)
        raise KeyError("boom")
    assert resources.threads() <= threads
    assert resources.fds() == fds


def test_disconnect_and_reconnect(transport: str, shared_target: TargetProcess, resources) -> None:  # type: ignore[no-untyped-def]
    with Engine("127.0.0.1", {"transport": transport}) as eng:
        buf = hixl.empty(4096)
        eng.register_mem(buf)
        threads, fds = resources.threads(), resources.fds()
        for _ in range(3):
            eng.connect(shared_target.engine)
            eng.transfer_sync(shared_target.engine, Op.READ, [(_addr(buf), shared_target.addrs[0], 4096)])
            assert buf.tobytes() == shared_target.read(0, 0, 4096)
            eng.disconnect(shared_target.engine)
            assert eng.connected_engines() == []
        assert resources.threads() <= threads
        assert resources.fds() == fds


def test_disconnect_keeps_the_socket_number_while_a_reader_is_inside_a_call(shared_target: TargetProcess, resources) -> None:  # type: ignore[no-untyped-def]
    """A thread inside a read (C code, too) holds the socket's descriptor number, not the socket:
    released under it, the number would go to the next socket opened — a reconnection, say — and
    that thread's next recv would read the other connection's stream. So disconnect shuts the
    socket down at once and releases it only once the read role is given back."""
    with Engine("127.0.0.1", {"transport": "tcp"}) as eng:
        threads = resources.threads()
        eng.connect(shared_target.engine)
        wire = eng._peers[shared_target.engine].link.wire  # (white box: a reader is whoever holds the read role)
        fd, inode = wire.fd, os.fstat(wire.fd).st_ino
        assert wire.read_lock.acquire(timeout=5)
        try:
            eng.disconnect(shared_target.engine)
            a, b = socket.socketpair()  # (the lowest free numbers: the link's, had it been released)
            with a, b:
                assert fd not in (a.fileno(), b.fileno()) and os.fstat(fd).st_ino == inode
                assert os.read(fd, 1) == b""  # shut down: a reader's next recv ends at once
        finally:
            wire.read_lock.release()
        deadline = time.monotonic() + 5
        while _same_file(fd, inode):
            assert time.monotonic() < deadline, "the socket was not released once the read role was free"
            time.sleep(0.01)
        while resources.threads() > threads:
            assert time.monotonic() < deadline
            time.sleep(0.01)


def _same_file(fd: int, inode: int) -> bool:
    try:
        return os.fstat(fd).st_ino == inode
    except OSError:
        return False


def test_notifications_name_their_connection_and_engines_their_incarnation() -> None:
    with Engine("127.0.0.1:0") as target, Engine("127.0.0.1") as a, Engine("127.0.0.1") as b:
        a.connect(target.local_engine)
        b.connect(target.local_engine)
        assert a.peer_incarnation(target.local_engine) == target.incarnation != a.incarnation
        a.send_notify(target.local_engine, NotifyDesc("n", "from a"))
        b.send_notify(target.local_engine, NotifyDesc("n", "from b"))
        got = target.wait_notifies(timeout=5)
        got += [] if len(got) == 2 else target.wait_notifies(timeout=5)
        assert got == [NotifyDesc("n", "from a"), NotifyDesc("n", "from b")]  # sender is not compared
        assert got[0].sender != got[1].sender and set(target.served_connections()) == {got[0].sender, got[1].sender}
        a.disconnect(target.local_engine)
        deadline = time.monotonic() + 5
        while got[0].sender in target.served_connections() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert list(target.served_connections()) == [got[1].sender]
        a.connect(target.local_engine)  # the same peer again: a new connection, a new id
        a.send_notify(target.local_engine, NotifyDesc("n", "again"))
        again = target.wait_notifies(timeout=5)
        assert again[0].sender not in (got[0].sender, got[1].sender)
