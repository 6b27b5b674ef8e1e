"""A network partition in the middle of a transfer: the target runs in its own network namespace
behind a veth pair, and the link is taken down while a long READ is in flight. The READ fails at
its timeout and the link within the heartbeat budget — nothing waits for a network that is gone.
(Needs root for ``ip netns``; skipped elsewhere.)"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest

import hixl
from hixl import Engine, Op, PeerDisconnected, TransferTimeout
from hixl.testing import TargetProcess

from .links import wait_until_link_dead

pytestmark = pytest.mark.timeout(90)

NS, HOST_SIDE, NS_SIDE = "hixl-part", "hixl-part0", "hixl-part1"
HOST_IP, NS_IP = "10.213.7.1", "10.213.7.2"  # a /30 that exists only between these two ends
SECRET = "partition test"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def namespace() -> Iterator[str]:
    if shutil.which("ip") is None:
        pytest.skip("no ip command")
    subprocess.run(["ip", "netns", "del", NS], capture_output=True, timeout=10)  # a leftover
    subprocess.run(["ip", "link", "del", HOST_SIDE], capture_output=True, timeout=10)
    try:
        _ip("netns", "add", NS)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot make a network namespace here: {exc.stderr.decode().strip()}")
    try:
        _ip("link", "add", HOST_SIDE, "type", "veth", "peer", "name", NS_SIDE)
        _ip("link", "set", NS_SIDE, "netns", NS)
        _ip("addr", "add", f"{HOST_IP}/30", "dev", HOST_SIDE)
        _ip("link", "set", HOST_SIDE, "up")
        _ip("netns", "exec", NS, "ip", "addr", "add", f"{NS_IP}/30", "dev", NS_SIDE)
        _ip("netns", "exec", NS, "ip", "link", "set", NS_SIDE, "up")
        _ip("netns", "exec", NS, "ip", "link", "set", "lo", "up")
        yield NS
    finally:
        subprocess.run(["ip", "link", "del", HOST_SIDE], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", NS], capture_output=True, timeout=10)


def test_a_link_cut_mid_read_fails_the_read_at_its_timeout(namespace: str) -> None:
    size = 256 << 20
    options = {"auth_secret": SECRET, "heartbeat_interval": 0.5, "heartbeat_misses": 4}
    with TargetProcess([size], options, address=f"{NS_IP}:0", prefix=["ip", "netns", "exec", namespace]) as target:
        with Engine(HOST_IP, {**options, "transport": "tcp"}) as eng:
            buf = hixl.empty(size)
            eng.register_mem(buf)
            eng.connect(target.engine)
            req = eng.transfer_async(target.engine, Op.READ, [(int(buf.ctypes.data), target.addrs[0], size)], timeout=3)
            time.sleep(0.05)
            start = time.monotonic()
            _ip("link", "set", HOST_SIDE, "down")
            try:
                with pytest.raises((TransferTimeout, PeerDisconnected)):
                    req.wait(10)
                assert time.monotonic() - start < 4.5, "the READ outlived its timeout"
                wait_until_link_dead(eng, target.engine, buf, target.addrs[0], start, 6)
            finally:
                _ip("link", "set", HOST_SIDE, "up")
