"""A link that drops while transfers are in flight: the target is on another host (its own network
and PID namespaces, so the engines use TCP), and its link is cut — the switch's port taken down,
or every packet dropped. The link is declared dead within the heartbeat budget, the pending
transfer fails cleanly (never a hang, and never past its own timeout), and once the link is back
``connect`` works again and so do transfers.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

import hixl
from hixl import Engine, Op, PeerDisconnected, TransferTimeout
from hixl.testing import TargetProcess
from hixl.testing.hosts import Hosts, hosts_fixture

from .links import wait_until_link_dead

pytestmark = pytest.mark.timeout(60)

INTERVAL, MISSES = 0.5, 4
BUDGET = INTERVAL * MISSES  # no sign of life for this long: the peer is dead
SLACK = 1.5  # a heartbeat interval to notice, and a loaded machine's scheduling
OPTIONS = {"auth_secret": "links test", "heartbeat_interval": INTERVAL, "heartbeat_misses": MISSES}
SIZE = 256 << 20
RATE = "1gbit"  # the link's cap while a transfer is cut: SIZE takes ~2 s, still on the wire at the cut

hosts = hosts_fixture(1, here=True, pid_namespaces=[0])


@pytest.fixture(scope="module")
def target(hosts: Hosts) -> Iterator[TargetProcess]:
    with hosts[0].target([SIZE], OPTIONS) as tp:
        tp.fill(0, 3)
        yield tp


@pytest.fixture(scope="module")
def local() -> np.ndarray:
    buf = hixl.empty(SIZE)
    buf.fill(0)
    return buf


@pytest.mark.parametrize("how", ["down", "loss"])
@pytest.mark.parametrize("op", [Op.READ, Op.WRITE], ids=["READ", "WRITE"])
def test_a_cut_link_fails_the_pending_transfer_and_connect_works_once_it_is_back(hosts, target, local, how, op) -> None:
    # What a cut WRITE leaves behind is the target's own bytes, so the next test reads them intact.
    local[:] = TargetProcess.expected(SIZE, 3) if op is Op.WRITE else 0
    # The link capped, or a fast machine finishes the transfer before the cut is made (CI did).
    with Engine(hosts[1].ip, OPTIONS) as eng, hosts[1].limit_rate(RATE):
        eng.register_mem(local)
        eng.connect(target.engine)
        assert eng.transport_of(target.engine) == "tcp"
        # A timeout far beyond the heartbeat budget: what ends this transfer is the dead link.
        req = eng.transfer_async(target.engine, op, [(int(local.ctypes.data), target.addrs[0], SIZE)], timeout=30)
        time.sleep(0.05)
        assert req.status is hixl.TransferStatus.WAITING, "the transfer ended before the link was cut"
        with hosts[0].cut(how):
            start = time.monotonic()
            with pytest.raises((PeerDisconnected, TransferTimeout)):
                req.wait(BUDGET + 10)
            failed_after = time.monotonic() - start
            assert failed_after < BUDGET + SLACK, f"the {op.name} failed only {failed_after:.1f} s after the cut"
            wait_until_link_dead(eng, target.engine, local, target.addrs[0], start, BUDGET + SLACK)
            assert req.status is hixl.TransferStatus.FAILED
        # The link is back: a new connection replaces the broken one, and carries transfers.
        eng.connect(target.engine)
        local[: 1 << 20] = 0
        eng.transfer_sync(target.engine, Op.READ, [(int(local.ctypes.data), target.addrs[0], 1 << 20)], timeout=10)
        np.testing.assert_array_equal(local[: 1 << 20], TargetProcess.expected(SIZE, 3)[: 1 << 20])


def test_a_short_cut_within_the_budget_is_survived(hosts, target, local) -> None:
    """Packets lost for less than the heartbeat budget are retransmitted: nothing fails."""
    with Engine(hosts[1].ip, OPTIONS) as eng:
        eng.register_mem(local)
        eng.connect(target.engine)
        local[:] = 0
        req = eng.transfer_async(target.engine, Op.READ, [(int(local.ctypes.data), target.addrs[0], 64 << 20)], timeout=30)
        with hosts[0].cut("loss"):
            time.sleep(BUDGET / 4)
        req.wait(20)
        np.testing.assert_array_equal(local[: 64 << 20], TargetProcess.expected(SIZE, 3)[: 64 << 20])
