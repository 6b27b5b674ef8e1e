"""Region updates travel as what changed, with generations, and initiators follow them exactly.

A target tells each peer only what changed since the generation that peer knows
(a REGIONS or REVOKE frame of a few rows, however many regions there are), and
the whole table only when the change is longer than the table or older than its
log. Initiators apply each update to the generation it follows on from; one that
does not follow on ends the link.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import hixl
from hixl import Engine, MemoryRangeError, Op, PeerDisconnected, TransferTimeout
from hixl import _protocol as proto
from hixl._memory import CHANGE_LOG, Registry
from hixl.testing import ScriptedPeer, ScriptedTarget, TargetProcess

MiB = 1 << 20
NO_ROWS = np.zeros((0, 3), np.uint64)


def _rows(*rows: tuple[int, int, int]) -> np.ndarray:
    return np.array(rows, dtype=np.uint64).reshape(-1, 3)


# -- the target side ------------------------------------------------------------------------------
def test_the_registry_tells_what_changed_since_a_generation() -> None:
    registry = Registry()
    bufs = [np.zeros(4096, np.uint8) for _ in range(8)]
    handles = [registry.register(b) for b in bufs[:6]]
    base = registry.generation
    registry.deregister(handles[1])
    new = registry.register(bufs[6], access="r")
    update = registry.update_since(base)
    assert (update.generation, update.base) == (base + 2, base)
    assert update.added.tolist() == [[new.addr, new.len, 0]]
    assert update.removed.tolist() == [[handles[1].addr, handles[1].len, 1]]
    # Registered and withdrawn again since: nothing to tell.
    again = registry.register(bufs[7])
    registry.deregister(again)
    since = registry.update_since(base + 2)
    assert (since.generation, since.base, len(since.added), len(since.removed)) == (base + 4, base + 2, 0, 0)
    # Up to date: an empty change; from before the log, or longer than the table: the whole table.
    assert len(registry.update_since(registry.generation).added) == 0
    whole = registry.update_since(0)
    assert whole.base is None and sorted(whole.added.tolist()) == sorted(map(list, registry.regions()))


def test_a_change_older_than_the_log_is_the_whole_table() -> None:
    registry = Registry()
    bufs = [np.zeros(64, np.uint8) for _ in range(4)]
    keep = [registry.register(b) for b in bufs[:3]]
    base = registry.generation
    for _ in range(CHANGE_LOG):
        registry.deregister(registry.register(bufs[3]))
    update = registry.update_since(base)
    assert update.base is None and sorted(update.added.tolist()) == sorted([h.addr, h.len, 1] for h in keep)
    # The last change alone is still known.
    assert registry.update_since(registry.generation - 1).base == registry.generation - 1


@pytest.fixture
def target() -> TargetProcess:
    with TargetProcess([MiB] * 64) as tp:
        yield tp


def _open(target: TargetProcess, one_sided: bool) -> tuple[ScriptedPeer, dict]:
    peer = ScriptedPeer.connect(target.engine, timeout=10)
    info = {"engine": "127.0.0.1", "engine_id": "scripted", "one_sided": one_sided}
    return peer, peer.handshake(info)


def test_a_registration_sends_one_row_to_a_peer_not_the_table(target: TargetProcess) -> None:
    peer, welcome = _open(target, one_sided=False)
    with peer:
        assert len(welcome["regions"]) == 64
        generation = welcome["generation"]
        addr = target.add_buffer(4096)
        pushed = _pushed(peer)
        assert (pushed.generation, pushed.base) == (generation + 1, generation)
        assert pushed.added.tolist() == [[addr, 4096, proto.REGION_WRITABLE]] and len(pushed.removed) == 0
        # A deregistration, to a peer the target serves itself (it said none of its transports
        # reaches memory one-sidedly): a REGIONS of one removed row.
        target.deregister(len(target.addrs) - 1)
        pushed = _pushed(peer)
        assert (pushed.generation, pushed.base) == (generation + 2, generation + 1)
        assert pushed.removed.tolist() == [[addr, 4096, proto.REGION_WRITABLE]] and len(pushed.added) == 0
        # Asked, it answers with every region, of its current generation.
        peer.send(proto.QueryRegions(1))
        answer = peer.recv()
        assert isinstance(answer, proto.Regions) and answer.base == proto.WHOLE and answer.generation == generation + 2
        assert len(answer.added) == 64


def _pushed(peer: ScriptedPeer) -> proto.Regions:
    event = peer.recv()
    assert isinstance(event, proto.RegionsPushed), event
    return event.update


def test_a_deregistration_revokes_one_row_from_a_one_sided_peer(target: TargetProcess) -> None:
    """The removal comes in the REVOKE, or in a REGIONS just before it (the registration change
    is announced as soon as it is made; the REVOKE then follows on from it)."""
    peer, welcome = _open(target, one_sided=True)
    with peer:
        generation = welcome["generation"]
        gone = target.addrs[5]
        done = threading.Thread(target=target.deregister, args=(5,))
        done.start()
        updates = [peer.recv()]
        while not isinstance(updates[-1], proto.Revoke):
            updates.append(peer.recv())
        changes = [u.update if isinstance(u, proto.RegionsPushed) else u for u in updates]
        assert [c.base for c in changes] == [generation, generation + 1][: len(changes)]
        assert changes[-1].generation == generation + 1
        assert [row for c in changes for row in c.removed.tolist()] == [[gone, MiB, proto.REGION_WRITABLE]]
        assert all(len(c.added) == 0 for c in changes)
        revoke = changes[-1]
        peer.send(proto.Revoked(revoke.generation))
        done.join(10)
        assert not done.is_alive()  # confirmed: the deregistration returned


# -- the initiator side ---------------------------------------------------------------------------
BASE = 0x7000_0000_0000


def _read(eng: Engine, remote: str, buf: np.ndarray, addr: int) -> None:
    eng.transfer_sync(remote, Op.READ, [(int(buf.ctypes.data), addr, 8)], timeout=5)


def test_an_initiator_follows_changes_without_asking() -> None:
    """A scripted target sends deltas just before its answers (so the engine has them when the
    answer returns): the engine's READ goes straight to a region a delta added, and one to a
    region a delta removed asks again (QUERY_REGIONS) and is refused."""
    a, b = (BASE, MiB, 1), (BASE + 2 * MiB, MiB, 1)
    seen: list[str] = []

    def script(peer: ScriptedPeer) -> None:
        peer.accept_handshake([a], generation=1)
        first = peer.recv()
        seen.append(f"READ@{int(first.descs[0, 0]):#x}")
        peer.send(proto.Regions(2, 1, _rows(b), NO_ROWS))  # b added
        peer.send(proto.Data(first.req_id, 8), bytes(8))
        second = peer.recv()
        seen.append(f"READ@{int(second.descs[0, 0]):#x}" if isinstance(second, proto.ReadRequest) else type(second).__name__)
        peer.send(proto.Regions(3, 2, NO_ROWS, _rows(b)))  # b removed
        peer.send(proto.Data(second.req_id, 8), bytes(8))
        query = peer.recv()
        seen.append(type(query).__name__)
        peer.send(proto.Regions(3, proto.WHOLE, _rows(a), NO_ROWS, query.req_id))
        peer.recv()  # BYE

    with ScriptedTarget(script) as fake, Engine("127.0.0.1", {"transport": "tcp"}) as eng:
        buf = hixl.empty(4096)
        eng.register_mem(buf)
        eng.connect(fake.engine)
        _read(eng, fake.engine, buf, a[0])
        _read(eng, fake.engine, buf, b[0])
        with pytest.raises(MemoryRangeError):
            _read(eng, fake.engine, buf, b[0])
        eng.disconnect(fake.engine)
    assert seen == [f"READ@{a[0]:#x}", f"READ@{b[0]:#x}", "QueryRegions"]


def test_an_update_that_does_not_follow_on_ends_the_link() -> None:
    def script(peer: ScriptedPeer) -> None:
        peer.accept_handshake([(BASE, MiB, 1)], generation=4)
        # A change of generation 2, which this initiator never knew: forged, or out of order.
        peer.send_raw(proto.encode(proto.Regions(5, 2, _rows((BASE + MiB, MiB, 1)), NO_ROWS)))
        peer.expect_closed()

    with ScriptedTarget(script) as fake, Engine("127.0.0.1", {"transport": "tcp"}) as eng:
        buf = hixl.empty(4096)
        eng.register_mem(buf)
        eng.connect(fake.engine)
        deadline = time.monotonic() + 5
        with pytest.raises(PeerDisconnected, match="initiator knows generation 4"):
            while time.monotonic() < deadline:
                eng.transfer_sync(fake.engine, Op.READ, [(int(buf.ctypes.data), BASE, 8)], timeout=1)
                time.sleep(0.01)


def test_a_sync_caller_leaves_another_requests_data_to_the_reader() -> None:
    """An async READ's reply stalls halfway; a sync READ sent after it times out on its own short
    deadline — its caller does not sit landing the other request's bytes until *their* deadline —
    and its own DATA, which comes after the other's rest, lands nothing."""
    release = threading.Event()

    def script(peer: ScriptedPeer) -> None:
        peer.accept_handshake([(BASE, 4 * MiB, 1)])
        big = peer.recv()
        small = peer.recv()
        peer.send(proto.Data(big.req_id, 4 * MiB), bytes(MiB))  # a quarter of it, then nothing
        release.wait(30)
        peer.send_raw(bytes(3 * MiB))
        peer.send(proto.Data(small.req_id, 8), b"\xab" * 8)
        peer.recv()  # BYE

    with ScriptedTarget(script) as fake, Engine("127.0.0.1", {"transport": "tcp"}) as eng:
        buf = hixl.empty(8 * MiB)
        buf[:] = 0
        eng.register_mem(buf)
        eng.connect(fake.engine)
        big = eng.transfer_async(fake.engine, Op.READ, [(int(buf.ctypes.data), BASE, 4 * MiB)], timeout=30)
        time.sleep(0.2)  # sent first
        start = time.monotonic()
        with pytest.raises(TransferTimeout):
            eng.transfer_sync(fake.engine, Op.READ, [(int(buf.ctypes.data) + 4 * MiB, BASE, 8)], timeout=1.0)
        took = time.monotonic() - start
        release.set()
        big.wait()
        time.sleep(0.2)  # (the sync READ's DATA has come)
        late = bytes(buf[4 * MiB : 4 * MiB + 8])
        eng.disconnect(fake.engine)
    assert took < 10, f"the sync READ returned after {took:.1f} s, past its 1 s deadline (the other READ's is 30 s)"
    assert late == bytes(8), f"the sync READ, reported timed out, landed {late!r} afterwards"
