"""Connections still in the handshake cannot crowd out authenticated peers: floods of slow
handshakes from many source addresses in 127.0.0.0/8, against a target in a child process, while
a real engine links, reads and unlinks again and again."""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

import hixl
from hixl import Engine, Op, ResourceExhausted, Status
from hixl import _protocol as proto
from hixl._protocol.connection import Connection, Role
from hixl.testing import ScriptedPeer, TargetProcess

pytestmark = pytest.mark.timeout(90)

MakeTarget = Callable[..., TargetProcess]
MiB = 1 << 20
HELLO = Connection(Role.INITIATOR).initiate()
"""A real HELLO frame; every flood socket trickles these bytes (a fresh nonce each is not needed)."""
_PATIENT = {"hello_timeout": 10.0, "handshake_timeout": 10.0}
"""Options under which silent connections stay in the handshake for the whole of a short test."""


def _sources(count: int, first: int = 2) -> list[str]:
    """``count`` loopback source addresses, ``127.0.0.<first>`` on."""
    return [f"127.0.0.{first + i}" for i in range(count)]


def _port(target: TargetProcess) -> int:
    return int(target.engine.rsplit(":", 1)[1])


class _Flood:
    """``per_source`` sockets from each of ``sources``, each sending :data:`HELLO` one byte every
    ``pace`` seconds, on one selector-driven thread. A socket the target closes (evicted, refused,
    timed out) is replaced at once, until the ``with`` block ends or ``limit`` seconds passed."""

    def __init__(self, port: int, sources: list[str], per_source: int, pace: float = 1.0, limit: float = 60.0) -> None:
        self._port, self._pace, self._limit = port, pace, limit
        self._slots = [source for source in sources for _ in range(per_source)]
        self._selector = selectors.DefaultSelector()
        self._stop = threading.Event()
        self.connects = 0
        """Connections opened so far."""
        self.dropped = 0
        """Connections the target ended (refused, evicted or timed out)."""
        self._thread = threading.Thread(target=self._run, name="test-flood", daemon=True)

    def _open(self, slot: int) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.bind((self._slots[slot], 0))
        code = sock.connect_ex(("127.0.0.1", self._port))
        if code not in (0, errno.EINPROGRESS):
            sock.close()
            raise OSError(code, f"flood connect from {self._slots[slot]} failed")
        self.connects += 1
        # [slot, bytes of HELLO sent, when the next byte is due]
        self._selector.register(sock, selectors.EVENT_READ, [slot, 0, time.monotonic()])

    def _drop(self, sock: socket.socket) -> None:
        slot = self._selector.get_key(sock).data[0]
        self._selector.unregister(sock)
        sock.close()
        self.dropped += 1
        self._open(slot)

    def _run(self) -> None:
        for slot in range(len(self._slots)):
            self._open(slot)
        ends = time.monotonic() + self._limit
        while not self._stop.is_set() and time.monotonic() < ends:
            for key, _ in self._selector.select(timeout=0.05):
                try:
                    got = key.fileobj.recv(4096)  # type: ignore[union-attr]
                except BlockingIOError:
                    continue
                except OSError:
                    got = b""
                if not got:  # anything else it says (an ERROR) is followed by the close
                    self._drop(key.fileobj)  # type: ignore[arg-type]
            now = time.monotonic()
            for key in list(self._selector.get_map().values()):
                state = key.data
                if state[1] < len(HELLO) and now >= state[2]:
                    with contextlib.suppress(BlockingIOError, OSError):  # not connected yet: next turn
                        state[1] += key.fileobj.send(HELLO[state[1] : state[1] + 1])  # type: ignore[union-attr]
                        state[2] = now + self._pace
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()

    def __enter__(self) -> _Flood:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(10)


def test_a_handshake_flood_from_many_sources_does_not_lock_out_a_real_peer(make_target: MakeTarget) -> None:
    """The tracker's case: 10 source addresses x 16 sockets trickling HELLO at 1 byte/s, against a
    target with default options. Every one of 51 connect-read-disconnect rounds of a real engine
    succeeds (the tracker saw 2 of 51 while handshakes counted against max_connections; this test
    saw 0)."""
    target = make_target([MiB])
    target.fill(0, 5)
    expected = TargetProcess.expected(MiB, 5)[:4096]
    failures: list[str] = []
    with _Flood(_port(target), _sources(10), 16) as flood, Engine("127.0.0.1") as eng:
        buf = hixl.empty(4096)
        eng.register_mem(buf)
        time.sleep(1.5)  # the flood holds every slot it can take
        assert flood.connects >= 160
        ends = time.monotonic() + 40
        for round_ in range(51):
            if time.monotonic() >= ends:
                failures.append(f"round {round_}: out of time")
                continue
            buf[:] = 0
            try:
                eng.connect(target.engine, timeout=5)
                eng.transfer_sync(target.engine, Op.READ, [(int(buf.ctypes.data), target.addrs[0], 4096)], timeout=5)
                assert np.array_equal(buf, expected)
            except hixl.HixlError as exc:
                failures.append(f"round {round_}: {type(exc).__name__}: {exc}")
            finally:
                with contextlib.suppress(hixl.HixlError):
                    eng.disconnect(target.engine)
            time.sleep(0.1)  # spread the rounds over several lifetimes of the flood's connections
        dropped = flood.dropped
    assert not failures, f"{51 - len(failures)} of 51 rounds succeeded; failures: {failures[:5]}"
    assert dropped > 0, "the target never dropped a flood connection: the flood was not a flood"


def _still_open(peer: ScriptedPeer, wait: float = 0.3) -> bool:
    """Whether the target still holds ``peer``'s connection: nothing arrives within ``wait`` s, not its close."""
    peer.sock.settimeout(wait)
    try:
        return bool(peer.sock.recv(1, socket.MSG_PEEK))
    except TimeoutError:
        return True
    except OSError:
        return False


def _silent(target: TargetProcess, sources: list[str], per_source: int) -> list[ScriptedPeer]:
    """Connections that say nothing (they stay in the handshake), ``per_source`` from each source."""
    return [ScriptedPeer.connect(target.engine, timeout=5, source=source) for source in sources for _ in range(per_source)]


def test_a_source_over_its_share_of_handshakes_is_refused_at_once(make_target: MakeTarget) -> None:
    target = make_target([MiB], {"max_handshakes_per_source": 3, **_PATIENT})
    held = _silent(target, ["127.0.0.2"], 3)
    with ScriptedPeer.connect(target.engine, timeout=5, source="127.0.0.2") as extra:
        refusal = extra.recv_raw()
        assert isinstance(refusal, proto.Error) and refusal.status == Status.RESOURCE_EXHAUSTED
        assert "max_handshakes_per_source" in refusal.message and "127.0.0.2" in refusal.message
        with pytest.raises(EOFError):
            extra.recv_raw()
    with ScriptedPeer.connect(target.engine, timeout=5, source="127.0.0.3") as other:
        other.handshake()  # another source has its own share
    assert all(_still_open(peer) for peer in held)
    for peer in held:
        peer.close()


def test_a_slow_hello_is_dropped_at_the_hello_timeout(make_target: MakeTarget) -> None:
    """A HELLO trickled a byte every 0.1 s is dropped at hello_timeout, long before handshake_timeout;
    a peer that sent its HELLO at once has the rest of handshake_timeout for the rest."""
    target = make_target([MiB], {"hello_timeout": 0.5, "handshake_timeout": 5.0})
    with ScriptedPeer.connect(target.engine, timeout=5) as prompt, ScriptedPeer.connect(target.engine, timeout=5) as slow:
        prompt.send_raw(prompt.conn.initiate())
        assert isinstance(prompt.recv(), proto.Challenge)
        start = time.monotonic()
        with contextlib.suppress(OSError):
            for i in range(len(HELLO)):
                slow.send_raw(HELLO[i : i + 1])
                if not _still_open(slow, 0.1):
                    break
        took = time.monotonic() - start
        assert took < 2.0, f"a trickled HELLO was held {took:.1f} s"
        assert not _still_open(slow, 0.1)
        assert _still_open(prompt, 0.5), "a peer past its HELLO was dropped before handshake_timeout"


def test_handshakes_in_progress_take_no_authenticated_slot(make_target: MakeTarget) -> None:
    """20 handshakes held open do not count against max_connections=2: two real peers connect;
    the third authenticated peer is the one over the limit, refused with ResourceExhausted."""
    target = make_target([MiB], {"max_connections": 2, **_PATIENT})
    held = _silent(target, _sources(5), 4)
    engines = [Engine("127.0.0.1") for _ in range(3)]
    try:
        for eng in engines[:2]:
            eng.connect(target.engine, timeout=5)
        with pytest.raises(ResourceExhausted, match="max_connections limit"):
            engines[2].connect(target.engine, timeout=5)
        assert len(target.call("served_connections")) == 2
        assert all(_still_open(peer, 0.05) for peer in held), "a handshake was dropped to make room"
    finally:
        for eng in engines:
            eng.finalize()
        for peer in held:
            peer.close()


def test_a_full_handshake_pool_evicts_the_oldest_of_the_source_holding_most(make_target: MakeTarget) -> None:
    """The oldest handshake of all is from a source holding one; the one evicted is the oldest of
    the source holding three. The newcomer's handshake completes."""
    target = make_target([MiB], {"max_handshakes": 4, **_PATIENT})
    oldest = _silent(target, ["127.0.0.3"], 1)
    first, *rest = _silent(target, ["127.0.0.2"], 3)
    with ScriptedPeer.connect(target.engine, timeout=5, source="127.0.0.4") as honest:
        honest.handshake()  # the pool was full: its arrival evicted one
        with pytest.raises(EOFError):
            first.recv_raw()
        assert all(_still_open(peer) for peer in oldest + rest)
    for peer in [*oldest, first, *rest]:
        peer.close()


def test_finalize_joins_evicted_handshakes(resources, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    """10 handshakes, one per source, into 2 slots: the 8 oldest are evicted in order (and logged);
    finalize then leaves no thread or descriptor behind."""
    threads, fds = resources.threads(), resources.fds()
    caplog.set_level(logging.DEBUG, logger="hixl")
    target = Engine("127.0.0.1:0", {"max_handshakes": 2, **_PATIENT})
    peers = [ScriptedPeer.connect(target.local_engine, timeout=5, source=source) for source in _sources(10)]
    try:
        with pytest.raises(EOFError):
            peers[7].recv_raw()  # the last to be evicted
        assert "8 evictions so far" in caplog.text
        assert all(_still_open(peer, 0.05) for peer in peers[8:])
    finally:
        target.finalize()
        for peer in peers:
            peer.close()
    assert resources.threads() <= threads, "hixl threads left after finalize"
    assert resources.fds() == fds, "descriptors left open after finalize"
