"""The hosts helper itself (:mod:`hixl.testing.hosts`): addresses, reachability, PID namespaces,
users, and that nothing is left behind — not even by a process that died holding its hosts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hixl
from hixl.testing.hosts import Hosts, hosts_fixture

pytestmark = pytest.mark.timeout(60)

hosts = hosts_fixture(3, here=True, pid_namespaces=[1], users={2: 65534})

_PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()
    print("reached")
except OSError as exc:
    print(type(exc).__name__)
"""


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def _listen(host) -> subprocess.Popen:
    code = "import socket, sys; s = socket.create_server((sys.argv[1], 0)); print(s.getsockname()[1], flush=True); s.accept()"
    return host.popen([sys.executable, "-c", code, host.ip], stdout=subprocess.PIPE, text=True)


def test_each_host_has_its_own_address_and_reaches_the_others(hosts: Hosts) -> None:
    assert len(hosts) == 4  # three namespaces, and this one
    assert len({h.ip for h in hosts}) == 4 and all(h.ip.startswith("10.213.") for h in hosts)
    assert hosts[3].netns is None and hosts[3].prefix == []
    for src in hosts:
        dst = hosts[(src.index + 1) % len(hosts)]
        server = _listen(dst)
        try:
            port = server.stdout.readline().strip()
            reached = src.run([sys.executable, "-c", _PROBE, dst.ip, port], capture_output=True, text=True).stdout.strip()
            assert reached == "reached", f"{src} -> {dst}: {reached}"
        finally:
            server.kill()
            server.wait()


def test_a_host_reaches_nothing_outside_its_subnet(hosts: Hosts) -> None:
    routes = hosts[0].run(["ip", "-4", "route", "show"], capture_output=True, text=True).stdout.splitlines()
    assert len(routes) == 1 and routes[0].startswith(hosts[0].ip.rsplit(".", 1)[0]), routes  # no default route
    # An address outside the subnet is unroutable from there: refused locally, nothing sent.
    out = hosts[0].run([sys.executable, "-c", _PROBE, "10.213.6.1", "9"], capture_output=True, text=True).stdout
    assert out.strip() == "OSError", out


def _root_qdisc(netns: str | None, device: str) -> str:
    where = ["-n", netns] if netns else []
    return subprocess.run(["tc", *where, "qdisc", "show", "dev", device, "root"], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("index", [0, 3], ids=["own-netns", "here"])
def test_limit_rate_caps_both_ends_of_the_link_and_lifts_the_cap_after(hosts: Hosts, index: int) -> None:
    host = hosts[index]
    ends = [(hosts.switch, f"p{index}"), (host.netns, host.device)]
    with host.limit_rate("300mbit"):
        for netns, device in ends:
            shown = _root_qdisc(netns, device)
            assert "tbf" in shown and "rate 300Mbit" in shown, (netns, device, shown)
    for netns, device in ends:
        assert "tbf" not in _root_qdisc(netns, device), (netns, device)


def test_processes_of_a_pid_namespace_host_share_one(hosts: Hosts) -> None:
    own = os.readlink("/proc/self/ns/pid")
    seen = [hosts[1].run(["readlink", "/proc/self/ns/pid"], capture_output=True, text=True).stdout.strip() for _ in range(2)]
    assert seen[0] == seen[1] != own  # one namespace for the host, not one per command
    assert hosts[0].run(["readlink", "/proc/self/ns/pid"], capture_output=True, text=True).stdout.strip() == own
    assert hosts[1].pid_namespace and not hosts[0].pid_namespace


def _running(host, argv: list[str]) -> bool:
    """Whether a process with command line ``argv`` runs in ``host``'s network namespace."""
    pids = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True, check=True).stdout.split()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().split(b"\0")[:-1] == [a.encode() for a in argv]:
                    return True
        except OSError:
            continue  # gone meanwhile
    return False


def test_killing_what_was_started_on_a_pid_namespace_host_kills_the_command(hosts: Hosts) -> None:
    """Popen's process there is nsenter, which passes no signal on: the command must die with it."""
    argv = ["sleep", "61"]
    started = hosts[1].popen(argv)
    deadline = time.monotonic() + 10
    while not _running(hosts[1], argv):
        assert time.monotonic() < deadline, "the command never started"
        time.sleep(0.01)
    started.kill()
    started.wait(10)
    while _running(hosts[1], argv):
        assert time.monotonic() < deadline, "the command outlived the process that started it"
        time.sleep(0.01)


def test_a_host_can_run_as_another_user(hosts: Hosts) -> None:
    assert hosts[2].run(["id", "-u"], capture_output=True, text=True).stdout.strip() == "65534"
    assert hosts[0].run(["id", "-u"], capture_output=True, text=True).stdout.strip() == str(os.getuid())


def test_close_removes_every_namespace_and_process() -> None:
    before = _namespaces()
    made = Hosts(2, here=True, pid_namespaces=[0])
    ours = {h.netns for h in made if h.netns} | {made.switch}
    assert ours <= _namespaces()
    sleeper = made[1].popen(["sleep", "60"])  # a process a test forgot
    made.close()
    made.close()  # idempotent
    assert sleeper.wait(10) == -signal.SIGKILL
    assert _namespaces() == before
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert f"hx{made.tag}" not in links  # this namespace's end of the veth went with the switch


_ABANDON = """
import os, sys, time
from hixl.testing.hosts import Hosts
made = Hosts(2, pid_namespaces=[1])
print(made.tag, flush=True)
time.sleep(60)
"""


def test_hosts_of_a_killed_process_are_swept_by_the_next() -> None:
    child = subprocess.Popen([sys.executable, "-c", _ABANDON], stdout=subprocess.PIPE, text=True)
    try:
        tag = child.stdout.readline().strip()
        assert tag, "the child made no hosts"
    finally:
        child.kill()  # dies holding its namespaces: nothing of its own cleans them up
        child.wait()
    left = {n for n in _namespaces() if n.startswith(f"hixl-{tag}-")}
    assert len(left) == 3
    with Hosts(1):
        assert not {n for n in _namespaces() if n.startswith(f"hixl-{tag}-")}


def test_a_live_owners_hosts_are_not_swept(hosts: Hosts) -> None:
    with Hosts(1):
        assert {h.netns for h in hosts if h.netns} <= _namespaces()


_NEEDS_HOSTS = """
from hixl.testing.hosts import hosts_fixture
hosts = hosts_fixture(1)

def test_uses_hosts(hosts):
    pass
"""


@pytest.mark.parametrize(("require", "outcome"), [("0", "1 skipped"), ("1", "1 error")])
def test_without_root_the_fixture_skips_with_the_reason_unless_required(hosts, tmp_path, require, outcome) -> None:
    """Run by an unprivileged user (host 2's), who can make no namespace: skipped, and why — or,
    where HIXL_REQUIRE_HOSTS is set (as CI sets it), an error instead of a silent skip."""
    (tmp_path / "test_needs_hosts.py").write_text(_NEEDS_HOSTS)
    done = hosts[2].run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True, text=True, check=False, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(hixl.__file__).resolve().parents[1]), "HIXL_REQUIRE_HOSTS": require},
    )  # fmt: skip
    assert outcome in done.stdout, done.stdout + done.stderr
    assert "making network namespaces needs root" in done.stdout
