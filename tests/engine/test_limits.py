"""Every limit a listening engine enforces, each pushed past its edge by a real peer: connection
and handshake caps (floods of handshakes: test_handshake_flood.py), whole-handshake and per-frame
deadlines, allocation bounded by what actually arrived, notification queues, requests in flight,
requests larger than one frame, and an accept loop that outlives running out of file descriptors."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import hixl
from hixl import Engine, NotifyDesc, Op, ResourceExhausted, TransferStatus
from hixl import _protocol as proto
from hixl.testing import ScriptedPeer, TargetProcess

pytestmark = pytest.mark.timeout(90)

MakeTarget = Callable[..., TargetProcess]
MiB = 1 << 20


def _closed_within(peer: ScriptedPeer, limit: float) -> float:
    """Seconds until the target dropped ``peer`` (fails past ``limit``)."""
    start = time.monotonic()
    peer.answer_pings = False
    peer.sock.settimeout(limit + 2)
    with contextlib.suppress(EOFError, ConnectionResetError, hixl.ProtocolError):
        while True:
            peer.recv_raw()
    took = time.monotonic() - start
    assert took < limit, f"the target held the connection for {took:.1f} s"
    return took


def _trickle(peer: ScriptedPeer, data: bytes, give_up: float = 4.0) -> float:
    """Send ``data`` a byte every 0.2 s until the target hangs up (or ``give_up`` s); when it began."""
    start = time.monotonic()
    with contextlib.suppress(OSError):
        for byte in data:
            peer.send_raw(bytes([byte]))
            time.sleep(0.2)
            if time.monotonic() - start > give_up:
                break
    return start


def test_max_connections(make_target: MakeTarget) -> None:
    target = make_target([MiB], {"max_connections": 2})
    peers = [ScriptedPeer.connect(target.engine) for _ in range(2)]
    for peer in peers:
        peer.handshake()
    with Engine("127.0.0.1") as eng:
        with pytest.raises(ResourceExhausted, match="max_connections"):
            eng.connect(target.engine)
        peers.pop().close()
        time.sleep(0.3)  # the target notices the close
        eng.connect(target.engine)  # room again
    for peer in peers:
        peer.close()


def test_max_connections_per_peer(make_target: MakeTarget) -> None:
    target = make_target([MiB], {"max_connections_per_peer": 3})
    peers = [ScriptedPeer.connect(target.engine) for _ in range(3)]
    for peer in peers:
        peer.handshake()
    with Engine("127.0.0.1") as eng:
        with pytest.raises(ResourceExhausted, match="max_connections_per_peer"):
            eng.connect(target.engine)
    for peer in peers:
        peer.close()


def test_handshakes_past_the_caps_start_no_threads(make_target: MakeTarget) -> None:
    """40 silent connections from 4 addresses: those past max_handshakes_per_source are refused
    before a thread starts, and of the rest, max_handshakes are served (the others were evicted)."""
    target = make_target([MiB], {"max_handshakes": 6, "max_handshakes_per_source": 4})
    _, threads_before = target.memory()
    port = int(target.engine.rsplit(":", 1)[1])
    socks = [socket.create_connection(("127.0.0.1", port), source_address=(f"127.0.0.{2 + i % 4}", 0)) for i in range(40)]
    time.sleep(0.5)
    _, threads = target.memory()
    assert threads <= threads_before + 6
    for sock in socks:
        sock.close()


def test_the_whole_handshake_has_one_deadline(make_target: MakeTarget) -> None:
    """A peer trickling its HELLO a byte at a time is alive, but is dropped at the handshake timeout."""
    target = make_target([MiB], {"handshake_timeout": 1.0})
    hello = ScriptedPeer.connect(target.engine)
    start = _trickle(hello, hello.conn.initiate())
    _closed_within(hello, 3.0 - (time.monotonic() - start))
    hello.close()


def test_a_frame_must_complete_within_the_frame_timeout(make_target: MakeTarget) -> None:
    target = make_target([MiB], {"frame_timeout": 1.0, "heartbeat_interval": 0.2})
    peer = ScriptedPeer.connect(target.engine)
    peer.handshake()
    start = _trickle(peer, peer.conn.send(proto.QueryRegions(1))[:-1])
    _closed_within(peer, 3.0 - (time.monotonic() - start))
    peer.close()


def test_a_stall_mid_write_frees_the_serving_thread(make_target: MakeTarget) -> None:
    """Data that stops flowing mid-WRITE is not progress: the target drops the peer within its
    heartbeat budget (here 0.2 s x 5 x 2), not at the peer's leisure."""
    target = make_target([MiB], {"heartbeat_interval": 0.2, "heartbeat_misses": 5})
    peer = ScriptedPeer.connect(target.engine)
    peer.handshake()
    descs = np.array([[target.addrs[0], MiB]], dtype=np.uint64)
    peer.send(proto.WriteRequest(1, descs, MiB), b"\x01" * 100)
    _closed_within(peer, 4.0)
    peer.close()


def test_announced_bodies_are_not_allocated_before_they_arrive(make_target: MakeTarget) -> None:
    """Headers that announce the largest body their type allows, then trickle: memory grows by
    what arrived, not by what was announced."""
    target = make_target([MiB])
    rss_before, _ = target.memory()
    peers = []
    limit = proto.frames.BODY_LIMITS[proto.FrameType.READ]
    for _ in range(8):
        peer = ScriptedPeer.connect(target.engine)
        peer.handshake()
        peer.send_raw(proto.encode_header(proto.FrameType.READ, 1, limit) + b"\x00" * 100)
        peers.append(peer)
    time.sleep(0.5)
    rss_after, _ = target.memory()
    assert rss_after - rss_before < 4 * MiB, f"{(rss_after - rss_before) / MiB:.1f} MiB for 8 x {limit / MiB:.1f} MiB announced"
    for peer in peers:
        peer.close()


def test_notification_bytes_are_bounded(make_target: MakeTarget) -> None:
    target = make_target([MiB], {"max_notify_bytes": 4096})
    with Engine("127.0.0.1") as eng:
        eng.connect(target.engine)
        for i in range(4):  # 4 x 1002 bytes of the 4096 allowed
            eng.send_notify(target.engine, NotifyDesc(f"n{i}", "x" * 1000))
        with pytest.raises(ResourceExhausted, match="bytes"):
            eng.send_notify(target.engine, NotifyDesc("n4", "x" * 1000))
        assert len(target.notifies()) == 4
        eng.send_notify(target.engine, NotifyDesc("n5", "x" * 1000))  # drained: room again
        assert target.notifies() == [("n5", "x" * 1000)]


def _flood(eng: Engine, target: str, notify: NotifyDesc, most: int) -> tuple[int, str]:
    """Send ``notify`` until refused (at most ``most`` times): how many were accepted, and why the refusal."""
    for sent in range(most):
        try:
            eng.send_notify(target, notify)
        except ResourceExhausted as exc:
            return sent, str(exc)
    return most, ""


@pytest.mark.parametrize(
    "notify, share",
    [(NotifyDesc("n", ""), 1024), (NotifyDesc("n" * 1024, "x" * 1024), 512)],
    ids=["count", "bytes"],
)
def test_one_connection_fills_only_its_share_of_the_notification_queue(
    make_target: MakeTarget, notify: NotifyDesc, share: int
) -> None:
    """With the default limits, a connection that never stops notifying is refused once it holds its
    share (1024 notifications, or 1 MiB); another connection's notifications are still taken. Reading
    the queue gives the flooder its share back."""
    target = make_target([MiB])
    total = 4096 if notify.msg == "" else 2048  # what the whole queue holds: max_notifies, or 4 MiB of 2 KiB
    with Engine("127.0.0.1") as flooder, Engine("127.0.0.1") as other:
        flooder.connect(target.engine)
        other.connect(target.engine)
        accepted, why = _flood(flooder, target.engine, notify, total + 1)
        other.send_notify(target.engine, NotifyDesc("other", "still heard"))
        assert (accepted, "this connection" in why) == (share, True), why
        held = target.notifies()
        assert len(held) == share + 1 and held[-1] == ("other", "still heard")
        flooder.send_notify(target.engine, notify)  # drained: its share is free again
        assert target.notifies() == [(notify.name, notify.msg)]


def test_metadata_answers_are_sent_from_the_stored_value() -> None:
    """One connection asks for a 16 MiB value 20 times without waiting, and reads slowly: each answer is
    sent from the stored value, one at a time, so the target's memory stays flat (it used to copy
    the value into a frame, and again for the part the socket did not take at once)."""
    code = (
        "import sys, hixl\n"
        "with hixl.Engine('127.0.0.1:0') as engine:\n"
        "    engine.set_metadata('big', b'\\x01' * hixl._protocol.frames.MAX_META)\n"
        "    print(engine.local_engine, flush=True)\n"
        "    sys.stdin.read()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(hixl.__file__).resolve().parents[1])}
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        assert child.stdout is not None
        address = child.stdout.readline().decode().strip()
        before = peak = _rss(child.pid)
        with ScriptedPeer.connect(address) as peer:
            peer.handshake()
            for req_id in range(1, 21):
                peer.send(proto.QueryMeta(req_id, "big"))
            received, ends = 0, time.monotonic() + 3.0
            while time.monotonic() < ends:  # about 3 MiB/s: a slow reader
                received += len(peer.sock.recv(64 * 1024))
                time.sleep(0.02)
                peak = max(peak, _rss(child.pid))
        assert received > MiB  # the answers were flowing
        assert peak - before < 8 * MiB, f"the target grew by {(peak - before) / MiB:.1f} MiB"
    finally:
        child.kill()
        child.wait(10)


def _rss(pid: int) -> int:
    """Resident set size of process ``pid`` in bytes (``VmRSS`` in ``/proc/PID/status``)."""
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_requests_in_flight_are_bounded(make_target: MakeTarget) -> None:
    target = make_target([MiB])
    with Engine("127.0.0.1", {"transport": "tcp", "max_inflight": 2}) as eng:
        buf = hixl.empty(MiB)
        eng.register_mem(buf)
        eng.connect(target.engine)
        desc = [(int(buf.ctypes.data), target.addrs[0], 4096)]
        target.stop()
        try:
            reqs = [eng.transfer_async(target.engine, Op.READ, desc, timeout=20) for _ in range(2)]
            with pytest.raises(ResourceExhausted, match="max_inflight"):
                eng.transfer_async(target.engine, Op.READ, desc, timeout=20)
        finally:
            target.stop(signal.SIGCONT)
        for req in reqs:
            req.wait(10)
            assert req.status is TransferStatus.COMPLETED
        eng.transfer_async(target.engine, Op.READ, desc).wait(10)


def test_requests_queued_behind_a_full_outbox_are_served_when_it_drains(make_target: MakeTarget) -> None:
    """Six pipelined READs of 8 MiB (more than the 4 MiB of answers a target queues before it stops
    reading a peer's requests, see ``_OUTBOX_READ_LIMIT``): the later requests arrived together
    with the first and wait in the connection's buffer, where no socket readiness announces them.
    They are served once the answers drain, not after the next heartbeat (30 s here: the
    requests' 10 s would run out first)."""
    quiet = {"heartbeat_interval": 30.0}
    target = make_target([8 * MiB], quiet)
    target.fill(0, 4)
    with Engine("127.0.0.1", {"transport": "tcp", **quiet}) as eng:
        bufs = [hixl.empty(8 * MiB) for _ in range(6)]
        for buf in bufs:
            eng.register_mem(buf)
        eng.connect(target.engine)
        block = 64 << 10  # (shuffled, so that none merge: many descriptors, one DATA each)
        order = np.random.default_rng(3).permutation(8 * MiB // block).astype(np.uint64)
        offsets = np.arange(len(order), dtype=np.uint64) * np.uint64(block)
        reqs = []
        for buf in bufs:
            descs = np.stack([buf.ctypes.data + offsets, target.addrs[0] + order * np.uint64(block), np.full(len(order), block, np.uint64)], axis=1)
            reqs.append(eng.transfer_async(target.engine, Op.READ, descs, timeout=10))
        for req in reqs:
            req.wait(12)
            assert req.status is TransferStatus.COMPLETED
    expected = TargetProcess.expected(8 * MiB, 4).reshape(-1, block)[order]
    for buf in bufs:
        assert np.array_equal(buf.reshape(-1, block), expected)


def test_a_write_streaming_in_does_not_hold_the_target_from_other_peers(make_target: MakeTarget) -> None:
    """While one peer's 256 MiB WRITE streams in without a pause, another peer's 8 B READ is served
    at once: the target lands a WRITE a share at a time (4 MiB a round), not to its end first."""
    big = 256 * MiB
    target = make_target([big, MiB])
    with Engine("127.0.0.1", {"transport": "tcp"}) as writer, Engine("127.0.0.1", {"transport": "tcp"}) as reader:
        source, small = hixl.empty(big), hixl.empty(4096)
        source.fill(5)
        writer.register_mem(source)
        reader.register_mem(small)
        writer.connect(target.engine)
        reader.connect(target.engine)
        req = writer.transfer_async(target.engine, Op.WRITE, [(int(source.ctypes.data), target.addrs[0], big)], timeout=60)
        time.sleep(0.02)
        reader.transfer_sync(target.engine, Op.READ, [(int(small.ctypes.data), target.addrs[1], 8)], timeout=30)
        status = req.status
        req.wait(60)
        assert req.status is TransferStatus.COMPLETED
    assert status is TransferStatus.WAITING, "the 8 B READ was served only once the 256 MiB WRITE had all landed"


def test_a_request_larger_than_one_frame_is_split(make_target: MakeTarget) -> None:
    """More descriptors than a frame carries (not mergeable: every other 8 bytes) still move, exactly."""
    count = proto.frames.MAX_DESCS + 1000
    target = make_target([16 * count])
    target.fill(0, 9)
    with Engine("127.0.0.1", {"transport": "tcp"}) as eng:
        buf = hixl.empty(16 * count)
        eng.register_mem(buf)
        eng.connect(target.engine)
        offsets = np.arange(count, dtype=np.uint64) * 16
        descs = np.stack([buf.ctypes.data + offsets, target.addrs[0] + offsets, np.full(count, 8, np.uint64)], axis=1)
        eng.transfer_sync(target.engine, Op.READ, descs, timeout=60)
        expected = TargetProcess.expected(16 * count, 9).reshape(count, 16)
        assert np.array_equal(buf.reshape(count, 16)[:, :8], expected[:, :8])
        assert not buf.reshape(count, 16)[:, 8:].any()


def test_the_accept_loop_survives_running_out_of_file_descriptors(
    make_target: MakeTarget, caplog: pytest.LogCaptureFixture
) -> None:
    target = make_target([MiB], {"handshake_timeout": 0.5})
    target.limit_fds(3)
    port = int(target.engine.rsplit(":", 1)[1])
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(10)]  # more than it can accept
    time.sleep(1.0)
    for sock in socks:
        sock.close()
    time.sleep(1.5)  # the accepted ones time out, freeing descriptors; the loop backs off and retries
    with Engine("127.0.0.1") as eng:
        eng.connect(target.engine, timeout=10)
        eng.send_notify(target.engine, NotifyDesc("still", "accepting"))
    assert target.notifies() == [("still", "accepting")]
