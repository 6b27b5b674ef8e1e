"""Several "hosts" on one machine: network namespaces joined by veth pairs to a bridge.

hixl exists to move bytes between machines; :class:`Hosts` gives a test (or ``hixl demo``
and ``hixl bench``) two or three of them without leaving the box. Each :class:`Host` is a
network namespace of its own, with one interface, ``eth0``, whose veth peer is a port of a
bridge in a "switch" namespace::

    host 0  netns hixl-P-N-0   eth0 10.213.S.1 --+
    host 1  netns hixl-P-N-1   eth0 10.213.S.2 --+-- bridge in netns hixl-P-N-sw
    here    this process's own netns  hxP-N 10.213.S.3 --+   (only with ``here=True``)

A host may also have a PID namespace of its own (every process started on it shares that
one, as the processes of one container do: a long-lived init holds it, and commands enter
it with ``nsenter``), and may run its commands as another user. :meth:`Host.cut` breaks its
link — the switch's port goes down, or every packet is dropped — until the block ends;
:meth:`Host.limit_rate` caps what the link carries, for as long.

Where the packets can go: each host namespace has ``lo`` and ``eth0`` and no route but the
subnet's, and the switch namespace holds only the bridge, so nothing leaves for any other
address. ``S`` is picked so that no route of the namespace this process runs in already
covers 10.213.S.0/24; that namespace gets a route to the subnet only with ``here=True``.

Nothing is left behind: :meth:`Hosts.close` (the context manager's exit) kills every process
still in the namespaces and deletes them, and each live :class:`Hosts` holds a lock file, so
one whose process died without cleaning up (SIGKILL, a crashed run) is swept away by the
next :class:`Hosts` created on the machine. Needs root (``ip netns``); :func:`hosts_unavailable`
says why not, and :func:`hosts_fixture` makes a pytest fixture that skips with that reason
(:func:`skip_unless_hosts` does the same in a test).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import itertools
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from ..datadist import LLMConfig, LLMRole
    from .datadist_peer import DataDistProcess
    from .peer import TargetProcess

__all__ = ["Host", "Hosts", "HostsError", "hosts_fixture", "hosts_unavailable", "skip_unless_hosts"]

_STATE = "/run/hixl-hosts"
"""Lock files: ``.lock`` serialises set-up and sweeps; ``P-N.lock`` is held by a live :class:`Hosts`."""
_NETNS = re.compile(r"^hixl-(\d+-\d+)-(?:\d+|sw|probe)$")
_SUBNETS = range(32, 255)
"""Third octets of the 10.213.S.0/24 subnets handed out (those below 32 are left to hand-made tests)."""
_serials = itertools.count()
_Scope = Literal["session", "package", "module", "class", "function"]
_REQUIRE = "HIXL_REQUIRE_HOSTS"
"""Set (to anything but ``0``) where namespaces must work: the fixture fails instead of skipping."""


class HostsError(RuntimeError):
    """A namespace, link or address could not be set up (the ``ip``/``tc`` error is in the message)."""


def _run(*args: str, check: bool = True, timeout: float = 10.0) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HostsError(f"{' '.join(args)}: {exc}") from exc
    if check and done.returncode != 0:
        raise HostsError(f"{' '.join(args)}: {done.stderr.strip() or f'exit status {done.returncode}'}")
    return done


def hosts_unavailable() -> str | None:
    """Why :class:`Hosts` cannot be made here (not root, no ``ip``, namespaces refused), or None."""
    for tool in ("ip", "tc", "nsenter", "unshare", "setpriv"):
        if shutil.which(tool) is None:
            return f"no {tool} command"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    probe = f"hixl-{os.getpid()}-{next(_serials)}-probe"
    done = _run("ip", "netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"cannot make a network namespace here: {done.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def skip_unless_hosts() -> None:
    """In a pytest test or fixture: skip, with the reason, where :class:`Hosts` cannot be made —
    or fail, where the environment variable ``HIXL_REQUIRE_HOSTS`` is set (CI sets it)."""
    import pytest  # only here: importing this module needs no pytest

    reason = hosts_unavailable()
    if reason is not None:
        if os.environ.get(_REQUIRE, "0") != "0":
            pytest.fail(f"{_REQUIRE} is set, but {reason}")
        pytest.skip(reason)


def hosts_fixture(count: int = 2, *, scope: _Scope = "module", **options: Any) -> Any:
    """A pytest fixture yielding ``Hosts(count, **options)``, removed after its ``scope``
    (see :func:`skip_unless_hosts` for where namespaces cannot be made).

    Use it in a test module or conftest: ``hosts = hosts_fixture(3, pid_namespaces=[2])``.
    """
    import pytest

    @pytest.fixture(scope=scope)
    def hosts() -> Iterator[Hosts]:
        skip_unless_hosts()
        with Hosts(count, **options) as made:
            yield made

    return hosts


class Host:
    """One host of a :class:`Hosts`: where its processes run, and its address.

    ``netns`` is its network namespace (None for the ``here`` host: the namespace this
    process runs in), ``ip`` its address, ``device`` its interface (in its namespace),
    ``pid_namespace`` whether it has a PID namespace of its own, ``user`` the uid its
    commands run as (None: this process's). Made by :class:`Hosts`, which closes it.
    """

    def __init__(
        self,
        index: int,
        netns: str | None,
        ip: str,
        device: str,
        switch: str,
        port: str,
        user: int | None,
        pid_namespace: bool,
    ) -> None:
        self.index = index
        self.netns = netns
        self.ip = ip
        self.device = device
        self.user = user
        self._switch, self._port = switch, port
        self._init: subprocess.Popen[bytes] | None = None
        self._init_pid = 0
        if pid_namespace:
            self._start_init()

    def _start_init(self) -> None:
        """Start the init that holds this host's PID namespace (its death ends every process in it)."""
        netns = ["ip", "netns", "exec", self.netns] if self.netns else []
        self._init = subprocess.Popen(
            [*netns, "unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "sleep", "infinity"]
        )
        # The init is unshare's child: pid 1 inside, and this number outside.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self._init.poll() is None:
            with contextlib.suppress(OSError), open(f"/proc/{self._init.pid}/task/{self._init.pid}/children") as f:
                children = f.read().split()
                if children:
                    self._init_pid = int(children[0])
                    return
            time.sleep(0.005)
        raise HostsError(f"the init of host {self.index}'s PID namespace did not start")

    def close(self) -> None:
        """End its PID namespace (every process in it) and take down an interface of this
        process's namespace; idempotent. (:class:`Hosts` deletes the network namespaces.)"""
        if self._init is not None and self._init.poll() is None:
            self._init.kill()  # unshare --kill-child: its death takes the PID namespace down
            self._init.wait(10)
        if self.netns is None:
            # Would go with the switch's namespace too, but only once the kernel gets round to
            # tearing that down: deleted now, so the subnet's route here goes now.
            _run("ip", "link", "del", self.device, check=False)

    @property
    def pid_namespace(self) -> bool:
        """Whether this host's processes run in a PID namespace of their own."""
        return self._init is not None

    @property
    def prefix(self) -> list[str]:
        """The command line that runs the rest on this host: e.g. ``[*host.prefix, "python3", ...]``."""
        if self._init is not None:
            # nsenter must fork to put the command in the PID namespace, and waits for it without
            # passing signals on: the command dies with it, so that killing what was started kills it.
            enter = ["nsenter", "-t", str(self._init_pid), "-n", "-p", "-m", "--", "setpriv", "--pdeathsig", "KILL", "--"]
        elif self.netns is not None:
            enter = ["ip", "netns", "exec", self.netns]
        else:
            enter = []
        if self.user is not None:
            # CAP_DAC_READ_SEARCH keeps an interpreter installed under a private home readable; it
            # grants reading files only: access to other processes (ptrace, cross-memory attach)
            # still follows the uid.
            enter += [
                "setpriv", f"--reuid={self.user}", f"--regid={self.user}", "--clear-groups",
                "--inh-caps=-all,+dac_read_search", "--ambient-caps=-all,+dac_read_search",
            ]  # fmt: skip
        return enter

    def address(self, port: int = 0) -> str:
        """``"ip:port"`` on this host (port 0: any free one), for an engine to listen on."""
        return f"{self.ip}:{port}"

    def popen(self, args: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``args`` on this host (``subprocess.Popen`` keyword arguments pass through)."""
        return subprocess.Popen([*self.prefix, *args], **kwargs)

    def run(self, args: Sequence[str], timeout: float = 30.0, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Run ``args`` on this host and wait (``subprocess.run`` keyword arguments pass through)."""
        return subprocess.run([*self.prefix, *args], timeout=timeout, **kwargs)

    def target(self, sizes: list[int], options: dict[str, Any] | None = None, **kwargs: Any) -> TargetProcess:
        """A :class:`~hixl.testing.TargetProcess` on this host, listening on its address.

        On a host with a PID namespace of its own, its ``pid`` is the one it has there, and
        ``stop`` (SIGSTOP) cannot reach it (nsenter, in front of it, would be stopped instead);
        ``kill`` and ``close`` work as anywhere.
        """
        from .peer import TargetProcess

        return TargetProcess(sizes, options, address=kwargs.pop("address", self.address()), prefix=self.prefix, **kwargs)

    def datadist(self, role: LLMRole, cluster_id: int, config: LLMConfig, **kwargs: Any) -> DataDistProcess:
        """A :class:`~hixl.testing.datadist_peer.DataDistProcess` on this host (``config`` listens on it)."""
        from .datadist_peer import DataDistProcess

        return DataDistProcess(role, cluster_id, config, prefix=self.prefix, **kwargs)

    @property
    def _link_ends(self) -> list[tuple[str | None, str]]:
        """(namespace, device) of each end of this host's link: the switch's port, the host's interface."""
        return [(self._switch, self._port), (self.netns, self.device)]

    @contextlib.contextmanager
    def cut(self, how: str = "down") -> Iterator[None]:
        """Break this host's link for the duration of the block; restored after it.

        ``"down"``: the switch's port to it goes down, as a pulled cable would (the host's
        own interface and routes stay as they are). ``"loss"``: every packet it sends or is
        sent is dropped (``netem loss 100%``; on a kernel without netem, a FIFO of length 0
        on both ends drops every packet just the same).
        """
        if how == "down":
            _run("ip", "-n", self._switch, "link", "set", self._port, "down")
            try:
                yield
            finally:
                _run("ip", "-n", self._switch, "link", "set", self._port, "up")
            return
        if how != "loss":
            raise ValueError(f"how must be 'down' or 'loss', not {how!r}")
        for netns, device in self._link_ends:
            _drop_everything(netns, device)
        try:
            yield
        finally:
            for netns, device in self._link_ends:
                _tc(netns, "qdisc", "del", "dev", device, "root")

    @contextlib.contextmanager
    def limit_rate(self, rate: str = "1gbit") -> Iterator[None]:
        """Cap what this host's link carries each way at ``rate`` (tc's units) for the block.

        A token bucket on both ends of the link (what the host sends, what the switch sends it),
        so a transfer of a known size is sure to be still on the wire a known time after it began,
        however fast this machine copies — a test cutting a link mid-transfer needs that.
        """
        for netns, device in self._link_ends:
            _tc(netns, "qdisc", "add", "dev", device, "root", "tbf", "rate", rate, "burst", "256kb", "latency", "100ms")
        try:
            yield
        finally:
            for netns, device in self._link_ends:
                _tc(netns, "qdisc", "del", "dev", device, "root", check=False)

    def __repr__(self) -> str:
        where = self.netns or "this netns"
        extra = (", own pid ns" if self.pid_namespace else "") + (f", uid {self.user}" if self.user is not None else "")
        return f"<Host {self.index} {self.ip} in {where}{extra}>"


def _tc(netns: str | None, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run(*(["tc", "-n", netns] if netns else ["tc"]), *args, check=check)


def _drop_everything(netns: str | None, device: str) -> None:
    """Make ``device`` drop every packet it would send."""
    if _tc(netns, "qdisc", "add", "dev", device, "root", "netem", "loss", "100%", check=False).returncode != 0:
        _tc(netns, "qdisc", "add", "dev", device, "root", "pfifo", "limit", "0")


class Hosts:
    """``count`` hosts (see the module docstring); a context manager, or call :meth:`close`.

    ``here=True`` adds one more, last: the namespace this process runs in, joined to the
    same bridge (so an engine in this process reaches the others, and they it).
    ``pid_namespaces``: indexes of hosts whose processes get a PID namespace of their own.
    ``users``: index -> uid that host's commands run as. Hosts are ``hosts[i]``.
    """

    def __init__(
        self,
        count: int = 2,
        *,
        here: bool = False,
        pid_namespaces: Sequence[int] = (),
        users: Mapping[int, int] | None = None,
    ) -> None:
        if count < 1 and not here:
            raise ValueError("Hosts needs at least one host")
        self.tag = f"{os.getpid()}-{next(_serials)}"
        self.switch = f"hixl-{self.tag}-sw"
        self.hosts: list[Host] = []
        self._netns: list[str] = []
        os.makedirs(_STATE, exist_ok=True)
        self._held = open(os.path.join(_STATE, f"{self.tag}.lock"), "w")  # noqa: SIM115  (held for our life)
        fcntl.flock(self._held, fcntl.LOCK_EX)
        try:
            with _global_lock():
                _sweep()
                subnet = _free_subnet()
                self._held.write(f"{subnet}\n")
                self._held.flush()
                self._build(count, here, subnet, dict(users or {}), set(pid_namespaces))
        except BaseException:
            self.close()
            raise

    def _build(
        self, count: int, here: bool, subnet: ipaddress.IPv4Network, users: dict[int, int], own_pids: set[int]
    ) -> None:
        self._add_netns(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        addresses = subnet.hosts()
        for index in range(count + (1 if here else 0)):
            port = f"p{index}"
            ip = str(next(addresses))
            if index < count:
                name = f"hixl-{self.tag}-{index}"
                self._add_netns(name)
                netns: str | None = name
                device, far_end, ip_in = "eth0", name, ["ip", "-n", name]
            else:
                # "netns PID" below: the network namespace this process is in.
                netns, device, far_end, ip_in = None, f"hx{self.tag}"[:15], str(os.getpid()), ["ip"]
            # Made in the switch namespace with its far end straight in the host's: no moment
            # where a half-made pair sits in a namespace nobody will delete.
            _run("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", device, "netns", far_end)
            if netns is not None:
                _run(*ip_in, "link", "set", "lo", "up")
            _run(*ip_in, "addr", "add", f"{ip}/{subnet.prefixlen}", "dev", device)
            _run(*ip_in, "link", "set", device, "up")
            _run("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            _run("ip", "-n", self.switch, "link", "set", port, "up")
            self.hosts.append(Host(index, netns, ip, device, self.switch, port, users.get(index), index in own_pids))

    def _add_netns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._netns.append(name)

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __len__(self) -> int:
        return len(self.hosts)

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def close(self) -> None:
        """Kill every process left on the hosts and delete their namespaces; idempotent."""
        for host in self.hosts:
            host.close()
        for name in reversed(self._netns):
            _remove_netns(name)
        self._netns.clear()
        if not self._held.closed:
            os.unlink(self._held.name)
            self._held.close()

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Hosts {self.tag}: {', '.join(h.ip for h in self.hosts)}>"


@contextlib.contextmanager
def _global_lock() -> Iterator[None]:
    with open(os.path.join(_STATE, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _remove_netns(name: str) -> None:
    """Kill what still runs in network namespace ``name``, then delete it (veths in it go with it)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pids = [int(p) for p in _run("ip", "netns", "pids", name, check=False).stdout.split()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        time.sleep(0.01)
    _run("ip", "netns", "del", name, check=False)


def _sweep() -> None:
    """Remove the namespaces of every :class:`Hosts` whose process is gone (its lock is free)."""
    names = [line.split()[0] for line in _run("ip", "netns", "list").stdout.splitlines() if line.strip()]
    stale: dict[str, list[str]] = {}
    for name in names:
        match = _NETNS.match(name)
        if match:
            stale.setdefault(match.group(1), []).append(name)
    for tag, members in stale.items():
        path = os.path.join(_STATE, f"{tag}.lock")
        try:
            lock = open(path)  # noqa: SIM115
        except FileNotFoundError:
            lock = None  # never locked, or unlinked by a close() that was cut short
        if lock is not None:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                continue  # its owner is alive
        for name in sorted(members, key=lambda n: n.endswith("-sw")):  # hosts first, the switch last
            _remove_netns(name)
        if lock is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            lock.close()


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.213.S.0/24 that no route here covers and no live :class:`Hosts` holds."""
    routes = []
    for line in _run("ip", "-4", "route", "show").stdout.splitlines():
        destination = line.split()[0] if line.strip() else "default"
        if destination != "default" and destination[0].isdigit():
            routes.append(ipaddress.ip_network(destination, strict=False))
    taken: set[str] = set()
    for entry in os.listdir(_STATE):
        if entry.endswith(".lock") and entry != ".lock":
            with contextlib.suppress(OSError), open(os.path.join(_STATE, entry)) as f:
                taken.add(f.read().strip())
    for third in _SUBNETS:
        subnet = ipaddress.IPv4Network(f"10.213.{third}.0/24")
        if str(subnet) not in taken and not any(subnet.overlaps(route) for route in routes):
            return subnet
    raise HostsError("every 10.213.S.0/24 subnet is in use")
