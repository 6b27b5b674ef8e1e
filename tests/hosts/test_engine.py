"""Engines on different hosts (network namespaces joined by a bridge, some in PID namespaces of
their own, one running as another user): transfers both ways, byte for byte, and which transport
each pair gets — decided by what makes cross-memory attach work, never by the address alone.

Hosts: 0 a network namespace, its processes uid 65533; 1 a network and a PID namespace;
2 a network namespace, uid 65534; 3 this process's own namespace (the tests' engines).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import pytest

import hixl
from hixl import Engine, Op, Unsupported
from hixl.testing import TargetProcess
from hixl.testing.hosts import Host, Hosts, hosts_fixture

pytestmark = pytest.mark.timeout(60)

SECRET = {"auth_secret": "hosts test"}
SIZE = 8 << 20

hosts = hosts_fixture(3, here=True, pid_namespaces=[1], users={0: 65533, 2: 65534})


@pytest.fixture(scope="module")
def targets(hosts: Hosts) -> Iterator[list[TargetProcess]]:
    """One target per namespace host, each with two buffers (the second one for its own READs)."""
    started: list[TargetProcess] = []
    try:
        for host in hosts.hosts[:3]:
            started.append(host.target([SIZE, SIZE], SECRET))
            started[-1].fill(0, 10 + host.index)
        yield started
    finally:
        for target in started:
            target.close()


def _engine(host: Host, transport: str = "auto") -> Engine:
    return Engine(host.ip, {**SECRET, "transport": transport})


@pytest.mark.parametrize(("index", "transport"), [(0, "cma"), (1, "tcp")])
def test_this_process_reads_and_writes_another_host_byte_for_byte(hosts, targets, index, transport) -> None:
    target = targets[index]
    with _engine(hosts[3]) as eng:
        local = hixl.empty(SIZE)
        eng.register_mem(local)
        eng.connect(target.engine)
        assert eng.transport_of(target.engine) == transport
        # One big range, then scattered pieces in both directions.
        eng.transfer_sync(target.engine, Op.READ, [(int(local.ctypes.data), target.addrs[0], SIZE)])
        np.testing.assert_array_equal(local, TargetProcess.expected(SIZE, 10 + index))
        local[:] = np.random.default_rng(5).integers(0, 256, SIZE, dtype=np.uint8)
        offsets = [(off, SIZE - off - 4096) for off in range(0, SIZE, 1 << 20)]  # (local, remote), reversed
        base = int(local.ctypes.data)
        eng.transfer_sync(target.engine, Op.WRITE, [(base + mine, target.addrs[1] + theirs, 4096) for mine, theirs in offsets])
        for mine, theirs in offsets:
            assert target.read(1, theirs, 4096) == local[mine : mine + 4096].tobytes()


def test_engines_on_two_other_hosts_read_and_write_each_other(targets) -> None:
    """Both ends in namespaces of their own, across the bridge, each way: 0 -> 1 and 1 -> 0."""
    for a, b in ((targets[0], targets[1]), (targets[1], targets[0])):
        a.call("connect", b.engine)
        try:
            assert a.call("transport_of", b.engine) == "tcp"  # host 1 has its own PID namespace
            a.call("transfer_sync", b.engine, Op.READ, [(a.addrs[1], b.addrs[0], SIZE)])
            assert a.read(1, 0, SIZE) == b.read(0, 0, SIZE)
            a.write(1, 0, bytes(range(256)) * 16)
            a.call("transfer_sync", b.engine, Op.WRITE, [(a.addrs[1], b.addrs[1] + 4096, 4096)])
            assert b.read(1, 4096, 4096) == bytes(range(256)) * 16
        finally:
            a.call("disconnect", b.engine)


# -- which transport: what makes cross-memory attach work decides -----------------------------------
def test_another_network_namespace_on_this_kernel_uses_cma(hosts, targets) -> None:
    """Host 0 shares this kernel and PID namespace but not the network: cma works, and is chosen."""
    with _engine(hosts[3], "cma") as eng:
        eng.connect(targets[0].engine)
        assert eng.transport_of(targets[0].engine) == "cma"


def test_another_pid_namespace_gets_tcp_and_the_log_says_why(hosts, targets, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="hixl"), _engine(hosts[3]) as eng:
        eng.connect(targets[1].engine)
        assert eng.transport_of(targets[1].engine) == "tcp"
    assert any("cma unusable: the peer runs in another PID namespace" in r.getMessage() for r in caplog.records)
    with _engine(hosts[3], "cma") as eng, pytest.raises(Unsupported, match="another PID namespace"):
        eng.connect(targets[1].engine)


def test_two_processes_in_one_pid_namespace_use_cma(hosts, targets) -> None:
    """Two engines on host 1, in its PID namespace together, are one host to each other."""
    with hosts[1].target([4096], SECRET) as other:
        other.call("connect", targets[1].engine)
        assert other.call("transport_of", targets[1].engine) == "cma"
        other.call("transfer_sync", targets[1].engine, Op.READ, [(other.addrs[0], targets[1].addrs[0], 4096)])
        assert other.read(0, 0, 4096) == targets[1].read(0, 0, 4096)


def test_a_process_of_another_user_cannot_be_attached_to(hosts, targets) -> None:
    """Hosts 0 and 2 run as two different unprivileged users: the kernel refuses cross-memory
    attach, the probe finds that out (so auto picks tcp), and a forced cma says why."""
    a, b = targets[0], targets[2]
    a.call("connect", b.engine)
    try:
        assert a.call("transport_of", b.engine) == "tcp"
    finally:
        a.call("disconnect", b.engine)
    refused = pytest.raises(Unsupported, match=r"cma unusable: .*(Permission denied|not permitted)")
    with hosts[0].target([4096], {**SECRET, "transport": "cma"}) as forced, refused:
        forced.call("connect", b.engine)
